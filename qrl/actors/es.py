"""The ES worker: evaluates antithetic perturbations theta +- sigma eps of the master's current
parameters, one episode each, ``envs_per_worker`` episodes side by side, and pushes the
results (generation, pair job id, noise index, both returns and lengths, observation sums)
in batches. A pair's observation statistics are those of its two episodes, so a message
counts exactly the steps it reports.

Both halves of an antithetic pair start from the same initial state (the env is reset with
a seed drawn for the pair: common random numbers), so their difference measures the
perturbation, not the luck of the start. Halves are matched by their pair's job id (unique
in the worker), not by noise index: two pairs in flight may draw the same index. A new
generation is picked up as soon as it
appears: episodes of the old one are abandoned (their results could only be stale) and
every slot starts on the new parameters.

Far from Redis (:class:`qrl.runtime.background.Background`: round trips of a millisecond or
more) the look for a new generation and the push of results each run on a thread of their
own while the envs step on: a look every ``poll_every`` (5 ms) in line would cost a round
trip about every step there (at 5 ms a worker stepped a tenth of its loopback rate). A new
generation a look brought is taken up at the next step; a push still under way when the
next is due is waited for (a full stream still holds the worker back).
"""

from __future__ import annotations

import logging
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import redis

from qrl.algos.es.config import ESConfig
from qrl.algos.es.keys import es_params, es_results
from qrl.algos.es.messages import KIND, pairs_per_message
from qrl.algos.es.strategy import NoiseTable, PolicySpec, normalize
from qrl.rl.envs import make_env
from qrl.rl.envspec import EnvSpec
from qrl.runtime.background import Background
from qrl.runtime.loop import Role, StopCheck
from qrl.wire import clock
from qrl.wire.codec import encode
from qrl.wire.keys import RunKeys
from qrl.wire.streams import StreamProducer
from qrl.wire.weights import Weights, WeightStore

log = logging.getLogger(__name__)


class Job(NamedTuple):
    """One half of an antithetic pair: the pair's id, its noise index and env seed."""

    id: int
    index: int
    sign: int  # +1 or -1
    env_seed: int


