"""The prioritized replay, kept in Redis.

Layout (keys from :class:`qrl.keys.RunKeys`):

* ``replay:prio``  sorted set, member = transition id, score = priority ``p_i`` (> 0)
* ``replay:data``  hash, transition id -> fixed-size record (see :class:`RecordLayout`)
* ``replay:meta``  hash: ``hi`` (next id), ``lo`` (oldest id still present), ``inserted``,
  ``evicted``, ``batches`` (producer batches inserted, each once)
* ``replay:batches`` sorted set of inserted producer batch ids (idempotence), scored by the
  id after their last transition; trimmed with the eviction, so it stays bounded too

Ids are consecutive integers, so FIFO eviction (oldest first, as in Ape-X) deletes the range
``[lo, hi - capacity)``. Every multi-step operation is one Lua script, so readers never see
half an insert or an eviction.

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

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import redis

from qrl.keys import RunKeys

P_LO = 1e-6  # priorities are clipped to [P_LO, P_HI]
P_HI = 1e4
BUCKETS_PER_OCTAVE = 4
N_BUCKETS = math.ceil(math.log2(P_HI / P_LO) * BUCKETS_PER_OCTAVE)

_INSERT = """
-- KEYS: prio, data, meta, batches
-- ARGV: capacity, batch_id, n, record size, the n priorities (decimal, space-separated),
--       the n records (each of the record size) concatenated
-- ids are formatted once with %d: a Lua number passed to redis.call costs a %.17g each time
local cap, n, size, blob = tonumber(ARGV[1]), tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[6]
local prio = {}
for p in string.gmatch(ARGV[5], '%S+') do prio[#prio + 1] = p end
if #prio ~= n or #blob ~= n * size then
  return redis.error_reply('replay insert: priorities or records do not match n')
end
if ARGV[2] ~= '' and redis.call('ZSCORE', KEYS[4], ARGV[2]) then
  return -1
end
local hi = redis.call('HINCRBY', KEYS[3], 'hi', n)
if ARGV[2] ~= '' then
  redis.call('ZADD', KEYS[4], hi, ARGV[2])
  redis.call('HINCRBY', KEYS[3], 'batches', 1)
end
local first = hi - n
local fmt, sub = string.format, string.sub
local z, h = {}, {}
for i = 1, n do
  local id = fmt('%d', first + i - 1)
  z[2 * i - 1] = prio[i]; z[2 * i] = id
  h[2 * i - 1] = id; h[2 * i] = sub(blob, (i - 1) * size + 1, i * size)
end
for s = 1, #z, 4000 do
  redis.call('ZADD', KEYS[1], unpack(z, s, math.min(s + 3999, #z)))
  redis.call('HSET', KEYS[2], unpack(h, s, math.min(s + 3999, #h)))
end
redis.call('HINCRBY', KEYS[3], 'inserted', n)
local lo = tonumber(redis.call('HGET', KEYS[3], 'lo') or '0')
local evicted = 0
if hi - lo > cap then
  local ids = {}
  for id = lo, hi - cap - 1 do ids[#ids + 1] = fmt('%d', id) end
  for s = 1, #ids, 4000 do
    local e = math.min(s + 3999, #ids)
    redis.call('ZREM', KEYS[1], unpack(ids, s, e))
    redis.call('HDEL', KEYS[2], unpack(ids, s, e))
  end
  evicted = #ids
  redis.call('HSET', KEYS[3], 'lo', hi - cap)
  -- forget the ids of batches whose transitions are all gone: bounded like the replay
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', '(' .. fmt('%d', hi - cap + 1))
  redis.call('HINCRBY', KEYS[3], 'evicted', evicted)
end
return evicted
"""

# how the sampling scripts fetch the records of ids[s..e] (a subclass may fetch otherwise)
_RECORDS = (
    "local function records(ids, s, e) return redis.call('HMGET', KEYS[2], unpack(ids, s, e)) end\n"
)

_FETCH_RANKS = """
-- KEYS: prio, data; ARGV: 'desc'|'asc', the ranks (0-based, space-separated)
-- returns {n_present, {id, score, record}...}
-- each rank goes on to ZRANGE as the string it came as (a Lua number would be formatted
-- with %.17g per call), a repeated rank reuses the last lookup, and one HMGET fetches
-- the records
local desc = ARGV[1] == 'desc'
local ids, scores, last, m = {}, {}, nil, nil
for r in string.gmatch(ARGV[2], '%d+') do
  if r ~= last then
    if desc then m = redis.call('ZRANGE', KEYS[1], r, r, 'REV', 'WITHSCORES')
    else m = redis.call('ZRANGE', KEYS[1], r, r, 'WITHSCORES') end
    last = r
  end
  if m[1] then ids[#ids + 1] = m[1]; scores[#scores + 1] = m[2] end
end
local out = {}
for s = 1, #ids, 4000 do
  local recs = records(ids, s, math.min(s + 3999, #ids))
  for j = 1, #recs do
    local i = s + j - 1
    out[3 * i - 2] = ids[i]; out[3 * i - 1] = scores[i]; out[3 * i] = recs[j]
  end
end
return {redis.call('ZCARD', KEYS[1]), out}
"""

_SAMPLE_PROPORTIONAL = """
-- KEYS: prio, data; ARGV: alpha, lo, ratio, n_buckets, u (increasing, in [0, 1): float64
-- little-endian, concatenated)
-- returns {n_present, {id, score, record, prob}...}, total mass (%.17g)
local alpha, lo = tonumber(ARGV[1]), tonumber(ARGV[2])
local ratio, k = tonumber(ARGV[3]), tonumber(ARGV[4])
local fmt = string.format
local counts, mass, starts = {}, {}, {}
local total, rank = 0, 0
-- bucket b is [edge(b), edge(b + 1)) with edge(b) = lo * ratio^b; both ends are written
-- from the same number with %.17g (exact), so the buckets tile the line: no priority
-- falls between two buckets or into two (tostring, used by '..', keeps only 14 digits)
local edge = fmt('%.17g', lo)
for b = 0, k - 1 do
  local lower = lo * ratio ^ b
  local next_edge = fmt('%.17g', lo * ratio ^ (b + 1))
  local lower_s = (b == 0) and '-inf' or edge
  local upper_s = (b == k - 1) and '+inf' or ('(' .. next_edge)
  edge = next_edge
  local c = redis.call('ZCOUNT', KEYS[1], lower_s, upper_s)
  local w = (lower * math.sqrt(ratio)) ^ alpha
  counts[b] = c; mass[b] = c * w; starts[b] = rank
  rank = rank + c; total = total + c * w
end
local out = {}
if total <= 0 or #ARGV[5] == 0 then return {rank, out, fmt('%.17g', total)} end
-- the u are increasing (stratified), so one walk over the buckets serves every draw
local ids, scores, probs, last, m = {}, {}, {}, nil, nil
local b, acc = 0, 0
for i = 1, #ARGV[5] / 8 do
  local target = struct.unpack('<d', ARGV[5], 8 * i - 7) * total
  while b < k - 1 and (counts[b] == 0 or acc + mass[b] <= target) do
    acc = acc + mass[b]; b = b + 1
  end
  local bb = b
  while counts[bb] == 0 and bb > 0 do bb = bb - 1 end
  local j = math.floor((target - acc) / mass[bb] * counts[bb])
  if j >= counts[bb] then j = counts[bb] - 1 end
  if j < 0 then j = 0 end
  local pos = fmt('%d', starts[bb] + j)
  if pos ~= last then m = redis.call('ZRANGE', KEYS[1], pos, pos, 'WITHSCORES'); last = pos end
  if m[1] then
    ids[#ids + 1] = m[1]; scores[#scores + 1] = m[2]
    probs[#probs + 1] = fmt('%.17g', mass[bb] / counts[bb] / total)
  end
end
for s = 1, #ids, 4000 do
  local recs = records(ids, s, math.min(s + 3999, #ids))
  for j = 1, #recs do
    local i = s + j - 1
    out[4 * i - 3] = ids[i]; out[4 * i - 2] = scores[i]; out[4 * i - 1] = recs[j]
    out[4 * i] = probs[i]
  end
end
return {rank, out, fmt('%.17g', total)}
"""


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


@dataclass
class Sample:
    """A sampled batch: ids (for priority updates), records, IS weights and the
    probabilities used."""

    ids: list[bytes]
    batch: np.ndarray
    weights: np.ndarray
    probs: np.ndarray
    size: int  # transitions present when sampled


class PrioritizedReplay:
    """The replay of one run. ``mode`` is ``rank`` or ``proportional``."""

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
        self._insert = client.register_script(_INSERT)
        self._fetch = client.register_script(self.records_lua() + _FETCH_RANKS)
        self._proportional = client.register_script(self.records_lua() + _SAMPLE_PROPORTIONAL)
        self._rank_cdf: np.ndarray | None = None
        self.last_size = 0  # transitions present at the last call (the replay never shrinks)

    def records_lua(self) -> str:
        """The Lua function ``records(ids, s, e)`` the sampling scripts fetch records with."""
        return _RECORDS

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
        return int(
            self._insert(
                keys=[
                    self.keys.replay_priorities,
                    self.keys.replay_data,
                    self.keys.replay_meta,
                    self.keys.replay_batches,
                ],
                args=args,
            )
        )

    def update_priorities(self, ids: list[bytes], priorities: np.ndarray) -> None:
        """Set new priorities, only for transitions still present (ZADD XX)."""
        if not ids:
            return
        p = np.clip(np.nan_to_num(priorities, nan=P_HI, posinf=P_HI), P_LO, P_HI)
        mapping = dict(zip(ids, p.tolist(), strict=True))
        self.client.zadd(self.keys.replay_priorities, mapping, xx=True)

    # -- reading
    def size(self) -> int:
        self.last_size = int(self.client.zcard(self.keys.replay_priorities))
        return self.last_size

    def stats(self) -> dict[str, int]:
        meta = self.client.hmget(self.keys.replay_meta, ["inserted", "evicted", "batches"])
        return {
            "size": self.size(),
            "inserted": int(meta[0] or 0),
            "evicted": int(meta[1] or 0),
            "batches": int(meta[2] or 0),
        }

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

    def sample(self, batch_size: int, beta: float = 0.4) -> Sample | None:
        """A stratified prioritized batch, or ``None`` while the replay is empty."""
        n, ids, recs, probs = self.draw(self._stratified(batch_size))
        if not ids:
            return None
        w = (n * probs) ** -beta
        return Sample(ids, self.layout.unpack(recs), (w / w.max()).astype(np.float32), probs, n)

    def mass(self) -> tuple[int, float]:
        """``(transitions present, sum of their proportional sampling weights)``."""
        n, _, total = self._proportional(keys=self.sample_keys(), args=self._bucket_args(b""))
        return int(n), float(total)

    def _bucket_args(self, u: bytes) -> list[object]:
        return [self.alpha, P_LO, 2 ** (1 / BUCKETS_PER_OCTAVE), N_BUCKETS, u]

    def draw(self, u: np.ndarray) -> tuple[int, list[bytes], list[bytes], np.ndarray]:
        """The transitions at the increasing positions ``u`` (in [0, 1)) of the sampling
        distribution: ``(transitions present, ids, records, probabilities)``."""
        if self.mode == "rank":
            n = self.last_size or self.size()
            if n == 0:
                return 0, [], [], np.zeros(0)
            cdf = self._cdf()[: min(n, self.capacity)]
            ranks = np.minimum(np.searchsorted(cdf, u * cdf[-1], side="right"), len(cdf) - 1)
            n_now, flat = self._fetch(
                keys=self.sample_keys(), args=["desc", " ".join(map(str, ranks.tolist()))]
            )
            ids, recs = flat[0::3], flat[2::3]
            probs = ((ranks + 1.0) ** -self.alpha / cdf[-1])[: len(ids)]
        else:
            n_now, flat, _ = self._proportional(
                keys=self.sample_keys(), args=self._bucket_args(u.astype("<f8").tobytes())
            )
            n = int(n_now)
            ids, recs = flat[0::4], flat[2::4]
            probs = np.array([float(x) for x in flat[3::4]])
        self.last_size = int(n_now)
        return n, list(ids), list(recs), probs
