"""A population's state in Redis. Its own keys, under a run named as the population, are
what only its controller writes; what a worker writes lives under the keys of the trial it
trains (the trial's run ``NAME-tI``), so a worker's ACL user may be given its trial's keys
alone (:mod:`qrl.pbt.acl`).

The population's keys:

- ``pbt:config``: the :class:`~qrl.pbt.config.PBTConfig` as JSON, written once.
- ``pbt:solved``: JSON, the first trial the controller confirmed at the target by its own
  evaluation (the workers stop when they see it).

Each trial's, ``qrl:{TRIAL}:pbt:...``:

- ``lease``: the worker that trains the trial now, expiring when its lease runs out;
  ``freed``: when (ms, Redis's clock) it was last given back, so the trial waiting longest
  goes first and more trials than slots take turns.
- ``score``: JSON ``{score, time}``, its last segment's score; ``segments``: the segments it
  has trained (its burn-in's count).
- ``lineage``: JSON, its last :data:`LINEAGE_KEEP` exploit/explore events (whom it copied,
  which values), numbered (the controller appends each new one to the run dir's
  ``lineage.jsonl``): one bounded read, where a stream's entries come whole, whatever size.
- ``reached``: its worker's claim that a segment reached the target (JSON): only a reason
  for the controller to evaluate the trial itself.

Whoever has a trial's keys may write anything in them: every read is bounded and checked, and
what fails a check is ignored (a score not finite, not JSON, too long, a lease no worker could
have taken), so it can neither crash a worker nor cause an exploit.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Mapping
from typing import Any

import redis
from pydantic import ValidationError

from qrl.pbt.config import PBTConfig
from qrl.wire.keys import RunKeys
from qrl.wire.scripts import Lua

log = logging.getLogger(__name__)

MAX_JSON = 64 * 1024  # the longest config, score or trial's events read
LINEAGE_KEEP = 16  # events kept per trial (one per segment at most: many for a follower)

# beyond any return an env pays (Atari's highest scores are ~1e6): a score out of this range
# is a writer's, that would win every ranking (and print as 300 digits)
MAX_SCORE = 1e12
MAX_LEASE_MS = 2 * 86_400 * 1000  # ready_s + lease_s, each at its largest (config.py)

# a worker's take of a trial's lease, and its renewal or release (qrl/wire/lua/pbt.*.lua):
# Population.take, .renew, .release
TAKE, HOLD = Lua("pbt.take"), Lua("pbt.hold")


class PopulationError(RuntimeError):
    """The population is missing, unreadable, or another one of that name."""


def _json(raw: Any) -> Any:
    if not isinstance(raw, bytes) or len(raw) > MAX_JSON:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _small(client: redis.Redis, key: str, cap: int = MAX_JSON) -> bytes | None:
    """String ``key`` if it holds 1 to ``cap`` bytes (GETRANGE reads no more than that), else
    None: missing, longer, or of another type (a writer's)."""
    try:
        raw = client.getrange(key, 0, cap)
    except redis.ResponseError:
        return None
    return raw if raw and len(raw) <= cap else None


def _count(x: Any) -> bool:
    """A whole number from 1 to 2^53 (a JSON number a float holds exactly)."""
    return isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= 2**53


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class Population:
    """The population ``name`` in ``client``'s Redis."""

    def __init__(self, client: redis.Redis, name: str) -> None:
        self.client, self.name = client, name
        self.keys = RunKeys(name)
        self.config_key, self.solved_key = self.keys.key("pbt:config"), self.keys.key("pbt:solved")
        self.trial_name = re.compile(re.escape(name) + r"-t[0-9]{1,2}")  # PBTConfig.trials()
        self._take = TAKE.on(client)
        self._hold = HOLD.on(client)

    @staticmethod
    def key(trial: str, name: str) -> str:
        """Trial ``trial``'s key ``pbt:NAME`` (under the trial's run: its worker's)."""
        return RunKeys(trial).key(f"pbt:{name}")

    # -- the config
    def create(self, cfg: PBTConfig) -> bool:
        """Store ``cfg``; False if the same population existed already (it goes on),
        PopulationError if another of that name does."""
        if not self.client.set(self.config_key, cfg.model_dump_json(), nx=True):
            if self.config() != cfg:
                raise PopulationError(f"population {self.name!r} exists with other settings")
            return False
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
    def free(self, trials: list[str]) -> list[str]:
        """Those of ``trials`` nobody holds (or whose lease no worker could have taken), the
        one given back longest ago first."""
        out = []
        for trial in trials:
            ttl = self.client.pttl(self.key(trial, "lease"))
            if ttl in (-2, -1) or ttl > MAX_LEASE_MS:
                text = (_small(self.client, self.key(trial, "freed"), 32) or b"").decode(
                    "ascii", "replace"
                )
                out.append((int(text) if text.isdigit() else 0, trial))
        return [trial for _, trial in sorted(out)]

    def take(self, trial: str, worker: str, lease_s: float) -> bool:
        """Lease ``trial`` to ``worker`` for ``lease_s`` if nobody holds it."""
        args = [worker, max(int(lease_s * 1000), 1), MAX_LEASE_MS]
        return bool(self._take(keys=[self.key(trial, "lease")], args=args))

    def claim(
        self,
        worker: str,
        lease_s: float,
        trials: list[str],
        via: Mapping[str, Population] | None = None,
    ) -> str | None:
        """One of ``trials`` for ``worker`` to run for up to ``lease_s``, or None (all are
        held); ``via``: each trial's Population to take it through (its worker's user)."""
        via = via or dict.fromkeys(trials, self)
        return next((t for t in self.free(trials) if via[t].take(t, worker, lease_s)), None)

    def renew(self, trial: str, worker: str, lease_s: float) -> bool:
        return self._held(trial, worker, max(int(lease_s * 1000), 1))

    def release(self, trial: str, worker: str) -> bool:
        return self._held(trial, worker, 0)

    def _held(self, trial: str, worker: str, ms: int) -> bool:
        keys = [self.key(trial, "lease"), self.key(trial, "freed")]
        return bool(self._hold(keys=keys, args=[worker, ms]))

    def holders(self, trials: list[str]) -> dict[str, str]:
        got = {t: _small(self.client, self.key(t, "lease"), 256) for t in trials}
        return {t: v.decode("utf-8", "replace") for t, v in got.items() if v}

    # -- the scoreboard
    def post(self, trial: str, score: float) -> None:
        entry = {"score": float(score), "time": time.time()}
        self.client.set(self.key(trial, "score"), json.dumps(entry))

    def forget(self, trial: str) -> None:
        """Drop ``trial``'s score (it took another's weights: its own score is stale)."""
        self.client.delete(self.key(trial, "score"))

    def scores(self, trials: list[str]) -> dict[str, float]:
        """The trials' last scores; whatever is not a score (not a number, not finite, out of
        range) is left out."""
        out = {}
        for trial in trials:
            entry = _json(_small(self.client, self.key(trial, "score"), 1024))
            score = entry.get("score") if isinstance(entry, dict) else None
            if _finite(score) and abs(score) <= MAX_SCORE:
                out[trial] = float(score)
        return out

    def trained(self, trial: str) -> None:
        """Count one more segment of ``trial``'s."""
        try:
            self.client.incr(self.key(trial, "segments"))
        except redis.ResponseError as e:  # not a count (a writer's): counted from 0 again
            if "WRONGTYPE" not in str(e) and "integer" not in str(e):  # e.g. BUSY: not a count's
                raise
            log.warning("%s: cannot count a segment (%s); counting from 0", trial, e)
            self.client.set(self.key(trial, "segments"), 1)

    def segments(self, trials: list[str]) -> dict[str, int]:
        """Each trial's segments trained (0 where the count is missing or not a count)."""
        out = {}
        for trial in trials:
            raw = _small(self.client, self.key(trial, "segments"), 32) or b""
            text = raw.decode("ascii", "replace")
            out[trial] = int(text) if text.isdigit() else 0
        return out

    # -- lineage and the end
    def record(self, event: dict[str, Any]) -> None:
        """Record exploit/explore ``event`` among the last events of its trial (the one that
        copied: only its lease holder writes there, one event at a time), numbered on from
        the trial's last one."""
        key = self.key(event["trial"], "lineage")
        kept = self._events(event["trial"])
        n = kept[-1][0] + 1 if kept else 1
        entries = [{"n": m, "event": e} for m, e in kept][-(LINEAGE_KEEP - 1) :]
        self.client.set(key, json.dumps([*entries, {"n": n, "event": event}]))

    def _events(self, trial: str) -> list[tuple[int, dict[str, Any]]]:
        """``trial``'s last events as (number, event), oldest first; what is not a numbered
        event is left out (read bounded: at most :data:`MAX_JSON` bytes)."""
        entries = _json(_small(self.client, self.key(trial, "lineage")))
        if not isinstance(entries, list):
            return []
        found = [
            (e["n"], e["event"])
            for e in entries[:LINEAGE_KEEP]
            if isinstance(e, dict) and _count(e.get("n")) and isinstance(e.get("event"), dict)
        ]
        return sorted(found, key=lambda pair: pair[0])

    def lineage(self, trials: list[str]) -> list[dict[str, Any]]:
        """The trials' last recorded events, oldest first (as their ``time`` says)."""
        return self.lineage_after({}, trials)[1]

    def lineage_after(
        self, after: dict[str, int], trials: list[str]
    ) -> tuple[dict[str, int], list[dict[str, Any]]]:
        """The events each trial recorded after its event number in ``after`` (none: all it
        keeps), oldest first, and the numbers to read on from (a follower takes only what is
        new; one that looks less often than every :data:`LINEAGE_KEEP` exploits of a trial
        misses some)."""
        read, found = dict(after), []
        for trial in trials:
            new = [(n, e) for n, e in self._events(trial) if n > after.get(trial, 0)]
            if new:
                read[trial] = new[-1][0]
                found += [e for _, e in new]
        found.sort(key=lambda e: e["time"] if _finite(e.get("time")) else 0.0)
        return read, found

    def report_reached(self, trial: str, reached: float) -> None:
        """A worker's claim: a segment of ``trial`` reached the target (``reached``: its
        confirmed return); the controller evaluates the trial before it believes it."""
        entry = {"return": reached, "time": time.time()}
        self.client.set(self.key(trial, "reached"), json.dumps(entry))

    def reports(self, trials: list[str]) -> dict[str, bytes]:
        """Each of ``trials``' claim to have reached the target, as its worker wrote it (at
        most 1 KiB; only whether it changed counts: the controller evaluates the trial)."""
        got = {t: _small(self.client, self.key(t, "reached"), 1024) for t in trials}
        return {t: raw for t, raw in got.items() if raw is not None}

    def solve(self, trial: str, confirmed: float) -> None:
        """The controller's: ``trial`` was confirmed at ``confirmed`` by its own evaluation."""
        entry = {"trial": trial, "return": confirmed, "time": time.time()}
        self.client.set(self.solved_key, json.dumps(entry), nx=True)

    def solved(self) -> dict[str, Any] | None:
        """The solve, if ``pbt:solved`` holds one that names a trial of the population and a
        finite return; else None (whatever else a writer put there)."""
        entry = _json(_small(self.client, self.solved_key))
        if (
            isinstance(entry, dict)
            and isinstance(entry.get("trial"), str)
            and self.trial_name.fullmatch(entry["trial"])
            and _finite(entry.get("return"))
        ):
            return entry
        return None
