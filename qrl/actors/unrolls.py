"""The actor of the unroll algorithms (IMPALA, PPO): vector envs sampled from the policy,
unrolls of length T pushed to a stream with the behaviour logits (and values, where the
algorithm's message has them) and the policy version they were acted with.

Follow one unroll: ``UnrollActor.unroll`` steps the envs T times; ``UnrollActor.advance``
encodes the B unrolls as one message (:mod:`qrl.rl.unrolls`) and adds it to the stream
through its producer; the learner's :class:`qrl.learners.unrolls.UnrollLoader` consumes it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import redis
import torch

from qrl.actors.base import VectorActor
from qrl.rl.envspec import EnvSpec
from qrl.rl.models import policy_value_net
from qrl.runtime.config import Config
from qrl.wire.codec import encode
from qrl.wire.keys import RunKeys
from qrl.wire.schema import Schema
from qrl.wire.streams import StreamProducer


def unroll_message(
    obs: np.ndarray,
    action: np.ndarray,
    reward: np.ndarray,
    terminated: np.ndarray,
    truncated: np.ndarray,
    logits: np.ndarray,
    trunc: list[tuple[int, int]],
    trunc_obs: list[np.ndarray],
    version: int,
    actor: int,
) -> dict[str, Any]:
    """The fields of one unroll message: ``obs`` [T + 1, B, ...], the per-step arrays
    [T, B], the step and env slot of each truncated episode (``trunc``) with its final
    observation, and the oldest weights ``version`` that acted in it."""
    return {
        "obs": obs,
        "action": action,
        "reward": reward,
        "terminated": terminated,
        "truncated": truncated,
        "logits": logits,
        "trunc_obs": np.array(trunc_obs, obs.dtype).reshape(-1, *obs.shape[2:]),
        "trunc_idx": np.array(trunc, np.int32).reshape(-1, 2),
        "version": version,
        "actor": actor,
        "batch": uuid.uuid4().hex,
    }


class UnrollActor(VectorActor):
    """Subclasses set ``schema`` (the algorithm's message: its kind, and which of the fields
    an unroll can have it carries) and ``stream`` (the stream's key from the run's keys)."""

    schema: Callable[..., Schema]  # (obs_shape, obs_dtype, n_actions, unroll, envs)
    stream: Callable[[RunKeys], str]

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        cfg: Config,
        actor_id: int = 0,
        env: EnvSpec | None = None,
    ) -> None:
        super().__init__(client, keys, cfg, actor_id, env)
        stream = type(self).stream(keys)
        self.producer = StreamProducer(client, stream, maxlen=cfg.stream_maxlen, keys=keys)
        schema = type(self).schema(
            self.obs_shape, self.obs_dtype, self.n_actions, cfg.unroll, cfg.envs_per_actor
        )
        self.kind, self.fields = schema.kind, tuple(schema.fields)
        self.net = policy_value_net(cfg, self.env)
        self.net.eval()
        self.gen = torch.Generator().manual_seed(cfg.seed * 10_000 + actor_id)

    @torch.no_grad()
    def act(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sampled actions, the logits and the value estimates."""
        logits, values = self.net(torch.from_numpy(np.asarray(obs)))
        actions = torch.multinomial(torch.softmax(logits, dim=1), 1, generator=self.gen)[:, 0]
        return actions.numpy(), logits.numpy(), values.numpy()

    def unroll(self, obs: np.ndarray) -> tuple[dict[str, object], np.ndarray]:
        """T steps from ``obs``; returns the message fields and the observation to go on from."""
        t_len, b = self.cfg.unroll, self.cfg.envs_per_actor
        obs_buf = np.empty((t_len + 1, b, *self.obs_shape), self.obs_dtype)
        act_buf = np.empty((t_len, b), np.int32)
        rew_buf = np.empty((t_len, b), np.float32)
        val_buf = np.empty((t_len, b), np.float32)
        term_buf = np.empty((t_len, b), bool)
        trunc_buf = np.empty((t_len, b), bool)
        logit_buf = np.empty((t_len, b, self.n_actions), np.float32)
        trunc_idx, trunc_obs = [], []
        version = self.version  # the policy these T steps act with
        for t in range(t_len):
            obs_buf[t] = obs
            actions, logits, values = self.act(obs)
            obs, true_next, rewards, term, trunc = self.step_envs(actions)
            act_buf[t], rew_buf[t], logit_buf[t], val_buf[t] = actions, rewards, logits, values
            term_buf[t], trunc_buf[t] = term, trunc
            for j in np.flatnonzero(trunc):
                trunc_idx.append((t, j))
                trunc_obs.append(true_next[j])
        obs_buf[t_len] = obs
        msg = unroll_message(
            obs_buf,
            act_buf,
            rew_buf,
            term_buf,
            trunc_buf,
            logit_buf,
            trunc_idx,
            trunc_obs,
            version,
            self.actor_id,
        )
        msg["value"] = val_buf
        return {name: msg[name] for name in self.fields}, obs  # those its message carries

    def advance(self, obs: np.ndarray, should_stop: Callable[[], bool]) -> np.ndarray | None:
        """One unroll of T steps, pushed as one stream entry."""
        msg, obs = self.unroll(obs)
        if self.producer.add(encode(self.kind, msg), should_stop=should_stop) is None:
            return None
        return obs

    def waited_s(self) -> float:
        return self.producer.waited_s
