"""A3C and Gorila as whole runs on a real Redis: Gorila solves CartPole-v1 from the CLI (and
its checkpoint evaluates and loads); a parameter server SIGKILLed mid-run (real processes)
resumes from Redis at the version it saved, with its optimizer state, and the run solves."""

from __future__ import annotations

import numpy as np
import pytest

import qrl
from qrl.algos import ALGOS
from qrl.algos.a3c.config import A3CConfig
from qrl.ps import protocol
from qrl.rl.envspec import EnvSpec
from qrl.rl.evaluate import evaluate
from qrl.runtime.runs import create_run
from qrl.wire.weights import WeightStore
from tests.cli import eval_confirmation, train
from tests.helpers import Roles, run_reader


def _reports(r, keys, role: str) -> list[dict]:
    reader, out = run_reader(r, keys), []
    while batch := reader.read():
        out += [m["values"] for m in batch if m["role"] == role]
    return out


# (`qrl train a3c` from the CLI: tests/test_hostile_live.py, under hostile writes)
@pytest.mark.slow
def test_train_gorila_cli_solves_cartpole_and_its_checkpoint_evaluates(tmp_path):
    run_dir = tmp_path / "run"
    # an env-step budget (seeds 0-2 solve in 17-45k): the same test on a slow machine
    result = train(
        "gorila",
        run_dir,
        "--env",
        "CartPole-v1",
        "--seed",
        "0",
        "--max-steps",
        "150000",
        "--learners",
        "2",
        timeout=280,
    )
    assert result["reached"] and result["eval_return"] >= 475
    # the checkpoint shard 0 assembled from every shard's block plays the confirmed policy
    assert "gorila step" in eval_confirmation(run_dir)
    policy = qrl.load_policy(run_dir)
    assert (policy.algo, policy.env_id) == ("gorila", "CartPole-v1")
    assert policy.predict(np.zeros((3, 4), np.float32)).shape == (3,)


def _solved(r, keys, cfg: A3CConfig) -> float:
    """qrl train's rule on the run's current weights: 10 episodes at the target, then the
    same weights confirmed on 100 fresh ones (their mean; -1 while there is none)."""
    w = WeightStore(r, keys).fetch()
    if w is None:
        return -1.0
    act = ALGOS["a3c"].policy(cfg, EnvSpec.of(cfg.env), w.params)
    if np.mean(evaluate(cfg.env, act, 10, seed=10_000)) < 475:
        return -1.0
    return float(np.mean(evaluate(cfg.env, act, 100, seed=10**6)))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sigkilled_parameter_server_resumes_from_redis_and_the_run_solves(r, keys, tmp_path):
    cfg = A3CConfig(ps_shards=2)
    create_run(r, keys, "a3c", cfg)
    roles = Roles(keys.run, tmp_path)
    shards = [protocol.shard_keys(keys, 2, k) for k in range(2)]
    try:
        for k in (0, 1):
            roles.start(f"ps{k}", "ps", "a3c", "--id", str(k))
        for w in (0, 1):
            roles.start(f"worker{w}", "worker", "a3c", "--id", str(w))

        def updates() -> int:
            return max((v["updates"] for v in _reports(r, keys, "ps")), default=0)

        roles.until(lambda: updates() >= 300, "300 gradients applied", 120)
        roles.kill("ps1")
        at = protocol.bounds(_size(cfg), 2)
        streams = len(protocol.workers(cfg.workers))
        _, saved = protocol.state_store(r, shards[1], at[2] - at[1], streams).read()
        assert set(saved["last_ids"]) == {"0", "1"}  # where it is in each worker's stream
        roles.start("ps1", "ps", "a3c", "--id", "1")
        roles.until(
            lambda: f"resumed from Redis at version {saved['version']}" in roles.log("ps1"),
            "the restarted shard to resume at its saved version",
        )
        # (training goes on while an evaluation does not confirm, as in qrl train)
        roles.until(
            lambda: _solved(r, keys, cfg),
            "the run to reach 475, confirmed",
            200,
            until=lambda s: s >= 475,
            every=2,
        )
    finally:
        roles.cleanup()


def _size(cfg: A3CConfig) -> int:
    from qrl.algos.a3c.builder import _policy_value_net

    return sum(p.numel() for p in _policy_value_net(cfg, EnvSpec.of(cfg.env)).parameters())
