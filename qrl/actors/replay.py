"""What the Ape-X family's actors share (Ape-X, Ape-X DPG, R2D2): per-slot exploration
spread like Ape-X's epsilons (:func:`spread`), and the sink that pushes replay items to the
experience stream of each env slot's shard under the rate limit against the learner
(:class:`ReplaySink`); the replay items of n-step transitions (:class:`Transitions`, with
:class:`NStep`). R2D2's sequences are in :mod:`qrl.actors.r2d2`.

Follow one batch: :meth:`ReplaySink.add` turns each vector step into replay items
(:meth:`Transitions.items`: ``NStep.add``'s n-step transitions; R2D2: sequences) and hands
them to its :class:`qrl.actors.feed.ReplayFeed`; once ``actor_batch`` are pending,
:meth:`ReplaySink.flush` pushes them as the items' ``message`` (initial priorities
included), one batch per shard, and keeps to the rate limit
(:class:`qrl.actors.feed.RateLimit`); the replay role (``qrl/replay/role.py``) inserts them.
Stacked frames (Atari) travel each frame once, in per-env-slot chunks
(:mod:`qrl.replay.frames`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import redis

from qrl.actors.actor import WeightsClient
from qrl.actors.envs import Step
from qrl.actors.feed import RateLimit, ReplayFeed
from qrl.algos.apex_family.config import ReplayConfig
from qrl.algos.apex_family.messages import EXPERIENCE, FRAMES
from qrl.replay.frames import is_frame_stack, pack_frames
from qrl.rl.envspec import EnvSpec
from qrl.runtime.config import Config
from qrl.runtime.loop import StopCheck
from qrl.wire.keys import RunKeys


def spread(base: float, alpha: float, cfg: ReplayConfig, actor_id: int) -> np.ndarray:
    """Ape-X's per-actor exploration schedule: env slot i of N = actors x envs_per_actor
    gets base^(1 + i * alpha / (N - 1)); each env slot plays the role of one paper actor."""
    n = cfg.actors * cfg.envs_per_actor
    # extra actors beyond the configured count reuse the schedule (the id reduced first: an
    # id an inference server was sent can be as large as 2^53, past int64 times the envs)
    i = ((actor_id % cfg.actors) * cfg.envs_per_actor + np.arange(cfg.envs_per_actor)) % n
    return base ** (1 + i * alpha / max(n - 1, 1))


def epsilon_greedy(
    greedy: np.ndarray, eps: np.ndarray, rng: np.random.Generator, n_actions: int
) -> np.ndarray:
    """``greedy`` with each env slot's action replaced by a random one with its epsilon
    (Ape-X's and R2D2's exploration; the draws in this order: the coins, then the actions)."""
    explore = rng.random(len(greedy)) < eps
    random = rng.integers(0, n_actions, len(greedy))
    return np.where(explore, random, greedy)


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


class ReplayItems(Protocol):
    """What an algorithm's replay items are: made of the steps, and sent as a message."""

    def items(
        self, obs: np.ndarray, actions: np.ndarray, extra: Any, step: Step
    ) -> tuple[list[Any], list[int]]:
        """The replay items that taking ``actions`` in ``obs`` completed (``extra``: what
        the policy said of them), and the env slot of each."""

    def message(self, items: list[Any], slots: np.ndarray) -> tuple[str, dict[str, Any]]:
        """The kind and the fields of the message of ``items`` (from env slots ``slots``),
        ``priority`` included; the actor, the version and a batch id are added to them."""


class ReplaySink:
    """One actor's replay items on their way to the replay shards: a unit is one vector
    step; a batch goes out once ``actor_batch`` items are ready, and then the rate limit
    holds the actor while the learner is behind."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        cfg: ReplayConfig,
        actor_id: int,
        items: ReplayItems,
    ) -> None:
        self.make = items.items
        self.feed = ReplayFeed(client, keys, cfg, actor_id, items.message)
        self.limit = RateLimit(client, keys, cfg, share=cfg.actors)

    def add(
        self, obs: np.ndarray, actions: np.ndarray, extra: Any, step: Step, version: int
    ) -> bool:
        self.feed.add(*self.make(obs, actions, extra, step))
        return True

    def flush(self, steps: int, weights: WeightsClient, should_stop: StopCheck) -> bool:
        """Push a batch if one is ready."""
        return not self.feed.ready or self.push(steps, weights, should_stop)

    def push(self, steps: int, weights: WeightsClient, should_stop: StopCheck) -> bool:
        """Push the pending items (:class:`qrl.actors.feed.ReplayFeed`) as acted with the
        weights' version now, and keep to the rate limit; False if stopped while waiting."""
        return self.feed.flush(weights.version, should_stop) and self.throttle(
            steps, weights, should_stop
        )

    def throttle(self, steps: int, weights: WeightsClient, should_stop: StopCheck) -> bool:
        """Count the actor's ``steps`` in the run's total and wait while the learner is behind
        (:class:`qrl.actors.feed.RateLimit`); its progress is the weights the actor loaded."""

        def progress() -> int:
            weights.refresh()
            return weights.version

        return self.limit.throttle(steps, weights.version, progress, should_stop)

    def close(self, steps: int, weights: WeightsClient, should_stop: StopCheck) -> None:
        self.push(steps, weights, should_stop)

    def reconfigure(self, cfg: Config) -> None:
        pass

    def metrics(self) -> dict[str, Any]:
        return {"backpressure_s": self.feed.waited_s(), "throttled_s": self.limit.throttled_s}


# (obs, actions, n-step returns, discounts, bootstrap obs) -> initial priorities
Priorities = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


class Transitions:
    """The replay items of Ape-X and Ape-X DPG: n-step transitions (:class:`NStep`) with
    initial priorities from the algorithm (``priorities``), actions as ``action_dtype``,
    stacked frames sent once."""

    def __init__(
        self, cfg: ReplayConfig, env: EnvSpec, action_dtype: Any, priorities: Priorities
    ) -> None:
        self.nstep = NStep(cfg.envs_per_actor, cfg.n_step, cfg.gamma)
        self.obs_dtype, self.action_dtype, self.priorities = env.obs_dtype, action_dtype, priorities
        self.frames = is_frame_stack(env.obs_shape, env.obs_dtype)  # send frames once

    def items(
        self, obs: np.ndarray, actions: np.ndarray, extra: Any, step: Step
    ) -> tuple[list[Any], list[int]]:
        done = self.nstep.add(
            obs, actions, step.rewards, step.true_next, step.terminated, step.truncated
        )
        return done, self.nstep.slots

    def message(
        self, items: list[tuple[np.ndarray, Any, float, float, np.ndarray]], slots: np.ndarray
    ) -> tuple[str, dict[str, Any]]:
        """Transitions (:data:`EXPERIENCE`), or over stacked frames (:data:`FRAMES`)."""
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
            return EXPERIENCE, {"obs": obs_a, "next_obs": nxt_a, **rows}
        fields = pack_frames(obs_a, nxt_a, slots)  # each frame once, per env-slot chunk
        order = fields.pop("order")
        fields.update({k: v[order] for k, v in rows.items()})
        return FRAMES, fields
