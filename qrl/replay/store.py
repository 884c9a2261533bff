"""The prioritized replay, kept in Redis.

Layout (keys from :class:`qrl.wire.keys.RunKeys`):

* ``replay:prio``  sorted set, member = transition id, score = priority ``p_i`` (> 0)
* ``replay:data``  hash, transition id -> fixed-size record (see :class:`RecordLayout`)
* ``replay:meta``  hash: ``hi`` (next id), ``lo`` (oldest id still present), ``inserted``,
  ``evicted``, ``batches`` (producer batches inserted, each once)
* ``replay:batches`` sorted set of inserted producer batch ids (idempotence), scored by the
  id after their last transition; trimmed with the eviction, so it stays bounded too

Ids are consecutive integers, so FIFO eviction (oldest first, as in Ape-X) deletes the range
``[lo, hi - capacity)``. Every multi-step operation is one Lua script
(``qrl/wire/lua/replay.*.lua``), so readers never see half an insert or an eviction.

Anyone with the run's keys can write anything into these keys. The scripts' work stays
bounded whatever they find (meta out of range is repaired, keys of another type deleted),
and a sampled item that does not decode (a member that is no id, a missing record, one of
the wrong size, a non-finite value, an action out of range) is removed, dead-lettered and
counted (``rejected:replay`` in the stats) instead of reaching the learner (:func:`screen`).

Sampling, with ``N`` transitions present:

* ``rank`` (default): order by priority, highest first; ``P(i) = r_i^-a / sum_{r<=N} r^-a``.
  The batch is stratified: the CDF is cut into ``B`` equal-mass segments and one rank is drawn
  in each (inverse CDF over exact cumulative sums of ``r^-a``).
* ``proportional``: priorities are quantized into log-spaced buckets (edges ``LO * 2^(k/4)``,
  so a bucket spans 19%); every transition in bucket ``k`` has weight ``v_k^a`` with ``v_k``
  the bucket's geometric mid-point, so ``P(i) = v_{k(i)}^a / sum_k n_k v_k^a`` exactly,
  which is within +-9% of ``p_i^a`` per unit of ``a``. One script counts the buckets
  (ZCOUNT), draws the stratified positions passed in, and maps each to a bucket and a rank
  inside it: O(K log N + B log N).

Importance-sampling weights are ``(N P(i))^-b`` divided by the batch's largest weight,
computed from the probability the sampler actually used.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import redis

from qrl.wire.cluster import run_scripts
from qrl.wire.keys import RunKeys
from qrl.wire.scripts import Lua
from qrl.wire.stream_scripts import DEAD_LETTER_LUA, dead_letter_call

log = logging.getLogger(__name__)

P_LO = 1e-6  # priorities are clipped to [P_LO, P_HI]
P_HI = 1e4
BUCKETS_PER_OCTAVE = 4
N_BUCKETS = math.ceil(math.log2(P_HI / P_LO) * BUCKETS_PER_OCTAVE)


Columns = dict[str, np.ndarray]  # a batch's fields as arrays (a ring slot's)
Rows = np.ndarray | Columns  # records (a structured array), or their fields' columns


@dataclass
class RecordLayout:
    """The fixed-size binary record of one replay item. By default an n-step transition:
    observation, action, n-step return, discount to the bootstrap state (``gamma^k``, 0 at a
    terminal) and the bootstrap observation. Built from the observation shape and dtype, so
    records can be decoded for a whole batch at once with ``np.frombuffer``. The action is
    one int32 (discrete actions) unless ``action_shape``/``action_dtype`` say otherwise (a
    Box action vector: ``(d,)``, ``"float32"``). Other items override :meth:`fields` (R2D2's
    sequences: :mod:`qrl.replay.sequences`): the replay only sees records of ``size`` bytes."""

    obs_shape: tuple[int, ...]
    obs_dtype: str
    action_shape: tuple[int, ...] = field(default=(), kw_only=True)
    action_dtype: str = field(default="int32", kw_only=True)
    n_actions: int | None = field(default=None, kw_only=True)  # discrete: actions 0..n-1

    def __post_init__(self) -> None:
        self.obs_shape, self.action_shape = tuple(self.obs_shape), tuple(self.action_shape)
        self.dtype = np.dtype(self.fields())

    def fields(self) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
        """The record's fields as ``(name, little-endian dtype, shape)``."""
        obs = np.dtype(self.obs_dtype).newbyteorder("<")
        return [
            ("obs", obs, self.obs_shape),
            ("action", np.dtype(self.action_dtype).newbyteorder("<"), self.action_shape),
            ("ret", np.dtype("<f4"), ()),
            ("disc", np.dtype("<f4"), ()),
            ("next_obs", obs, self.obs_shape),
        ]

    @property
    def size(self) -> int:
        return self.dtype.itemsize

    def pack(self, obs: Any, action: Any, ret: Any, disc: Any, next_obs: Any) -> list[bytes]:
        """One record (bytes) per transition."""
        return self.pack_columns(obs=obs, action=action, ret=ret, disc=disc, next_obs=next_obs)

    def items(self, msg: dict[str, Any]) -> Any:
        """What the replay inserts of a decoded message of these items: one record per row,
        each field from the message's field of its name (rows in the order of its
        ``priority``)."""
        return self.pack_columns(**{name: msg[name] for name in self.dtype.names or ()})

    def pack_columns(self, **columns: np.ndarray) -> list[bytes]:
        """One record (bytes) per row of ``columns``, one column per field (all of them)."""
        if set(columns) != set(self.dtype.names or ()):
            raise ValueError(f"columns {sorted(columns)}, the records need {self.dtype.names}")
        n = len(next(iter(columns.values())))
        rec = np.empty(n, self.dtype)
        for name, column in columns.items():
            rec[name] = column
        buf = rec.tobytes()
        s = self.size
        return [buf[i * s : (i + 1) * s] for i in range(n)]

    def unpack(self, records: list[bytes]) -> np.ndarray:
        """A structured array from records; raises ``ValueError`` on a record of wrong size."""
        if set(map(len, records)) - {self.size}:
            raise ValueError(f"replay record of wrong size (expected {self.size} bytes)")
        return np.frombuffer(b"".join(records), self.dtype)

    def decode(self, records: list[Any], out: Columns | None = None) -> tuple[Rows, np.ndarray]:
        """The records as sampled (any of them missing or garbage: Redis holds what any
        writer put there) decoded: ``(rows of those that are fine, which were)``. Fine means
        bytes of the record's size whose float fields are all finite and whose actions are
        in ``0..n_actions - 1`` (if given): a learner indexes its Q-values with them. With
        ``out`` (a ring slot's columns) the rows are written there and their columns come
        back."""
        ok = np.array([isinstance(r, bytes) and len(r) == self.size for r in records], bool)
        rows = np.frombuffer(b"".join(r for r, k in zip(records, ok, strict=True) if k), self.dtype)
        finite = np.ones(len(rows), bool)
        for name in rows.dtype.names or ():
            if rows.dtype[name].base.kind == "f":
                each = np.isfinite(rows[name])
                finite &= each.all(axis=tuple(range(1, each.ndim)))
        if self.n_actions is not None and len(rows):
            a = rows["action"].reshape(len(rows), -1)
            finite &= ((a >= 0) & (a < self.n_actions)).all(axis=1)
        ok[ok] = finite
        rows = rows[finite]
        if out is None:
            return rows, ok
        for name in rows.dtype.names or ():
            out[name][: len(rows)] = rows[name]
        return {name: out[name][: len(rows)] for name in rows.dtype.names or ()}, ok


