"""Ape-X DPG (issue 16): the critic target, Polyak averaging, action scaling and clipping,
the schema's action bounds, priorities through the real replay, and a short training run."""

import os

import numpy as np
import pytest
import torch

from qrl.actors.replay import NStep, spread
from qrl.algos.apex_dpg.config import ApexDPGConfig
from qrl.algos.apex_dpg.dpg import (
    ActorCritic,
    critic_target,
    explore,
    polyak,
    scale_action,
    unscale_action,
)
from qrl.algos.apex_family.messages import experience_schema
from qrl.replay.role import make_replay
from qrl.runtime.runs import create_run
from qrl.wire.codec import CodecError, decode, encode
from tests.cli import eval_confirmation, qrl, train
from tests.helpers import experience, fill_replay, make_learner, not_none, wait_until

LOW, HIGH = np.array([-2.0, 0.0], np.float32), np.array([2.0, 1.0], np.float32)


def test_critic_target_bootstraps_n_step_returns_unless_terminal():
    """NStep with vector actions, then the TD3 target: a terminal transition's target is its
    n-step return; a truncated one bootstraps with gamma^k min(Q1', Q2')(s', pi'(s'))."""
    gamma, n = 0.9, 3
    ns = NStep(2, n, gamma)
    out, slots = [], []
    for t in range(4):  # env 0 (reward 1) terminates at t=3, env 1 (reward 2) is truncated
        last = t == 3
        out += ns.add(
            np.full((2, 3), t, np.float32),
            np.full((2, 2), 0.1 * t, np.float32),
            np.array([1.0, 2.0]),
            np.full((2, 3), t + 1, np.float32),
            np.array([last, False]),
            np.array([False, last]),
        )
        slots += ns.slots
    assert len(out) == 8  # one full window each at t=2, then the rest when the episodes end
    obs, act, ret, disc, nxt = (np.asarray(x) for x in zip(*out, strict=True))
    assert act.shape == (8, 2) and act[0] == pytest.approx([0.0, 0.0])  # vectors kept
    torch.manual_seed(0)
    target = ActorCritic((3,), 2, (16,))
    y = critic_target(
        target,
        torch.from_numpy(ret.astype(np.float32)),
        torch.from_numpy(disc.astype(np.float32)),
        torch.from_numpy(nxt),
        noise=0.0,
        noise_clip=0.5,
    ).numpy()
    with torch.no_grad():
        nxt_t = torch.from_numpy(nxt)
        q1, q2 = target.critic(nxt_t, target.actor(nxt_t))
        boot = torch.min(q1, q2).numpy()
    for i, env in enumerate(slots):
        t, k = int(obs[i][0]), int(nxt[i][0]) - int(obs[i][0])
        reward = 1.0 if env == 0 else 2.0
        assert ret[i] == pytest.approx(reward * sum(gamma**j for j in range(k)))
        terminal = env == 0 and t + k == 4
        assert disc[i] == pytest.approx(0.0 if terminal else gamma**k)
        want = ret[i] + (0.0 if terminal else gamma**k * boot[i])
        assert y[i] == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert (disc == 0).sum() == 3 and sorted(slots) == [0] * 4 + [1] * 4


def test_target_policy_smoothing_noise_is_clipped():
    torch.manual_seed(0)
    target = ActorCritic((3,), 1, (16,))
    nxt = torch.zeros(4096, 3)
    ret, disc = torch.zeros(4096), torch.ones(4096)
    y = critic_target(target, ret, disc, nxt, noise=100.0, noise_clip=0.05)
    with torch.no_grad():
        a0 = target.actor(nxt[:1])
        grid = (a0 + torch.linspace(-0.05, 0.05, 201)[:, None]).clamp(-1, 1)
        q1, q2 = target.critic(torch.zeros(201, 3), grid)
        reachable = torch.min(q1, q2)
    assert reachable.min() - 1e-5 <= y.min() and y.max() <= reachable.max() + 1e-5
    assert y.std() > 0  # noise was added


def test_polyak_update_moves_targets_by_tau():
    source, target = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in source.parameters():
            p.fill_(1.0)
        for p in target.parameters():
            p.fill_(0.0)
    polyak(target, source, 0.1)
    assert all(torch.allclose(p, torch.full_like(p, 0.1)) for p in target.parameters())
    polyak(target, source, 0.1)
    assert all(torch.allclose(p, torch.full_like(p, 0.19)) for p in target.parameters())
    polyak(target, source, 1.0)
    pairs = zip(target.parameters(), source.parameters(), strict=True)
    assert all(torch.equal(p, s) for p, s in pairs)


