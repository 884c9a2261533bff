"""Per-role Redis ACL users: what each role of a run may read, write and run, in one place.

Each role of an algorithm (from the registry, :mod:`qrl.algos`) gets the user ``RUN.ROLE``
(:func:`user_name`), limited to its run's keys and, within them, to what its kind of role
needs (:func:`role_access`):

- every role reads ``config``, ``config:live`` and ``control`` and writes its own heartbeats
  and leases (``proc:ROLE.*``, ``lease:ROLE.*``), ``metrics``, ``stats`` and ``deadletter``;
- an actor writes the streams the algorithm's actors feed (experience, trajectories, ES
  results) and reads the weights (ES: the parameters);
- a service (the replay filler) drains those streams into the replay (``replay:*``);
- a learner writes the weights, and drains the replay where a service fills it, else the
  streams.

Redis 7 makes the read-only keys read-only per key (``%R~``). Redis 6.2 has no such
selector: there an actor's user gets no write command but the few it needs (XADD, SET, DEL,
HINCRBY), so HSET, HDEL, ZADD or FLUSH on the weights are refused, but SET, DEL or HINCRBY
on a key it may read are not (use Redis 7 where actors are not trusted). Every user also lacks
what a run never needs: admin and dangerous commands, SCAN (it lists other runs' key names),
SELECT, SCRIPT FLUSH/KILL and FUNCTION (only EVAL, EVALSHA, SCRIPT LOAD/EXISTS), pub/sub.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.cluster import RedisCluster

from qrl.algos import Algorithm, RoleDef
from qrl.wire.cluster import ClusterClient
from qrl.wire.connection import read_password_file
from qrl.wire.keys import RunKeys

log = logging.getLogger(__name__)

# what the run needs of Redis, whatever the role: the per-run rule the README documents
RUN_COMMANDS = (
    "+@all -@admin -@dangerous -@scripting +eval +evalsha +script|load +script|exists "
    "-scan -select +cluster|info +cluster|slots"
)
# an actor: reads, plus the writes of its streams, heartbeats, leases and counters
ACTOR_COMMANDS = RUN_COMMANDS + " -@write +xadd +set +del +hincrby"

EXAMPLE_PASSWORD = "change-me"  # .env.example's passwords begin so: never accepted
_ROLE = re.compile(r"[a-z][a-z0-9-]*")  # role names are used in key patterns unescaped


@dataclass(frozen=True)
class Access:
    """What one role's user may do: key names (relative to the run's prefix, glob patterns
    allowed) it reads and writes, and its command rule."""

    reads: tuple[str, ...]
    writes: tuple[str, ...]
    commands: str


def user_name(run: str, role: str) -> str:
    """The ACL user of ``role`` in ``run``: ``RUN.ROLE``."""
    return f"{run}.{role}"


def _name(key: str) -> str:
    """A key's name within its run or shard prefix: ``qrl:{RUN~TAG}:replay:data`` ->
    ``replay:data``."""
    return key.split("}:", 1)[1]


def role_access(algo: Algorithm, role: RoleDef, keys: RunKeys, config: dict[str, Any]) -> Access:
    """The keys and commands ``role`` of ``algo`` needs, from the algorithm's own
    declarations (its streams, its weights key, whether a service fills a replay)."""
    if not _ROLE.fullmatch(role.name):
        raise ValueError(f"role name {role.name!r} cannot go in a key pattern")
    streams = tuple(sorted({_name(k) for k in algo.streams(keys, config).values()}))
    weights = _name(algo.weights_key(keys))
    reads = ("config", "config:live", "control")  # only an admin changes them
    own = (f"proc:{role.name}.*", f"lease:{role.name}.*", "metrics", "stats", "deadletter")
    if role.kind == "actor":
        return Access((*reads, weights), (*own, *streams), ACTOR_COMMANDS)
    if role.kind == "service":
        return Access(reads, (*own, *streams, "replay:*"), RUN_COMMANDS)
    has_replay = any(r.kind == "service" for r in algo.roles)
    drains = ("replay:*",) if has_replay else streams
    return Access(reads, (*own, *drains, weights), RUN_COMMANDS)


def setuser_args(
    keys: RunKeys, access: Access, user: str, password: str, selectors: bool
) -> list[str]:
    """``ACL SETUSER`` arguments for ``user``: reset, then the password, the key patterns
    (under the run's prefix and its shards'), the commands. ``selectors``: the server has
    Redis 7's ``%R~`` (read-only keys); else the reads are plain ``~`` patterns too."""
    prefixes = [p.removesuffix("*") for p in keys.acl_patterns()]  # qrl:{RUN}: qrl:{RUN~*}:

    def patterns(names: tuple[str, ...], mark: str) -> list[str]:
        return [f"{mark}{prefix}{name}" for name in names for prefix in prefixes]

    read_mark = "%R~" if selectors else "~"
    return [
        user,
        "reset",
        "on",
        f">{password}",
        *patterns(access.reads, read_mark),
        *patterns(access.writes, "~"),
        *access.commands.split(),
        *(["+eval_ro", "+evalsha_ro"] if selectors else []),  # scripts on %R~ keys
    ]


def check_password(password: str | None, what: str) -> None:
    """Refuse an empty password or the example one (``.env.example``'s)."""
    if not password:
        raise ValueError(f"{what}: no password")
    if password.startswith(EXAMPLE_PASSWORD):
        raise ValueError(
            f"{what} is the example password (begins {EXAMPLE_PASSWORD!r}): anyone who read "
            "the example knows it; set a random one (e.g. `openssl rand -hex 24`)"
        )


def role_passwords(folder: Path, roles: list[str]) -> dict[str, Path]:
    """The password file of each role in ``folder`` (``folder/ROLE``, e.g. a compose
    secret): a missing one is made with a random password, readable by this user only."""
    files = {}
    for role in roles:
        path = folder / role
        if not path.exists():
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(24) + "\n")
        check_password(read_password_file(path), f"the password in {path}")
        files[role] = path
    return files


def _on_every_node(client: Any, *args: Any) -> Any:
    """A command for every node: a cluster's ACLs are per node."""
    if isinstance(client, ClusterClient):
        return client.execute_command(*args, target_nodes=RedisCluster.ALL_NODES)
    return client.execute_command(*args)


def has_selectors(client: Any) -> bool:
    """Whether every node is Redis 7 or later (``%R~`` read-only key patterns)."""
    if isinstance(client, ClusterClient):
        nodes = client.info("server", target_nodes=RedisCluster.ALL_NODES).values()
    else:
        nodes = [client.info("server")]
    return all(int(str(n["redis_version"]).split(".")[0]) >= 7 for n in nodes)


def create_users(
    client: Any, algo: Algorithm, keys: RunKeys, config: dict[str, Any], folder: Path
) -> dict[str, tuple[str, Path]]:
    """Create (or reset) the ACL user of every role of ``algo`` for run ``keys``, with the
    passwords in ``folder`` (made where missing); returns role -> (user, password file)."""
    files = role_passwords(folder, algo.role_names)
    selectors = has_selectors(client)
    if not selectors:
        log.warning(
            "Redis 6 has no read-only key patterns: actors' users may still SET or DEL the "
            "config and weights (not HSET, ZADD, ...); use Redis 7 where actors are not trusted"
        )
    users = {}
    for role in algo.roles:
        user = user_name(keys.run, role.name)
        access = role_access(algo, role, keys, config)
        password = read_password_file(files[role.name])
        args = setuser_args(keys, access, user, password, selectors)
        _on_every_node(client, "ACL", "SETUSER", *args)
        users[role.name] = (user, files[role.name])
    return users
