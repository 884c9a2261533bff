"""The R2D2 actor's policy and replay items, for the Ape-X family's sink
(:class:`qrl.actors.replay.ReplaySink`: shards, pushing, throttling): an LSTM Q-network
whose state it carries from step to step (zeros at each episode's start), epsilon-greedy
with per-slot epsilons (:class:`RecurrentEpsilonGreedy`); each env slot's episodes cut into
overlapping sequences (:class:`qrl.replay.sequences.Sequencer`) that go to the stream with
their starting state and initial priorities from its own network (R2D2's loss and priority
mix, :func:`qrl.algos.r2d2.rule.sequence_td`): :class:`SequenceItems`."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from qrl.actors.actor import Policy
from qrl.actors.envs import Step
from qrl.actors.replay import epsilon_greedy, spread
from qrl.algos.r2d2.config import R2D2Config
from qrl.algos.r2d2.messages import KIND
from qrl.algos.r2d2.rule import Rule, Sequences, priorities, rule_of
from qrl.replay.sequences import Sequencer, stack
from qrl.rl.envspec import EnvSpec
from qrl.rl.models import RecurrentQNetwork
from qrl.runtime.loop import StopCheck

State = tuple[torch.Tensor, torch.Tensor]  # the LSTM's (h, c), one row per env slot


class RecurrentEpsilonGreedy(Policy):
    """Epsilon-greedy on ``net`` (:class:`qrl.rl.models.RecurrentQNetwork`) with its LSTM
    state per env slot; each action is told with the state it was taken in."""

    def __init__(
        self, net: RecurrentQNetwork, cfg: R2D2Config, actor_id: int, n_actions: int
    ) -> None:
        self.net, self.actor_id, self.n_actions = net, actor_id, n_actions
        self.rng = np.random.default_rng(cfg.seed * 10_000 + actor_id)
        self.state: State = net.initial_state(cfg.envs_per_actor)
        self.reconfigure(cfg)

    def reconfigure(self, cfg: R2D2Config) -> None:
        self.eps = spread(cfg.eps_base, cfg.eps_alpha, cfg, self.actor_id)

    @torch.no_grad()
    def act(self, obs: np.ndarray, should_stop: StopCheck) -> tuple[np.ndarray, State]:
        """Epsilon-greedy actions, and the state they were taken in; the state moves on."""
        acted_in = self.state
        q, self.state = self.net(torch.from_numpy(np.asarray(obs))[:, None], self.state)
        greedy = q[:, 0].argmax(dim=1).numpy()
        return epsilon_greedy(greedy, self.eps, self.rng, self.n_actions), acted_in

    def observe(self, step: Step) -> None:
        """The state of a slot whose episode ended starts again from zeros."""
        ended = torch.from_numpy(step.terminated | step.truncated)[:, None]
        self.state = tuple(torch.where(ended, 0.0, x) for x in self.state)  # type: ignore[assignment]


class SequenceItems:
    """R2D2's replay items: the sequences each step completed (each step kept with the LSTM
    state it was acted in), sent with their initial priorities under ``net``."""

    def __init__(self, net: RecurrentQNetwork, cfg: R2D2Config, env: EnvSpec) -> None:
        self.net, self.rule = net, rule_of(cfg)
        self.sequencer = Sequencer(
            cfg.envs_per_actor,
            cfg.sequence_length,
            cfg.overlap,
            env.obs_shape,
            env.obs_dtype,
            cfg.lstm,
        )

    def items(
        self, obs: np.ndarray, actions: np.ndarray, extra: State, step: Step
    ) -> tuple[list[Any], list[int]]:
        h, c = (x.numpy() for x in extra)
        done = self.sequencer.add(
            obs, actions, step.rewards, step.true_next, step.terminated, step.truncated, h, c
        )
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
