"""Per-role Redis ACL users: what each role of a run may read, write and run, in one place.

Each role of an algorithm (from the registry, :mod:`qrl.algos`) gets the user ``RUN.ROLE``
(:func:`user_name`), limited to its run's keys and, within them, to what the role declares
(:class:`qrl.runtime.roles.Access`, :func:`role_access`):

- every role reads ``config``, ``config:live``, ``control`` and the metrics (``metrics:*``)
  and writes its own heartbeats, leases and metrics (``proc:ROLE.*``, ``lease:ROLE.*``,
  ``metrics:ROLE.*``), ``stats`` and ``deadletter``;
- besides, the keys its declaration names: an actor reads the weights (ES: the parameters)
  and writes the stream it feeds; the replay filler drains those streams into the replay
  (``replay:*``); a learner writes the weights and drains the replay or the streams;
- of qrl's Lua scripts, those its code runs (``Access.scripts``, by name, and those every
  role runs: its lease, the live config, dead letters; a role that logs the run, the
  metrics reader's), by SHA: an actor's user cannot run the replay's sampling, say.

A machine of a role that runs many processes may get a user of its own instead,
``RUN.ROLE.N`` (``qrl run join``, :func:`join_user`; :func:`revoke_user` ends it,
``qrl run delete`` ends every one of the run: :func:`joined_users`): the role's access, but of
the keys of one process (heartbeats, lease, metrics, ``Access.mine``) only process N's.

Redis 7 makes the read-only keys read-only per key (``%R~``). Redis 6 has no such
selector: there an actor's user could still SET or DEL the config and weights it reads, so
users are refused on a server of which any node is older than 7 (:func:`require_selectors`).
Every user also lacks what a run never needs: admin and dangerous commands,
SCAN (it lists other runs' key names), SELECT, pub/sub, and every scripting command but
EVALSHA of the scripts it runs (:func:`script_rules`; EVALSHA_RO of the read-only ones on
Redis 7): no EVAL, SCRIPT or FUNCTION, so no Lua of its own, which could stall the whole
Redis. The users cannot load those scripts: :func:`create_users` does, on every node
(:func:`qrl.wire.scripts.load_scripts`; ``qrl run scripts`` again after a restart or
failover).
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from redis.cluster import RedisCluster

from qrl.algos import Algorithm, RoleDef
from qrl.runtime.config import Config
from qrl.runtime.ids import id_limit, instance_user
from qrl.runtime.roles import (
    ACTOR_COMMANDS,
    EVERY_ROLE_SCRIPTS,
    METRICS_SCRIPTS,
    RUN_COMMANDS,
    Access,
)
from qrl.wire.cluster import ClusterClient
from qrl.wire.connection import read_password_file
from qrl.wire.keys import RunKeys
from qrl.wire.scripts import every_script, load_scripts

__all__ = [
    "ACTOR_COMMANDS",
    "RUN_COMMANDS",
    "create_users",
    "delete_users",
    "job_scripts",
    "join_user",
    "joined_users",
    "process_user",
    "revoke_user",
    "role_access",
    "role_rule",
    "run_rule",
    "user_name",
]


class AclRefused(ValueError):
    """``--acl`` cannot be had here (``qrl run create``, ``qrl train``, ``qrl pbt``): this Redis
    has no read-only key patterns (before 7.0). Its message is one line: what to run instead."""


EXAMPLE_PASSWORD = "change-me"  # .env.example's passwords begin so: never accepted


def user_name(run: str, role: str) -> str:
    """The ACL user of ``role`` in ``run``: ``RUN.ROLE``."""
    return f"{run}.{role}"


def role_access(role: RoleDef, ident: int | None = None) -> Access:
    """The keys, commands and scripts ``role`` needs: what every role needs (the run's
    config, its live changes and control flags, which only an admin changes, and every
    process's metrics; its own heartbeats, leases and metrics, the stats and dead letters;
    the scripts of those, and the metrics reader's where it logs the run) and what it
    declares. ``ident``: process ``ident`` only (a per-instance user), which reaches no
    other process's keys."""
    declared = role.access
    logs = METRICS_SCRIPTS if role.logs_run else ()
    return Access(
        ("config", "config:live", "control", "metrics:*", *declared.reads),
        (*_own(role, ident), "stats", "deadletter", *declared.writes),
        declared.commands,
        scripts=tuple(sorted({*EVERY_ROLE_SCRIPTS, *logs, *declared.scripts})),
    )


def job_scripts(algo: Algorithm) -> tuple[str, ...]:
    """The scripts a whole job of ``algo`` runs, as one user (a PBT trial's): every role's,
    and ``qrl train``'s own (it follows the metrics and the live config)."""
    roles = (role_access(r).scripts for r in algo.roles)
    return tuple(sorted({*EVERY_ROLE_SCRIPTS, *METRICS_SCRIPTS, *(s for r in roles for s in r)}))


def _own(role: RoleDef, ident: int | None) -> tuple[str, ...]:
    """The keys of process ``ident`` of ``role`` (``None``: of every process): its
    heartbeats, its lease, its metrics and what the role marks as one process's
    (``Access.mine``)."""
    n = "*" if ident is None else str(ident)
    mine = (pattern.replace("{id}", n) for pattern in role.access.mine)
    own = (f"proc:{role.name}.{n}@*", f"lease:{role.name}.{n}", f"metrics:{role.name}.{n}")
    return (*own, *mine)


def script_rules(names: Iterable[str], selectors: bool) -> list[str]:
    """The rules that let a user run the scripts ``names`` of qrl's (and no others): each by
    SHA (Redis's first-argument rules), and where the server has ``%R~`` (``selectors``,
    Redis 7) the read-only ones with EVALSHA_RO too. A name qrl has no script of is a
    declaration's mistake: KeyError."""
    known = every_script()
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise KeyError(f"qrl has no Lua scripts named {', '.join(unknown)}")
    scripts = [known[name] for name in sorted(set(names))]
    return [
        *(f"+evalsha|{s.sha}" for s in scripts),
        *(f"+evalsha_ro|{s.sha}" for s in scripts if s.read_only and selectors),
    ]


def run_rule(run: str, user: str = "runner", password: str = "SECRET") -> str:
    """The ``ACL SETUSER`` command of one user for every role of ``run`` (no per-role
    users): its key prefixes, :data:`RUN_COMMANDS` and every script of qrl's, since it runs
    every role and command of the run (``qrl run rule``). It serves Redis 6 too, which has
    no EVALSHA_RO (its live-config reads fall back to EVALSHA)."""
    patterns = " ".join(f"~{p}" for p in RunKeys(run).acl_patterns())
    return (
        f"ACL SETUSER {user} on >{password} resetkeys resetchannels {patterns} "
        f"{RUN_COMMANDS} {' '.join(script_rules(every_script(), selectors=False))}"
    )


def role_rule(algo: Algorithm, run: str, role: str, password: str = "SECRET") -> str:
    """The ``ACL SETUSER`` command of ``role``'s user in ``run``, as ``qrl run create --acl``
    sets it on Redis 7 (``qrl run rule RUN ALGO ROLE``): its keys, commands and scripts."""
    access = role_access(algo.role(role))
    args = setuser_args(RunKeys(run), access, user_name(run, role), password, selectors=True)
    return "ACL SETUSER " + " ".join(args)


def setuser_args(
    keys: RunKeys, access: Access, user: str, password: str, selectors: bool
) -> list[str]:
    """``ACL SETUSER`` arguments for ``user``: reset, then the password, the key patterns
    (under the run's prefix and its shards'), the commands, the scripts (those of
    ``access.scripts`` only: pass :func:`role_access`'s for a role). ``selectors``: the server has
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
        *script_rules(access.scripts, selectors),
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
    """Raise :class:`AclRefused` (one line) unless every node has read-only key patterns: without
    them a role's user may write the keys it only reads, so per-role users would promise
    what Redis 6 cannot keep."""
    if not has_selectors(client):
        raise AclRefused(
            "--acl needs Redis 7 or later (read-only key patterns): on this older Redis a "
            "role's user could still SET or DEL what it only reads (the config, the weights, "
            "another trial's state). Run Redis 7 or later (e.g. Debian's redis-server package: "
            "QRL_REDIS_SERVER=/usr/bin/redis-server for `qrl redis` or the embedded one; or the "
            "compose file's redis:7 image) and pass its URL with --redis"
        )


def create_users(
    client: Any,
    algo: Algorithm,
    keys: RunKeys,
    folder: Path,
    cfg: Config | None = None,
    *,
    shared_by_many: bool = True,
) -> dict[str, tuple[str, Path]]:
    """Create (or reset) the ACL user of every role of ``algo`` that a run of config ``cfg``
    runs (every role without one) for run ``keys``, with the passwords in ``folder`` (made
    where missing), and load qrl's scripts, which the users may run but not load; returns
    role -> (user, password file). Without ``shared_by_many``, none for a role that runs
    many processes (they get a user each, :func:`join_user`)."""
    require_selectors(client)
    roles = [r for r in algo.roles if cfg is None or r.when is None or r.when(cfg)]
    roles = [r for r in roles if shared_by_many or not r.count]
    files = role_passwords(folder, [r.name for r in roles])
    users = {}
    for role in roles:
        user = user_name(keys.run, role.name)
        access = role_access(role)
        password = read_password_file(files[role.name])
        set_user(client, setuser_args(keys, access, user, password, selectors=True))
        users[role.name] = (user, files[role.name])
    load_scripts(client)
    return users


def join_user(
    client: Any,
    algo: Algorithm,
    keys: RunKeys,
    cfg: Config,
    role: str,
    ident: int | None,
    folder: Path,
) -> tuple[str, int, Path]:
    """Issue one machine its own user for process ``ident`` of ``role`` (``None``: the
    smallest number without one), ``RUN.ROLE.N``: the role's reads and writes, but of the
    keys of one process (heartbeats, lease, metrics, ``Access.mine``) only its own. Its password,
    always a fresh one (a revoked machine's is void), goes in ``folder/ROLE.N``. Needs Redis
    7: without read-only key patterns any user of the role could rewrite the config and the
    weights. Returns (user, number, password file)."""
    require_selectors(client)
    roledef = algo.role(role)
    if roledef.when is not None and not roledef.when(cfg):
        raise ValueError(f"run {keys.run!r} has no {role} processes with its config")
    limit = id_limit(sum(1 for r, _ in algo.processes(cfg) if r is roledef))
    if ident is None:  # the smallest number nobody joined as
        users = (instance_user(keys.run, role, i) for i in range(limit))
        ident = next((i for i, u in enumerate(users) if not client.acl_getuser(u)), limit)
    if not 0 <= ident < limit:
        raise ValueError(
            f"{role} numbers of run {keys.run!r} go from 0 to {limit - 1} (twice the "
            "configured count, plus 8): revoke one to join another"
        )
    user = instance_user(keys.run, role, ident)
    (folder / f"{role}.{ident}").unlink(missing_ok=True)
    path = role_passwords(folder, [f"{role}.{ident}"])[f"{role}.{ident}"]
    access = role_access(roledef, ident)
    set_user(client, setuser_args(keys, access, user, read_password_file(path), True))
    return user, ident, path


def revoke_user(client: Any, algo: Algorithm, keys: RunKeys, role: str, ident: int) -> int:
    """End process ``ident`` of ``role``'s per-instance user on every node (Redis drops its
    connections) and delete the keys of that process (heartbeats, lease, metrics, ``Access.mine``),
    so a new holder of the number starts clean; returns how many keys went."""
    roledef = algo.role(role)
    delete_users(client, [instance_user(keys.run, role, ident)])
    prefixes = [p.removesuffix("*") for p in keys.acl_patterns()]
    gone = 0
    for pattern in (prefix + name for prefix in prefixes for name in _own(roledef, ident)):
        names = list(client.scan_iter(match=pattern, count=1000))
        gone += client.delete(*names) if names else 0
    return gone


def process_user(run: str, role: RoleDef, ident: int) -> tuple[str, Access]:
    """The user process ``ident`` of ``role`` in ``run`` runs as under ``--acl``, and what it
    may do: a role that runs many processes has one per process (``RUN.ROLE.N``,
    :func:`join_user`'s: none of them can pass for another), the others their role's."""
    if role.count:
        return instance_user(run, role.name, ident), role_access(role, ident)
    return user_name(run, role.name), role_access(role)


def process_users(
    client: Any, algo: Algorithm, keys: RunKeys, cfg: Config, folder: Path
) -> dict[tuple[str, int], tuple[str, Path]]:
    """A user for every process of a run of ``cfg`` (``qrl train --acl``): a role that runs
    many processes gets one per process (:func:`join_user`: none of them can pass for
    another), the others their role's (:func:`create_users`); (role, number) -> (user,
    password file). No user is shared by a role's many processes: its password would let one
    pass for all."""
    shared = create_users(client, algo, keys, folder, cfg, shared_by_many=False)
    users = {}
    for role, i in algo.processes(cfg):
        if role.count:
            user, _, path = join_user(client, algo, keys, cfg, role.name, i, folder)
            users[(role.name, i)] = (user, path)
        else:
            users[(role.name, i)] = shared[role.name]
    return users


def set_user(client: Any, args: list[str]) -> None:
    """``ACL SETUSER`` with ``args`` (:func:`setuser_args`' and more) on every node."""
    _on_every_node(client, "ACL", "SETUSER", *args)


def joined_users(client: Any, run: str) -> list[str]:
    """The per-instance users of ``run`` (``RUN.ROLE.N``: ``qrl run join``'s, ``qrl train
    --acl``'s) on any node. Role names hold no dot, so no other run's user matches."""
    if isinstance(client, ClusterClient):  # a cluster's ACLs are per node
        nodes = client.get_nodes()
        replies = [client.execute_command("ACL", "USERS", target_nodes=n) for n in nodes]
    else:
        replies = [client.execute_command("ACL", "USERS")]
    joined = re.compile(re.escape(run) + r"\.[a-z][a-z0-9-]*\.(0|[1-9][0-9]*)")
    names = {u.decode() if isinstance(u, bytes) else u for reply in replies for u in reply}
    return sorted(u for u in names if joined.fullmatch(u))


def delete_users(client: Any, users: list[str]) -> None:
    """Delete ``users`` on every node (Redis drops their connections); a missing one is no
    error."""
    if users:
        _on_every_node(client, "ACL", "DELUSER", *users)
