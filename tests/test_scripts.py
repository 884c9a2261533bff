"""qrl's Lua scripts (:mod:`qrl.wire.scripts`): one registry holds every script qrl runs,
each loads into Redis 6.2 and 7, and a role's ACL user may run those its role declares and
no others: no EVAL, no script of its own, no SCRIPT LOAD or FUNCTION (issue 68, finding 1:
one role's Lua loop stalled every client of the Redis, and SCRIPT KILL could not end it),
none of qrl's it does not run. A role whose Redis lost the scripts waits for the admin to
load them again. Real redis-servers."""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import re
import threading
from pathlib import Path

import pytest
import redis

from qrl.algos import ALGOS
from qrl.jobs.acl import create_users, role_access
from qrl.runtime import live
from qrl.runtime.ids import KEEP
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.connection import connect
from qrl.wire.keys import RunKeys
from qrl.wire.scripts import DECLARING, every_script, load_scripts
from tests.cli import ROOT, qrl
from tests.helpers import make_runner, redis7, redis_binaries, wait_until

ADMIN = "admin-pw-for-script-tests"
BINARIES = redis_binaries()
BY_VERSION = pytest.mark.parametrize(
    "binary", BINARIES.values(), ids=[f"redis{v}" for v in BINARIES]
)
# the finding's attack: a write, then a loop (after a write SCRIPT KILL cannot stop it)
LOOP = "redis.call('SET', KEYS[1], '1') for i = 1, 1e8 do end return 1"
FUNCTION = "#!lua name=mine\nredis.register_function('mine', function() return 1 end)"
# running Lua other than by EVALSHA of qrl's: the module's own name for it
LUA_FILES = sorted((ROOT / "qrl" / "wire" / "lua").glob("*.lua"))
_OWN_LUA = re.compile(r"register_script\(|\.eval(sha)?(_ro)?\([^)]|script_load\(|[\"']EVAL")


def test_the_registry_holds_every_script_qrl_runs():
    """No module of qrl runs Lua but through the registry, each module that declares a
    script is one that :func:`every_script` imports, and no module holds Lua of its own (it
    is in qrl/wire/lua/, :func:`test_every_lua_file_is_part_of_a_declared_script`), so the
    ACL rules can list every script qrl runs."""
    root = ROOT / "qrl"
    declaring = set()
    for path in sorted(root.rglob("*.py")):
        if path.name == "__main__.py":  # runs the CLI when imported
            continue
        name = ".".join(("qrl", *path.relative_to(root).with_suffix("").parts))
        source = path.read_text()
        if name == "qrl.wire.scripts":
            continue
        assert not _OWN_LUA.search(source), f"{path} runs Lua outside qrl/wire/scripts.py"
        if re.search(r"\bLua\(", source):
            declaring.add(name)
        for attr, value in vars(importlib.import_module(name)).items():
            if isinstance(value, str):
                assert "redis.call(" not in value, f"{name}.{attr}: Lua belongs in qrl/wire/lua"
    assert declaring == set(DECLARING)
    assert len({s.sha for s in every_script().values()}) == len(every_script())


def test_every_lua_file_is_part_of_a_declared_script():
    """Every file of qrl/wire/lua is (a part of) a declared script's text, and every part a
    script declares is a file there: no Lua lies unused, none is missing."""
    files = {path.stem for path in LUA_FILES}
    used = {part for script in every_script().values() for part in script.parts}
    assert files == used and len(files) > 20


@BY_VERSION
def test_every_lua_file_loads(binary):
    """Each file of qrl/wire/lua compiles in Redis (SCRIPT LOAD), alone: a syntax error in
    any, a part that several scripts share included, fails here (the scripts they make up:
    :func:`test_every_script_loads`)."""
    assert len(LUA_FILES) > 20
    with EmbeddedRedis(binary=binary) as server:
        client = redis.Redis.from_url(server.url)
        for path in LUA_FILES:
            text = path.read_text(encoding="utf-8")
            assert client.script_load(text) == hashlib.sha1(text.encode()).hexdigest(), path


@BY_VERSION
def test_every_script_loads(binary):
    with EmbeddedRedis(binary=binary) as server:
        client = connect(server.url)
        assert load_scripts(client) == len(every_script()) > 20
        assert all(client.script_exists(*(s.sha for s in every_script().values())))


def _users(server: EmbeddedRedis, algo: str, run: str, folder: Path) -> dict[str, redis.Redis]:
    """``qrl run create --acl``'s users of every role of ``algo``: role -> its client."""
    users = create_users(connect(server.url), ALGOS[algo], RunKeys(run), folder)
    return {
        role: redis.Redis(
            server.host, server.port, username=user, password=path.read_text().strip()
        )
        for role, (user, path) in users.items()
    }


