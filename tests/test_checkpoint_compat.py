"""Checkpoints written by an earlier qrl still load: files in tests/data/checkpoints/ were
written by qrl 0.1.0 before the package was restructured into layers (commit 1f48e01,
`qrl train impala|es --env CartPole-v1 --max-time 15`), with the actions their policies took
on 32 fixed observations (actions.json, recorded by that same code)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import qrl
from qrl.runtime.checkpoint import load_checkpoint
from tests.cli import qrl as qrl_cli
from tests.cli import role
from tests.helpers import wait_until

DATA = Path(__file__).parent / "data" / "checkpoints"
ACTIONS = json.loads((DATA / "actions.json").read_text())


def _observations() -> np.ndarray:
    return np.random.default_rng(0).normal(0, 0.5, (32, 4)).astype(np.float32)


@pytest.mark.parametrize("algo", sorted(ACTIONS))
def test_an_old_checkpoint_acts_as_it_did(algo):
    policy = qrl.load_policy(DATA / f"{algo}-cartpole.pt")
    assert (policy.algo, policy.env_id) == (algo, "CartPole-v1")
    assert policy.predict(_observations()).tolist() == ACTIONS[algo]


@pytest.mark.slow
def test_an_old_checkpoint_resumes_a_learner(r, keys, redis_server, tmp_path):
    """The IMPALA learner of a new run resumes from the old file: it publishes weights at
    the update count the file holds, not from 0."""
    ckpt = tmp_path / "checkpoint.pt"
    shutil.copy(DATA / "impala-cartpole.pt", ckpt)
    state = torch.load(ckpt, weights_only=True)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"config": state["config"]}))
    made = qrl_cli("run", "create", "impala", "--run", keys.run, "--config", str(config))
    assert made.returncode == 0, made.stderr
    assert load_checkpoint(ckpt, "impala")["step"] == state["step"] > 0
    proc = role("learner", "impala", "--run", keys.run, "--checkpoint", str(ckpt))
    try:
        version = wait_until(lambda: r.hget(keys.weights, "version"), "the learner's weights", 60)
        assert int(version) == state["step"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
