"""What the Ape-X family's actors share (Ape-X, Ape-X DPG, R2D2): vector envs, per-slot
exploration spread like Ape-X's epsilons, batches of replay items pushed to the experience
stream of each env slot's shard, and the rate limit against the learner
(:class:`ReplayActor`); and the actors of n-step transitions (:class:`TransitionActor`).

Follow one batch: ``ReplayActor.advance`` calls ``act`` and steps the envs; ``collect``
turns the step into replay items (``TransitionActor``: ``NStep.add``'s n-step transitions;
R2D2: sequences); ``ReplayActor.flush`` pushes them, one batch per shard
(:func:`qrl.replay.shards.shard_of_slots`), as the subclass's ``message`` (initial
priorities included), through :class:`qrl.wire.streams.StreamProducer`; the replay role
(``qrl/replay/role.py``) inserts them. Stacked frames (Atari) travel each frame once, in
per-env-slot chunks (:mod:`qrl.replay.frames`)."""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import redis
import torch

from qrl.actors.base import VectorActor
from qrl.actors.envs import Step
from qrl.algos.apex_family.config import ReplayConfig
from qrl.replay.frames import is_frame_stack, pack_frames
from qrl.replay.shards import shard_of_slots
from qrl.rl.envspec import EnvSpec
from qrl.wire.codec import encode
from qrl.wire.faults import repaired, warn_once
from qrl.wire.keys import RunKeys
from qrl.wire.streams import StreamProducer


def spread(base: float, alpha: float, cfg: ReplayConfig, actor_id: int) -> np.ndarray:
    """Ape-X's per-actor exploration schedule: env slot i of N = actors x envs_per_actor
    gets base^(1 + i * alpha / (N - 1)); each env slot plays the role of one paper actor."""
    n = cfg.actors * cfg.envs_per_actor
    i = actor_id * cfg.envs_per_actor + np.arange(cfg.envs_per_actor)
    i = i % n  # extra actors beyond the configured count reuse the schedule
    return base ** (1 + i * alpha / max(n - 1, 1))


class NStep:
    """Per-env n-step return accumulation. ``add`` returns the transitions that became
    complete: (obs, action, n-step return, discount to bootstrap, bootstrap obs); an action
    is whatever the actor took (an int, or a vector for continuous actions)."""

    def __init__(self, num_envs: int, n: int, gamma: float) -> None:
        self.n, self.gamma = n, gamma
        self.buf: list[deque[tuple[np.ndarray, Any, float]]] = [deque() for _ in range(num_envs)]
        self.slots: list[int] = []  # the env slot of each transition the last add returned

    def add(
        self,
        obs: np.ndarray,
        actions: np.ndarray,
        rewards: np.ndarray,
        next_obs: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
    ) -> list[tuple[np.ndarray, Any, float, float, np.ndarray]]:
        """``next_obs`` must be the true next observation (the final one for ended episodes)."""
        out, self.slots = [], []
        for j, buf in enumerate(self.buf):
            buf.append((obs[j], actions[j], float(rewards[j])))
            ended = terminated[j] or truncated[j]
            while len(buf) == self.n or (ended and buf):
                ret = sum(r * self.gamma**k for k, (_, _, r) in enumerate(buf))
                disc = 0.0 if terminated[j] else self.gamma ** len(buf)
                o, a, _ = buf.popleft()
                out.append((o, a, ret, disc, next_obs[j]))
                self.slots.append(j)
                if not ended:
                    break
        return out