def test_actions_scale_to_the_bounds_and_clip_there():
    a = np.array([[-1.0, -1.0], [1.0, 1.0], [0.0, 0.0], [5.0, -7.0]], np.float32)
    out = scale_action(a, LOW, HIGH)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [[-2, 0], [2, 1], [0, 0.5], [2, 0]])
    back = unscale_action(torch.from_numpy(out), torch.from_numpy(LOW), torch.from_numpy(HIGH))
    np.testing.assert_allclose(back.numpy(), [[-1, -1], [1, 1], [0, 0], [1, -1]], atol=1e-6)
    noisy = explore(np.zeros((1000, 2)), np.full(1000, 10.0), np.random.default_rng(0))
    assert noisy.min() == -1.0 and noisy.max() == 1.0  # huge noise: clipped, both ends hit
    quiet = explore(np.zeros((1000, 2)), np.full(1000, 1e-3), np.random.default_rng(0))
    assert 0 < np.abs(quiet).max() < 0.01
    scaled = scale_action(noisy, LOW, HIGH)
    assert (scaled >= LOW).all() and (scaled <= HIGH).all()


def test_per_actor_noise_scales_spread_like_ape_x_epsilons():
    cfg = ApexDPGConfig(actors=2, envs_per_actor=4, noise_base=0.5, noise_alpha=3.0)
    sigma = np.concatenate([spread(0.5, 3.0, cfg, 0), spread(0.5, 3.0, cfg, 1)])
    np.testing.assert_allclose(sigma, 0.5 ** (1 + np.arange(8) * 3 / 7))


def _experience(action: np.ndarray) -> dict:
    return experience(np.zeros((len(action), 3), np.float32), action)  # Pendulum's


def test_schema_bounds_each_action_dimension():
    schema = experience_schema((3,), "float32", 0, max_rows=8, action_bounds=(LOW, HIGH))
    ok = np.array([[-2.0, 0.0], [2.0, 1.0]], np.float32)
    assert decode(encode("apex.experience", _experience(ok)), schema)["action"].shape == (2, 2)
    bad = {
        "below low": np.array([[-2.1, 0.5]], np.float32),
        "above this dimension's high": np.array([[0.0, 1.5]], np.float32),  # < other's high
        "not finite": np.array([[np.nan, 0.5]], np.float32),
        "wrong width": np.zeros((1, 3), np.float32),
        "discrete": np.zeros(1, np.int32),
    }
    for what, action in bad.items():
        with pytest.raises(CodecError):
            decode(encode("apex.experience", _experience(action)), schema)
            pytest.fail(f"an action {what} was accepted")


def test_learner_priorities_are_the_critic_td_errors(r, keys, redis_server):
    """Transitions go through the real replay (float action vectors in the records), the
    learner's sampler draws them with IS weights, and the priorities it writes back are
    Q1's |TD error| against the smoothed twin target."""

    cfg = ApexDPGConfig(learning_starts=100, batch_size=32, target_noise=0.0)
    create_run(r, keys, "apex-dpg", cfg)
    replay = make_replay(r, keys, cfg)
    assert replay.layout.dtype["action"].shape == (1,)
    rng = np.random.default_rng(0)
    obs = rng.standard_normal((200, 3)).astype(np.float32)
    act = rng.uniform(-2, 2, (200, 1)).astype(np.float32)
    ret = rng.standard_normal(200).astype(np.float32)
    disc = np.where(np.arange(200) % 2, 0.0, 0.97).astype(np.float32)
    fill_replay(replay, obs, act, ret, disc, priority=np.full(200, 1000.0))
    lrn = make_learner(redis_server.url, keys, cfg)
    lrn.source.start(lrn.fail)
    try:
        b = wait_until(lambda: lrn.source.next(1.0, 0), "a batch", until=not_none, every=0)
        assert b.action.dtype == torch.float32 and b.action.shape == (32, 1)
        i = [int(x) for x in b.ids]
        np.testing.assert_allclose(b.action.numpy(), act[i])
        with torch.no_grad():
            a = torch.from_numpy(act[i] / 2.0)  # Pendulum's bounds are +-2
            q1, _ = lrn.net.critic(torch.from_numpy(obs[i]), a)
            nxt = torch.from_numpy(obs[i])
            t1, t2 = lrn.rule.target.critic(nxt, lrn.rule.target.actor(nxt))
            y = torch.from_numpy(ret[i]) + torch.from_numpy(disc[i]) * torch.min(t1, t2)
            want = (y - q1).abs().numpy()
            given = lrn.rule.loss(b, 0).priorities  # returned by the loss, for the replay
        np.testing.assert_allclose(given.numpy(), want, rtol=1e-4, atol=1e-4)
        assert np.isfinite(lrn.train(b))  # the update, then the slot back with the priorities
    finally:
        lrn.source.stop()  # writes the priorities given back
    got = np.array(r.zmscore(keys.replay_priorities, b.ids))
    np.testing.assert_allclose(got, want + 1e-6, rtol=1e-4, atol=1e-4)
    assert set(lrn.rule.published().state_dict()) == {
        k for k in lrn.net.state_dict() if k.startswith("actor.")
    }


