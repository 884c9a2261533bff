"""The sharded replay (``replay_shards`` = S > 1): S prioritized replays, each over its own
keys (:meth:`qrl.wire.keys.RunKeys.shards`: its own hash tag, so on a Redis Cluster the shards
spread over the nodes), each with its own experience stream, filler and eviction; the
learner draws every batch across all of them.

* **Routing.** Env slot ``g`` of the run (actor ``a``'s env ``j`` is ``g = a x
  envs_per_actor + j``) sends its transitions to shard ``g mod S``: every shard gets an
  even share when the run has at least S env slots, and an env slot's consecutive
  transitions stay in one shard (:func:`shard_of_slots`).
* **Capacity.** Each shard keeps ``ceil(replay_capacity / S)`` transitions, evicting its own
  oldest (FIFO per shard).
* **Fillers.** Filler number ``i`` (``qrl replay --id i``) drains shard ``i mod S``; ``qrl
  train`` starts ``max(replays, S)`` of them.
* **Proportional sampling** is exact: shard ``s`` holds priority mass ``M_s`` (the sum of
  its transitions' bucketed weights, counted by the sampling script), the batch's ``B``
  stratified positions are cut over ``M = sum M_s`` and each lands in one shard, which draws
  it from its own distribution. So ``P(i) = M_s / M x w_i / M_s = w_i / M``: the
  probability of one unsharded replay over the same transitions and priorities. The
  masses are read afresh for every batch (one extra call per shard).
* **Rank sampling** is approximate: an exact global rank needs all shards' sorted sets
  merged, which no single Lua call can do on a cluster. Shard ``s`` gets the batch's share
  ``n_s / N`` (its size) and ranks within itself: ``P(i) = n_s / N x r_s(i)^-a / sum_{r <=
  n_s} r^-a``. When the shards hold statistically alike priorities (the routing spreads
  every actor's epsilons over all shards), ``r_s(i) ~ r(i) n_s / N`` and this equals the
  global ``r(i)^-a / sum_{r <= N} r^-a`` up to the discreteness of the top ranks
  (``tests/test_shards.py`` measures the gap). The IS weights use the probability actually
  used, so they correct for what is left.

IS weights are ``(N P(i))^-b`` over the batch's largest, ``N`` the transitions of all
shards. Sampled ids name their shard (``b"s:id"``), so priority updates go back to it; with
one shard, ids and everything else are exactly those of :class:`PrioritizedReplay`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Literal

import numpy as np
import redis

from qrl.replay.frames import replay_class
from qrl.replay.store import (
    Columns,
    PrioritizedReplay,
    RecordLayout,
    Sample,
    priorities_refused,
    screen,
)
from qrl.wire.cluster import run_scripts
from qrl.wire.keys import RunKeys


def shard_capacity(capacity: int, shards: int) -> int:
    """The transitions each of ``shards`` shards keeps."""
    return math.ceil(capacity / shards)


def shard_of_slots(actor_id: int, envs_per_actor: int, shards: int) -> np.ndarray:
    """The shard of each env slot of actor ``actor_id`` (any natural number: reduced before
    the arithmetic, which would overflow int64 for ids near 2^53)."""
    return ((actor_id % shards) * envs_per_actor + np.arange(envs_per_actor)) % shards


def filler_shard(ident: int, shards: int) -> int:
    """The shard filler number ``ident`` drains."""
    return ident % shards


class ShardedReplay:
    """The learner's view of a run's replay: ``shards`` :class:`PrioritizedReplay` s
    sampled as one (same interface: ``size``, ``sample``, ``update_priorities``)."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        layout: RecordLayout,
        capacity: int,
        *,
        shards: int = 1,
        mode: Literal["rank", "proportional"] = "rank",
        alpha: float = 0.6,
        seed: int | None = None,
    ) -> None:
        cap = shard_capacity(capacity, shards)
        self.parts = [
            replay_class(layout)(client, k, layout, cap, mode=mode, alpha=alpha, seed=seed)
            for k in keys.shards(shards)
        ]
        self.client, self.layout, self.mode = client, layout, mode
        self.rng = np.random.default_rng(seed)

    def size(self) -> int:
        return sum(p.size() for p in self.parts)

    def sample(
        self, batch_size: int, beta: float = 0.4, out: Columns | None = None
    ) -> Sample | None:
        """A stratified batch across the shards, or ``None`` while they are all empty;
        decoded into ``out`` if given."""
        return self.samples(batch_size, beta, [out])[0]

    def samples(
        self, batch_size: int, beta: float, outs: list[Columns | None]
    ) -> list[Sample | None]:
        """One batch per ``outs`` (each as :meth:`sample`), all drawn in one round trip: a
        sampler far from Redis (5 ms) that fills every slot given back at once keeps the
        learner fed where one batch per round trip would not (docs/benchmarks.md, "Many
        machines")."""
        sizes, shares = self._shares()
        total = shares.sum()
        fractions = shares / total if total > 0 else shares
        plans = [self._plan(batch_size, shares) for _ in outs]
        calls = [call[:3] for plan in plans for call in plan.values()]
        replies = iter(run_scripts(self.client, calls) if calls else [])
        got = []
        bad: dict[bytes, Any] = {}  # drawn by several of the batches: removed, counted once

        def hold(ids: list[bytes], records: list[Any]) -> None:
            bad.update(zip(ids, records, strict=True))

        for plan, out in zip(plans, outs, strict=True):
            ids: list[bytes] = []
            recs: list[bytes] = []
            probs = []
            for s, call in plan.items():
                n, drawn, records, p = self.parts[s].drawn(next(replies), call[3])
                sizes[s] = n
                ids += [b"%d:%s" % (s, i) for i in drawn] if len(self.parts) > 1 else drawn
                recs += records
                probs.append(p * fractions[s])
            prob = np.concatenate(probs) if probs else np.zeros(0)
            got.append(screen(self, int(sizes.sum()), ids, recs, prob, beta, out, hold))
        if bad:
            self.reject(list(bad), list(bad.values()))
        return got

    def _shares(self) -> tuple[np.ndarray, np.ndarray]:
        """Each shard's ``(size, share of the sampling)``: its priority mass
        (proportional) or its size (rank: the size the next draw ranks over). One shard
        draws all (its script counts its mass and size itself)."""
        if len(self.parts) == 1:
            return np.zeros(1), np.ones(1)
        if self.mode == "proportional":
            replies = run_scripts(self.client, [p.mass_call() for p in self.parts])
            sizes, masses = zip(*map(PrioritizedReplay.massed, replies), strict=True)
            return np.array(sizes, np.float64), np.array(masses, np.float64)
        sizes = np.array([p.last_size or p.size() for p in self.parts], np.float64)
        return sizes, sizes

    def _plan(self, batch_size: int, shares: np.ndarray) -> dict[int, Any]:
        """Shard -> its draw's script call for one stratified batch cut over the shards'
        ``shares`` (none while they are all empty)."""
        total = shares.sum()
        if total <= 0:
            return {}
        pos = (np.arange(batch_size) + self.rng.random(batch_size)) / batch_size * total
        edges = np.concatenate([[0.0], np.cumsum(shares)])
        which = np.clip(np.searchsorted(edges, pos, side="right") - 1, 0, len(self.parts) - 1)
        calls = {}
        for s in np.unique(which):
            if shares[s] <= 0:
                continue  # only by rounding at an edge: an empty shard has no mass
            u = np.clip((pos[which == s] - edges[s]) / shares[s], 0.0, np.nextafter(1.0, 0.0))
            if (call := self.parts[s].draw_call(u)) is not None:
                calls[int(s)] = call
        return calls

    def _by_shard(self, ids: list[bytes]) -> dict[int, tuple[list[int], list[bytes]]]:
        """Each shard's positions in ``ids`` (``b"shard:id"``) and its own ids there."""
        groups: dict[int, tuple[list[int], list[bytes]]] = defaultdict(lambda: ([], []))
        for k, i in enumerate(ids):
            shard, _, local = i.partition(b":")
            at, own = groups[int(shard)]
            at.append(k)
            own.append(local)
        return groups

    def reject(self, ids: list[bytes], records: list[Any]) -> None:
        """Remove sampled items that did not decode, each from its shard."""
        if len(self.parts) == 1:
            self.parts[0].reject(ids, records)
            return
        for s, (at, local) in self._by_shard(ids).items():
            self.parts[s].reject(local, [records[k] for k in at])

    def update_priorities(self, ids: list[bytes], priorities: np.ndarray) -> None:
        """New priorities, each sent to the shard its id names (ZADD XX there)."""
        if len(self.parts) == 1:
            self.parts[0].update_priorities(ids, priorities)
            return
        p = np.asarray(priorities, np.float64)
        # one pipeline: one round trip to a node, or one to each node of a cluster at once
        pipe = self.client.pipeline(transaction=False)
        for s, (at, local) in self._by_shard(ids).items():
            self.parts[s].queue_priorities(pipe, local, p[at])
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, redis.ResponseError):
                priorities_refused(reply)
