"""Trained policies from checkpoints: the greedy policy a run's checkpoint holds, whatever
the algorithm (its builder says how to act with its parameters)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qrl.algos import ALGOS, Algorithm
from qrl.algos.base import Policy
from qrl.checkpoint import CheckpointError, load_checkpoint
from qrl.configs.base import parse_config


@dataclass
class LoadedPolicy:
    algo: Algorithm
    config: Any
    act: Policy  # a batch of observations -> a batch of greedy actions
    step: int


def policy_from_checkpoint(path: Path) -> LoadedPolicy:
    """The greedy policy in checkpoint ``path``; raises ``CheckpointError`` (a
    ``ValueError``) if it cannot be used."""
    state = load_checkpoint(path)
    algo = ALGOS.get(state["algo"])
    if algo is None:
        raise CheckpointError(f"unknown algorithm {state['algo']!r} in {path}")
    cfg = parse_config(algo.config, state["config"])
    act = algo.policy(cfg, {k: v.numpy() for k, v in state["model"].items()})
    return LoadedPolicy(algo, cfg, act, int(state["step"]))