@pytest.mark.parametrize("algo", ["apex", "impala", "a3c", "es"])
def test_no_roles_user_runs_lua_of_its_own(algo, tmp_path):
    """Every role's user (``qrl run create --acl``, Redis 7): EVAL (the finding's loop among
    them), EVAL_RO, EVALSHA of a script that is not qrl's (loaded by the admin), SCRIPT LOAD,
    FLUSH and KILL, FUNCTION LOAD, FLUSH and FCALL are refused; qrl's own scripts run (a
    lease kept, the live config read with EVALSHA_RO). Redis 6.2's per-run rule:
    tests/test_acl.py."""
    run, keys = f"own-{algo}", RunKeys(f"own-{algo}")
    with EmbeddedRedis(password=ADMIN, binary=redis7()) as server:
        admin = redis.Redis.from_url(server.url)
        loaded = admin.script_load(LOOP)
        admin.function_load(FUNCTION)
        for role, user in _users(server, algo, run, tmp_path / "pw").items():
            own = keys.lease(role, 0)  # a key the role writes
            refused = [
                lambda u=user, k=own: u.eval(LOOP, 1, k),
                lambda u=user, k=own: u.eval_ro("return 1", 1, k),
                lambda u=user, k=own: u.evalsha(loaded, 1, k),
                lambda u=user: u.script_load(LOOP),
                lambda u=user: u.script_flush(),
                lambda u=user: u.script_kill(),
                lambda u=user: u.function_load(FUNCTION.replace("mine", "theirs")),
                lambda u=user: u.fcall("mine", 0),
                lambda u=user: u.function_flush(),
            ]
            for attempt in refused:
                with pytest.raises(redis.exceptions.NoPermissionError):
                    attempt()
            assert KEEP(user, [own], ["me", 10, "keep"]) == 1, role
            assert live._read(live.READ.on(user), keys, b"").stop == 0
        assert admin.ping()


@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_a_roles_user_may_run_only_the_scripts_its_role_declares(algo, tmp_path):
    """Each role's user (``qrl run create --acl``, Redis 7) may EVALSHA the scripts its role
    runs (declared, and every role's) and is refused every other of qrl's (``ACL DRYRUN``:
    nothing runs)."""
    run = f"only-{algo}"
    with EmbeddedRedis(password=ADMIN, binary=redis7()) as server:
        admin = connect(server.url)
        users = create_users(admin, ALGOS[algo], RunKeys(run), tmp_path / "pw")
        for role in ALGOS[algo].roles:
            declared = role_access(role).scripts
            for name, script in every_script().items():
                dry = ("ACL", "DRYRUN", users[role.name][0], "EVALSHA", script.sha, "0")
                allowed = admin.execute_command(*dry) in (b"OK", "OK")
                assert allowed == (name in declared), (role.name, name)


def test_an_actors_user_is_refused_the_replays_sampling_and_says_which_script(tmp_path, caplog):
    """An Ape-X actor never samples the replay: its user's EVALSHA of the sampling script
    is refused (NOPERM), on keys it may write too, and the log names the script; the
    learner's runs it."""
    run, keys = "sampling", RunKeys("sampling")
    with EmbeddedRedis(password=ADMIN, binary=redis7()) as server:
        users = _users(server, "apex", run, tmp_path / "pw")
        sampling = every_script()["replay.fetch_ranks"]
        args = ["desc", "0", 16]  # rank 0 of an empty replay, records of 16 bytes
        own = [keys.lease("actor", 1), keys.lease("actor", 2)]  # (empty) keys it may write
        refused = pytest.raises(redis.exceptions.NoPermissionError, match="'evalsha' command")
        with caplog.at_level(logging.WARNING, logger="qrl"), refused:
            sampling(users["actor"], own, args)
        assert "may not run qrl's script replay.fetch_ranks" in caplog.text
        n, *_ = sampling(users["learner"], [keys.replay_priorities, keys.replay_data], args)
        assert n == 0


def test_every_script_is_run_by_someone_who_declares_it():
    """Every script of qrl's is declared by a role of an algorithm or a population's users
    (:mod:`qrl.pbt.acl`), and every declared name is a script's."""
    from qrl.jobs.acl import job_scripts
    from qrl.pbt.acl import CONTROLLER_SCRIPTS, WORKER_SCRIPTS

    jobs = {name for algo in ALGOS.values() for name in job_scripts(algo)}
    assert jobs | {*WORKER_SCRIPTS, *CONTROLLER_SCRIPTS} == set(every_script())


@pytest.mark.slow
@BY_VERSION
def test_a_role_waits_for_scripts_its_redis_lost_until_the_admin_loads_them(
    binary, tmp_path, caplog
):
    """A Redis that lost its scripts (restart, failover, SCRIPT FLUSH): a role, whose user
    may not load them (here the per-run rule's), waits (one log line naming the command to
    run) instead of exiting, and goes on once ``qrl run scripts`` loaded them."""
    keys = RunKeys("lost")
    with EmbeddedRedis(password=ADMIN, binary=binary) as server:
        admin = redis.Redis.from_url(server.url)
        make_runner(admin, keys.run)
        url = f"redis://runner:runner-pw@127.0.0.1:{server.port}/0"
        actor = connect(url, deadline=1.0)  # the wait outlasts any deadline: no exit
        admin.script_flush()
        got: list[object] = []
        kept = threading.Thread(
            target=lambda: got.append(KEEP(actor, [keys.lease("actor", 0)], ["me", 10, "keep"]))
        )

        def missing() -> list[logging.LogRecord]:
            return [r for r in caplog.records if "lacks qrl's Lua scripts" in r.getMessage()]

        with caplog.at_level(logging.WARNING, logger="qrl"):
            kept.start()
            line = wait_until(missing, "the role's line about the missing scripts")[0]
            assert "qrl run scripts" in line.getMessage() and kept.is_alive()
            env = {**os.environ, "QRL_REDIS_URL": server.url, "QRL_REDIS_PASSWORD": ""}
            done = qrl("run", "scripts", env=env)
            assert done.returncode == 0, done.stderr
            assert f"loaded {len(every_script())} scripts" in done.stdout
            kept.join(30)
        assert got == [1] and admin.get(keys.lease("actor", 0)) == b"me"
        assert len(missing()) == 1  # one line per outage, not one per retry
