"""The ES master: publishes the parameters with their generation, gathers that generation's
results from the results stream (older ones are counted as stale and dropped), and once it
has a population's worth computes the update: the returns shaped into weights (``shaping``:
by default each antithetic pair's signed rank of its own difference, or centered ranks over
all returns), the gradient from the shared noise, L2 weight decay, Adam. A restarted master
resumes from its checkpoint, or from the last generation it published if that is ahead (the
blob carries the optimizer and observation stats), never from one far ahead of its own
(garbage).

The master never applies or publishes anything non-finite: a generation whose update would
make the parameters, the optimizer or the observation statistics non-finite is refused (its
results are dropped and counted, the generation is gathered again), and saved state that is
not finite or does not fit is not resumed from. Workers can only evaluate parameters they
can read: when no result of the current generation came for ``CHECK_AFTER`` seconds and the
parameters key holds anything but the version and blob it published (something else
overwrote it: garbage, or an older, newer or far-ahead version), the master publishes its
parameters again as a new generation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch

from qrl.algos.es.config import ESConfig
from qrl.algos.es.keys import es_params, es_results
from qrl.algos.es.messages import es_results_schema, pairs_per_message
from qrl.algos.es.strategy import Adam, NoiseTable, PolicySpec, es_gradient
from qrl.rl.envspec import EnvSpec
from qrl.runtime.checkpoint import load_checkpoint, save_checkpoint
from qrl.runtime.loop import Role, StopCheck
from qrl.wire.keys import RunKeys
from qrl.wire.streams import Entry, StreamConsumer
from qrl.wire.weights import WeightStore, ahead

log = logging.getLogger(__name__)

CHECK_AFTER = 2.0  # seconds without a current result before the published key is checked


def _finite(*arrays: Any) -> bool:
    return all(np.isfinite(a).all() for a in arrays)


class ESMaster(Role):
    algo = "es"
    name = "master"
    counter = "updates"

    def __init__(
        self,
        client_factory: Callable[[], redis.Redis],
        keys: RunKeys,
        cfg: ESConfig,
        checkpoint: Path | None = None,
        env: EnvSpec | None = None,
    ) -> None:
        self.client, self.keys, self.cfg = client_factory(), keys, cfg
        env = env or EnvSpec.of(cfg.env)
        self.spec = PolicySpec.for_env(env, cfg.hidden)
        self.noise = NoiseTable(cfg.noise_seed, cfg.noise_size)
        self.store = WeightStore(self.client, keys, es_params(keys))
        self.consumer = StreamConsumer(
            self.client,
            keys,
            es_results(keys),
            es_results_schema(
                self.spec.obs_dim,
                cfg.noise_size,
                self.spec.dim,
                max_pairs=pairs_per_message(cfg),
                max_steps=env.max_steps or 2**31 - 1,
            ),
            count=64,
            block_ms=100,
            claim_idle_ms=cfg.claim_idle_ms,
        )
        self.checkpoint = checkpoint
        self.adam = Adam(self.spec.dim, cfg.lr)
        self.theta = self.spec.init(np.random.default_rng(cfg.seed))
        self.generation = 0
        d = self.spec.obs_dim
        self.obs_count, self.obs_sum, self.obs_sumsq = 1e-2, np.zeros(d), np.full(d, 1e-2)
        self.stale = 0  # result pairs of older generations, dropped
        self.refused = 0  # result pairs of generations refused as non-finite
        self.last_stats: dict[str, float] = {}  # of the last update
        self.resumed = self._resume()

    # -- state in the published blob
    def _resume(self) -> bool:
        """Resume from the checkpoint, then from the last generation published in Redis if it
        is ahead of that (a master killed after publishing), but not far ahead (garbage: see
        :func:`qrl.wire.weights.ahead`; anyone with the run's keys may write it). Published
        parameters that do not fit are ignored with a warning; a checkpoint that does not fit
        is an error."""
        resumed = False
        if self.checkpoint is not None and self.checkpoint.exists():
            state = load_checkpoint(self.checkpoint, self.algo, self.cfg)
            p = {k: v.numpy() for k, v in state["model"].items()}
            if not self._adopt(state["step"], p, state["extra"]):
                raise ValueError("saved ES parameters do not fit this run's policy")
            resumed = True
        w = self.store.fetch()
        if w is not None and ahead(w.version, self.generation):
            if self._adopt(w.version, w.params, w.meta):
                return True
            log.warning("published generation %d does not fit this run: ignored", w.version)
        return resumed

    def _adopt(self, generation: int, p: dict[str, Any], meta: dict[str, Any]) -> bool:
        """Take saved state if every part of it has the right shape and is finite; else
        change nothing."""
        dim, d = (self.spec.dim,), (self.spec.obs_dim,)
        shapes = {"theta": dim, "adam_m": dim, "adam_v": dim, "obs_sum": d, "obs_sumsq": d}
        if any(getattr(p.get(k), "shape", None) != v for k, v in shapes.items()):
            return False
        adam_t, obs_count = meta.get("adam_t", 0), meta.get("obs_count", self.obs_count)
        if type(adam_t) is not int or adam_t < 0 or type(obs_count) not in (int, float):
            return False
        if not (np.isfinite(obs_count) and obs_count > 0 and _finite(*(p[k] for k in shapes))):
            return False
        self.generation = generation
        self.theta = p["theta"].astype(np.float32)
        self.adam.m, self.adam.v = p["adam_m"].astype(np.float64), p["adam_v"].astype(np.float64)
        self.adam.t = adam_t
        self.obs_count = float(obs_count)
        self.obs_sum, self.obs_sumsq = (
            p["obs_sum"].astype(np.float64),
            p["obs_sumsq"].astype(np.float64),
        )
        log.info("resumed at generation %d", self.generation)
        return True

    def obs_stats(
        self, count: float | None = None, total: Any = None, sumsq: Any = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Mean and std of the observations (of the master's sums, or of those given)."""
        if count is None:
            count, total, sumsq = self.obs_count, self.obs_sum, self.obs_sumsq
        mean = total / count
        var = np.maximum(sumsq / count - mean**2, 1e-4)
        return mean.astype(np.float32), np.sqrt(var).astype(np.float32)

    def params(self) -> dict[str, np.ndarray]:
        mean, std = self.obs_stats()
        return {
            "theta": self.theta,
            "obs_mean": mean,
            "obs_std": std,
            "adam_m": self.adam.m,
            "adam_v": self.adam.v,
            "obs_sum": self.obs_sum,
            "obs_sumsq": self.obs_sumsq,
        }

    def meta(self) -> dict[str, float]:
        return {"adam_t": self.adam.t, "obs_count": self.obs_count}

    def publish(self) -> None:
        """Publish the generation; above a newer one another writer stored, and go on from
        there (see :meth:`qrl.wire.weights.WeightStore.publish`)."""
        self.generation = self.store.publish(
            self.params(), version=self.generation, meta=self.meta()
        )

    def save(self) -> None:
        if self.checkpoint is not None:
            model = {k: torch.from_numpy(np.asarray(v)) for k, v in self.params().items()}
            meta = self.meta()
            save_checkpoint(
                self.checkpoint, self.algo, self.cfg, model, None, self.generation, extra=meta
            )

    # -- one generation
    def update(self, pairs: list[tuple[np.ndarray, ...]]) -> dict[str, float]:
        """Apply the ES update for the collected ``(index, return_pos, return_neg)`` arrays."""
        idx = np.concatenate([p[0] for p in pairs])
        rp = np.concatenate([p[1] for p in pairs])
        rn = np.concatenate([p[2] for p in pairs])
        eps = np.stack([self.noise.get(int(i), self.spec.dim) for i in idx])
        grad = es_gradient(eps, rp, rn, self.cfg.sigma, self.cfg.shaping) - self.cfg.l2 * self.theta
        self.theta = (self.theta + self.adam.step(grad)).astype(np.float32)
        self.generation += 1
        both = np.concatenate([rp, rn])
        return {"population_mean": float(both.mean()), "population_max": float(both.max())}

    # -- the role (run by :func:`qrl.runtime.loop.run_role`)
    @property
    def updates(self) -> int:
        return self.generation

    def reconfigure(self, cfg: ESConfig) -> None:
        super().reconfigure(cfg)  # l2 is read at every update; Adam keeps its own lr
        self.adam.lr = cfg.lr

    def start(self, should_stop: StopCheck) -> bool:
        if self.store.version() != self.generation:  # not what it resumed from: publish
            self.publish()  # (above a newer version that did not fit)
        self._new_generation()
        return True

    def _new_generation(self) -> None:
        self.waiting_since = time.monotonic()
        self.pairs: list[tuple[np.ndarray, ...]] = []
        self.used: list[Entry] = []
        self.obs_new = [0.0, np.zeros_like(self.obs_sum), np.zeros_like(self.obs_sumsq)]

    def step(self, should_stop: StopCheck) -> bool:
        """Gather results of the current generation; once a population's worth came, apply
        the update, publish the next generation and acknowledge what went into it."""
        for e in self.consumer.read():
            self.fold(e)
        if sum(len(p[0]) for p in self.pairs) >= self.cfg.population // 2:
            self.apply()
        elif time.monotonic() - self.waiting_since > CHECK_AFTER:
            self.check_published()
        return True

    def check_published(self) -> None:
        """Publish again, as a new generation, unless the key still holds the version and
        blob this master published (:meth:`WeightStore.kept`). A newer version too: workers
        that took it evaluate parameters the master does not have (a valid blob anyone with
        the run's keys wrote); the master publishes above it, or over it if it is far ahead
        (garbage, see :mod:`qrl.wire.weights`), and they follow."""
        self.waiting_since = time.monotonic()
        if self.store.kept(every_s=0):
            return
        stored, lost = self.store.version(), self.generation
        self.consumer.ack(self.used)  # results of the lost generation
        self.generation += 1
        self._new_generation()
        self.publish()
        log.warning(
            "the parameters key held version %d, not generation %d: published again as %d",
            stored,
            lost,
            self.generation,
        )

    def fold(self, e: Entry) -> None:
        """Take one results entry into the current generation (or drop it as stale)."""
        d = e.data
        if d["generation"] != self.generation:
            self.stale += len(d["index"])
            self.consumer.ack([e])
            return
        self.waiting_since = time.monotonic()
        self.used.append(e)
        self.pairs.append((d["index"], d["return_pos"], d["return_neg"]))
        self.obs_new[0] += d["obs_count"]
        self.obs_new[1] = self.obs_new[1] + d["obs_sum"]
        self.obs_new[2] = self.obs_new[2] + d["obs_sumsq"]

    def apply(self) -> bool:
        """Apply the generation's update and statistics, publish, acknowledge; False (and
        nothing applied or published) if the result would not be finite."""
        before = self.theta, self.adam.m, self.adam.v, self.adam.t, self.generation
        obs = self.obs_count, self.obs_sum, self.obs_sumsq
        if self.cfg.obs_norm:
            obs = tuple(a + b for a, b in zip(obs, self.obs_new, strict=True))
        with np.errstate(all="ignore"):
            stats = self.update(self.pairs)
            ok = obs[0] > 0 and _finite(
                self.theta, self.adam.m, self.adam.v, *obs, *self.obs_stats(*obs)
            )
        if ok:
            self.last_stats = stats
            self.obs_count, self.obs_sum, self.obs_sumsq = obs
            self.publish()
        else:
            self.theta, self.adam.m, self.adam.v, self.adam.t, self.generation = before
            self.refused += sum(len(p[0]) for p in self.pairs)
            log.warning(
                "generation %d: its results would make the parameters or observation "
                "statistics non-finite: refused, gathering it again",
                self.generation,
            )
        self.consumer.ack(self.used)  # consumed into the published generation, or refused
        self._new_generation()
        return bool(ok)

    def metrics(self) -> dict[str, float]:
        return {
            "updates": self.generation,
            "generation": self.generation,
            "stale": self.stale,
            "refused": self.refused,
            **self.last_stats,
        }

    def close(self, should_stop: StopCheck) -> None:
        self.consumer.close()


def policy_from_params(
    cfg: ESConfig, env: EnvSpec, params: dict[str, Any]
) -> Callable[[np.ndarray], np.ndarray]:
    """The center policy (no noise) of published or checkpointed ES parameters on ``env``;
    raises ``ValueError`` if they do not fit the run's policy."""
    from qrl.algos.es.strategy import normalize

    spec = PolicySpec.for_env(env, cfg.hidden)
    shapes = {"theta": (spec.dim,), "obs_mean": (spec.obs_dim,), "obs_std": (spec.obs_dim,)}
    if any(np.shape(params.get(k)) != v for k, v in shapes.items()):
        raise ValueError("ES parameters do not fit this run's policy")
    theta = np.asarray(params["theta"], np.float32)
    mean = np.asarray(params["obs_mean"]) if cfg.obs_norm else np.zeros(spec.obs_dim)
    std = np.asarray(params["obs_std"]) if cfg.obs_norm else np.ones(spec.obs_dim)
    return lambda obs: spec.act(theta, normalize(np.asarray(obs), mean, std))
