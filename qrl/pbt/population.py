"""A population's state in Redis, under the keys of a run named as the population (one Cluster
slot): its config, the trials' leases, the scoreboard, the lineage and the first solve.

- ``pbt:config``: the :class:`~qrl.pbt.config.PBTConfig` as JSON, written once.
- ``pbt:leases``: sorted set, trial -> the time (ms, Redis's clock) it may next be taken: when
  its lease runs out, or when it was given back (so the trial waiting longest goes first and
  more trials than slots take turns); ``pbt:owners`` says which worker holds each lease.
- ``pbt:scores``: hash, trial -> JSON ``{score, time}``, the trial's last segment's score.
- ``pbt:segments``: hash, trial -> the segments it has trained (its burn-in's count).
- ``pbt:lineage``: stream of exploit/explore events (who copied whom, which values).
- ``pbt:solved``: JSON, the first trial whose evaluation was confirmed at the target.

Whoever has the population's keys may write anything in them: every read is bounded and
checked, and what fails a check is ignored (a score from an unknown trial, not finite, not
JSON, too long), so it can neither crash a worker nor cause an exploit.
"""

from __future__ import annotations

import json
import logging
import math
import time
from functools import partial
from typing import Any

import redis
from pydantic import ValidationError

from qrl.pbt.config import PBTConfig
from qrl.wire.faults import repaired
from qrl.wire.keys import RunKeys

log = logging.getLogger(__name__)

MAX_JSON = 64 * 1024  # the longest config, score or event read
LINEAGE_LEN = 10_000

MAX_LEASE_MS = 2 * 86_400 * 1000  # ready_s + lease_s, each at its largest (config.py)