class ReplayActor(VectorActor):
    """One actor process's worth of environments feeding the prioritized replay. A subclass
    gives the policy (:meth:`make_net`, :meth:`act`), turns each vector step into replay
    items (:meth:`collect`) and a batch of items into a message (:meth:`message`)."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        cfg: ReplayConfig,
        actor_id: int = 0,
        env: EnvSpec | None = None,
    ) -> None:
        super().__init__(client, keys, cfg, actor_id, env)
        self.explore()
        self.net = self.make_net()
        self.net.eval()
        self.pending: list[Any] = []  # replay items not pushed yet
        self.pending_slots: list[int] = []  # the env slot of each
        # each shard's stream (its own keys: on a cluster, its own node), and each slot's shard
        self.producers = [
            StreamProducer(client, k.experience, maxlen=cfg.stream_maxlen, keys=k)
            for k in keys.shards(cfg.replay_shards)
        ]
        self.shard_of = shard_of_slots(actor_id, cfg.envs_per_actor, cfg.replay_shards)
        self.counted = 0  # steps already added to the run's global env-step counter
        self.throttled_s = 0.0

    def make_net(self) -> torch.nn.Module:
        """The local copy of the learner's (published) network."""
        raise NotImplementedError

    def explore(self) -> None:
        """Set each env slot's exploration (epsilons, noise) from ``self.cfg``: at the start
        and again when a live config change came (:meth:`reconfigure`)."""
        raise NotImplementedError

    def reconfigure(self, cfg: Any) -> None:
        super().reconfigure(cfg)
        self.explore()

    def act(self, obs: np.ndarray) -> np.ndarray:
        """A batch of actions, exploration included."""
        raise NotImplementedError

    def collect(
        self, obs: np.ndarray, actions: np.ndarray, step: Step
    ) -> tuple[list[Any], list[int]]:
        """The replay items that taking ``actions`` in ``obs`` completed, and the env slot of
        each."""
        raise NotImplementedError

    def message(self, items: list[Any], slots: np.ndarray) -> tuple[str, dict[str, Any]]:
        """The kind and the fields of the message of ``items`` (from env slots ``slots``),
        ``priority`` included; the actor, the version and a batch id are added to them."""
        raise NotImplementedError

    def flush(self, should_stop: Callable[[], bool]) -> bool:
        """Push the pending items, one batch per shard (the shard of their env slot); False
        if stopped while waiting."""
        if not self.pending:
            return True
        pending, slots = self.pending, np.asarray(self.pending_slots)
        shard = self.shard_of[slots]
        self.pending, self.pending_slots = [], []
        for s, producer in enumerate(self.producers):
            mine = np.flatnonzero(shard == s)
            items = [pending[i] for i in mine]
            if items and not self.push(producer, items, slots[mine], should_stop):
                return False
        return self.throttle(should_stop)

    def push(
        self,
        producer: StreamProducer,
        items: list[Any],
        slots: np.ndarray,
        should_stop: Callable[[], bool],
    ) -> bool:
        """Push ``items`` (from env slots ``slots``) as one message to ``producer``'s
        stream; False if stopped."""
        kind, fields = self.message(items, slots)
        payload = encode(
            kind,
            {**fields, "version": self.version, "actor": self.actor_id, "batch": uuid.uuid4().hex},
        )
        return producer.add(payload, should_stop=should_stop) is not None

    def env_steps(self) -> int:
        """The run's env steps, ours added (HINCRBY on its stats). Anyone with the run's keys
        can write that count: garbage (the wrong type, not a whole number, about to overflow)
        is deleted, and what is believed is at least our own steps and at most our fair
        share's worth (ours times the configured actors), so a count lowered or raised by
        someone else neither lifts the limit for good nor holds actors for good."""
        key, add = self.keys.stats, self.steps - self.counted
        total = None
        for _ in range(2):
            try:
                incr = partial(self.client.hincrby, key, "env_steps", add)
                total = repaired(self.client, key, incr, None)
                break
            except redis.ResponseError as e:  # not an integer, or it would overflow
                warn_once(f"{key}:env_steps", "%s env_steps was garbage (%s): reset", key, e)
                self.client.hdel(key, "env_steps")
        self.counted = self.steps
        return min(max(total or 0, self.steps), self.steps * max(self.cfg.actors, 1))

    def throttle(self, should_stop: Callable[[], bool]) -> bool:
        """Count our steps in the run's total and wait while the total is ahead of what the
        learner's progress allows. Its progress is the version of the weights this actor
        loaded (a blob that passed validation: a bare version field anyone with the run's
        keys can set does not count; see :mod:`qrl.wire.weights` for versions far ahead)."""
        total = self.env_steps()
        spu = self.cfg.steps_per_update
        if spu <= 0:
            return True
        t0 = time.monotonic()
        while total > self.cfg.learning_starts + spu * max(self.version, 0):
            if should_stop():
                return False
            time.sleep(0.005)
            self.refresh_weights()
            total = self.env_steps()
        self.throttled_s += time.monotonic() - t0
        return True

    def advance(self, obs: np.ndarray, should_stop: Callable[[], bool]) -> np.ndarray | None:
        """One vector step; pushes a batch when ``actor_batch`` items are ready."""
        actions = self.act(obs)
        step = self.step_envs(actions)
        items, slots = self.collect(obs, actions, step)
        self.pending += items
        self.pending_slots += slots
        if len(self.pending) >= self.cfg.actor_batch and not self.flush(should_stop):
            return None
        return step.next_obs

    def finish(self, should_stop: Callable[[], bool]) -> None:
        self.flush(should_stop)

    def waited_s(self) -> float:
        return sum(p.waited_s for p in self.producers)

    def extra_metrics(self) -> dict[str, float]:
        return {"throttled_s": self.throttled_s}


