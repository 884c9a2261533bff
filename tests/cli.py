"""Running the real ``qrl`` command line from tests."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent


def qrl(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    """``python -m qrl.cli ARGS`` from the repository root, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "qrl.cli", *args], capture_output=True, text=True, cwd=ROOT, **kw
    )


def qrl_of(module: str, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGS``: the ``qrl`` command line of a test module that first puts
    an algorithm of its own in the registry (``tests._random_algo``, ``tests._episode_algo``)."""
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=ROOT, **kw
    )


def role(*args: str, **kw: Any) -> subprocess.Popen:
    """A long-running ``qrl ARGS`` process (a role); output discarded unless ``kw`` says."""
    kw = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, **kw}
    return subprocess.Popen([sys.executable, "-m", "qrl.cli", *args], cwd=ROOT, **kw)


class QrlRedis(NamedTuple):
    """A running ``qrl redis``: the process, the URLs it printed (one per node), its
    redis-server pids and the line that named them."""

    proc: subprocess.Popen
    urls: list[str]
    pids: list[int]
    banner: str


def qrl_redis(*args: str, nodes: int = 1, **kw: Any) -> QrlRedis:
    """Start ``qrl redis ARGS`` and wait for its URLs."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "qrl.cli", "redis", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        **kw,
    )
    urls = [proc.stdout.readline().strip() for _ in range(nodes)]
    banner = proc.stderr.readline()
    pids = [int(p) for p in banner.split("(pid ")[1].split(")")[0].split(", ")]
    return QrlRedis(proc, urls, pids, banner)


def train(algo: str, run_dir: Path, *args: str, timeout: float = 240) -> dict[str, Any]:
    """``qrl train ALGO ARGS --run-dir RUN_DIR`` with its embedded Redis (the session's URL is
    not passed on); asserts it exited 0, returns result.json."""
    env = {k: v for k, v in os.environ.items() if k != "QRL_REDIS_URL"}
    proc = qrl("train", algo, *args, "--run-dir", str(run_dir), timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((run_dir / "result.json").read_text())


def eval_stats(stdout: str) -> dict[str, float]:
    """The numbers ``qrl eval`` printed: mean, std, min, max and episodes."""
    found = re.search(
        r"mean return (\S+), std (\S+), min (\S+), max (\S+) over (\d+) episodes", stdout
    )
    assert found, stdout
    return dict(
        zip(("mean", "std", "min", "max", "episodes"), map(float, found.groups()), strict=True)
    )


def eval_mean(checkpoint: Path, episodes: int = 5) -> tuple[float, str]:
    """``qrl eval CHECKPOINT``: the mean return it printed, and its whole output."""
    out = qrl("eval", str(checkpoint), "--episodes", str(episodes), timeout=120)
    assert out.returncode == 0, out.stderr
    return eval_stats(out.stdout)["mean"], out.stdout


def eval_confirmation(run_dir: Path) -> str:
    """``qrl eval`` of a solved run's checkpoint on the episodes its confirmation played
    (seeds 1,000,000 + 10,000 x seed + i); asserts it scores the confirmed mean, which
    reached the target (a checkpoint other than the confirmed weights would not score the
    same; a few lucky episodes cannot). Returns the output."""
    result = json.loads((run_dir / "result.json").read_text())
    seed = json.loads((run_dir / "config.json").read_text())["config"]["seed"]
    assert result["reached"] and result["confirm_return"] >= result["target"], result
    out = qrl(
        "eval",
        str(run_dir),
        "--episodes",
        str(result["confirm_episodes"]),
        "--seed",
        str(1_000_000 + 10_000 * seed),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    mean = eval_stats(out.stdout)["mean"]
    assert abs(mean - result["confirm_return"]) <= 0.06, (mean, result)  # printed rounded
    return out.stdout
