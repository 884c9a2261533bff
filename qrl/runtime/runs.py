"""Runs in Redis: a run's configuration, written once when the run is created, and the
operations on whole runs (list, delete).

A role that joins a run needs only the Redis URL and the run name: it reads the algorithm
and its configuration back with :func:`load_run`.
"""

from __future__ import annotations

import time
from typing import Any, TypeVar

import redis

from qrl.runtime.config import Config, parse_config
from qrl.version import __version__
from qrl.wire.codec import CodecError, Field, Schema, decode, encode
from qrl.wire.keys import RunKeys

C = TypeVar("C", bound=Config)

RUN_CONFIG = Schema(
    "run_config",
    {
        "algo": Field(str),
        "config": Field(dict),
        "qrl_version": Field(str),
        "created": Field(float),
    },
)


class RunExists(ValueError):
    """A run of that name exists with a different configuration."""


class RunNotFound(LookupError):
    """No run of that name exists in this Redis."""


class RunUnreadable(CodecError):
    """The run's config key holds something that is not a run config (another Redis type,
    or a payload that does not decode). It is the run's identity: never repaired here."""


def create_run(client: redis.Redis, keys: RunKeys, algo: str, config: Config) -> bool:
    """Write the run's configuration once. Returns True if the run was created, False if an
    identical one already existed; raises :class:`RunExists` if it differs."""
    data = config.to_dict()
    blob = encode(
        "run_config",
        {"algo": algo, "config": data, "qrl_version": __version__, "created": time.time()},
    )
    if client.set(keys.config, blob, nx=True):
        return True
    old_algo, old = load_run(client, keys)
    if old_algo != algo or old != data:
        diff = sorted(k for k in set(old) | set(data) if old.get(k) != data.get(k))
        raise RunExists(
            f"run {keys.run!r} already exists as {old_algo} with a different configuration "
            f"(differs in {diff or 'algo'}); pick another --run name or delete it"
        )
    return False


def load_run(client: redis.Redis, keys: RunKeys) -> tuple[str, dict[str, Any]]:
    """The run's ``(algo, config dict)``; raises :class:`RunNotFound` or
    :class:`RunUnreadable`."""
    try:
        blob = client.get(keys.config)
        if blob is None:
            raise RunNotFound(
                f"no run {keys.run!r} in this Redis "
                "(create it with `qrl run create` or `qrl train`)"
            )
        msg = decode(blob, RUN_CONFIG)
    except (CodecError, redis.ResponseError) as e:
        if isinstance(e, redis.ResponseError) and "WRONGTYPE " not in str(e):
            raise
        raise RunUnreadable(
            f"the config of run {keys.run!r} ({keys.config}) is not readable ({e}); qrl "
            "leaves it as it is: delete the run (`qrl run delete`) or pick another --run name"
        ) from e
    return msg["algo"], msg["config"]


def load_run_config(client: redis.Redis, keys: RunKeys, algo: str, cls: type[C]) -> C:
    """The run's configuration as ``cls``; checks the run is of algorithm ``algo``."""
    found, data = load_run(client, keys)
    if found != algo:
        raise CodecError(f"run {keys.run!r} is a {found} run, not {algo}")
    return parse_config(cls, data)


def list_runs(client: redis.Redis) -> list[dict[str, Any]]:
    """Every run in this Redis: name, algo, env, created (unix time), stopped; unreadable
    configs (bad or of the wrong type) are listed with algo ``?``."""
    runs = []
    for key in client.scan_iter(match=RunKeys.config_pattern(), count=1000):
        name = RunKeys.run_of(key)
        if name is None:
            continue
        keys = RunKeys(name)
        try:
            blob = client.get(keys.config)
            msg = decode(blob, RUN_CONFIG) if blob is not None else None
        except (CodecError, redis.ResponseError):
            msg = None
        try:
            stopped = bool(client.hget(keys.control, "stop"))
        except redis.ResponseError:  # a control key of the wrong type: nobody asked to stop
            stopped = False
        runs.append(
            {
                "run": name,
                "algo": msg["algo"] if msg else "?",
                "env": msg["config"].get("env", "?") if msg else "?",
                "created": msg["created"] if msg else None,
                "stopped": stopped,
            }
        )
    return sorted(runs, key=lambda r: r["created"] or 0.0)


def delete_run(client: redis.Redis, keys: RunKeys) -> int:
    """Delete every key of the run (``qrl:{RUN}:*``); returns how many were removed."""
    n = 0
    batch: list[Any] = []
    for key in client.scan_iter(match=keys.pattern(), count=1000):
        batch.append(key)
        if len(batch) >= 500:
            n += client.unlink(*batch)
            batch = []
    if batch:
        n += client.unlink(*batch)
    return n
