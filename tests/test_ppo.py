"""PPO: GAE against its definition, the rollout message, the learner's update and its
stale-rollout rule, with one learner (the pool of several: tests/test_ppo_pool.py)."""

import time

import numpy as np
import pytest
import torch

import qrl
from qrl.algos.ppo.config import PPOConfig
from qrl.algos.ppo.gae import gae
from qrl.algos.ppo.keys import rollouts
from qrl.algos.ppo.messages import KIND, rollout_schema
from qrl.learners.base import Learner
from qrl.runtime.config import ConfigError, parse_config, with_budget
from qrl.runtime.runs import create_run
from qrl.wire.codec import CodecError, decode, encode
from qrl.wire.streams import GROUP
from tests.cli import eval_confirmation, train
from tests.helpers import make_actor, make_learner, next_unroll, wait_until


def gae_by_definition(rewards, discounts, values, bootstrap, lam):
    """A_s = sum_{t>=s} (prod_{i=s}^{t-1} lam d_i) delta_t, a direct double loop."""
    t_len, b = rewards.shape
    v_next = lambda t, j: values[t + 1, j] if t + 1 < t_len else bootstrap[j]  # noqa: E731
    adv = torch.zeros(t_len, b, dtype=torch.float64)
    for j in range(b):
        for s in range(t_len):
            total, coef = 0.0, 1.0
            for t in range(s, t_len):
                delta = rewards[t, j] + discounts[t, j] * v_next(t, j) - values[t, j]
                total += coef * delta
                coef *= lam * discounts[t, j]
            adv[s, j] = total
    return adv


@pytest.mark.parametrize("lam", [0.0, 0.8, 1.0])
def test_gae_matches_its_definition(lam):
    g = torch.Generator().manual_seed(0)
    t, b = 9, 4
    done = torch.rand(t, b, generator=g) < 0.25
    args = dict(
        rewards=torch.randn(t, b, generator=g, dtype=torch.float64),
        discounts=0.9 * (~done).double(),
        values=torch.randn(t, b, generator=g, dtype=torch.float64),
        bootstrap=torch.randn(b, generator=g, dtype=torch.float64),
    )
    adv, ret = gae(**args, lam=lam)
    want = gae_by_definition(**args, lam=lam)
    torch.testing.assert_close(adv, want)
    torch.testing.assert_close(ret, want + args["values"])


def _learner(r, keys, redis_server, **over) -> Learner:
    cfg = PPOConfig(**{"envs_per_actor": 4, "batch_unrolls": 4, "unroll": 8, **over})
    create_run(r, keys, "ppo", cfg)
    return make_learner(redis_server.url, keys, cfg)


def _rollouts(lrn: Learner, r, keys, version: int = 0) -> dict:
    """A real actor's message, acted with ``version``."""
    actor = make_actor("ppo", r, keys, lrn.cfg)
    actor.weights.version = version
    return next_unroll(actor)


def test_rollouts_carry_values_and_are_validated(r, keys, redis_server):
    lrn = _learner(r, keys, redis_server)
    msg = _rollouts(lrn, r, keys)
    schema = rollout_schema((4,), "float32", 2, 8)
    out = decode(encode(KIND, msg), schema)
    assert out["value"].shape == (8, 4) and out["logits"].shape == (8, 4, 2)
    for name, bad in (
        ("value", np.zeros((7, 4), np.float32)),  # not one per step
        ("value", np.full((8, 4), np.nan, np.float32)),
        ("action", np.full((8, 4), 2, np.int32)),  # no such action
    ):
        with pytest.raises(CodecError):
            decode(encode(KIND, {**msg, name: bad}), schema)
    no_value = {k: v for k, v in msg.items() if k != "value"}
    with pytest.raises(CodecError):
        decode(encode(KIND, no_value), schema)


def test_batch_unrolls_is_shared_equally_by_the_learners():
    with pytest.raises(ConfigError, match="multiple of learners"):
        parse_config(PPOConfig, {"learners": 3, "batch_unrolls": 32})
    assert parse_config(PPOConfig, {"learners": 4, "batch_unrolls": 32}).learners == 4


def _run_until(lrn: Learner, done) -> None:
    stop = lambda: False  # noqa: E731
    assert lrn.start(stop)
    try:
        wait_until(lambda: lrn.step(stop) and done(), "the learner", timeout=60, every=0)
    finally:
        lrn.close(stop)


def test_an_update_trains_on_fresh_rollouts_publishes_and_acknowledges(r, keys, redis_server):
    lrn = _learner(r, keys, redis_server, epochs=3, minibatches=2)
    r.xadd(rollouts(keys), {"d": encode(KIND, _rollouts(lrn, r, keys, version=0))})
    before = [p.detach().clone() for p in lrn.net.parameters()]
    _run_until(lrn, lambda: lrn.updates >= 1)
    assert lrn.updates == 1 and lrn.rule.grad_steps == 6  # epochs x minibatches
    assert lrn.publisher.weights.version() == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, lrn.net.parameters(), strict=True))
    wait_until(lambda: r.xpending(rollouts(keys), GROUP)["pending"] == 0, "the acknowledgement")


def test_stale_rollouts_are_dropped_and_counted(r, keys, redis_server):
    lrn = _learner(r, keys, redis_server, max_policy_lag=2)
    lrn.updates = 10
    # 3 updates old, and from weights not yet published: dropped; 1 old: trained on
    for version in (7, 2**53, 9):
        r.xadd(rollouts(keys), {"d": encode(KIND, _rollouts(lrn, r, keys, version))})
    _run_until(lrn, lambda: lrn.updates >= 11)
    assert (
        lrn.source.admit.stale == 8 and lrn.updates == 11
    )  # the two dropped entries' 4 rollouts each
    assert lrn.metrics()["stale"] == 8
    wait_until(lambda: r.xpending(rollouts(keys), GROUP)["pending"] == 0, "the acknowledgements")


