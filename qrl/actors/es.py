"""The ES worker: evaluates antithetic perturbations theta +- sigma eps of the master's current
parameters, one episode each, ``envs_per_worker`` episodes side by side, and pushes the
results (generation, noise index, both returns and lengths, observation sums) in batches.

A new generation is picked up as soon as it appears: episodes of the old one are abandoned
(their results could only be stale) and every slot starts on the new parameters.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable

import numpy as np
import redis

from qrl.codec import encode
from qrl.configs import ESConfig
from qrl.envs import make_vector_env
from qrl.es import NoiseTable, PolicySpec, normalize
from qrl.keys import RunKeys
from qrl.metrics import report
from qrl.streams import StreamProducer
from qrl.weights import WeightStore

log = logging.getLogger(__name__)


class ESWorker:
    def __init__(
        self, client: redis.Redis, keys: RunKeys, cfg: ESConfig, worker_id: int = 0
    ) -> None:
        self.client, self.keys, self.cfg, self.worker_id = client, keys, cfg, worker_id
        self.spec = PolicySpec.for_env(cfg.env, cfg.hidden)
        self.noise = NoiseTable(cfg.noise_seed, cfg.noise_size)
        self.n = cfg.envs_per_worker
        self.envs = make_vector_env(cfg.env, self.n, seed=cfg.seed * 10_000 + worker_id * 100)
        self.rng = np.random.default_rng(cfg.seed * 10_000 + worker_id)
        self.store = WeightStore(client, keys, keys.es_params)
        self.producer = StreamProducer(client, keys.es_results, maxlen=cfg.stream_maxlen)
        self.generation = -1
        self.theta = np.zeros(self.spec.dim, np.float32)
        self.obs_mean = np.zeros(self.spec.obs_dim)
        self.obs_std = np.ones(self.spec.obs_dim)
        self.steps = 0
        self.episodes = 0
        self.abandoned = 0
        self.returns: list[float] = []

    def refresh(self) -> bool:
        """Take a newer generation's parameters if the master published one."""
        w = self.store.fetch(newer_than=self.generation)
        if w is None:
            return False
        self.generation = w.version
        self.theta = w.params["theta"].astype(np.float32)
        if self.cfg.obs_norm:
            self.obs_mean, self.obs_std = w.params["obs_mean"], w.params["obs_std"]
        return True

    def _reset_generation(self) -> None:
        """Start every slot on the current generation's parameters."""
        dim = self.spec.dim
        self.jobs: deque[tuple[int, int]] = deque()  # (noise index, sign) not yet started
        self.slot_job: list[tuple[int, int]] = [(0, 0)] * self.n
        self.params = np.empty((self.n, dim), np.float32)
        self.ret = np.zeros(self.n)
        self.length = np.zeros(self.n, np.int64)
        self.halves: dict[int, dict[int, tuple[float, int]]] = {}
        self.done_pairs: list[tuple[int, float, float, int, int]] = []
        self.obs_sum = np.zeros(self.spec.obs_dim)
        self.obs_sumsq = np.zeros(self.spec.obs_dim)
        self.obs_count = 0.0
        for j in range(self.n):
            self._assign(j)

    def _assign(self, j: int) -> None:
        if not self.jobs:
            i = self.noise.sample_index(self.rng, self.spec.dim)
            self.jobs.extend([(i, 1), (i, -1)])
        i, sign = self.jobs.popleft()
        self.slot_job[j] = (i, sign)
        self.params[j] = self.theta + sign * self.cfg.sigma * self.noise.get(i, self.spec.dim)
        self.ret[j], self.length[j] = 0.0, 0

    def _finish(self, j: int) -> None:
        i, sign = self.slot_job[j]
        self.episodes += 1
        self.returns.append(float(self.ret[j]))
        half = self.halves.setdefault(i, {})
        half[sign] = (float(self.ret[j]), int(self.length[j]))
        if len(half) == 2:
            del self.halves[i]
            (rp, lp), (rn, ln) = half[1], half[-1]
            self.done_pairs.append((i, rp, rn, lp, ln))

    def push(self, should_stop: Callable[[], bool]) -> bool:
        if not self.done_pairs:
            return True
        idx, rp, rn, lp, ln = (np.array(x) for x in zip(*self.done_pairs, strict=True))
        payload = encode(
            "es.results",
            {
                "generation": self.generation,
                "index": idx.astype(np.int64),
                "return_pos": rp.astype(np.float32),
                "return_neg": rn.astype(np.float32),
                "length_pos": lp.astype(np.int32),
                "length_neg": ln.astype(np.int32),
                "obs_sum": self.obs_sum,
                "obs_sumsq": self.obs_sumsq,
                "obs_count": self.obs_count,
                "worker": self.worker_id,
                "batch": uuid.uuid4().hex,
            },
        )
        self.done_pairs = []
        self.obs_sum, self.obs_sumsq, self.obs_count = 0 * self.obs_sum, 0 * self.obs_sumsq, 0.0
        return self.producer.add(payload, should_stop=should_stop) is not None

    def run(
        self,
        should_stop: Callable[[], bool],
        max_steps: int | None = None,
        report_every: float = 1.0,
        poll_every: int = 10,
    ) -> int:
        """Evaluate perturbations until ``should_stop()``; returns env steps taken."""
        while not self.refresh():
            if should_stop():
                return 0
            time.sleep(0.05)
        self._reset_generation()
        obs, _ = self.envs.reset()
        next_report, last = time.monotonic() + report_every, (time.monotonic(), 0)
        vec_steps = 0
        while not should_stop() and (max_steps is None or self.steps < max_steps):
            actions = self.spec.act(self.params, normalize(obs, self.obs_mean, self.obs_std))
            obs, rewards, term, trunc, _ = self.envs.step(actions)
            self.obs_sum += obs.sum(axis=0)
            self.obs_sumsq += (obs.astype(np.float64) ** 2).sum(axis=0)
            self.obs_count += len(obs)
            self.ret += rewards
            self.length += 1
            self.steps += self.n
            vec_steps += 1
            for j in np.flatnonzero(term | trunc):  # obs[j] already starts the next episode
                self._finish(j)
                self._assign(j)
            if len(self.done_pairs) >= self.cfg.batch_pairs and not self.push(should_stop):
                break
            if vec_steps % poll_every == 0 and self.store.version() > self.generation:
                self.push(
                    should_stop
                )  # finished pairs of the old generation (the master counts them)
                self.abandoned += self.n  # episodes in flight on the old parameters
                self.refresh()
                self._reset_generation()
                obs, _ = self.envs.reset()
            now = time.monotonic()
            if now >= next_report:
                t0, s0 = last
                report(
                    self.client,
                    self.keys,
                    "worker",
                    self.worker_id,
                    steps=self.steps,
                    steps_per_s=(self.steps - s0) / (now - t0),
                    episode_returns=self.returns,
                    generation=self.generation,
                    abandoned=self.abandoned,
                )
                self.returns = []
                next_report, last = now + report_every, (now, self.steps)
        return self.steps
