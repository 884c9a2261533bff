"""The apex profile of docker-compose.yml run as local processes around a password-protected
Redis, as the containers would run it, and stopped with SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from qrl.algos.apex.config import ApexConfig
from qrl.replay.role import make_replay
from qrl.runtime.runs import load_run_config
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.keys import RunKeys
from qrl.wire.weights import WeightStore
from tests.compose import (
    EXAMPLE,
    environment,
    load,
    volume_mounts,
)
from tests.helpers import redis7, skip_or_fail, wait_until

pytestmark = pytest.mark.slow

# -- the apex profile, run as local processes


@dataclass
class Role:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self) -> str:
        return f"--- {self.name} (exit {self.proc.poll()}):\n" + self.log.read_text()[-2000:]


SECRETS = "/run/secrets"  # where compose mounts a service's secrets


def local_command(
    service: dict[str, Any], server: EmbeddedRedis, volumes: Path, secrets: Path
) -> tuple[list[str], dict[str, str]]:
    """A service's command and environment as a local process: the Redis host is the
    test's server, each named volume a directory under ``volumes``, each secret the file of
    its name in ``secrets``."""
    argv = [sys.executable, "-m", "qrl.cli"]
    mounts = {**volume_mounts(service), SECRETS: None}
    for arg in service["command"]:
        for target, name in mounts.items():
            if arg == target or arg.startswith(target + "/"):
                folder = secrets if name is None else volumes / name
                arg = str(folder) + arg.removeprefix(target)
        argv.append(arg)
    env = environment(service)
    url = urlsplit(env["QRL_REDIS_URL"])
    env["QRL_REDIS_URL"] = url._replace(
        netloc=url.netloc.replace(f"@{url.hostname}:{url.port}", f"@{server.host}:{server.port}")
    ).geturl()
    for secret in service.get("secrets", []):
        if isinstance(secret, dict):  # a role's own: its password file
            target = f"{SECRETS}/{secret['target']}"
            assert env.pop("QRL_REDIS_PASSWORD_FILE") == target
            env["QRL_REDIS_PASSWORD_FILE"] = str(secrets / secret["source"])
    return argv, {**os.environ, "QRL_REDIS_PASSWORD": "", **env}


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``, from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


def catches_sigterm(pid: int) -> bool:
    """Whether the process installed a SIGTERM handler (the roles' stop flag does, once
    started: before that SIGTERM would kill it, as in a container)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & 1 << (signal.SIGTERM - 1))
    return False


def tails(roles: list[Role]) -> str:
    return "\n".join(r.tail() for r in roles)


def wait_for(what: str, check: Callable[[], Any], timeout: float, roles: list[Role]) -> Any:
    """Poll ``check`` until it returns something truthy; fails if a role exits first."""

    def running() -> None:
        dead = [r for r in roles if r.proc.poll() is not None]
        assert not dead, f"{what}: a role exited\n{tails(dead)}"

    return wait_until(check, what, timeout, between=running, context=lambda: tails(roles))


@pytest.mark.timeout(90)  # about 15 s on an idle 2-core machine
def test_apex_profile_runs_as_local_processes_and_stops_on_sigterm(tmp_path):
    if not sys.platform.startswith("linux"):
        skip_or_fail("reads /proc: Linux only")
    # the compose file's redis:7, as --acl (its init service's) needs read-only key patterns
    with EmbeddedRedis(password="compose-test-pw", binary=redis7()) as server:
        keys = RunKeys("compose-apex")
        dotenv = {**EXAMPLE, "REDIS_PASSWORD": server.password, "QRL_RUN": keys.run}
        services = load(env=dotenv)["services"]
        client = redis.Redis.from_url(server.url)
        with pytest.raises(redis.AuthenticationError):  # the password is really required
            redis.Redis(host=server.host, port=server.port).ping()

        secrets = tmp_path / "secrets"  # as .env.example says to make them
        secrets.mkdir(mode=0o700)
        for role in ("actor", "learner", "replay"):
            (secrets / role).write_text(f"{role}-{os.urandom(12).hex()}\n")

        argv, env = local_command(services["init"], server, tmp_path, secrets)
        assert env["QRL_REDIS_URL"] == server.url  # the admin: the password where it puts it
        example = subprocess.run(  # refused with the example's password
            argv,
            env={**env, "QRL_REDIS_URL": server.url.replace(server.password, "change-me-x")},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert example.returncode == 1 and "example password" in example.stderr, example.stderr
        assert not client.exists(keys.config)  # refused before anything was written
        init = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert init.returncode == 0, init.stderr[-2000:]
        cfg = load_run_config(client, keys, "apex", ApexConfig)
        assert (cfg.env, cfg.actors) == (EXAMPLE["QRL_ENV"], int(EXAMPLE["QRL_ACTORS"]))

        roles: list[Role] = []
        for name in ("replay", "learner", "actor", "actor"):  # two replicas of `actor`
            argv, env = local_command(services[name], server, tmp_path, secrets)
            assert server.password not in str(env["QRL_REDIS_URL"])  # its own user
            log = tmp_path / f"{name}{len(roles)}.log"
            with log.open("wb") as out:
                # a process group of its own per role, as a container
                proc = subprocess.Popen(
                    argv, env=env, stdout=out, stderr=out, start_new_session=True
                )
            roles.append(Role(name, proc, log))
        try:
            store, replay = WeightStore(client, keys), make_replay(client, keys, cfg)

            def progress() -> tuple[int, int]:
                return store.version(), replay.stats()["inserted"]

            first = wait_for("training", lambda: min(p := progress()) > 0 and p, 60, roles)
            later = wait_for(
                "more training",
                lambda: (p := progress())[0] > first[0] and p[1] > first[1] and p,
                30,
                roles,
            )
            assert later[1] > first[1] >= cfg.learning_starts  # the learner waited for these
            leases = [client.exists(keys.lease("actor", i)) for i in range(3)]
            assert leases == [1, 1, 0]  # `--id auto`: actors 0 and 1
            users = {c["user"] for c in client.client_list()}  # each role as its own user
            assert {f"{keys.run}.{r}" for r in ("actor", "learner", "replay")} <= users
            wait_for(
                "stop handlers", lambda: all(catches_sigterm(r.proc.pid) for r in roles), 30, roles
            )

            for role in roles:
                role.proc.send_signal(signal.SIGTERM)
            for role in roles:
                try:
                    code = role.proc.wait(30)
                except subprocess.TimeoutExpired:
                    code = None
                assert code == 0, role.tail()
            wait_for(  # the learner's sampler process included
                "no process left", lambda: not any(group_members(r.proc.pid) for r in roles), 15, []
            )
            run_dir = tmp_path / "runs" / keys.run  # in the `runs` volume
            assert (run_dir / "checkpoint.pt").exists()  # written on exit
            assert len((run_dir / "metrics.csv").read_text().splitlines()) > 1
        finally:
            for role in roles:
                for pid in group_members(role.proc.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                role.proc.wait(10)
            client.close()
