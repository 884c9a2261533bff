"""R2D2's side of central inference (as in the SEED RL paper): each actor's LSTM state kept
on the server, epsilon-greedy actions with Ape-X's per-env-slot epsilons, each env slot's
steps cut into overlapping sequences with the state they started in
(:class:`qrl.replay.sequences.Sequencer`), pushed with initial priorities from the server's
network to each slot's replay shard (:class:`qrl.actors.feed.ReplayFeed`), under the run's
rate limit (:class:`qrl.actors.feed.RateLimit`): what a local R2D2 actor does, minus the
envs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import redis
import torch

from qrl.actors.feed import RateLimit, ReplayFeed
from qrl.actors.r2d2 import sequence_message
from qrl.actors.replay import spread
from qrl.algos.r2d2.config import R2D2Config
from qrl.algos.r2d2.rule import rule_of
from qrl.inference.server import Agent, Track
from qrl.replay.sequences import Sequencer
from qrl.rl.envspec import EnvSpec
from qrl.rl.models import RecurrentQNetwork
from qrl.runtime.loop import StopCheck
from qrl.wire.keys import RunKeys


@dataclass(kw_only=True)
class SequenceTrack(Track):
    """The env slots of one env batch of an actor: their sequences in the making, the
    observations and LSTM state to act on next (``h``, ``c``; zeros at an episode's start),
    and the last actions with the state they were taken in. ``feed`` holds the finished
    sequences not pushed yet; it outlives a restart of the actor (they are whole)."""

    sequencer: Sequencer
    feed: ReplayFeed
    eps: np.ndarray
    obs: np.ndarray
    h: np.ndarray
    c: np.ndarray
    action: np.ndarray | None = None  # set by the first act
    acted_h: np.ndarray | None = None  # set by the first act
    acted_c: np.ndarray | None = None  # set by the first act

    def held(self) -> bool:
        s = self.sequencer
        return super().held() or any(len(b) > n for b, n in zip(s.buf, s.sent, strict=True))

    def advance(self, req: dict[str, Any]) -> None:
        term, trunc = req["terminated"], req["truncated"]
        true_next = req["obs"]
        if len(req["final_idx"]):  # an ended episode's last observation, not the next one's first
            true_next = true_next.copy()
            true_next[req["final_idx"]] = req["final_obs"]
        s = self.sequencer
        done = s.add(
            self.obs,
            self.action,
            req["reward"],
            true_next,
            term,
            trunc,
            self.acted_h,
            self.acted_c,
        )
        self.feed.add(done, s.slots)
        ended = term | trunc
        self.h[ended], self.c[ended] = 0.0, 0.0
        self.obs = req["obs"]

    def acted(self, action: np.ndarray, h: np.ndarray, c: np.ndarray) -> None:
        self.action, self.acted_h, self.acted_c = action, self.h, self.c
        self.h, self.c = h, c


class SequenceAgent(Agent):
    """Acts for its actors with ``net`` (an LSTM Q-network) and feeds the replay their
    sequences."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        cfg: R2D2Config,
        server_id: int,
        env: EnvSpec,
        net: RecurrentQNetwork,
        device: torch.device,
    ) -> None:
        self.client, self.keys, self.cfg, self.env = client, keys, cfg, env
        self.net, self.device, self.rule = net, device, rule_of(cfg)
        self.n_actions = env.discrete_actions()
        self.rng = np.random.default_rng(cfg.seed * 10_000 + server_id)
        # its actors are one in inference_servers of the run's: so is its share of the steps
        self.limit = RateLimit(client, keys, cfg, share=cfg.inference_servers)
        self.steps = 0
        self.sequences = 0

    def track(self, req: dict[str, Any], old: Track | None) -> SequenceTrack:
        cfg, a = self.cfg, req["actor"]
        b = cfg.envs_per_actor
        feed = old.feed if isinstance(old, SequenceTrack) else None
        tr = SequenceTrack(
            a,
            req["batch"],
            req["life"],
            req["seq"],
            sequencer=Sequencer(
                b,
                cfg.sequence_length,
                cfg.overlap,
                self.env.obs_shape,
                self.env.obs_dtype,
                cfg.lstm,
            ),
            feed=feed or ReplayFeed(self.client, self.keys, cfg, a, self.message),
            eps=spread(cfg.eps_base, cfg.eps_alpha, cfg, a),
            obs=req["obs"],
            h=np.zeros((b, cfg.lstm), np.float32),
            c=np.zeros((b, cfg.lstm), np.float32),
        )
        if req["seq"]:  # its episodes began before this server knew it (a restart, a gap):
            tr.sequencer.first = [False] * b  # zeros are no episode's exact starting state
        return tr

    def reconfigure(self, cfg: R2D2Config, tracks: list[Track]) -> None:
        """Live epsilons: each track's again from ``cfg``."""
        self.cfg = cfg
        for tr in tracks:
            assert isinstance(tr, SequenceTrack)
            tr.eps = spread(cfg.eps_base, cfg.eps_alpha, cfg, tr.actor)

    def act(self, tracks: list[Track], obs: torch.Tensor, version: int) -> np.ndarray:
        mine = cast(list[SequenceTrack], tracks)
        state = tuple(
            torch.from_numpy(np.concatenate(x)).to(self.device)
            for x in ([tr.h for tr in mine], [tr.c for tr in mine])
        )
        q, (h, c) = self.net(obs[:, None], state)
        greedy = q[:, 0].argmax(dim=1).cpu().numpy()
        eps = np.concatenate([tr.eps for tr in mine])
        explore = self.rng.random(len(greedy)) < eps
        actions = np.where(explore, self.rng.integers(0, self.n_actions, len(greedy)), greedy)
        actions = actions.astype(np.int32)
        h_np, c_np = h.float().cpu().numpy(), c.float().cpu().numpy()
        b = self.cfg.envs_per_actor
        for i, tr in enumerate(mine):
            sl = slice(i * b, (i + 1) * b)
            tr.acted(actions[sl], h_np[sl], c_np[sl])
        return actions

    def message(self, items: list[Any], slots: np.ndarray) -> tuple[str, dict[str, Any]]:
        self.sequences += len(items)
        return sequence_message(self.net, self.rule, items)

    def push(
        self,
        tracks: list[Track],
        version: int,
        progress: Callable[[], int],
        should_stop: StopCheck,
    ) -> bool:
        """Push each actor's batch of sequences that is ready, then keep to the rate limit
        (each request was ``envs_per_actor`` env steps)."""
        self.steps += len(tracks) * self.cfg.envs_per_actor
        pushed = False
        for tr in tracks:
            assert isinstance(tr, SequenceTrack)
            if tr.feed.ready:
                if not tr.feed.flush(version, should_stop):
                    return False
                pushed = True
        return not pushed or self.limit.throttle(self.steps, version, progress, should_stop)

    def metrics(self) -> dict[str, Any]:
        return {"sequences": self.sequences, "throttled_s": self.limit.throttled_s}


def sequence_agent(
    net: Callable[[Any, EnvSpec], RecurrentQNetwork],
) -> Callable[[Any, EnvSpec, torch.device], SequenceAgent]:
    """The agent of R2D2's inference servers (for
    :func:`qrl.inference.server.server_maker`); ``net(cfg, env)`` acts."""

    def make(ctx: Any, env: EnvSpec, device: torch.device) -> SequenceAgent:
        return SequenceAgent(
            ctx.client, ctx.keys, ctx.cfg, ctx.ident, env, net(ctx.cfg, env), device
        )

    return make
