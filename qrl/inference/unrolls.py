"""IMPALA's side of central inference: each actor's steps assembled into unrolls of T steps
with the behaviour logits, as a local actor would send them (:mod:`qrl.actors.unrolls`),
pushed to the run's trajectory stream; actions sampled from the policy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis
import torch

from qrl.actors.unrolls import unroll_message
from qrl.inference.server import Agent, Track
from qrl.rl.envspec import EnvSpec
from qrl.runtime.config import Config
from qrl.runtime.loop import StopCheck
from qrl.wire.codec import encode
from qrl.wire.keys import RunKeys
from qrl.wire.streams import StreamProducer


@dataclass(kw_only=True)
class UnrollTrack(Track):
    """The unroll being built from one env batch's steps (``t`` of ``T`` done; step ``t``
    waits for its result); the unrolls it finished, encoded, in ``done``."""

    kind: str
    obs: np.ndarray
    action: np.ndarray
    logits: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    t: int = 0
    version: int = 2**62  # the oldest weights that acted in this unroll
    trunc: list[tuple[int, int]] = field(default_factory=list)
    trunc_obs: list[np.ndarray] = field(default_factory=list)
    done: list[bytes] = field(default_factory=list)

    @classmethod
    def new(cls, req: dict[str, Any], kind: str, t_len: int, n_actions: int) -> UnrollTrack:
        """A fresh track of the actor that sent ``req``, its unroll starting there."""
        obs = req["obs"]
        b = len(obs)
        tr = cls(
            req["actor"],
            req["batch"],
            req["life"],
            req["seq"],
            kind=kind,
            obs=np.empty((t_len + 1, b, *obs.shape[1:]), obs.dtype),
            action=np.empty((t_len, b), np.int32),
            logits=np.empty((t_len, b, n_actions), np.float32),
            reward=np.empty((t_len, b), np.float32),
            terminated=np.empty((t_len, b), bool),
            truncated=np.empty((t_len, b), bool),
        )
        tr.obs[0] = obs
        return tr

    def held(self) -> bool:
        return self.t > 0 or super().held()

    def advance(self, req: dict[str, Any]) -> None:
        t = self.t
        self.reward[t], self.terminated[t], self.truncated[t] = (
            req["reward"],
            req["terminated"],
            req["truncated"],
        )
        for j, final in zip(req["final_idx"], req["final_obs"], strict=True):
            if req["truncated"][j]:  # V-trace bootstraps from a cut episode's last state
                self.trunc.append((t, int(j)))
                self.trunc_obs.append(final)
        self.t += 1
        self.obs[self.t] = req["obs"]
        if self.t == len(self.action):
            self.done.append(self.unroll())

    def acted(self, action: np.ndarray, logits: np.ndarray, version: int) -> None:
        self.action[self.t], self.logits[self.t] = action, logits
        self.version = min(self.version, version)

    def unroll(self) -> bytes:
        """The finished unroll, encoded as a local actor would send it; the next starts
        where it ended."""
        msg = unroll_message(
            self.obs,
            self.action,
            self.reward,
            self.terminated,
            self.truncated,
            self.logits,
            self.trunc,
            self.trunc_obs,
            self.version,
            self.actor,
        )
        payload = encode(self.kind, msg)
        self.obs[0] = self.obs[-1]
        self.t, self.version, self.trunc, self.trunc_obs = 0, 2**62, [], []
        return payload


class UnrollAgent(Agent):
    """Samples actions from ``net``'s logits; the unrolls go to ``stream`` as ``kind``."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        cfg: Config,
        server_id: int,
        env: EnvSpec,
        net: torch.nn.Module,
        stream: str,
        kind: str,
        device: torch.device,
    ) -> None:
        self.cfg, self.net, self.kind = cfg, net, kind
        self.n_actions = env.discrete_actions()
        self.producer = StreamProducer(client, stream, maxlen=cfg.stream_maxlen, keys=keys)
        self.gen = torch.Generator(device=device).manual_seed(cfg.seed * 10_000 + server_id)
        self.unrolls = 0

    def track(self, req: dict[str, Any], old: Track | None) -> UnrollTrack:
        return UnrollTrack.new(req, self.kind, self.cfg.unroll, self.n_actions)

    def act(self, tracks: list[Track], obs: torch.Tensor, version: int) -> np.ndarray:
        logits = self.net(obs)[0]
        actions = torch.multinomial(torch.softmax(logits, 1), 1, generator=self.gen)[:, 0]
        logits_np, actions_np = logits.float().cpu().numpy(), actions.int().cpu().numpy()
        b = self.cfg.envs_per_actor
        for i, tr in enumerate(tracks):
            assert isinstance(tr, UnrollTrack)
            tr.acted(actions_np[i * b : (i + 1) * b], logits_np[i * b : (i + 1) * b], version)
        return actions_np

    def push(
        self,
        tracks: list[Track],
        version: int,
        progress: Callable[[], int],
        should_stop: StopCheck,
    ) -> bool:
        for tr in tracks:
            assert isinstance(tr, UnrollTrack)
            done, tr.done = tr.done, []
            for payload in done:
                if self.producer.add(payload, should_stop=should_stop) is None:
                    return False
                self.unrolls += 1
        return True

    def metrics(self) -> dict[str, Any]:
        return {"unrolls": self.unrolls}


def unroll_agent(
    net: Callable[[Any, EnvSpec], torch.nn.Module], stream: Callable[[RunKeys], str], kind: str
) -> Callable[[Any, EnvSpec, torch.device], UnrollAgent]:
    """The agent of an unroll algorithm's inference servers (for
    :func:`qrl.inference.server.server_maker`): ``net(cfg, env)`` acts, the unrolls go to
    ``stream(keys)`` as ``kind``."""

    def make(ctx: Any, env: EnvSpec, device: torch.device) -> UnrollAgent:
        return UnrollAgent(
            ctx.client,
            ctx.keys,
            ctx.cfg,
            ctx.ident,
            env,
            net(ctx.cfg, env),
            stream(ctx.keys),
            kind,
            device,
        )

    return make
