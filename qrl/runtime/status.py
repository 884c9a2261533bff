"""Heartbeats and ``qrl status``: what every process of a run is doing, at a glance.

Every role already sends a metrics report about once a second (:func:`qrl.runtime.metrics.report`);
the same call refreshes the process's heartbeat, a key ``qrl:{RUN}:proc:ROLE.ID@HOST:PID``
holding its latest counters, with a TTL. A process that dies stops refreshing it: ``qrl
status`` flags it stale after :data:`STALE_AFTER` seconds, and Redis forgets it after
:data:`HEARTBEAT_TTL`. A role that stops cleanly removes its own key.
"""

from __future__ import annotations

import logging
import math
import os
import reprlib
import socket
import unicodedata
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np
import redis

from qrl.runtime.live import describe
from qrl.runtime.roles import POLICY_LAG, Reports
from qrl.wire.codec import CodecError, Field, Schema, decode, encode
from qrl.wire.faults import warn_once
from qrl.wire.keys import RunKeys

log = logging.getLogger(__name__)
T = TypeVar("T")

STALE_AFTER = 10.0  # seconds without a heartbeat before a process is flagged
HEARTBEAT_TTL = 120  # seconds a silent process stays listed (as stale)

HEARTBEAT = Schema(
    "heartbeat",
    {
        "role": Field(str),
        "id": Field(int),
        "host": Field(str),
        "pid": Field(int),
        "started": Field(float, finite=True),
        "time": Field(float, finite=True),
        "values": Field(dict),
    },
)

_HOST = socket.gethostname()
_started: dict[int, float] = {}  # pid -> first heartbeat (forked roles inherit the module)


def is_finite(x: Any) -> bool:
    """True for an int or float (not a bool) that is finite as a float."""
    if type(x) is int:
        return abs(x) <= 2**1023
    return type(x) is float and math.isfinite(x)


def finite_values(
    values: Mapping[str, Any], where: str, lists: bool = False
) -> tuple[dict[str, Any], list[str]]:
    """The values of a report or heartbeat that are finite numbers (or, with ``lists``, lists
    of them), and the names of the others (NaN, inf, other types: whoever wrote them), which
    are dropped and logged once per ``where`` and name."""
    good: dict[str, Any] = {}
    bad: list[str] = []
    for name, x in values.items():
        if is_finite(x) or (lists and type(x) is list and all(is_finite(i) for i in x)):
            good[name] = x
            continue
        bad.append(name)
        warn_once(
            f"{where}:{name}",
            "ignoring %s=%s from %s: not a finite number",
            name,
            reprlib.repr(x),
            where,
            kind="bad value",
            logger=log,
        )
    return good, bad


def proc_name(role: str, ident: int) -> str:
    return f"{role}.{ident}@{_HOST}:{os.getpid()}"


def beat(pipe: Any, keys: RunKeys, role: str, ident: int, now: float, values: dict) -> None:
    """Queue this process's heartbeat on ``pipe``: its numeric counters, with a TTL."""
    pid = os.getpid()
    counters = {k: v for k, v in values.items() if isinstance(v, (int, float)) and np.isfinite(v)}
    payload = encode(
        "heartbeat",
        {
            "role": role,
            "id": ident,
            "host": _HOST,
            "pid": pid,
            "started": _started.setdefault(pid, now),
            "time": now,
            "values": counters,
        },
    )
    pipe.set(keys.proc(proc_name(role, ident)), payload, ex=HEARTBEAT_TTL)


def leave(client: redis.Redis, keys: RunKeys, role: str, ident: int) -> None:
    """Remove this process's heartbeat (it stopped cleanly)."""
    client.delete(keys.proc(proc_name(role, ident)))


# --------------------------------------------------------------------------- collect