@dataclass
class Sample:
    """A sampled batch: ids (for priority updates), records, IS weights and the
    probabilities used."""

    ids: list[bytes]
    batch: Rows  # records, or their columns (in a ring's slot)
    weights: np.ndarray
    probs: np.ndarray
    size: int  # transitions present when sampled
    slot: int | None = None  # the ring slot its arrays are in (qrl.replay.ring)


def sampling_scripts(name: str, records: str) -> tuple[Lua, Lua]:
    """The two sampling scripts of a replay whose records the Lua part ``records`` fetches
    (e.g. ``qrl/wire/lua/replay.records.lua``: the keys' types and a ``records`` function)."""
    return (
        Lua(f"{name}.fetch_ranks", "replay.prelude", records, "replay.fetch_ranks"),
        Lua(f"{name}.sample_proportional", "replay.prelude", records, "replay.sample_proportional"),
    )


class PrioritizedReplay:
    """The replay of one run. ``mode`` is ``rank`` or ``proportional``."""

    # its scripts (qrl/wire/lua/replay.*.lua, each after replay.prelude's checks of what is
    # stored): the insert with its FIFO eviction, the two samplings (a subclass stores
    # records otherwise). What differs per replay (record size, capacity) goes in ARGV
    INSERT = Lua("replay.insert", "replay.prelude", "replay.insert")
    FETCH, PROPORTIONAL = sampling_scripts("replay", "replay.records")

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        layout: RecordLayout,
        capacity: int,
        *,
        mode: Literal["rank", "proportional"] = "rank",
        alpha: float = 0.6,
        seed: int | None = None,
    ) -> None:
        if mode not in ("rank", "proportional"):
            raise ValueError(f"unknown sampling mode {mode!r} (rank or proportional)")
        self.client, self.keys, self.layout = client, keys, layout
        self.capacity, self.mode, self.alpha = int(capacity), mode, float(alpha)
        self.rng = np.random.default_rng(seed)
        self._insert = self.INSERT.on(client)
        self._fetch, self._proportional = self.FETCH.on(client), self.PROPORTIONAL.on(client)
        self._rank_cdf: np.ndarray | None = None
        self.last_size = 0  # transitions present at the last call (the replay never shrinks)

    def record_args(self) -> list[int]:
        """What the sampling scripts' ``records`` needs of the layout, last in their ARGV."""
        return [self.layout.size]

    def sample_keys(self) -> list[str]:
        return [self.keys.replay_priorities, self.keys.replay_data]

    # -- writing
    def insert(self, records: list[bytes], priorities: np.ndarray, batch_id: str = "") -> int:
        """Insert records with their priorities; evicts the oldest beyond capacity. A
        non-empty ``batch_id`` already inserted is skipped (returns -1), so a re-delivered
        producer batch is not inserted twice. Returns the number evicted."""
        if len(records) != len(priorities):
            raise ValueError("records and priorities differ in length")
        if set(map(len, records)) - {self.layout.size}:
            raise ValueError(f"replay record of wrong size (expected {self.layout.size} bytes)")
        p = np.clip(np.nan_to_num(priorities, nan=P_HI, posinf=P_HI), P_LO, P_HI)
        # two arguments instead of 2n: redis-py and the script pay per argument
        args = [
            self.capacity,
            batch_id,
            len(records),
            self.layout.size,
            " ".join(map(repr, p.tolist())),  # repr: the shortest exact decimal
            b"".join(records),
        ]
        keys = [
            self.keys.replay_priorities,
            self.keys.replay_data,
            self.keys.replay_meta,
            self.keys.replay_batches,
        ]
        return self.evicted(self._insert(keys=keys, args=args))

    def evicted(self, reply: list[int]) -> int:
        """What an insert script's reply says was evicted, with a warning if the replay's keys
        held garbage (meta out of range, a key of another type), which it repaired."""
        evicted, repaired = reply
        if repaired:
            log.warning(
                "%s held garbage (ids out of range or keys of another type): repaired",
                self.keys.replay_meta,
            )
        return int(evicted)

    def update_priorities(self, ids: list[bytes], priorities: np.ndarray) -> None:
        """Set new priorities, only for transitions still present (ZADD XX)."""
        if not ids:
            return
        try:
            self.queue_priorities(self.client, ids, priorities)
        except redis.ResponseError as e:
            priorities_refused(e)

    def queue_priorities(self, client: Any, ids: list[bytes], priorities: np.ndarray) -> Any:
        """The ZADD XX of :meth:`update_priorities` on ``client`` (this replay's, or a
        pipeline that sends several shards' at once)."""
        p = np.clip(np.nan_to_num(priorities, nan=P_HI, posinf=P_HI), P_LO, P_HI)
        return client.zadd(
            self.keys.replay_priorities, dict(zip(ids, p.tolist(), strict=True)), xx=True
        )

    # -- reading
    def size(self) -> int:
        try:
            self.last_size = int(self.client.zcard(self.keys.replay_priorities))
        except redis.ResponseError as e:  # a key of another type: the next insert repairs it
            log.warning("replay size: %s", e)
            self.last_size = 0
        return self.last_size

    def stats(self) -> dict[str, int]:
        """Size and counters (a counter holding garbage, or a meta of another type, reads 0)."""
        names = ("inserted", "evicted", "batches")
        try:
            meta = self.client.hmget(self.keys.replay_meta, names)
        except redis.ResponseError:
            meta = [None] * 3
        count = {
            k: int(m) if m is not None and m.isdigit() else 0
            for k, m in zip(names, meta, strict=True)
        }
        return {"size": self.size(), **count}

    def rank_probabilities(self, n: int) -> np.ndarray:
        """P(rank r), r = 1..n, for the rank mode."""
        w = np.arange(1, n + 1, dtype=np.float64) ** -self.alpha
        return w / w.sum()

    def _cdf(self) -> np.ndarray:
        if self._rank_cdf is None:
            self._rank_cdf = np.cumsum(
                np.arange(1, self.capacity + 1, dtype=np.float64) ** -self.alpha
            )
        return self._rank_cdf

    def _stratified(self, batch_size: int) -> np.ndarray:
        return (np.arange(batch_size) + self.rng.random(batch_size)) / batch_size

    def sample(
        self, batch_size: int, beta: float = 0.4, out: Columns | None = None
    ) -> Sample | None:
        """A stratified prioritized batch, or ``None`` while the replay is empty (or all it
        drew was removed, see :func:`screen`); decoded into ``out`` if given."""
        n, ids, recs, probs = self.draw(self._stratified(batch_size))
        return screen(self, n, ids, recs, probs, beta, out)

    def reject(self, ids: list[bytes], records: list[Any]) -> None:
        """Remove sampled items that did not decode (a bogus member, a missing record, one of
        the wrong size or with values out of bounds: only a writer other than the filler
        puts them there), dead-lettered and counted as ``rejected:replay`` in the stats."""
        log.warning("removed %d sampled replay items that did not decode", len(ids))
        pipe = self.client.pipeline(transaction=False)
        pipe.zrem(self.keys.replay_priorities, *ids)
        pipe.hdel(self.keys.replay_data, *ids)  # a frame replay's chunks stay: shared
        reason = "replay item missing, of the wrong size or out of bounds"
        letter, letters = DEAD_LETTER_LUA.on(self.client), []
        for i, rec in zip(ids, records, strict=True):
            payload = rec if isinstance(rec, bytes) else None
            call = dead_letter_call(
                self.keys, "replay", reason, payload, i.decode(errors="replace")
            )
            letters.append((letter, *call))
        try:
            pipe.execute()
            run_scripts(self.client, letters)  # loads the script where it is missing
        except redis.ResponseError as e:  # e.g. a stats key of another type: removed anyway
            log.warning("replay rejection: %s", e)

    def mass(self) -> tuple[int, float]:
        """``(transitions present, sum of their proportional sampling weights)``."""
        script, keys, args = self.mass_call()
        return self.massed(script(keys=keys, args=args))

    def mass_call(self) -> tuple[Any, list[str], list[Any]]:
        """The script call of :meth:`mass`, for :func:`qrl.wire.cluster.run_scripts`."""
        return self._proportional, self.sample_keys(), self._bucket_args(b"")

    @staticmethod
    def massed(reply: list[Any]) -> tuple[int, float]:
        n, _, total = reply
        return int(n), float(total)

    def _bucket_args(self, u: bytes) -> list[object]:
        return [self.alpha, P_LO, 2 ** (1 / BUCKETS_PER_OCTAVE), N_BUCKETS, u, *self.record_args()]

    def draw(self, u: np.ndarray) -> tuple[int, list[bytes], list[bytes], np.ndarray]:
        """The transitions at the increasing positions ``u`` (in [0, 1)) of the sampling
        distribution: ``(transitions present, ids, records, probabilities)``."""
        call = self.draw_call(u)
        if call is None:
            return 0, [], [], np.zeros(0)
        script, keys, args, ranked = call
        return self.drawn(script(keys=keys, args=args), ranked)

    def draw_call(self, u: np.ndarray) -> tuple[Any, list[str], list[Any], Any] | None:
        """The script call of :meth:`draw` (``None``: nothing to draw) and what
        :meth:`drawn` needs of it, for :func:`qrl.wire.cluster.run_scripts`."""
        if self.mode == "rank":
            n = self.last_size or self.size()
            if n == 0:
                return None
            cdf = self._cdf()[: min(n, self.capacity)]
            ranks = np.minimum(np.searchsorted(cdf, u * cdf[-1], side="right"), len(cdf) - 1)
            args = ["desc", " ".join(map(str, ranks.tolist())), *self.record_args()]
            return self._fetch, self.sample_keys(), args, (n, ranks, cdf[-1])
        args = self._bucket_args(u.astype("<f8").tobytes())
        return self._proportional, self.sample_keys(), args, None

    def drawn(
        self, reply: list[Any], ranked: Any
    ) -> tuple[int, list[bytes], list[bytes], np.ndarray]:
        """:meth:`draw`'s result from its script's reply (``ranked``: what the rank mode's
        call was made of, the size ranked over, the ranks and the CDF's total)."""
        if self.mode == "rank":
            n_now, flat = reply
            n, ranks, total = ranked
            ids, recs = flat[0::3], flat[2::3]
            probs = ((ranks + 1.0) ** -self.alpha / total)[: len(ids)]
        else:
            n_now, flat, _ = reply
            n = int(n_now)
            ids, recs = flat[0::4], flat[2::4]
            probs = np.array([float(x) for x in flat[3::4]])
        self.last_size = int(n_now)
        return n, list(ids), list(recs), probs


