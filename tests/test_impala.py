import gymnasium as gym
import numpy as np
import pytest
import redis
import torch

from qrl.algos.impala.config import ImpalaConfig
from qrl.algos.impala.keys import trajectories
from qrl.algos.impala.messages import unroll_schema
from qrl.algos.impala.vtrace import vtrace
from qrl.learners.unrolls import SLOTS, stack_unrolls
from qrl.runtime.loop import run_role
from qrl.runtime.runs import create_run
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.codec import CodecError, decode, encode
from qrl.wire.keys import RunKeys
from qrl.wire.streams import GROUP, Entry
from tests.cli import eval_confirmation, train
from tests.helpers import impala_unrolls, kill_feed_mid_run, make_learner, reads_of, wait_until


def random_inputs(t=12, b=5, seed=0, gamma=0.9):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    done = torch.rand(t, b, generator=g) < 0.2  # episode ends inside the unroll
    return dict(
        behaviour_logp=-torch.rand(t, b, generator=g, dtype=torch.float64) * 2,
        target_logp=-torch.rand(t, b, generator=g, dtype=torch.float64) * 2,
        rewards=r(t, b),
        discounts=gamma * (~done).double(),
        values=r(t, b),
        bootstrap=r(b),
    )


def vtrace_by_definition(
    behaviour_logp, target_logp, rewards, discounts, values, bootstrap, rho_bar, c_bar
):
    """v_s = V(x_s) + sum_{t>=s} (prod_{i=s}^{t-1} d_i c_i) rho_t (r_t + d_t V(x_{t+1}) - V(x_t)),
    a direct double loop, and the policy-gradient advantage rho_s (r_s + d_s v_{s+1} - V(x_s))."""
    t_len, b = rewards.shape
    rho = torch.exp(target_logp - behaviour_logp)
    v_next = lambda t, j: values[t + 1, j] if t + 1 < t_len else bootstrap[j]  # noqa: E731
    vs = torch.zeros(t_len, b, dtype=torch.float64)
    for j in range(b):
        for s in range(t_len):
            total, coef = 0.0, 1.0
            for t in range(s, t_len):
                delta = min(rho_bar, rho[t, j]) * (
                    rewards[t, j] + discounts[t, j] * v_next(t, j) - values[t, j]
                )
                total += coef * delta
                coef *= discounts[t, j] * min(c_bar, rho[t, j])
            vs[s, j] = values[s, j] + total
    adv = torch.zeros(t_len, b, dtype=torch.float64)
    for j in range(b):
        for s in range(t_len):
            nxt = vs[s + 1, j] if s + 1 < t_len else bootstrap[j]
            adv[s, j] = min(rho_bar, rho[s, j]) * (
                rewards[s, j] + discounts[s, j] * nxt - values[s, j]
            )
    return vs, adv


@pytest.mark.parametrize("rho_bar, c_bar", [(1.0, 1.0), (2.0, 0.5), (float("inf"), float("inf"))])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vtrace_matches_the_definition(seed, rho_bar, c_bar):
    x = random_inputs(seed=seed)
    vs, adv = vtrace(**x, rho_bar=rho_bar, c_bar=c_bar)
    ref_vs, ref_adv = vtrace_by_definition(**x, rho_bar=rho_bar, c_bar=c_bar)
    torch.testing.assert_close(vs, ref_vs)
    torch.testing.assert_close(adv, ref_adv)


def test_on_policy_untruncated_vtrace_is_the_n_step_return():
    x = random_inputs(seed=3)
    x["target_logp"] = x["behaviour_logp"].clone()  # pi = mu
    vs, _ = vtrace(**x, rho_bar=float("inf"), c_bar=float("inf"))
    r, d, boot = x["rewards"], x["discounts"], x["bootstrap"]
    t_len, b = r.shape
    for j in range(b):
        for s in range(t_len):
            ret, disc = 0.0, 1.0  # sum_t gamma^(t-s) r_t up to the episode end or T
            for t in range(s, t_len):
                ret += disc * r[t, j]
                disc *= d[t, j]
            ret += disc * boot[j]  # bootstraps only if no episode ended
            assert vs[s, j].item() == pytest.approx(ret.item(), rel=1e-9, abs=1e-9)


