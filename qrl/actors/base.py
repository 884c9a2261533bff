"""What every actor shares: vector envs, a local copy of the learner's network kept fresh
from the weight store, a bounded producer, episode statistics and metrics reports."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import redis
import torch

from qrl.envs import env_spec, make_vector_env
from qrl.keys import RunKeys
from qrl.metrics import report
from qrl.streams import StreamProducer
from qrl.weights import WeightStore


class VectorActor:
    """Base of the Ape-X and IMPALA actors. Subclasses build ``self.net`` and the loop."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        cfg: Any,
        actor_id: int,
        stream: str,
    ) -> None:
        torch.set_num_threads(1)
        self.client, self.keys, self.cfg, self.actor_id = client, keys, cfg, actor_id
        self.obs_shape, self.obs_dtype, self.n_actions = env_spec(cfg.env)
        self.envs = make_vector_env(
            cfg.env, cfg.envs_per_actor, seed=cfg.seed * 10_000 + actor_id * 100
        )
        self.rng = np.random.default_rng(cfg.seed * 10_000 + actor_id)
        self.weights = WeightStore(client, keys)
        self.producer = StreamProducer(client, stream, maxlen=cfg.stream_maxlen, keys=keys)
        self.net: torch.nn.Module
        self.version = -1
        self.steps = 0
        self.ep_return = np.zeros(cfg.envs_per_actor)
        self.ep_length = np.zeros(cfg.envs_per_actor, dtype=np.int64)
        self.finished: list[tuple[float, int]] = []
        self._last_report = (time.monotonic(), 0)

    def wait_for_weights(self, should_stop: Callable[[], bool], timeout: float = 600) -> bool:
        """Block until the learner published weights (all actors start from the same ones);
        False if stopped first, ``RuntimeError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not should_stop():
            if self.refresh_weights():
                return True
            if time.monotonic() > deadline:
                raise RuntimeError(f"no weights published in {timeout:.0f}s: is a learner running?")
            time.sleep(0.05)
        return False

    def refresh_weights(self) -> bool:
        """Load newer weights if the learner published some (one HGET when not)."""
        v = self.weights.load_into(self.net, newer_than=self.version)
        if v is None:
            return False
        self.version = v
        return True

    def step_envs(self, actions: np.ndarray) -> tuple[np.ndarray, ...]:
        """Step every env; returns ``(next_obs, true_next_obs, rewards, terminated,
        truncated)`` where ``true_next_obs`` holds the final observation of ended episodes."""
        next_obs, rewards, term, trunc, info = self.envs.step(actions)
        ended = term | trunc
        true_next = next_obs
        if ended.any():
            true_next = next_obs.copy()
            for j in np.flatnonzero(ended):
                true_next[j] = info["final_obs"][j]
        self.ep_return += rewards
        self.ep_length += 1
        for j in np.flatnonzero(ended):
            self.finished.append((float(self.ep_return[j]), int(self.ep_length[j])))
            self.ep_return[j], self.ep_length[j] = 0.0, 0
        self.steps += len(actions)
        return next_obs, true_next, rewards, term, trunc

    # -- for subclasses
    def advance(self, obs: np.ndarray, should_stop: Callable[[], bool]) -> np.ndarray | None:
        """One unit of work from ``obs`` (a vector step, an unroll); returns the observation
        to go on from, or ``None`` if stopped while pushing."""
        raise NotImplementedError

    def finish(self, should_stop: Callable[[], bool]) -> None:
        """Push what is left before the actor ends."""

    def extra_metrics(self) -> dict[str, float]:
        return {}

    def run(
        self,
        should_stop: Callable[[], bool],
        max_steps: int | None = None,
        report_every: float = 1.0,
    ) -> int:
        """Act until ``should_stop()`` (or ``max_steps`` env steps); returns env steps taken.
        Weights are checked every ``weight_poll`` units of work."""
        if not self.wait_for_weights(should_stop):
            return 0
        obs, _ = self.envs.reset()
        next_report = time.monotonic() + report_every
        n = 0
        while not should_stop() and (max_steps is None or self.steps < max_steps):
            obs = self.advance(obs, should_stop)
            if obs is None:
                break
            n += 1
            if n % self.cfg.weight_poll == 0:
                self.refresh_weights()
            if time.monotonic() >= next_report:
                self.report(**self.extra_metrics())
                next_report = time.monotonic() + report_every
        self.finish(should_stop)
        self.report(**self.extra_metrics())
        return self.steps

    def report(self, **extra: float) -> None:
        """Send env steps, steps/s and the episodes finished since the last report."""
        now = time.monotonic()
        t0, s0 = self._last_report
        self._last_report = (now, self.steps)
        returns = [r for r, _ in self.finished]
        lengths = [n for _, n in self.finished]
        self.finished = []
        report(
            self.client,
            self.keys,
            "actor",
            self.actor_id,
            steps=self.steps,
            steps_per_s=(self.steps - s0) / max(now - t0, 1e-9),
            episode_returns=returns,
            episode_lengths=lengths,
            version=self.version,
            backpressure_s=self.producer.waited_s,
            **extra,
        )