def test_apex_dpg_takes_box_actions_only(tmp_path):
    out = qrl("train", "apex-dpg", "--env", "CartPole-v1", "--run-dir", str(tmp_path / "c"))
    assert out.returncode != 0 and "continuous" in out.stderr and "discrete" in out.stderr
    assert not (tmp_path / "c" / "result.json").exists()
    out = qrl("train", "apex", "--env", "Pendulum-v1", "--run-dir", str(tmp_path / "p"))
    assert out.returncode != 0 and "continuous" in out.stderr


# the Pendulum run's budget: seeds 0-1 reach -400 in ~3,600 env steps (20 s here); steps, not
# seconds, so a slow or loaded machine has the same budget
PENDULUM_STEPS = 20_000


@pytest.fixture(scope="module")
def pendulum_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("apex-dpg") / "run"
    result = train(
        "apex-dpg",
        run_dir,
        "--env",
        "Pendulum-v1",
        "--seed",
        "0",
        "--target-return",
        "-400",  # random play: about -1200
        "--max-steps",
        str(PENDULUM_STEPS),
        "--eval-every",
        "5",
    )
    return result, run_dir


@pytest.mark.slow
def test_train_apex_dpg_learns_pendulum(pendulum_run):
    result, run_dir = pendulum_run
    assert result["reached"] and result["eval_return"] >= -400, result
    assert result["updates"] > 0 and result["env_steps"] < PENDULUM_STEPS  # stopped on reaching
    eval_confirmation(run_dir)


@pytest.mark.slow
def test_load_policy_acts_within_the_bounds(pendulum_run):
    import qrl as qrl_api

    _, run_dir = pendulum_run
    policy = qrl_api.load_policy(run_dir)
    assert policy.algo == "apex-dpg" and policy.env_id == "Pendulum-v1"
    one = policy.predict(np.array([1.0, 0.0, 0.0], np.float32))
    assert one.shape == (1,) and -2.0 <= one[0] <= 2.0
    batch = policy.predict(np.random.default_rng(0).uniform(-8, 8, (64, 3)).astype(np.float32))
    assert batch.shape == (64, 1) and (np.abs(batch) <= 2.0).all()
    assert os.path.exists(run_dir / "checkpoint.pt")


def test_reaching_actor_weights_replace_only_the_actor_in_the_checkpoint(tmp_path):
    from qrl.runtime.checkpoint import (
        CheckpointError,
        load_checkpoint,
        replace_model,
        save_checkpoint,
    )

    net, reached = ActorCritic((3,), 1, (8,)), ActorCritic((3,), 1, (8,))
    path = tmp_path / "c.pt"
    save_checkpoint(path, "apex-dpg", ApexDPGConfig(), net, None, 90)
    actor = {k: v.numpy() for k, v in reached.state_dict().items() if k.startswith("actor.")}
    replace_model(path, actor, 50)
    model = load_checkpoint(path)["model"]
    for k, v in net.state_dict().items():
        want = actor[k] if k.startswith("actor.") else v.numpy()
        np.testing.assert_array_equal(model[k].numpy(), want)
    with pytest.raises(CheckpointError, match="do not match"):
        replace_model(path, {"actor.mu.bias": actor["actor.mu.bias"]}, 60)  # part of a part
