"""Where a run's metrics go beside ``metrics.csv``: TensorBoard event files and, with
``--track``, Weights & Biases. Each is a :class:`Sink` that takes the same scalars (tag ->
value, with env steps as the x axis); :class:`qrl.runtime.runlog.RunLog` feeds them all."""

from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

WANDB_MISSING = "--track needs Weights & Biases: pip install 'qrl-rl[wandb]'"


@dataclass(frozen=True)
class Tracking:
    """Which sinks a run's metrics go to (``wandb_project``/``wandb_entity``: ``None`` lets
    wandb read ``WANDB_PROJECT``/``WANDB_ENTITY``)."""

    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str | None = None
    wandb_entity: str | None = None

    def check(self) -> None:
        """Raise ``RuntimeError`` (one line) if a chosen sink is not installed."""
        if self.wandb and importlib.util.find_spec("wandb") is None:
            raise RuntimeError(WANDB_MISSING)


class Sink(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Event files in ``RUN_DIR/tb``."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(run_dir / "tb"), flush_secs=5)

    def log(self, scalars: dict[str, float], step: int) -> None:
        now = time.time()
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step, walltime=now)

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A Weights & Biases run named after the qrl run, its config the run's config, its
    files under ``RUN_DIR/wandb`` (``WANDB_MODE=offline`` keeps them there); W&B's system
    metadata (command line, host, git) is not collected."""

    def __init__(
        self, run_dir: Path, tracking: Tracking, run: str | None, config: dict[str, Any]
    ) -> None:
        import wandb

        self._run = wandb.init(
            project=tracking.wandb_project,
            entity=tracking.wandb_entity,
            name=run,
            config=config,
            dir=str(run_dir),
            # no system metadata: it holds the command line, whose --redis URL may hold the
            # password (and the host names and paths are nobody else's business either)
            settings=wandb.Settings(x_disable_meta=True),
        )
        # env steps may repeat between rows: a step metric, not wandb's own monotonic step
        self._run.define_metric("env_steps")
        self._run.define_metric("*", step_metric="env_steps")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._run.log({"env_steps": step, **scalars})

    def close(self) -> None:
        self._run.finish()


def open_sinks(
    run_dir: Path, tracking: Tracking, run: str | None = None, config: dict[str, Any] | None = None
) -> list[Sink]:
    """The sinks ``tracking`` asks for. TensorBoard missing is a one-line warning (metrics.csv
    still gets everything); W&B missing is an error (``--track`` asked for it); W&B refusing
    to start (not logged in, say) is one error line, and the run goes on without it."""
    sinks: list[Sink] = []
    if tracking.tensorboard:
        try:
            sinks.append(TensorBoardSink(run_dir))
        except ImportError:
            log.warning("tensorboard is not installed: metrics.csv only (pip install tensorboard)")
    if tracking.wandb:
        tracking.check()
        import wandb

        try:
            sinks.append(WandbSink(run_dir, tracking, run, config or {}))
        except wandb.errors.Error as e:
            log.error("W&B did not start, the run goes on without it: %s", e)
    return sinks
