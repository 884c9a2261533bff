"""Where a learner resumes from, in one place. Three sources may hold its state, each with a
version (its update count):

- its checkpoint file (``--checkpoint``: network, optimizer, updates);
- the run's snapshot (:mod:`qrl.runtime.snapshot`, PBT's trials), in the file its slot hands
  in: taken when it is at least as far on as the checkpoint and fits the network;
- the weights published in Redis: a learner restarted after SIGKILL finds them newer than
  its file, and counts on from them.

:func:`resume` loads the first two into the network when the learner is made;
:func:`load_optimizer` gives the optimizer its part once it exists (it is made late: see
``Learner.opt``); :func:`settle` reconciles the third as the learner starts, and says
whether its weights must be published for the actors to start from. A learner's
:class:`Checkpointer` resumes from the first two and saves to them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qrl.runtime.checkpoint import load_checkpoint, save_checkpoint
from qrl.runtime.config import Config
from qrl.runtime.snapshot import capture, load_model, optimizer_state, read_file, write_file
from qrl.wire.codec import CodecError
from qrl.wire.weights import WeightStore, ahead, fits

log = logging.getLogger(__name__)


@dataclass
class Resumed:
    """What a learner resumed: its update count and its optimizer's state, either as torch
    saved it (a checkpoint's) or as a snapshot's arrays (checked against the optimizer when
    it is made)."""

    updates: int = 0
    opt_state: dict[str, Any] = field(default_factory=dict)
    opt_arrays: dict[str, np.ndarray] = field(default_factory=dict)


def resume(
    net: torch.nn.Module,
    algo: str,
    cfg: Config,
    checkpoint: Path | None,
    snapshot: Path | None,
) -> Resumed:
    """Load the furthest of the checkpoint file and the snapshot file into ``net``."""
    out = Resumed()
    if checkpoint is not None and checkpoint.exists():
        state = load_checkpoint(checkpoint, algo, cfg)
        net.load_state_dict(state["model"])
        out = Resumed(int(state["step"]), state["optimizer"])
        log.info("resumed from %s at update %d", checkpoint, out.updates)
    snap = read_file(snapshot) if snapshot is not None else None
    if snap is None or snap.updates < out.updates:
        return out
    try:
        load_model(snap.model, net)
    except CodecError as e:
        log.warning("the snapshot in %s does not fit the network: %s", snapshot, e)
        return out
    log.info("resumed from the run's snapshot at update %d", snap.updates)
    return Resumed(snap.updates, opt_arrays=snap.opt)


def load_optimizer(opt: torch.optim.Optimizer, resumed: Resumed) -> bool:
    """Give ``opt`` the resumed optimizer state; whether there was one (a snapshot's that
    does not fit the optimizer is dropped: it starts fresh)."""
    state = resumed.opt_state
    if resumed.opt_arrays:
        try:
            state = optimizer_state(resumed.opt_arrays, opt)
        except CodecError as e:
            log.warning("the snapshot's optimizer state does not fit: %s (fresh)", e)
    if state:
        opt.load_state_dict(state)
    return bool(state)


def settle(weights: WeightStore, module: torch.nn.Module, updates: int) -> tuple[int, bool]:
    """The learner's version once the published weights are taken into account, and whether
    it must publish its own before the actors can start.

    Published weights newer than the learner's own (a restart after SIGKILL: Redis is newer
    than the file) are loaded into ``module`` and counted on from, unless they are far ahead
    of it (garbage, overwritten with the learner's own count: see :mod:`qrl.wire.weights`).
    A blob at the learner's version that actors cannot load is a writer's, not the
    learner's: it is replaced. Versions never go back, so a newer version that could not be
    loaded is published over."""
    stored = weights.version()
    if ahead(stored, updates):
        loaded = weights.load_into(module, newer_than=updates)
        if loaded is not None and ahead(loaded, updates):
            log.warning("continuing from published weights %d (checkpoint: %d)", loaded, updates)
            updates = stored = loaded
    if stored == updates and not fits(module, weights.fetch()):
        stored = -1
    return updates, stored != updates


class Checkpointer:
    """A learner's own state in its checkpoint file and the run's snapshot file (either may
    be ``None``): resumed from as the learner is made, saved to by the pool's leader."""

    def __init__(self, algo: str, checkpoint: Path | None, snapshot: Path | None) -> None:
        self.algo, self.checkpoint, self.snapshot = algo, checkpoint, snapshot

    def resume(self, net: torch.nn.Module, cfg: Config) -> Resumed:
        return resume(net, self.algo, cfg, self.checkpoint, self.snapshot)

    def save(
        self, cfg: Config, net: torch.nn.Module, opt: torch.optim.Optimizer, updates: int
    ) -> None:
        if self.checkpoint is not None:
            save_checkpoint(self.checkpoint, self.algo, cfg, net, opt, updates)
        if self.snapshot is not None:
            try:
                write_file(self.snapshot, capture(net, opt, updates))
            except OSError as e:  # the checkpoint above holds it
                log.warning("could not save the snapshot to %s: %s", self.snapshot, e)
