"""The R2D2 actor: the Ape-X family's actor (vector envs, per-slot epsilons, shards,
pushing, throttling: :class:`qrl.actors.replay.ReplayActor`) with an LSTM Q-network whose
state it carries from step to step (zeros at each episode's start), cutting each env slot's
episodes into overlapping sequences (:class:`qrl.replay.sequences.Sequencer`) that go to
the stream with their starting state and initial priorities from its own network (R2D2's
loss and priority mix, :func:`qrl.algos.r2d2.rule.sequence_td`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import redis
import torch

from qrl.actors.envs import Step
from qrl.actors.replay import ReplayActor, spread
from qrl.algos.r2d2.config import R2D2Config
from qrl.algos.r2d2.messages import KIND
from qrl.algos.r2d2.rule import Rule, Sequences, priorities, rule_of
from qrl.replay.sequences import Sequencer, stack
from qrl.rl.envspec import EnvSpec
from qrl.rl.models import RecurrentQNetwork, recurrent_q_network
from qrl.wire.keys import RunKeys


class R2D2Actor(ReplayActor):
    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        cfg: R2D2Config,
        actor_id: int = 0,
        env: EnvSpec | None = None,
    ) -> None:
        super().__init__(client, keys, cfg, actor_id, env)
        self.sequencer = Sequencer(
            cfg.envs_per_actor,
            cfg.sequence_length,
            cfg.overlap,
            self.obs_shape,
            self.obs_dtype,
            cfg.lstm,
        )
        self.state = self.net.initial_state(cfg.envs_per_actor)
        self.acted_in = self.state  # the state the last actions were taken in
        self.rule = rule_of(cfg)

    def make_net(self) -> torch.nn.Module:
        return recurrent_q_network(self.cfg, self.env)

    def explore(self) -> None:
        self.eps = spread(self.cfg.eps_base, self.cfg.eps_alpha, self.cfg, self.actor_id)

    @torch.no_grad()
    def act(self, obs: np.ndarray) -> np.ndarray:
        """Epsilon-greedy actions; the LSTM state moves on (``self.state``)."""
        self.acted_in = self.state
        q, self.state = self.net(torch.from_numpy(np.asarray(obs))[:, None], self.state)
        greedy = q[:, 0].argmax(dim=1).numpy()
        explore = self.rng.random(len(greedy)) < self.eps
        random = self.rng.integers(0, self.n_actions, len(greedy))
        return np.where(explore, random, greedy)

    def collect(
        self, obs: np.ndarray, actions: np.ndarray, step: Step
    ) -> tuple[list[Any], list[int]]:
        """The sequences this step completed (each step kept with the LSTM state it was
        acted in); the state of a slot whose episode ended starts again from zeros."""
        h, c = (x.numpy() for x in self.acted_in)
        done = self.sequencer.add(
            obs, actions, step.rewards, step.true_next, step.terminated, step.truncated, h, c
        )
        ended = torch.from_numpy(step.terminated | step.truncated)[:, None]
        self.state = tuple(torch.where(ended, 0.0, x) for x in self.state)  # type: ignore[assignment]
        return done, self.sequencer.slots

    def message(self, items: list[Any], slots: np.ndarray) -> tuple[str, dict[str, Any]]:
        return sequence_message(self.net, self.rule, items)


@torch.no_grad()
def sequence_message(
    net: RecurrentQNetwork, rule: Rule, items: list[dict[str, Any]]
) -> tuple[str, dict[str, Any]]:
    """The message of ``items`` (sequences), with initial priorities: R2D2's priority mix
    of their TD errors under ``net``."""
    batch = stack(items)
    device = next(net.parameters()).device
    prio = priorities(net, net, Sequences.of(batch, device), rule).float().cpu().numpy()
    return KIND, {**batch, "priority": prio}
