"""Live config changes: ``qrl run set`` changes named fields of a running run's config, and
every role takes the change in between two of its steps.

The run's config (:mod:`qrl.runtime.runs`) is written once. Its changes go beside it, in the
hash ``config:live`` (:attr:`qrl.wire.keys.RunKeys.config_live`): ``version`` (1, 2, ...),
``values`` (JSON: every field changed so far, at its latest value), ``changed`` (JSON: what
this version changed) and ``time``. :func:`set_live` checks a change with the config's own
pydantic model (only fields marked :data:`~qrl.runtime.config.LIVE` may change, and the whole
config with every change applied must validate) and writes it with a compare-and-set
script: the write lands only if the version is still the one it read, so of two setters at
once the second reads again and lands on top, and neither change is lost.

A role follows the key with :class:`LiveConfig`: the poll of the run's stop flag
(:class:`qrl.runtime.control.StopFlag`) reads the version in the same script, and the values
only when the version changed, refusing any field over :data:`MAX_BYTES` unread. Anyone with
the run's keys can write anything there (another type, a version that is not a number or
goes back, values that are not JSON, not live, out of bounds): the role keeps the config it
has and warns once.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import re
import reprlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import redis

from qrl.runtime.config import Config, ConfigError, live_fields, parse_config
from qrl.runtime.files import open_appending
from qrl.runtime.runs import load_run
from qrl.wire.faults import warn_once
from qrl.wire.keys import RunKeys
from qrl.wire.scripts import Lua

log = logging.getLogger(__name__)
C = TypeVar("C", bound=Config)

MAX_BYTES = 64 * 1024  # the largest values, changed or time field a reader takes
MAX_VERSION = 2**53 - 1  # versions are whole numbers from 1 to this
_VERSION = re.compile(rb"[1-9][0-9]{0,15}")
_SHOWN = reprlib.Repr()  # values shown in logs and qrl status: a few, short
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlist, _SHOWN.maxdict = 40, 40, 6, 8

# every role's poll of the stop flag and the live config (qrl/wire/lua/live.read.lua: it only
# reads, so a role's user runs it with EVALSHA_RO on keys it may only read), and qrl run
# set's compare-and-set (live.set.lua)
READ = Lua("live.read", read_only=True)
SET = Lua("live.set")


class LiveUnreadable(ValueError):
    """The live-config hash holds something no setter wrote."""


@dataclass(frozen=True)
class LiveState:
    """One version of a run's live changes."""

    version: int
    values: dict[str, Any]  # every field changed so far, at its latest value
    changed: dict[str, Any]  # what this version changed
    time: float

    def line(self, values: dict[str, Any] | None = None) -> str:
        """``config v3: lr=0.0001`` (``values``: the fields to show, default all changed so
        far; a few, shortened: what came from Redis may be long)."""
        shown = self.values if values is None else values
        items = [f"{k}={_SHOWN.repr(v)}" for k, v in list(shown.items())[:8]]
        more = ", ..." if len(shown) > 8 else ""
        return f"config v{self.version}: {', '.join(items)}{more}"


@dataclass(frozen=True)
class _Reply:
    stop: int  # 1 set, 0 not, -1 the control key is of another type
    seen: bytes  # the version read ('' if none could be)
    state: LiveState | None = None  # a new version, readable
    problem: str | None = None  # why the stored one is not


def _parse(version: bytes, values: bytes, changed: bytes, stamp: bytes) -> LiveState:
    if not _VERSION.fullmatch(version) or int(version) > MAX_VERSION:
        raise LiveUnreadable(f"version {version!r} is not a whole number from 1 to {MAX_VERSION}")
    parts = []
    for name, blob in (("values", values), ("changed", changed)):
        try:
            part = json.loads(blob)
        except (ValueError, RecursionError) as e:
            raise LiveUnreadable(f"{name} is not JSON ({_SHOWN.repr(str(e))})") from None
        if not isinstance(part, dict):
            raise LiveUnreadable(f"{name} is not a JSON object")
        parts.append(part)
    try:
        when = float(stamp)
    except ValueError:
        when = math.nan
    if not math.isfinite(when):
        raise LiveUnreadable(f"time {_SHOWN.repr(stamp)} is not a number")
    return LiveState(int(version), parts[0], parts[1], when)