def printable(value: Any) -> Any:
    """``value`` with every control or format character of its strings (dict keys too)
    written as its escape, ``\\x1b``: what came from Redis is shown, never obeyed by the
    terminal (escape sequences, bell, carriage return, bidi overrides)."""
    if isinstance(value, str):
        return "".join(
            c.encode("unicode_escape").decode() if unicodedata.category(c)[0] == "C" else c
            for c in value
        )
    if isinstance(value, dict):
        return {printable(k): printable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [printable(v) for v in value]
    return value


def _read(unreadable: list[str], what: str, read: Callable[[], T], default: T) -> T:
    """``read()``, or ``default`` if Redis refused it (a key of the wrong type, which
    whoever wrote it chose): ``what`` is then listed in ``unreadable``."""
    try:
        return read()
    except redis.ResponseError:
        unreadable.append(what)
        return default


def _stream(client: redis.Redis, key: str) -> dict[str, Any] | None:
    if not client.exists(key):
        return None
    info: dict[str, Any] = {"length": client.xlen(key), "pending": 0, "lag": 0, "consumers": 0}
    try:
        groups = client.xinfo_groups(key)
    except redis.ResponseError:
        groups = []
    for g in groups:
        info["pending"] += int(g.get("pending") or 0)
        info["consumers"] += int(g.get("consumers") or 0)
        lag = g.get("lag")  # Redis >= 7; None when Redis cannot tell
        info["lag"] = None if lag is None or info["lag"] is None else info["lag"] + int(lag)
    return info


def _int(value: Any, default: int = -1) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def collect(
    client: redis.Redis,
    keys: RunKeys,
    stale_after: float = STALE_AFTER,
    *,
    algo: str | None = None,
    env: str | None = None,
    weights_key: str | None = None,
    streams: dict[str, str] | None = None,
    extra: Callable[[], dict[str, Any]] | None = None,
    unreadable: list[str] | None = None,
    reports: Mapping[str, Reports] | None = None,
) -> dict[str, Any]:
    """Everything ``qrl status`` shows, as plain data (what ``--json`` prints). What depends
    on the algorithm comes from its builder: where its weights are, its streams,
    ``extra()``'s top-level values (e.g. the replay size) and what its roles report
    (``reports``, by role name: each role's rate, summed per role, and the policy lag). A
    key of the wrong type is shown as nothing and named in ``unreadable`` (with what the
    caller could not read); every string from Redis is :func:`printable`."""
    reports = reports or {}
    unreadable = list(unreadable or [])
    sec, usec = client.time()
    now = sec + usec / 1e6
    procs = []
    names = list(client.scan_iter(match=keys.procs_pattern(), count=1000))
    for blob in client.mget(names) if names else []:
        if blob is None:
            continue  # expired between SCAN and MGET
        try:
            hb = printable(decode(blob, HEARTBEAT))
        except CodecError as e:
            warn_once(
                f"heartbeat:{e}",
                "ignoring a heartbeat of run %s: %s",
                keys.run,
                e,
                kind="bad heartbeat",
                logger=log,
            )
            continue
        where = f"heartbeat {hb['role']}.{hb['id']}@{hb['host']}:{hb['pid']}"
        hb["values"], hb["bad"] = finite_values(hb["values"], where)
        age = now - hb["time"]
        procs.append({**hb, "age_s": round(age, 1), "stale": age > stale_after})
    procs.sort(key=lambda p: (p["role"], p["id"], p["host"], p["pid"]))
    live = [p for p in procs if not p["stale"]]

    throughput: dict[str, float] = {}
    for p in live:
        role = reports.get(p["role"])
        rate = p["values"].get(role.rate) if role else None
        if rate is not None:
            throughput[p["role"]] = throughput.get(p["role"], 0.0) + float(rate)

    read_version = (lambda: client.hget(weights_key, "version")) if weights_key else None
    version = _int(_read(unreadable, "weights", read_version, -1)) if read_version else -1
    policy_lag = _policy_lag(live, reports, version)

    stats = {
        k.decode(errors="backslashreplace"): _int(v, 0)
        for k, v in _read(unreadable, "stats", lambda: client.hgetall(keys.stats), {}).items()
    }
    stream_info = {}
    for name, key in (streams or {}).items():
        info = _read(unreadable, name, lambda key=key: _stream(client, key), None)
        if info is not None:
            stream_info[name] = info
    stopped = _read(unreadable, "control", lambda: client.hget(keys.control, "stop"), None)
    dead = _read(unreadable, "deadletter", lambda: client.xlen(keys.deadletter), 0)
    live = _read(unreadable, "config:live", lambda: describe(client, keys), None)
    more = _read(unreadable, f"{algo} status", extra, {}) if extra else {}
    return printable(
        {
            "run": keys.run,
            "algo": algo,
            "env": env,
            "stopped": bool(stopped),
            "time": now,
            "processes": procs,
            "throughput": throughput,
            "streams": stream_info,
            "weights_version": version,
            "policy_lag": policy_lag,
            "dead_letters": dead,
            "rejected": stats.get("rejected", 0),
            "stats": stats,
            "live_config": live,  # the changes `qrl run set` made: version, values...
            "unreadable": unreadable,
            "extra": sorted(more),
            **more,
        }
    )


def _policy_lag(
    live: list[dict[str, Any]], reports: Mapping[str, Reports], version: int
) -> float | None:
    """The lag a process measured (on the batches it trained on), else how far the oldest
    process acting with the weights is behind the published version; ``None`` if neither
    is known."""
    acting = []
    for p in live:
        role, values = reports.get(p["role"]), p["values"]
        if role is None:
            continue
        measured = [f.metric for f in role.progress if f.column == POLICY_LAG]
        if measured and measured[0] in values:
            return values[measured[0]]
        if role.acts_on is not None and role.acts_on in values:
            acting.append(values[role.acts_on])
    return float(version - min(acting)) if acting and version >= 0 else None


# --------------------------------------------------------------------------- render


def _shown(proc: dict[str, Any], name: str) -> str:
    """A heartbeat's value for a table cell: '?' where it sent something not a number."""
    if name in proc["values"]:
        return f"{proc['values'][name]:,.0f}"
    return "?" if name in proc.get("bad", []) else ""


def render(status: dict[str, Any], reports: Mapping[str, Reports] | None = None) -> Any:
    """A rich renderable of :func:`collect`'s result; ``reports`` (by role name) say which
    values of a process to show: its rate and what its role lists."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    s = status
    head = Text.assemble(
        ("run ", "bold"),
        (s["run"], "bold cyan"),
        f"  {s['algo'] or '?'} on {s['env'] or '?'}",
        ("  STOPPED" if s["stopped"] else "", "bold yellow"),
        f"   weights v{s['weights_version']}" if s["weights_version"] >= 0 else "   no weights yet",
        f"   policy lag {s['policy_lag']:.1f}" if s["policy_lag"] is not None else "",
        *(f"   {k.replace('_', ' ')} {s[k]:,}" for k in s.get("extra", [])),
        (f"   dead letters {s['dead_letters']}", "red" if s["dead_letters"] else ""),
    )
    live = s.get("live_config")
    if live:  # a line of its own: what the run's config now says, beyond its stored one
        head.append(f"\n{live.get('line') or 'live config unreadable: ' + live['unreadable']}")
    if s.get("unreadable"):
        head.append(
            f"\nunreadable (a key of the wrong type): {', '.join(s['unreadable'])}", "bold red"
        )
    procs = Table("process", "host:pid", "up", "heartbeat", "rate/s", "counters", box=None)
    for p in s["processes"]:
        v, bad = p["values"], p.get("bad", [])
        role = (reports or {}).get(p["role"])
        beat_age = f"{p['age_s']:.0f}s ago" + (" STALE" if p["stale"] else "")
        listed = role.listed if role else ()
        cells = (
            f"{p['role']}.{p['id']}",
            f"{p['host']}:{p['pid']}",
            f"{s['time'] - p['started']:.0f}s",
            beat_age,
            _shown(p, role.rate) if role else "",
            " ".join(f"{k} {_shown(p, k)}" for k in listed if k in v or k in bad),
        )  # Text: a host or role name is shown as written, never read as markup
        procs.add_row(*map(Text, cells), style="bold red" if p["stale"] else None)
    if not s["processes"]:
        procs.add_row("(no process has reported)", "", "", "", "", "")
    rates = Table("role", "total rate/s", box=None)
    for role, rate in sorted(s["throughput"].items()):
        rates.add_row(role, f"{rate:,.1f}")
    streams = Table("stream", "length", "pending", "lag", "consumers", box=None)
    for name, info in s["streams"].items():
        lag = "?" if info["lag"] is None else f"{info['lag']:,}"
        streams.add_row(
            name, f"{info['length']:,}", f"{info['pending']:,}", lag, str(info["consumers"])
        )
    return Group(head, Text(""), procs, Text(""), rates, Text(""), streams)