def test_unroll_messages_validate_and_stack(r, keys):
    cfg = ImpalaConfig(unroll=30, envs_per_actor=3)
    msg = impala_unrolls(cfg, r, keys)
    schema = unroll_schema((4,), "float32", 2, 30)
    out = decode(encode("impala.unrolls", msg), schema)
    assert out["obs"].shape == (31, 3, 4) and out["logits"].shape == (30, 3, 2)
    for name, bad, reason in [
        ("action", np.full((30, 3), 2, np.int32), "action. has values out of"),
        ("reward", np.zeros((29, 3), np.float32), "reward has shape"),
        ("obs", np.zeros((30, 3, 4), np.float32), "obs has shape"),
        ("truncated", np.ones((30, 3), bool), "final observation"),
        ("version", -1, "version. is -1, out of"),
    ]:
        with pytest.raises(CodecError, match=reason):
            decode(encode("impala.unrolls", {**msg, name: bad}), schema)
    # two entries stacked: truncation indices move to the second entry's columns
    m2 = {
        **msg,
        "trunc_idx": np.array([[4, 1]], np.int32),
        "trunc_obs": np.ones((1, 4), np.float32),
        "truncated": np.zeros((30, 3), bool),
    }
    m2["truncated"][4, 1] = True
    b = stack_unrolls([Entry("1-0", msg), Entry("2-0", m2)], torch.device("cpu"))
    assert b.obs.shape == (31, 6, 4) and b.action.shape == (30, 6)
    assert b.trunc_idx.tolist()[-1] == [4, 4] and b.done[4, 4]


def test_learner_drops_unrolls_beyond_max_policy_lag(r, keys, redis_server):
    cfg = ImpalaConfig(envs_per_actor=4, batch_unrolls=8, max_policy_lag=5, unroll=10)
    create_run(r, keys, "impala", cfg)
    lrn = make_learner(redis_server.url, keys, cfg)
    lrn.updates = 100
    lrn.publisher.weights.publish(lrn.net, version=100)
    for version in (10, 98):  # one entry far too old, one fresh
        r.xadd(
            trajectories(keys),
            {"d": encode("impala.unrolls", impala_unrolls(cfg, r, keys, version))},
        )
    assert run_role(lrn, r, keys, 0, lambda: False, limit=1) == 1
    assert lrn.source.source.admit.dropped == 4  # the old entry's 4 unrolls
    assert r.xlen(trajectories(keys)) == 0 and r.xpending(trajectories(keys), GROUP)["pending"] == 0
    assert lrn.publisher.weights.version() == 101


def test_learner_reuses_a_batch_only_while_no_fresh_one_waits(r, keys, redis_server):
    cfg = ImpalaConfig(envs_per_actor=4, batch_unrolls=4, unroll=10, passes=3)
    create_run(r, keys, "impala", cfg)
    lrn = make_learner(redis_server.url, keys, cfg)
    stream = trajectories(keys)
    for _ in range(2):
        r.xadd(stream, {"d": encode("impala.unrolls", impala_unrolls(cfg, r, keys))})
    lrn.source.start(lrn.fail)
    try:
        loaded = lambda: [g["pending"] for g in r.xinfo_groups(stream)] == [2]  # noqa: E731
        wait_until(loaded, "both entries loaded")
        before = [p.detach().clone() for p in lrn.net.parameters()]
        for fresh, left in ((True, 1), (True, 0), (False, 0), (False, 0)):
            if fresh:  # a fresh batch waits: no reuse of the first
                wait_until(lrn.source.feed.waiting, "the batch loaded")
            assert fresh == lrn.source.feed.waiting()
            batch = lrn.source.next(5, lrn.updates)
            assert batch is not None and (batch.slot is not None) == fresh
            assert np.isfinite(lrn.train(batch))
            # acknowledged once, after the first pass (by the loader, within 0.1 s)
            wait_until(lambda left=left: r.xlen(stream) == left, "acknowledged")
        assert lrn.source.next(0.5, lrn.updates) is None  # the second batch had its three passes
        assert lrn.source.reused == 2 and lrn.updates == 4
        assert int(lrn.opt.state[next(lrn.net.parameters())]["step"]) == 4
        assert any(not torch.equal(a, b) for a, b in zip(before, lrn.net.parameters(), strict=True))
    finally:
        lrn.source.stop()
    assert r.xpending(stream, GROUP)["pending"] == 0