# KEYS: leases, owners. ARGV: worker, lease ms, the longest lease ms, then the population's
# trials (only those: members a writer added are never handed out, and the work is bounded
# by the population). The trial free longest (or whose lease ran out longest ago), leased to
# the worker; nil if every trial is held. A trial missing from the set counts as free since
# always, and so does one whose lease ends further ahead than any lease can (a writer's
# +inf would park it for good).
_CLAIM = """
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local best, when = false, ms
for i = 4, #ARGV do
  local s = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[i]) or '0')
  if s == nil or s ~= s or s > ms + tonumber(ARGV[3]) then s = 0 end
  if s <= ms and (not best or s < when) then best, when = ARGV[i], s end
end
if not best then return false end
redis.call('ZADD', KEYS[1], ms + tonumber(ARGV[2]), best)
redis.call('HSET', KEYS[2], best, ARGV[1])
return best
"""
# KEYS: leases, owners. ARGV: trial, worker, lease ms (0: give it back). 1 if the worker held it.
_HOLD = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('ZADD', KEYS[1], 'XX', ms + tonumber(ARGV[3]), ARGV[1])
if tonumber(ARGV[3]) == 0 then redis.call('HDEL', KEYS[2], ARGV[1]) end
return 1
"""
# KEYS: a hash. ARGV: the fields, then the longest value read: the values (false if longer).
_BOUNDED = """
local out = {}
local cap = tonumber(ARGV[#ARGV])
for i = 1, #ARGV - 1 do
  if redis.call('HSTRLEN', KEYS[1], ARGV[i]) <= cap then
    out[i] = redis.call('HGET', KEYS[1], ARGV[i]) or false
  else
    out[i] = false
  end
end
return out
"""


class PopulationError(RuntimeError):
    """The population is missing, unreadable, or another one of that name."""


def _json(raw: Any) -> Any:
    if not isinstance(raw, bytes) or len(raw) > MAX_JSON:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class Population:
    """The population ``name`` in ``client``'s Redis."""

    def __init__(self, client: redis.Redis, name: str) -> None:
        self.client, self.name = client, name
        self.keys = RunKeys(name)
        k = self.keys.key
        self.config_key, self.leases, self.owners = (
            k("pbt:config"), k("pbt:leases"), k("pbt:owners"),
        )  # fmt: skip
        self.scores_key, self.lineage_key, self.solved_key, self.segments_key = (
            k("pbt:scores"), k("pbt:lineage"), k("pbt:solved"), k("pbt:segments"),
        )  # fmt: skip
        self._claim = client.register_script(_CLAIM)
        self._hold = client.register_script(_HOLD)
        self._bounded = client.register_script(_BOUNDED)

    # -- the config
    def create(self, cfg: PBTConfig) -> bool:
        """Store ``cfg`` and free every trial; False if the same population existed already
        (it goes on), PopulationError if another of that name does."""
        text = cfg.model_dump_json()
        if not self.client.set(self.config_key, text, nx=True):
            if self.config() != cfg:
                raise PopulationError(f"population {self.name!r} exists with other settings")
            return False
        self.client.zadd(self.leases, dict.fromkeys(cfg.trials(), 0), nx=True)
        return True

    def config(self) -> PBTConfig:
        try:
            if self.client.strlen(self.config_key) > MAX_JSON:
                raise PopulationError(f"{self.config_key} is over {MAX_JSON} bytes")
            raw = self.client.get(self.config_key)
        except redis.ResponseError as e:
            raise PopulationError(f"{self.config_key}: {e}") from None
        if raw is None:
            raise PopulationError(f"no population {self.name!r} in this Redis")
        try:
            cfg = PBTConfig.model_validate_json(raw)
        except ValidationError as e:
            raise PopulationError(f"population {self.name!r}: {e}") from None
        if cfg.name != self.name:
            raise PopulationError(f"{self.config_key} names population {cfg.name!r}")
        return cfg

    # -- leases
    def claim(self, worker: str, lease_s: float, trials: list[str]) -> str | None:
        """One of ``trials`` for ``worker`` to run for up to ``lease_s``, or None (all are
        held)."""
        args = [worker, int(lease_s * 1000), MAX_LEASE_MS, *trials]
        got = self._claim(keys=[self.leases, self.owners], args=args)
        return got.decode() if isinstance(got, bytes) else None

    def renew(self, trial: str, worker: str, lease_s: float) -> bool:
        args = [trial, worker, max(int(lease_s * 1000), 1)]
        return bool(self._hold(keys=[self.leases, self.owners], args=args))

    def release(self, trial: str, worker: str) -> bool:
        return bool(self._hold(keys=[self.leases, self.owners], args=[trial, worker, 0]))

    def _fields(self, key: str, trials: list[str], cap: int) -> dict[str, bytes]:
        """``trials``' fields of hash ``key``, those at most ``cap`` bytes long; none if ``key``
        is not a hash (a writer's)."""
        try:
            got = self._bounded(keys=[key], args=[*trials, cap])
        except redis.ResponseError as e:
            log.warning("%s unreadable (%s)", key, e)
            return {}
        return {t: v for t, v in zip(trials, got, strict=True) if isinstance(v, bytes)}

    def holders(self, trials: list[str]) -> dict[str, str]:
        got = self._fields(self.owners, trials, 256)
        return {t: v.decode("utf-8", "replace") for t, v in got.items() if v}

    # -- the scoreboard
    def post(self, trial: str, score: float) -> None:
        entry = {"score": float(score), "time": time.time()}
        self.client.hset(self.scores_key, trial, json.dumps(entry))

    def forget(self, trial: str) -> None:
        """Drop ``trial``'s score (it took another's weights: its own score is stale)."""
        self.client.hdel(self.scores_key, trial)

    def scores(self, trials: list[str]) -> dict[str, float]:
        """The known trials' last scores; whatever is not a finite score is left out."""
        out = {}
        for trial, raw in self._fields(self.scores_key, trials, 1024).items():
            entry = _json(raw)
            if isinstance(entry, dict) and _finite(entry.get("score")):
                out[trial] = float(entry["score"])
        return out

    def trained(self, trial: str) -> None:
        """Count one more segment of ``trial``'s."""
        try:
            self.client.hincrby(self.segments_key, trial, 1)
        except redis.ResponseError as e:  # not a hash, or a field no count: a writer's
            log.warning("%s: cannot count %s's segment (%s)", self.segments_key, trial, e)

    def segments(self, trials: list[str]) -> dict[str, int]:
        """Each trial's segments trained (0 where the count is missing or not a count)."""
        got = self._fields(self.segments_key, trials, 32)
        out = {}
        for trial in trials:
            text = got.get(trial, b"").decode("ascii", "replace")
            out[trial] = int(text) if text.isdigit() else 0
        return out

    # -- lineage and the end
    def record(self, event: dict[str, Any]) -> None:
        fields = {"event": json.dumps(event)}
        key = self.lineage_key
        add = partial(self.client.xadd, key, fields, maxlen=LINEAGE_LEN, approximate=True)
        repaired(self.client, key, add, None)  # a stream whose ids were used up starts afresh

    def lineage(self, count: int = LINEAGE_LEN) -> list[dict[str, Any]]:
        """The recorded events, oldest first (those that do not parse left out)."""
        return self.lineage_after("-", count)[1]

    def lineage_after(
        self, after: str, count: int = LINEAGE_LEN
    ) -> tuple[str, list[dict[str, Any]]]:
        """The events recorded after stream entry ``after`` ("-": all), oldest first, and the
        entry to read on from (a follower reads only what is new)."""
        try:
            entries = self.client.xrange(
                self.lineage_key, min="-" if after == "-" else f"({after}", count=count
            )
        except redis.ResponseError:
            return after, []
        out = []
        for _, fields in entries:
            event = _json(fields.get(b"event"))
            if isinstance(event, dict):
                out.append(event)
        last = entries[-1][0].decode() if entries else after
        return last, out

    def solve(self, trial: str, confirmed: float) -> None:
        entry = {"trial": trial, "return": confirmed, "time": time.time()}
        self.client.set(self.solved_key, json.dumps(entry), nx=True)

    def solved(self) -> dict[str, Any] | None:
        try:
            if self.client.strlen(self.solved_key) > MAX_JSON:
                return None
            entry = _json(self.client.get(self.solved_key))
        except redis.ResponseError:
            return None
        return entry if isinstance(entry, dict) and isinstance(entry.get("trial"), str) else None
