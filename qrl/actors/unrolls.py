"""The parts of the unroll algorithms' actors (IMPALA, PPO): actions sampled from the
policy's softmax (:class:`SampledPolicy`), and unrolls of length T pushed to a stream with
the behaviour logits (and values, where the algorithm's message has them) and the policy
version they were acted with (:class:`UnrollSink`).

Follow one unroll: :meth:`UnrollSink.add` records T vector steps and then makes the B
unrolls one message's fields (:func:`unroll_message`, :mod:`qrl.rl.unrolls`);
:meth:`UnrollSink.flush` encodes it and adds it to the stream through its producer; the
learner's loader process (:mod:`qrl.learners.loader`) consumes it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import redis
import torch

from qrl.actors.actor import Policy, WeightsClient
from qrl.actors.envs import Step
from qrl.rl.envspec import EnvSpec
from qrl.runtime.background import Background
from qrl.runtime.config import Config
from qrl.runtime.loop import StopCheck
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


class SampledPolicy(Policy):
    """Actions sampled from the softmax of ``net``'s logits (a
    :class:`qrl.rl.models.PolicyValueNet`; the actor's own generator, seeded by ``cfg.seed``
    and ``actor_id``), told with the logits and the value estimates."""

    def __init__(self, net: torch.nn.Module, cfg: Config, actor_id: int) -> None:
        self.net = net
        self.gen = torch.Generator().manual_seed(cfg.seed * 10_000 + actor_id)

    @torch.no_grad()
    def act(
        self, obs: np.ndarray, should_stop: StopCheck
    ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        logits, values = self.net(torch.from_numpy(np.asarray(obs)))
        actions = torch.multinomial(torch.softmax(logits, dim=1), 1, generator=self.gen)[:, 0]
        return actions.numpy(), (logits.numpy(), values.numpy())


# (obs_shape, obs_dtype, n_actions, unroll, envs) -> the algorithm's message schema
UnrollSchema = Callable[..., Schema]


class UnrollSink:
    """Unrolls of ``cfg.unroll`` steps of actor ``actor_id``'s envs to ``stream``, as the
    message of ``schema`` (its kind, and which of the fields an unroll can have it carries):
    a unit is one unroll. :attr:`unroll` holds the fields of the last one made until it is
    pushed."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        stream: str,
        cfg: Config,
        actor_id: int,
        env: EnvSpec,
        schema: UnrollSchema,
    ) -> None:
        self.cfg, self.actor_id = cfg, actor_id
        self.producer = StreamProducer(client, stream, maxlen=cfg.stream_maxlen, keys=keys)
        self.obs_shape, self.obs_dtype = env.obs_shape, env.obs_dtype
        self.n_actions = env.discrete_actions()
        made = schema(
            self.obs_shape, self.obs_dtype, self.n_actions, cfg.unroll, cfg.envs_per_actor
        )
        self.kind, self.fields = made.kind, tuple(made.fields)
        self.t = 0  # steps of the unroll being recorded
        self.unroll: dict[str, Any] | None = None
        self.sending = Background("unrolls")

    def _begin(self, version: int) -> None:
        """Fresh buffers for the next T steps (an unroll made keeps its own), acted with
        weights ``version``."""
        t_len, b = self.cfg.unroll, self.cfg.envs_per_actor
        self.obs_buf = np.empty((t_len + 1, b, *self.obs_shape), self.obs_dtype)
        self.act_buf = np.empty((t_len, b), np.int32)
        self.rew_buf = np.empty((t_len, b), np.float32)
        self.val_buf = np.empty((t_len, b), np.float32)
        self.term_buf = np.empty((t_len, b), bool)
        self.trunc_buf = np.empty((t_len, b), bool)
        self.logit_buf = np.empty((t_len, b, self.n_actions), np.float32)
        self.trunc_idx: list[tuple[int, int]] = []
        self.trunc_obs: list[np.ndarray] = []
        self.version = version  # the policy these T steps act with

    def add(
        self,
        obs: np.ndarray,
        actions: np.ndarray,
        extra: tuple[np.ndarray, np.ndarray],
        step: Step,
        version: int,
    ) -> bool:
        """Record one step (``extra``: the logits and values); after T, make the unroll."""
        t = self.t
        if t == 0:
            self._begin(version)
        logits, values = extra
        self.obs_buf[t] = obs
        self.act_buf[t], self.rew_buf[t], self.logit_buf[t], self.val_buf[t] = (
            actions,
            step.rewards,
            logits,
            values,
        )
        self.term_buf[t], self.trunc_buf[t] = step.terminated, step.truncated
        for j in np.flatnonzero(step.truncated):
            self.trunc_idx.append((t, j))
            self.trunc_obs.append(step.true_next[j])
        self.t = t + 1
        if self.t < len(self.act_buf):
            return False
        self.t = 0
        self.obs_buf[-1] = step.next_obs
        msg = unroll_message(
            self.obs_buf,
            self.act_buf,
            self.rew_buf,
            self.term_buf,
            self.trunc_buf,
            self.logit_buf,
            self.trunc_idx,
            self.trunc_obs,
            self.version,
            self.actor_id,
        )
        msg["value"] = self.val_buf
        self.unroll = {name: msg[name] for name in self.fields}  # those its message carries
        return True

    def flush(self, steps: int, weights: WeightsClient, should_stop: StopCheck) -> bool:
        """Push the unroll made as one stream entry, on the sending thread while the actor
        acts on (:class:`qrl.runtime.background.Background`; the push before waited for
        first); False if that one (in line: this one) was stopped while the stream was full."""
        msg, self.unroll = self.unroll, None

        def push() -> bool:
            return self.producer.add(encode(self.kind, msg), should_stop=should_stop) is not None

        return self.sending.submit(push) is not False

    def close(self, steps: int, weights: WeightsClient, should_stop: StopCheck) -> None:
        self.sending.close()  # the push under way; an unroll not complete is not sent

    def reconfigure(self, cfg: Config) -> None:
        pass

    def metrics(self) -> dict[str, Any]:
        return {"backpressure_s": self.producer.waited_s}