def _read(script: Any, keys: RunKeys, seen: bytes) -> _Reply:
    """One run of :data:`READ`: the stop flag and what is stored past version ``seen``."""
    stop, what, *rest = script(keys=[keys.control, keys.config_live], args=[seen, MAX_BYTES])
    what = what.decode() if isinstance(what, bytes) else what
    if what == "none":
        return _Reply(stop, b"")
    if what == "same":
        return _Reply(stop, seen)
    if what == "bad":
        why = rest[0].decode(errors="backslashreplace")
        return _Reply(stop, rest[1] if len(rest) > 1 else b"", problem=why)
    try:
        return _Reply(stop, rest[0], state=_parse(*rest))
    except LiveUnreadable as e:
        return _Reply(stop, rest[0], problem=str(e))


def check_fields(cls: type[Config], names: Any) -> None:
    """Refuse (:class:`ConfigError`) a change of a field ``cls`` lacks or that may not change
    while its run runs."""
    live = live_fields(cls)
    may = f"fields that may change live: {', '.join(live) or 'none'}"
    for name in names:
        if name not in cls.model_fields:
            close = difflib.get_close_matches(name, list(cls.model_fields), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{cls.__name__}: unknown field {_SHOWN.repr(name)} ({hint}{may})")
        if name not in live:
            raise ConfigError(
                f"{cls.__name__}: {name} cannot change while the run runs (it shapes what "
                f"was built or started; {may})"
            )


def changed_config(cls: type[C], base: dict[str, Any], values: dict[str, Any]) -> C:
    """The run's config ``base`` with the live changes ``values``, validated by ``cls``."""
    check_fields(cls, values)
    return parse_config(cls, {**base, **values})


def set_live(
    client: redis.Redis, keys: RunKeys, cls: type[C], changes: dict[str, Any], floor: int = 0
) -> tuple[LiveState, C]:
    """Change the fields ``changes`` of run ``keys`` (config class ``cls``) while it runs:
    returns the new version and the config the roles will run with. The version counts on
    from the stored one and from ``floor`` (the highest its roles report having taken in:
    they take only newer ones). Raises :class:`qrl.runtime.runs.RunNotFound`,
    :class:`ConfigError` for a field that may not change or a value the config refuses."""
    if not changes:
        raise ConfigError("no change given (KEY=VALUE)")
    check_fields(cls, changes)
    _, base = load_run(client, keys)
    read, write = READ.on(client), SET.on(client)
    for _ in range(100):  # another setter wrote in between: read again
        got = _read(read, keys, b"")
        current = got.state.values if got.state else {}
        try:
            changed_config(cls, base, current)
        except ConfigError as e:
            got = _Reply(got.stop, got.seen, problem=str(e))
        if got.problem is not None:
            log.warning("run %s: live config unreadable (%s): replaced", keys.run, got.problem)
            current = {}
        stored = got.state.version if got.state else _version(got.seen)
        cfg = changed_config(cls, base, {**current, **changes})
        typed = cfg.to_dict()
        new = LiveState(
            min(max(stored, floor), MAX_VERSION - 1) + 1,
            {k: typed[k] for k in {**current, **changes}},
            {k: typed[k] for k in changes},
            time.time(),
        )
        blobs = (json.dumps(new.values), json.dumps(new.changed), repr(new.time))
        if write(keys=[keys.config_live], args=[got.seen, new.version, *blobs]):
            log.info("run %s: %s", keys.run, new.line(new.changed))
            return new, cfg
    raise ConfigError(f"the live config of run {keys.run!r} kept changing: try again")


def _version(raw: bytes) -> int:
    return int(raw) if _VERSION.fullmatch(raw) and int(raw) <= MAX_VERSION else 0


def describe(client: redis.Redis, keys: RunKeys) -> dict[str, Any] | None:
    """What ``qrl status`` shows of the run's live changes: ``None`` if none were made, else
    ``version``, ``values``, ``changed``, ``time`` and ``line`` (or ``unreadable``: why)."""
    got = _read(READ.on(client), keys, b"")
    if got.problem is not None:
        return {"unreadable": got.problem}
    s = got.state
    if s is None:
        return None
    return {
        "version": s.version,
        "values": s.values,
        "changed": s.changed,
        "time": s.time,
        "line": s.line(),
    }


class LiveConfig(Generic[C]):
    """A role's side of its run's live config: ``cfg``, the config to run with (the run's
    stored one with every change taken in so far), ``version``, the last change taken in
    (0: none), and ``applied``, the last one handed to the role. Made, it reads the changes
    made so far. :meth:`poll` reads the stop flag and any new version in one round trip (the
    run's :class:`qrl.runtime.control.StopFlag` calls it); :meth:`take` hands a new config
    over, once. With ``record``, every version taken
    in is appended to that file as a JSON line."""

    def __init__(
        self, client: redis.Redis, keys: RunKeys, cfg: C, record: Path | None = None
    ) -> None:
        self.keys, self.cfg, self.record = keys, cfg, record
        self.base = cfg.to_dict()
        self.version = 0
        self.following = True  # False once this user may not read the key (an older ACL)
        self._seen = b""
        self._new = False
        self._script = READ.on(client)
        self.poll()
        self._new = False
        self.applied = self.version  # the version handed over by take(): the role runs it

    def poll(self) -> bool | None:
        """Whether the run's stop flag is set (``None``: the control key is of another type,
        or this user may not read the live config: the caller reads it alone), taking in a
        newer live version on the way."""
        if not self.following:
            return None
        try:
            got = _read(self._script, self.keys, self._seen)
        except redis.exceptions.NoPermissionError as e:
            self.following = False
            log.warning(
                "cannot read %s (%s): live config changes are not followed",
                self.keys.config_live,
                e,
            )
            return None
        self._seen = got.seen
        if got.problem is not None:
            self._refuse(got.problem)
        elif got.state is not None:
            self._take_in(got.state)
        return None if got.stop < 0 else bool(got.stop)

    def take(self) -> C | None:
        """The config with a change taken in since the last call, else ``None``."""
        if not self._new:
            return None
        self._new, self.applied = False, self.version
        return self.cfg

    def _refuse(self, why: str) -> None:
        warn_once(
            f"{self.keys.run}: {why}",
            "live config of run %s refused (%s): config v%d kept",
            self.keys.run,
            why,
            self.version,
            kind="live config",
            logger=log,
        )

    def _take_in(self, state: LiveState) -> None:
        if state.version <= self.version:
            self._refuse(f"version {state.version} is not newer than v{self.version}")
            return
        try:
            cfg = changed_config(type(self.cfg), self.base, state.values)
        except ConfigError as e:
            self._refuse(str(e))
            return
        old, new = self.cfg.to_dict(), cfg.to_dict()
        values = {k: new[k] for k in state.values}
        changed = {k: new[k] for k in state.changed if k in values}
        self.cfg, self.version, self._new = cfg, state.version, True
        diff = {k: new[k] for k in new if new[k] != old[k]}
        log.info("run %s: %s (now %s)", self.keys.run, state.line(changed), _SHOWN.repr(diff))
        if self.record is not None:
            line = {"version": state.version, "time": state.time, "changed": changed}
            line["values"] = values
            try:
                fd = open_appending(self.record, 0o644)
                with os.fdopen(fd, "a") as f:
                    f.write(json.dumps(line) + "\n")
            except OSError as e:
                warn_once(
                    f"{self.record}: {e}",
                    "cannot record live config changes in %s: %s",
                    self.record,
                    e,
                    kind="live config",
                    logger=log,
                )
