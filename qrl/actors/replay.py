"""What the Ape-X family's actors share (Ape-X, Ape-X DPG, R2D2): vector envs, per-slot
exploration spread like Ape-X's epsilons, batches of replay items pushed to the experience
stream of each env slot's shard, and the rate limit against the learner
(:class:`ReplayActor`); and the actors of n-step transitions (:class:`TransitionActor`).

Follow one batch: ``ReplayActor.advance`` calls ``act`` and steps the envs; ``collect``
turns the step into replay items (``TransitionActor``: ``NStep.add``'s n-step transitions;
R2D2: sequences); ``ReplayActor.flush`` pushes them as the subclass's ``message`` (initial
priorities included), one batch per shard, and keeps to the rate limit
(:mod:`qrl.actors.feed`); the replay role (``qrl/replay/role.py``) inserts them. Stacked
frames (Atari) travel each frame once, in per-env-slot chunks (:mod:`qrl.replay.frames`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import redis
import torch

from qrl.actors.base import VectorActor
from qrl.actors.envs import Step
from qrl.actors.feed import RateLimit, ReplayFeed
from qrl.algos.apex_family.config import ReplayConfig
from qrl.algos.apex_family.messages import EXPERIENCE, FRAMES
from qrl.replay.frames import is_frame_stack, pack_frames
from qrl.rl.envspec import EnvSpec
from qrl.runtime.config import Config
from qrl.wire.keys import RunKeys


def spread(base: float, alpha: float, cfg: ReplayConfig, actor_id: int) -> np.ndarray:
    """Ape-X's per-actor exploration schedule: env slot i of N = actors x envs_per_actor
    gets base^(1 + i * alpha / (N - 1)); each env slot plays the role of one paper actor."""
    n = cfg.actors * cfg.envs_per_actor
    # extra actors beyond the configured count reuse the schedule (the id reduced first: an
    # id an inference server was sent can be as large as 2^53, past int64 times the envs)
    i = ((actor_id % cfg.actors) * cfg.envs_per_actor + np.arange(cfg.envs_per_actor)) % n
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
        self.feed = ReplayFeed(client, keys, cfg, actor_id, self.message)
        self.limit = RateLimit(client, keys, cfg, share=cfg.actors)

    def make_net(self) -> torch.nn.Module:
        """The local copy of the learner's (published) network."""
        raise NotImplementedError

    def explore(self) -> None:
        """Set each env slot's exploration (epsilons, noise) from ``self.cfg``: at the start
        and again when a live config change came (:meth:`reconfigure`)."""
        raise NotImplementedError

    def reconfigure(self, cfg: Config) -> None:
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
        """Push the pending items (:class:`qrl.actors.feed.ReplayFeed`) and keep to the rate
        limit; False if stopped while waiting."""
        return self.feed.flush(self.version, should_stop) and self.throttle(should_stop)

    def throttle(self, should_stop: Callable[[], bool]) -> bool:
        """Count our steps in the run's total and wait while the learner is behind
        (:class:`qrl.actors.feed.RateLimit`); its progress is the weights this actor loaded."""

        def progress() -> int:
            self.refresh_weights()
            return self.version

        return self.limit.throttle(self.steps, self.version, progress, should_stop)

    def advance(self, obs: np.ndarray, should_stop: Callable[[], bool]) -> np.ndarray | None:
        """One vector step; pushes a batch when ``actor_batch`` items are ready."""
        actions = self.act(obs)
        step = self.step_envs(actions)
        self.feed.add(*self.collect(obs, actions, step))
        if self.feed.ready and not self.flush(should_stop):
            return None
        return step.next_obs

    def finish(self, should_stop: Callable[[], bool]) -> None:
        self.flush(should_stop)

    def waited_s(self) -> float:
        return self.feed.waited_s()

    def extra_metrics(self) -> dict[str, float]:
        return {"throttled_s": self.limit.throttled_s}


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
