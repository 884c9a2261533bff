"""An env id ``module:EnvId`` that comes from data (a run's config in Redis, a checkpoint, a
run directory) imports nothing: modules come only from the person starting the process
(``--env-module``, ``QRL_ENV_MODULES``, ``load_policy(env_modules=...)``, or an ``--env``
typed on the command line). Real redis-server, the real CLI, real checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from qrl.algos.apex.config import ApexConfig
from qrl.runtime.checkpoint import save_checkpoint
from qrl.runtime.config import parse_config
from qrl.runtime.runs import create_run
from tests.cli import qrl

ZEN = "Beautiful is better than ugly"  # what importing `this` prints


def _role(*args: str) -> subprocess.CompletedProcess[str]:
    """A role command that must end by itself; its output whether it ended or not."""
    try:
        return qrl(*args, timeout=60)
    except subprocess.TimeoutExpired as e:  # the role ran: it waited for the others
        out = subprocess.CompletedProcess(args, -1, e.stdout or "", e.stderr or "")
        for name in ("stdout", "stderr"):
            value = getattr(out, name)
            setattr(out, name, value.decode() if isinstance(value, bytes) else value)
        return out


@pytest.mark.parametrize(
    "command", [("actor", "apex", "--max-steps", "1"), ("learner", "apex", "--max-updates", "1")]
)
def test_a_role_does_not_import_a_module_named_by_the_runs_config(command, r, keys):
    # what a writer with the run's keys can write: the config naming a module to import
    create_run(r, keys, "apex", parse_config(ApexConfig, {"env": "this:CartPole-v1"}))
    out = _role(*command, "--run", keys.run)
    assert ZEN not in out.stdout + out.stderr  # `this` was not imported
    assert out.returncode in (1, 2), out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--env-module this" in lines[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def _plant(tmp_path: Path, env: str) -> tuple[Path, Path]:
    """A run directory ``tmp_path/run`` whose checkpoint's env is ``env``, and beside it a
    module and a package (the run directory itself) that leave a marker file if imported;
    returns (run dir, marker)."""
    from qrl.rl.envspec import EnvSpec
    from qrl.rl.models import q_network

    marker = tmp_path / "imported"
    code = f"open({str(marker)!r}, 'w').write(__name__)\n"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "__init__.py").write_text(code)
    (tmp_path / "evil.py").write_text(code)
    net = q_network(parse_config(ApexConfig, {"env": "CartPole-v1"}), EnvSpec.of("CartPole-v1"))
    cfg = parse_config(ApexConfig, {"env": env})
    save_checkpoint(run_dir / "checkpoint.pt", "apex", cfg, net, None, 0)
    return run_dir, marker


def _in(cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """A Python command run from ``cwd`` (which is then first on its sys.path), with this
    checkout importable."""
    root = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
@pytest.mark.parametrize("module", ["evil", "run"])
def test_load_policy_and_eval_import_nothing_a_checkpoint_names(module, tmp_path):
    run_dir, marker = _plant(tmp_path, f"{module}:CartPole-v1")
    code = (
        "import sys, qrl\n"
        "try:\n"
        f"    qrl.load_policy({str(run_dir)!r})\n"
        "except ValueError as e:\n"
        "    print(e); sys.exit(3)\n"
    )
    out = _in(tmp_path, "-c", code)
    assert not marker.exists(), "load_policy imported a module the checkpoint named"
    assert out.returncode == 3 and "env_modules" in out.stdout, out.stderr[-2000:]
    out = _in(tmp_path, "-m", "qrl.cli", "eval", "run", "--episodes", "1")
    assert not marker.exists(), "qrl eval imported a module the checkpoint named"
    assert out.returncode in (1, 2) and f"--env-module {module}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_load_policy_and_eval_import_the_modules_they_are_told_to(tmp_path):
    run_dir, marker = _plant(tmp_path, "tests._envs:CartPole-v1")
    out = _in(
        tmp_path,
        "-m",
        "qrl.cli",
        "eval",
        str(run_dir),
        "--episodes",
        "1",
        "--env-module",
        "tests._envs",
    )
    assert out.returncode == 0 and "CartPole-v1" in out.stdout, out.stderr[-2000:]
    code = (
        "import qrl\n"
        f"p = qrl.load_policy({str(run_dir)!r}, env_modules=['tests._envs'])\n"
        "print(p.observation_shape)\n"
    )
    out = _in(tmp_path, "-c", code)
    assert out.returncode == 0 and "(4,)" in out.stdout, out.stderr[-2000:]
    assert not marker.exists()


def test_env_modules_are_refused_unless_allowed_and_never_from_data(monkeypatch):
    from qrl.rl import envs
    from qrl.rl.envs import EnvModuleRefused, allow_env_modules, make_env

    monkeypatch.setattr(envs, "_allowed", set())  # this process's list, restored after

    with pytest.raises(EnvModuleRefused, match="--env-module tests._envs"):
        make_env("tests._envs:QrlTestPendulum-v0")
    for bad in ("os.path:x", "a b:CartPole-v1", ":CartPole-v1", "tests._envs:a:b"):
        with pytest.raises(ValueError):
            make_env(bad)
    with pytest.raises(ValueError, match="not a module name"):
        allow_env_modules(["../evil"])
    allow_env_modules(["tests._envs"])
    env = make_env("tests._envs:QrlTestPendulum-v0")
    env.close()
    with pytest.raises(ValueError):  # one allowed module does not let a second id in
        make_env("tests._envs:x:CartPole-v1")
