"""Live: a run whose every process is a Redis ACL user of its own (``qrl train --acl`` on Redis
7) reaches its target while one more process of the role that comes in many, joined with
``qrl run join`` (the holder of one compromised machine, with that machine's credentials
only), keeps making every attack its user allows (``tests/_role_attacker.py``: Lua of its
own, exhausted stream ids, a counter at the int64 edge, 30 MB metrics entries, the weights,
config and control, other processes' leases, heartbeats and reply lists, parameter-server
state, another worker's gradient stream and a gradient flood, poisoned ES statistics).
What Redis refuses must be refused; what goes in, every honest role rides out. No honest
process is refused anything: not a script its role runs (its rule lists those its role
declares, no others), a command or a key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
import redis

from qrl.server.embedded import EmbeddedRedis
from tests.cli import ROOT, qrl
from tests.helpers import kill_all, redis7, wait_until

ADMIN = "admin-pw-for-attacked-runs"
# the first evaluation comes this late, so the job lasts while the attacker makes every
# attack more than once (Ape-X can solve CartPole in 6 s)
EVAL_EVERY = 20
CASES = {  # case -> algorithm, the role the attacker joins as, settings
    "apex": ("apex", "actor", ()),
    "impala-central": ("impala", "stepper", ("--set", "inference=central")),
    "a3c": ("a3c", "worker", ()),
    "es": ("es", "worker", ()),
}
# what no role's user may do, whatever the algorithm (the rest is algorithm-specific)
REFUSED = {
    "lua_loop",
    "lua_load",
    "function_load",
    "set weights",
    "del config",
    "set control",
    "take lease 0",
    "heartbeat as 0",
    "metrics as learner",
    "metrics as 0",
}
REFUSED_TOO = {
    "impala-central": {"steal replies", "read requests", "drop requests"},
    "a3c": {"ps_state", "other's gradient"},
}


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", CASES)
def test_a_run_solves_while_one_of_its_own_users_attacks_it(case, tmp_path):
    binary = redis7()
    algo, role, settings = CASES[case]
    run = f"attacked-{case}"
    env = {**os.environ, "QRL_REDIS_PASSWORD": "", "PYTHONPATH": str(ROOT)}
    procs: list[subprocess.Popen] = []
    with EmbeddedRedis(password=ADMIN, binary=binary) as server:
        admin = redis.Redis.from_url(server.url)
        log = (tmp_path / "train.log").open("w")
        train = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "qrl.cli",
                "train",
                algo,
                "--redis",
                server.url,
                "--acl",
                "--run",
                run,
                "--run-dir",
                str(tmp_path / "run"),
                "--seed",
                "0",
                "--max-time",
                "240",
                "--eval-every",
                str(EVAL_EVERY),
                *settings,
            ],
            cwd=ROOT,
            env={**env, "QRL_REDIS_URL": ""},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        procs.append(train)
        try:
            # the honest processes' users exist: join one more, the attacker's machine
            wait_until(
                lambda: train.poll() is not None or admin.acl_getuser(f"{run}.{role}.0"),
                "the run's users",
                timeout=120,
            )
            assert train.poll() is None, (tmp_path / "train.log").read_text()[-3000:]
            assert not admin.acl_getuser(f"{run}.{role}")  # no user passes for all of them
            joined = qrl(
                "run",
                "join",
                run,
                role,
                "--acl",
                str(tmp_path / "taken"),
                env={**env, "QRL_REDIS_URL": server.url},
            )
            assert joined.returncode == 0, joined.stderr
            user = joined.stdout.split()[2]  # "ACL user RUN.ROLE.N for ROLE N: password in P"
            password = joined.stdout.split()[-1]
            attacker = _attacker(server, user, password, run, algo, role, env)
            procs.append(attacker)
            code = train.wait(360)
            assert attacker.poll() is None, attacker.communicate()[0][-3000:]
            # what Redis refused the run's own users; inside a script, a pcall of what a
            # role's user may not do (an actor's XGROUP CREATE) is by design
            refusals = admin.acl_log(1000)
            honest = [e for e in refusals if e["username"] != user and e["context"] != "lua"]
        finally:
            kill_all(procs)
        lines = attacker.communicate()[0].splitlines() if procs[1:] else []
    train_log = (tmp_path / "train.log").read_text()
    assert code == 0, train_log[-3000:]
    assert honest == [], honest  # not a command, key or script of theirs
    _no_script_refused(tmp_path)
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["reached"] and not result.get("failed"), result
    made = _outcomes(lines, REFUSED | REFUSED_TOO.get(case, set()), least=2)
    print(case, "attacks:", made, "time_s:", result["time_s"])


def _attacker(server, user: str, password_file: str, run: str, algo: str, role: str, env: dict):
    """``tests/_role_attacker.py`` as ``user`` (password in ``password_file``), an attack
    every 0.1 s."""
    return subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests" / "_role_attacker.py"),
            f"redis://{user}@127.0.0.1:{server.port}/0",
            run,
            algo,
            role,
            "0.1",
        ],
        cwd=ROOT,
        env={**env, "QRL_REDIS_PASSWORD": "", "QRL_REDIS_PASSWORD_FILE": password_file},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _no_script_refused(folder) -> None:
    """No process whose log is under ``folder`` ran a script its user may not run (qrl logs
    the script's name, :meth:`qrl.wire.scripts.Lua.refused`)."""
    for log in folder.rglob("*.log"):
        assert "may not run qrl's script" not in log.read_text(), log


def _outcomes(lines: list[str], refused: set[str], least: int) -> Counter:
    """The attacker's report checked: each attack of ``refused`` was refused every time, and
    every kind it makes was made at least ``least`` times; (attack, outcome) -> times."""
    kinds = int(lines[0].removeprefix("attacks: "))
    made = [tuple(line.split(": ", 1)) for line in lines[1:] if ": " in line]
    for name, outcome in made:
        if name in refused:
            assert outcome == "refused", (name, outcome)
    times = Counter(name for name, _ in made)
    assert len(times) == kinds and min(times.values()) >= least, times
    return Counter(made)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_pbt_population_solves_while_one_trials_users_attack_it(tmp_path):
    """``qrl pbt --acl``: the holder of trial 0's worker credentials tries its own Lua, the
    population's solve, another trial's score, config and lease (refused), and lies about
    its own trial (a score of 1e300, a claim to have reached the target, terminal escapes);
    the holders of its actor 0's and its learner 0's credentials (each process of a segment
    runs as its own user) try all but the lies, and the trial's own score, lineage, claim,
    snapshot and lease (refused: the slot's). The population goes on and ends solved only on
    the controller's own confirmation; its users go with it."""
    from qrl.pbt.acl import role_password

    name, pw = "attacked-pbt", tmp_path / "pw"
    trial = f"{name}-t0"
    with EmbeddedRedis(password=ADMIN, binary=redis7()) as server:
        admin = redis.Redis.from_url(server.url)
        env = {**os.environ, "QRL_REDIS_URL": server.address, "QRL_REDIS_PASSWORD": ADMIN}
        log = (tmp_path / "pbt.log").open("w")
        pbt = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "qrl.cli",
                "pbt",
                "ppo",
                "--env",
                "CartPole-v1",
                "--population",
                "2",
                "--slots",
                "2",
                "--explore",
                "lr=1e-4..3e-3:log",
                "--ready",
                "40",
                "--target-return",
                "60",
                "--max-time",
                "240",
                "--name",
                name,
                "--run-dir",
                str(tmp_path / "run"),
                "--acl",
                str(pw),
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        procs = [pbt]
        try:  # the users are there once the last process's is
            wait_until(
                lambda: pbt.poll() is not None or admin.acl_getuser(f"{name}-t1.actor.1"),
                "users",
                timeout=120,
            )
            users = {
                "worker": f"{trial}.worker",
                "actor": f"{trial}.actor.0",
                "learner": f"{trial}.learner.0",
            }
            for role, user in users.items():  # a process's password: from its trial's
                secret = (pw / trial).read_text().strip()
                path = pw / trial if role == "worker" else tmp_path / f"{role}.pw"
                if role != "worker":
                    path.write_text(role_password(secret, user) + "\n")
                procs.append(_attacker(server, user, str(path), trial, "pbt", role, env))
            code = pbt.wait(360)
            assert admin.acl_users() == ["default"]  # the population's users went with it
            for attacker in procs[1:]:  # each ran until its user went (or runs on)
                assert attacker.wait(15) == 0, attacker.communicate()[0][-3000:]
        finally:
            kill_all(procs)
        reports = [attacker.communicate()[0].splitlines() for attacker in procs[1:]]
    out = (tmp_path / "pbt.log").read_text()
    assert code == 0, out[-3000:]
    _no_script_refused(tmp_path)  # (the attacker is trial 0's user: Redis's ACL log mixes them)
    assert "\x1b" not in out  # nothing a writer wrote reaches the console raw
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["solved"]["return"] >= 60 and result["solved"]["trial"].startswith(name)
    refused = {
        "lua_loop",
        "lua_load",
        "function_load",
        "forge solved",
        "other's score",
        "other's config",
        "other's lease",
    }
    records = {"own score", "own lineage", "own claim", "own snapshot", "own lease"}
    for role, lines in zip(users, reports, strict=True):
        made = _outcomes(lines, refused if role == "worker" else refused | records, least=1)
        print(f"pbt attacks as {role}:", made)