class ESWorker(Role):
    name = "worker"
    counter = "steps"

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        cfg: ESConfig,
        worker_id: int = 0,
        poll_every: float = 0.005,
        env: EnvSpec | None = None,
    ) -> None:
        self.client, self.keys, self.cfg, self.worker_id = client, keys, cfg, worker_id
        self.spec = PolicySpec.for_env(env or EnvSpec.of(cfg.env), cfg.hidden)
        self.noise = NoiseTable(cfg.noise_seed, cfg.noise_size)
        self.n = cfg.envs_per_worker
        self.envs = [make_env(cfg.env) for _ in range(self.n)]
        self.obs = np.zeros((self.n, self.spec.obs_dim), np.float32)
        self.rng = np.random.default_rng(cfg.seed * 10_000 + worker_id)
        self.store = WeightStore(client, keys, es_params(keys))
        self.producer = StreamProducer(
            client, es_results(keys), maxlen=cfg.stream_maxlen, keys=keys
        )
        self.generation = -1
        self.theta = np.zeros(self.spec.dim, np.float32)
        self.obs_mean = np.zeros(self.spec.obs_dim)
        self.obs_std = np.ones(self.spec.obs_dim)
        self.steps = 0
        self.episodes = 0
        self.abandoned = 0
        self.last_push = 0.0
        self.returns: list[float] = []
        self.next_job = 0  # the id of the next antithetic pair
        self.poll_every, self.next_poll = poll_every, 0.0
        self.looking, self.pushing = Background("generation"), Background("results")
        self.looked: Weights | None = None  # a new generation a look brought

    def newer(self) -> Weights | None:
        """Another generation's parameters, if the master published valid ones."""
        w = self.store.fetch(newer_than=self.generation)
        if w is None:
            return None
        d = self.spec.obs_dim
        shapes = {"theta": (self.spec.dim,), "obs_mean": (d,), "obs_std": (d,)}
        if any(getattr(w.params.get(k), "shape", None) != v for k, v in shapes.items()):
            log.warning("generation %d's parameters do not fit this policy: ignored", w.version)
            return None
        return w

    def adopt(self, w: Weights) -> None:
        self.generation = w.version
        self.theta = w.params["theta"].astype(np.float32)
        if self.cfg.obs_norm:
            self.obs_mean, self.obs_std = w.params["obs_mean"], w.params["obs_std"]

    def _reset_generation(self) -> None:
        """Start every slot on the current generation's parameters."""
        dim = self.spec.dim
        self.jobs: deque[Job] = deque()
        self.slot_job: list[Job] = [Job(0, 0, 0, 0)] * self.n
        self.params = np.empty((self.n, dim), np.float32)
        self.ret = np.zeros(self.n)
        self.length = np.zeros(self.n, np.int64)
        # each slot's episode's observation sums (and squares): a pair's go with its results
        self.ep_obs = np.zeros((self.n, 2, self.spec.obs_dim))
        self.halves: dict[int, dict[int, tuple[float, int, np.ndarray]]] = {}  # job -> sign ->
        self.done_pairs: list[tuple[int, int, float, float, int, int, np.ndarray]] = []
        for j in range(self.n):
            self._assign(j)

    def _assign(self, j: int) -> None:
        if not self.jobs:
            i = self.noise.sample_index(self.rng, self.spec.dim)
            env_seed = int(self.rng.integers(2**31))
            self.jobs.extend(Job(self.next_job, i, sign, env_seed) for sign in (1, -1))
            self.next_job += 1
        job = self.slot_job[j] = self.jobs.popleft()
        noise = self.noise.get(job.index, self.spec.dim)
        self.params[j] = self.theta + job.sign * self.cfg.sigma * noise
        self.ret[j], self.length[j], self.ep_obs[j] = 0.0, 0, 0.0
        self.obs[j] = self.envs[j].reset(seed=job.env_seed)[0]

    def _finish(self, j: int) -> None:
        job = self.slot_job[j]
        self.episodes += 1
        self.returns.append(float(self.ret[j]))
        half = self.halves.setdefault(job.id, {})
        half[job.sign] = (float(self.ret[j]), int(self.length[j]), self.ep_obs[j].copy())
        if len(half) == 2:
            del self.halves[job.id]
            (rp, lp, op), (rn, ln, on) = half[1], half[-1]
            self.done_pairs.append((job.id, job.index, rp, rn, lp, ln, op + on))

    def push(self, should_stop: Callable[[], bool]) -> bool:
        """Send the finished pairs, at most :func:`pairs_per_message` a message, each with the
        observation sums of exactly its episodes (the count: their steps, which the master
        checks): on the pushing thread, far from Redis, while the envs step on; False if
        that push (in line: this one) was stopped while the stream was full."""
        payloads = self._messages()
        self.last_push = clock.now()

        def send() -> bool:
            return all(self.producer.add(p, should_stop=should_stop) is not None for p in payloads)

        return self.pushing.submit(send) is not False

    def _messages(self) -> list[bytes]:
        """The finished pairs' messages (of the current generation), taken."""
        pairs, self.done_pairs = self.done_pairs, []
        size = pairs_per_message(self.cfg)
        out = []
        for start in range(0, len(pairs), size):
            chunk = pairs[start : start + size]
            job, idx, rp, rn, lp, ln, obs = (np.array(x) for x in zip(*chunk, strict=True))
            payload = encode(
                KIND,
                {
                    "generation": self.generation,
                    "job": job.astype(np.int64),
                    "index": idx.astype(np.int64),
                    "return_pos": rp.astype(np.float32),
                    "return_neg": rn.astype(np.float32),
                    "length_pos": lp.astype(np.int32),
                    "length_neg": ln.astype(np.int32),
                    "obs_sum": obs[:, 0].sum(axis=0),
                    "obs_sumsq": obs[:, 1].sum(axis=0),
                    "obs_count": float(lp.sum() + ln.sum()),
                    "worker": self.worker_id,
                    "batch": uuid.uuid4().hex,
                },
            )
            out.append(payload)
        return out

    def look(self) -> None:
        """Look for another generation, on the looking thread far from Redis (the step
        after it is back takes it up); in line near Redis."""
        if self.looking.busy:  # the look under way brings the newest it finds
            return
        self.looking.submit(self._look)

    def _look(self) -> None:
        if (w := self.newer()) is not None:
            self.looked = w

    # -- the role (run by :func:`qrl.runtime.loop.run_role`)
    def start(self, should_stop: StopCheck) -> bool:
        """Wait for the master's first generation."""
        while self.generation < 0:
            if (w := self.newer()) is not None:
                self.adopt(w)
            elif should_stop():
                return False
            else:
                clock.sleep(0.05)
        self._reset_generation()
        return True

    def step(self, should_stop: StopCheck) -> bool:
        """One step of every episode in flight; results pushed in batches, a new generation
        picked up as soon as it appears (one HGET, at most every ``poll_every`` seconds)."""
        actions = self.spec.act(self.params, normalize(self.obs, self.obs_mean, self.obs_std))
        ended = []
        for j, env in enumerate(self.envs):
            obs, reward, term, trunc, _ = env.step(actions[j])
            self.obs[j] = obs
            self.ret[j] += reward
            if term or trunc:
                ended.append(j)
        self.ep_obs[:, 0] += self.obs
        self.ep_obs[:, 1] += self.obs.astype(np.float64) ** 2
        self.length += 1
        self.steps += self.n
        for j in ended:
            self._finish(j)
            self._assign(j)  # resets the env with the next job's seed
        now = clock.now()
        if (
            len(self.done_pairs) >= self.cfg.batch_pairs
            and now - self.last_push >= self.cfg.push_interval
            and not self.push(should_stop)
        ):
            return False
        if now >= self.next_poll:
            self.next_poll = now + self.poll_every
            self.look()
        # another generation, older too: the master overwrote a far-ahead one (garbage
        # someone wrote, which this worker took), see qrl.wire.weights
        w, self.looked = self.looked, None
        if w is not None and w.version != self.generation:
            if not self.push(should_stop):  # the old generation's pairs (the master counts them)
                return False
            self.abandoned += self.n  # episodes in flight on the old parameters
            self.adopt(w)
            self._reset_generation()
        return True

    def close(self, should_stop: StopCheck) -> None:
        """Wait for the look and the push under way (the results are sent)."""
        try:
            self.looking.close()
        finally:
            self.pushing.close()

    def metrics(self) -> dict[str, Any]:
        returns, self.returns = self.returns, []
        return {
            "steps": self.steps,
            "episode_returns": returns,
            "generation": self.generation,
            "abandoned": self.abandoned,
        }