class TransitionActor(ReplayActor):
    """The actors of n-step transitions (Ape-X, Ape-X DPG): local n-step returns
    (:class:`NStep`), initial priorities from the subclass (:meth:`priorities`), stacked
    frames sent once. A subclass also gives ``action_dtype``."""

    action_dtype: Any = np.int32

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        cfg: ReplayConfig,
        actor_id: int = 0,
        env: EnvSpec | None = None,
    ) -> None:
        super().__init__(client, keys, cfg, actor_id, env)
        self.nstep = NStep(cfg.envs_per_actor, cfg.n_step, cfg.gamma)
        self.frames = is_frame_stack(self.obs_shape, self.obs_dtype)  # send frames once

    def priorities(
        self, obs: np.ndarray, act: np.ndarray, ret: np.ndarray, disc: np.ndarray, nxt: np.ndarray
    ) -> np.ndarray:
        """Initial priorities of n-step transitions."""
        raise NotImplementedError

    def collect(
        self, obs: np.ndarray, actions: np.ndarray, step: Step
    ) -> tuple[list[Any], list[int]]:
        done = self.nstep.add(
            obs, actions, step.rewards, step.true_next, step.terminated, step.truncated
        )
        return done, self.nstep.slots

    def message(
        self, items: list[tuple[np.ndarray, Any, float, float, np.ndarray]], slots: np.ndarray
    ) -> tuple[str, dict[str, Any]]:
        """Transitions as ``apex.experience``, or over stacked frames as ``apex.frames``."""
        obs, act, ret, disc, nxt = zip(*items, strict=True)
        obs_a = np.stack(obs).astype(self.obs_dtype)
        nxt_a = np.stack(nxt).astype(self.obs_dtype)
        act_a = np.asarray(act, self.action_dtype)
        ret_a, disc_a = np.asarray(ret, np.float32), np.asarray(disc, np.float32)
        rows = {
            "action": act_a,
            "ret": ret_a,
            "disc": disc_a,
            "priority": self.priorities(obs_a, act_a, ret_a, disc_a, nxt_a),
        }
        if not self.frames:
            return "apex.experience", {"obs": obs_a, "next_obs": nxt_a, **rows}
        fields = pack_frames(obs_a, nxt_a, slots)  # each frame once, per env-slot chunk
        order = fields.pop("order")
        fields.update({k: v[order] for k, v in rows.items()})
        return "apex.frames", fields