def priorities_refused(e: redis.ResponseError) -> None:
    """A priority update Redis refused: on a key of another type (a writer's) it is skipped
    (the next insert repairs the key); anything else is raised."""
    if "WRONGTYPE " not in str(e):
        raise e
    log.warning("replay priorities not updated: %s", e)


def screen(
    replay: Any,
    n: int,
    ids: list[bytes],
    records: list[Any],
    probs: np.ndarray,
    beta: float,
    out: Columns | None = None,
    reject: Callable[[list[bytes], list[Any]], None] | None = None,
) -> Sample | None:
    """The sample of what ``replay`` drew (``n`` items present), without the items whose
    records did not decode, which ``reject`` (``replay.reject`` unless given) removes;
    ``None`` if none is left. The IS weights are ``(n P(i))^-beta`` over the batch's
    largest. Decoded into ``out`` if given."""
    batch, ok = replay.layout.decode(records, out)
    if not ok.all():
        bad = {i: r for i, r, k in zip(ids, records, ok, strict=True) if not k}  # once each
        (reject or replay.reject)(list(bad), list(bad.values()))
        ids, probs = [i for i, k in zip(ids, ok, strict=True) if k], probs[ok]
    if not ids:
        return None
    w = (n * probs) ** -beta
    return Sample(ids, batch, (w / w.max()).astype(np.float32), probs, n)