def _act_until_it_waits(actor) -> None:
    """Step ``actor`` until it would wait, for credit (paced) or for room in the stream: its
    stop check is asked only there, and says stop. Then the push under way (its own
    thread's) is done: the stream holds all it sent."""
    while actor.step(lambda: True):
        pass
    actor.sink.sending.wait()


@pytest.mark.parametrize("ahead", [0, 1, None])
def test_actors_send_one_batch_per_published_version(r, keys, redis_server, ahead):
    # two actors of 4 envs, batches of 8 rollouts: each actor's share is one entry per
    # version, and it may hold ``ahead`` more (None: not paced)
    over = {"pace_actors": False} if ahead is None else {"batches_ahead": ahead}
    lrn = _learner(r, keys, redis_server, actors=2, batch_unrolls=8, **over)
    lrn.publish()
    actor = make_actor("ppo", r, keys, lrn.cfg)
    assert actor.start(lambda: False)
    _act_until_it_waits(actor)
    lrn.updates += 1
    lrn.publish()
    actor.weights.refresh()  # as its steps do every weight_poll unrolls
    _act_until_it_waits(actor)
    schema = rollout_schema((4,), "float32", 2, 8)
    versions = [decode(f[b"d"], schema)["version"] for _, f in r.xrange(rollouts(keys))]
    if ahead is None:  # the stream's room alone bounds them
        assert len(versions) == lrn.cfg.stream_maxlen
    else:  # out of credit: it waited for the next version, sending nothing unpaced
        assert versions == [0] * (1 + ahead) + [1]
        assert actor.weights.credit == 0 and actor.metrics()["unpaced"] == 0


@pytest.mark.parametrize("paced", [True, False])
def test_a_paced_learner_reads_no_further_than_its_batch(r, keys, redis_server, paced):
    # one entry is one learner's share: paced, it holds one and leaves the rest to the pool
    lrn = _learner(r, keys, redis_server, learners=2, batch_unrolls=8, pace_actors=paced)
    for _ in range(4):
        r.xadd(rollouts(keys), {"d": encode(KIND, _rollouts(lrn, r, keys))})
    held = lambda: r.xpending(rollouts(keys), GROUP)["pending"]  # noqa: E731
    lrn.source.start(lrn.fail)
    try:
        batch = lrn.source.take(timeout=10)
        assert batch is not None and batch.action.shape[1] == 4
        if paced:  # the batch in hand, nothing read ahead: an absence, so time must pass
            time.sleep(0.5)
            assert held() == 1
        else:
            wait_until(held, "the loader to read ahead", 10, until=lambda n: n == 4)
        lrn.source.used(batch)
        assert lrn.source.take(timeout=10) is not None
        if paced:
            wait_until(lambda: held() == 1, "the next entry only")
    finally:
        lrn.source.stop()


@pytest.mark.slow
def test_train_ppo_cli_solves_cartpole(tmp_path):
    run_dir = tmp_path / "run"
    result = train("ppo", run_dir, "--env", "CartPole-v1", "--seed", "0", "--max-time", "120")
    assert result["reached"] and result["eval_return"] >= 475
    assert "ppo step" in eval_confirmation(run_dir)
    policy = qrl.load_policy(run_dir)  # from Python, as SB3 users load a model
    assert (policy.algo, policy.env_id) == ("ppo", "CartPole-v1")
    assert policy.predict(np.zeros((3, 4), np.float32)).shape == (3,)


def test_anneal_takes_the_jobs_budget_and_falls_linearly_to_zero():
    cfg = parse_config(PPOConfig, {"anneal": True})
    assert with_budget(cfg, 1000, 90.0).anneal_steps == 1000  # steps first
    by_time = with_budget(cfg, None, 90.0)
    assert by_time.anneal_s == 90.0 and by_time.anneal_steps == 0
    assert with_budget(parse_config(PPOConfig, {}), 1000, 90.0).anneal_steps == 0  # off: none
    own = parse_config(PPOConfig, {"anneal": True, "anneal_steps": 50})
    assert with_budget(own, 1000, None).anneal_steps == 50  # its own horizon kept
    steps = with_budget(cfg, 1000, None)
    assert [steps.remaining(n, 0) for n in (0, 250, 1000, 5000)] == [1.0, 0.75, 0.0, 0.0]
    assert by_time.remaining(10**9, 45.0) == 0.5
    assert cfg.remaining(10**9, 10**9) == 1.0  # no horizon: no schedule
    assert parse_config(PPOConfig, {}).remaining(10**9, 10**9) == 1.0


def test_an_annealing_learner_steps_with_a_falling_lr_and_clip(r, keys, redis_server):
    """Each update's lr and clip are the schedule's at the env steps trained on so far (the
    updates times the batch): two batches of 32 env steps (4 unrolls of 8 steps) over a
    horizon of 128, half of it left."""
    lrn = _learner(r, keys, redis_server, anneal=True, anneal_steps=128, lr=1e-3)
    for _ in range(2):
        r.xadd(rollouts(keys), {"d": encode(KIND, _rollouts(lrn, r, keys, version=lrn.updates))})
        before = lrn.updates
        _run_until(lrn, lambda before=before: lrn.updates > before)
    assert lrn.rule.batch_steps == 32 and lrn.updates == 2
    assert lrn.rule.remaining == pytest.approx(0.5)
    assert lrn.opt.param_groups[0]["lr"] == pytest.approx(5e-4)
    assert lrn.metrics()["anneal"] == pytest.approx(0.5)