def test_a_reused_batch_is_its_own_copy_once_its_slot_goes_back(r, keys, redis_server):
    """On CPU a batch's tensors are views of its ring slot; the slot is filled again after
    the first pass, so the batch kept for more passes is a copy, unchanged by the next."""
    cfg = ImpalaConfig(envs_per_actor=4, batch_unrolls=4, unroll=10, passes=2)
    create_run(r, keys, "impala", cfg)
    lrn = make_learner(redis_server.url, keys, cfg)
    lrn.source.start(lrn.fail)
    try:
        msg = impala_unrolls(cfg, r, keys)
        r.xadd(trajectories(keys), {"d": encode("impala.unrolls", msg)})
        batch = lrn.source.next(10, lrn.updates)
        assert batch is not None and batch.slot is not None
        np.testing.assert_array_equal(batch.obs.numpy(), msg["obs"])
        lrn.train(batch)
        again = lrn.source.again
        assert again is not None and again.slot is None
        other = {**msg, "obs": msg["obs"] + 1}  # fills the slot the first batch was in
        r.xadd(trajectories(keys), {"d": encode("impala.unrolls", other)})
        wait_until(lrn.source.feed.waiting, "the next batch loaded")
        np.testing.assert_array_equal(again.obs.numpy(), msg["obs"])
    finally:
        lrn.source.stop()


def test_the_loader_pays_one_round_trip_a_batch():
    """Far from Redis each round trip is the loader's time (at 5 ms it held the learner and
    the actors back): a slot given back is acknowledged in the round trip of the read that
    fills it again, so a batch costs one round trip, where it took two."""
    cfg = ImpalaConfig(envs_per_actor=4, batch_unrolls=8, unroll=10, claim_idle_ms=3_600_000)
    keys = RunKeys("loader")
    with EmbeddedRedis() as server, redis.Redis.from_url(server.url) as r:  # no other client
        create_run(r, keys, "impala", cfg)
        stream, source = trajectories(keys), make_learner(server.url, keys, cfg).source.source
        entry = {"d": encode("impala.unrolls", impala_unrolls(cfg, r, keys))}
        for _ in range(2 * (SLOTS + 1)):  # two entries a batch: every slot's, and one more
            r.xadd(stream, entry)
        source.start(lambda what: pytest.fail(what))
        try:
            batches = [source.take(10) for _ in range(SLOTS)]  # every slot in our hands
            assert all(b is not None for b in batches)
            source.used(batches[0])  # (the scripts loaded at their first run)
            batches.append(source.take(10))
            wait_until(lambda: r.xlen(stream), "the acknowledgement", until=lambda n: n == 8)
            for b in batches[1:]:
                r.xadd(stream, entry)
                r.xadd(stream, entry)
                before = reads_of(r)
                source.used(b)
                assert source.take(10) is not None  # the loader waits for a slot again
                assert reads_of(r) - before == 2  # its read with the acknowledgement, INFO
                assert r.xlen(stream) == 2 * SLOTS  # the given-back batch's entries gone
        finally:
            source.stop()


@pytest.mark.slow
def test_train_impala_cli_learns_cartpole(tmp_path):
    run_dir = tmp_path / "run"
    result = train(
        "impala",
        run_dir,
        "--env",
        "CartPole-v1",
        "--seed",
        "0",
        "--target-return",
        "200",
        "--max-time",
        "120",
    )
    assert result["reached"] and result["eval_return"] >= 200  # random play scores ~22
    assert "impala step" in eval_confirmation(run_dir)


