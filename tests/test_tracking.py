"""What ``--track`` sends to Weights & Biases: the metrics and the run's config, never the
command line's secrets (a ``--redis`` URL with a password). W&B offline, in a subprocess
whose argv holds the secret as a role command's would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.cli import ROOT

SECRET = "Tr4ck3dS3cr3t"

SCRIPT = """
import sys
from pathlib import Path
from qrl.runtime.tracking import Tracking, open_sinks

tracking = Tracking(tensorboard=False, wandb=True, wandb_project="qrl-test")
(sink,) = open_sinks(Path(sys.argv[1]), tracking, run="argv-test", config={"lr": 0.1})
sink.log({"charts/loss": 1.0}, 10)
sink.close()
print("argv still", sys.argv[2:])
"""


def test_wandb_gets_no_password_from_the_command_line(tmp_path):
    home = tmp_path / "home"
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    argv = [
        "--redis",
        f"redis://qrl:{SECRET}@db.example:6379/0",
        "--redis=redis://:{SECRET}@db.example/0?password={SECRET}".replace("{SECRET}", SECRET),
        "--password",
        SECRET,
        f"--password={SECRET}",
    ]
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(run_dir), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert SECRET in out.stdout  # the process's own argv is left as it was
    files = [p for p in tmp_path.rglob("*") if p.is_file()]  # the run's and W&B's own
    assert any(p.suffix == ".wandb" for p in files), files  # W&B did write its run
    leaks = [p for p in files if SECRET.encode() in Path(p).read_bytes()]
    assert not leaks, leaks
