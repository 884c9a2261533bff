"""Per-role Redis ACL users: what each role of a run may read, write and run, in one place.

Each role of an algorithm (from the registry, :mod:`qrl.algos`) gets the user ``RUN.ROLE``
(:func:`user_name`), limited to its run's keys and, within them, to what the role declares
(:class:`qrl.runtime.roles.Access`, :func:`role_access`):

- every role reads ``config``, ``config:live`` and ``control`` and writes its own heartbeats
  and leases (``proc:ROLE.*``, ``lease:ROLE.*``), ``metrics``, ``stats`` and ``deadletter``;
- besides, the keys its declaration names: an actor reads the weights (ES: the parameters)
  and writes the stream it feeds; the replay filler drains those streams into the replay
  (``replay:*``); a learner writes the weights and drains the replay or the streams.

Redis 7 makes the read-only keys read-only per key (``%R~``). Redis 6 has no such
selector: there an actor's user could still SET or DEL the config and weights it reads, so
:func:`create_users` refuses a server of which any node is older than 7 (:func:`require_selectors`).
Every user also lacks what a run never needs: admin and dangerous commands,
SCAN (it lists other runs' key names), SELECT, SCRIPT FLUSH/KILL and FUNCTION (only EVAL,
EVALSHA, SCRIPT LOAD/EXISTS), pub/sub.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from redis.cluster import RedisCluster

from qrl.algos import Algorithm, RoleDef
from qrl.runtime.roles import ACTOR_COMMANDS, RUN_COMMANDS, Access
from qrl.wire.cluster import ClusterClient
from qrl.wire.connection import read_password_file
from qrl.wire.keys import RunKeys

__all__ = ["ACTOR_COMMANDS", "RUN_COMMANDS", "create_users", "role_access", "user_name"]

EXAMPLE_PASSWORD = "change-me"  # .env.example's passwords begin so: never accepted


def user_name(run: str, role: str) -> str:
    """The ACL user of ``role`` in ``run``: ``RUN.ROLE``."""
    return f"{run}.{role}"


def role_access(role: RoleDef) -> Access:
    """The keys and commands ``role`` needs: what every role needs (the run's config, its
    live changes and control flags, which only an admin changes; its own heartbeats and
    leases, the metrics, stats and dead letters) and what it declares."""
    own = (f"proc:{role.name}.*", f"lease:{role.name}.*", "metrics", "stats", "deadletter")
    declared = role.access
    return Access(
        ("config", "config:live", "control", *declared.reads),
        (*own, *declared.writes),
        declared.commands,
    )


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


def require_selectors(client: Any) -> None:
    """Raise ``ValueError`` (one line) unless every node has read-only key patterns: without
    them a role's user may write the keys it only reads, so per-role users would promise
    what Redis 6 cannot keep."""
    if not has_selectors(client):
        raise ValueError(
            "this Redis is older than 7 and has no read-only key patterns: an actor's user "
            "could still SET or DEL the config and weights it reads. Run Redis 7 or later for "
            "--acl (e.g. Debian's redis-server package: QRL_REDIS_SERVER=/usr/bin/redis-server "
            "qrl redis; or the compose file's redis:7 image)"
        )


def create_users(
    client: Any, algo: Algorithm, keys: RunKeys, folder: Path, cfg: Any = None
) -> dict[str, tuple[str, Path]]:
    """Create (or reset) the ACL user of every role of ``algo`` that a run of config ``cfg``
    runs (every role without one) for run ``keys``, with the passwords in ``folder`` (made
    where missing); returns role -> (user, password file)."""
    require_selectors(client)
    roles = [r for r in algo.roles if cfg is None or r.when is None or r.when(cfg)]
    files = role_passwords(folder, [r.name for r in roles])
    users = {}
    for role in roles:
        user = user_name(keys.run, role.name)
        access = role_access(role)
        password = read_password_file(files[role.name])
        args = setuser_args(keys, access, user, password, selectors=True)
        _on_every_node(client, "ACL", "SETUSER", *args)
        users[role.name] = (user, files[role.name])
    return users