def test_non_finite_loss_publishes_nothing_and_does_not_loop(r, keys, redis_server):
    cfg = ImpalaConfig(envs_per_actor=4, batch_unrolls=4, unroll=10)
    create_run(r, keys, "impala", cfg)
    lrn = make_learner(redis_server.url, keys, cfg)
    lrn.publisher.weights.publish(lrn.net, version=0)
    with torch.no_grad():
        next(lrn.net.parameters()).fill_(float("nan"))  # a diverged learner
    for _ in range(3):
        r.xadd(trajectories(keys), {"d": encode("impala.unrolls", impala_unrolls(cfg, r, keys))})
    stop_at = [0]

    def stop() -> bool:  # run until the three batches were all skipped, or give up
        stop_at[0] += 1
        return lrn.skipped >= 3 or stop_at[0] > 2000

    assert run_role(lrn, r, keys, 0, stop) == 0
    assert lrn.skipped == 3 and lrn.updates == 0
    assert lrn.publisher.weights.version() == 0  # the NaN weights were never published
    # the skipped unrolls were consumed once, not redelivered forever
    assert r.xlen(trajectories(keys)) == 0 and r.xpending(trajectories(keys), GROUP)["pending"] == 0


class EndsAfter(gym.Env):
    """Observation ``[k, 0, 0, 0]`` at step k, reward 1, terminated after ``end`` steps."""

    observation_space = gym.spaces.Box(-100.0, 100.0, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, end: int) -> None:
        self.end, self.k = end, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.k = 0
        return np.zeros(4, np.float32), {}

    def step(self, action):
        self.k += 1
        return np.array([self.k, 0, 0, 0], np.float32), 1.0, self.k >= self.end, False, {}


# both end every episode after 3 steps by the time limit; one also terminates there
ENDS_AT_LIMIT, CUT_BY_LIMIT = "QrlTestEndsAtLimit-v0", "QrlTestCutByLimit-v0"
for _id, _end in ((ENDS_AT_LIMIT, 3), (CUT_BY_LIMIT, 100)):
    if _id not in gym.registry:
        gym.register(_id, entry_point=lambda end=_end: EndsAfter(end), max_episode_steps=3)


@pytest.mark.parametrize("env_id", [ENDS_AT_LIMIT, CUT_BY_LIMIT])
def test_a_terminal_step_at_the_time_limit_does_not_bootstrap(r, keys, redis_server, env_id):
    """gymnasium's TimeLimit says truncated=True on the limit's step even when the episode
    terminated there: termination wins, the target is the reward alone."""
    cfg = ImpalaConfig(env=env_id, unroll=7, envs_per_actor=2, batch_unrolls=2)
    create_run(r, keys, "impala", cfg)
    msg = impala_unrolls(cfg, r, keys)
    lrn = make_learner(redis_server.url, keys, cfg)
    entry = Entry("1-0", decode(encode("impala.unrolls", msg), lrn.source.source.spec.schema()))
    b = stack_unrolls([entry], lrn.device)
    ends = np.zeros((7, 2), bool)
    ends[[2, 5]] = True  # steps 3 and 6 of the unroll end an episode
    assert (msg["truncated"] | msg["terminated"]).tolist() == ends.tolist()
    assert b.done.numpy().tolist() == ends.tolist()
    reward = b.rewards(lrn.net, cfg.reward_scale, cfg.gamma)
    plain = torch.full((7, 2), cfg.reward_scale)
    if env_id == ENDS_AT_LIMIT:
        assert msg["terminated"].tolist() == ends.tolist()
        assert torch.equal(reward, plain)  # r alone: no gamma V(final obs)
    else:  # cut by the limit only: bootstraps from the final observation
        assert not msg["terminated"].any()
        with torch.no_grad():
            _, v_final = lrn.net(torch.tensor([[3.0, 0, 0, 0]] * 4))
        torch.testing.assert_close(reward[ends], plain[ends] + cfg.gamma * v_final)
        assert torch.equal(reward[~ends], plain[~ends])


def test_learner_fails_loudly_when_its_loader_dies(r, keys, redis_server):
    """A SIGKILLed loader process stops the learner with a message that names it (the role
    then exits non-zero); its entries stay pending in the group for a restarted learner."""
    cfg = ImpalaConfig(envs_per_actor=4, batch_unrolls=4, unroll=10)
    create_run(r, keys, "impala", cfg)
    lrn = make_learner(redis_server.url, keys, cfg)
    msg = encode("impala.unrolls", impala_unrolls(cfg, r, keys))
    for _ in range(3):
        r.xadd(trajectories(keys), {"d": msg})
    assert "loader process (exit code -9)" in kill_feed_mid_run(lrn, r, keys, 1)
