"""R2D2 (issue 17): the value rescaling and its inverse, n-step double-Q targets over
sequences against a plain loop, sequence cutting and masks at episode ends, the stored LSTM
state through the codec and the (sharded) replay, the priority mix, hostile sequence
payloads and the velocity-hidden CartPole (the roles and whole runs: test_r2d2_roles.py)."""

import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from qrl.algos.r2d2.config import R2D2Config
from qrl.algos.r2d2.rule import (
    Rule,
    Sequences,
    n_step_targets,
    rule_of,
    sequence_loss,
    sequence_priority,
    sequence_td,
    value_rescale,
    value_rescale_inv,
)
from qrl.replay.role import make_replay
from qrl.replay.sequences import SequenceFiller, Sequencer, max_rows, sequence_spec, stack
from qrl.replay.shards import ShardedReplay
from qrl.rl.envspec import EnvSpec
from qrl.rl.models import RecurrentQNetwork
from qrl.runtime.config import ConfigError, parse_config
from qrl.runtime.runs import create_run
from qrl.wire.codec import CodecError, decode, encode
from tests.cli import ROOT
from tests.helpers import random_sequences, sequence_message

LSTM = 8


@pytest.mark.parametrize("eps", [1e-3, 1e-2, 0.0])
def test_value_rescaling_and_its_inverse(eps):
    x = torch.cat([torch.linspace(-1e4, 1e4, 2001, dtype=torch.float64), torch.zeros(1)])
    hx = value_rescale(x, eps)
    torch.testing.assert_close(value_rescale_inv(hx, eps), x, rtol=1e-9, atol=1e-7)
    torch.testing.assert_close(value_rescale(value_rescale_inv(x, eps), eps), x)
    assert value_rescale(torch.tensor(3.0, dtype=torch.float64), eps) == pytest.approx(1 + 3 * eps)
    assert value_rescale(torch.tensor(-8.0, dtype=torch.float64), eps) == pytest.approx(
        -2 - 8 * eps
    )
    assert (hx[:-1].diff() > 0).all() and hx[-1] == 0  # increasing, h(0) = 0
    torch.testing.assert_close(value_rescale(-x, eps), -hx)  # odd


def _targets_by_loop(reward, steps, terminal, boot, n, gamma):
    """The definition, one step at a time."""
    b, t = reward.shape
    out = np.zeros((b, t))
    for i in range(b):
        for s in range(steps[i]):
            g, k = 0.0, s
            while k < steps[i] and k - s < n:
                g += gamma ** (k - s) * reward[i, k]
                k += 1
            if not (terminal[i] and k == steps[i]):
                g += gamma ** (k - s) * boot[i, k]
            out[i, s] = g
    return out


def test_n_step_targets_over_sequences_match_a_plain_loop():
    rng = np.random.default_rng(0)
    b, t = 64, 9
    reward = rng.standard_normal((b, t))
    steps = rng.integers(1, t + 1, b)
    steps[:4] = [t, t, 1, 2]
    terminal = rng.random(b) < 0.5
    boot = rng.standard_normal((b, t + 1))
    for n, gamma in ((1, 0.9), (3, 0.99), (5, 0.97), (20, 0.5)):
        got, valid = n_step_targets(
            torch.from_numpy(reward),
            torch.from_numpy(steps),
            torch.from_numpy(terminal),
            torch.from_numpy(boot),
            n,
            gamma,
        )
        want = _targets_by_loop(reward, steps, terminal, boot, n, gamma)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-10)
        np.testing.assert_array_equal(valid.numpy(), np.arange(t)[None] < steps[:, None])


def _episode_stream(sequencer, lengths, ends, h_of):
    """Play one env slot through episodes of ``lengths`` (ending ``terminated`` or
    ``truncated`` per ``ends``); observation = (episode, step), reward = step, action =
    step % 2, state = h_of(episode, step). Returns every sequence sent."""
    out = []
    for e, (n, how) in enumerate(zip(lengths, ends, strict=True)):
        for k in range(n):
            last = k == n - 1
            h = np.full((1, LSTM), h_of(e, k), np.float32)
            out += sequencer.add(
                np.array([[e, k]], np.float32),
                np.array([k % 2]),
                np.array([float(k)]),
                np.array([[e, k + 1]], np.float32),
                np.array([last and how == "terminated"]),
                np.array([last and how == "truncated"]),
                h,
                -h,
            )
            assert set(sequencer.slots) <= {0}
    return out


def test_sequences_overlap_and_are_cut_padded_and_masked_at_episode_ends():
    length, overlap = 6, 2  # a new sequence every 4 steps
    seq = Sequencer(1, length, overlap, (2,), "float32", LSTM)
    h_of = lambda e, k: (e * 100 + k) / 1000  # noqa: E731
    out = _episode_stream(seq, [14, 3, 6], ["terminated", "truncated", "terminated"], h_of)
    got = [(int(s["obs"][0, 0]), int(s["obs"][0, 1]), s["steps"]) for s in out]
    # episode 0 (14 steps): full sequences at steps 0-5, 4-9, then 8-13 cut by the end
    # (6 steps exactly), episode 1 (3 steps) one short one, episode 2 (6 steps) one full
    assert got == [(0, 0, 6), (0, 4, 6), (0, 8, 6), (1, 0, 3), (2, 0, 6)]
    assert [s["first"] for s in out] == [True, False, False, True, True]
    assert [s["terminal"] for s in out] == [False, False, True, False, True]
    for s in out:
        e, k0, n = int(s["obs"][0, 0]), int(s["obs"][0, 1]), s["steps"]
        np.testing.assert_array_equal(s["obs"][: n + 1, 1], np.arange(k0, k0 + n + 1))  # + final
        assert (s["obs"][n + 1 :] == 0).all() and (s["obs"][:, 0][: n + 1] == e).all()
        np.testing.assert_array_equal(s["reward"][:n], np.arange(k0, k0 + n))
        np.testing.assert_array_equal(s["action"][:n], np.arange(k0, k0 + n) % 2)
        assert (s["reward"][n:] == 0).all() and (s["action"][n:] == 0).all()  # padding
        assert (s["h0"] == np.float32(h_of(e, k0))).all() and (s["c0"] == -s["h0"]).all()
    short = out[3]
    assert short["steps"] == 3 and short["obs"][3].tolist() == [1, 3]  # truncated: final obs
    # the loss mask: real steps after the burn-in, or all of them when a sequence starts
    # an episode (its stored state, zeros, is exact)
    s = Sequences.of(stack(out))
    rule = Rule(n=2, gamma=0.9, burn_in=2, rescale_eps=1e-3, eta=0.9)
    net = RecurrentQNetwork((2,), 2, (8,), LSTM)
    s.h0.zero_(), s.c0.zero_()
    _, _, mask = sequence_td(net, net, s, rule)
    want = [
        [True] * 6,
        [False] * 2 + [True] * 4,
        [False] * 2 + [True] * 4,
        [True] * 3 + [False] * 3,
        [True] * 6,
    ]
    assert mask.tolist() == want


def test_sequences_from_several_env_slots_carry_their_slots():
    seq = Sequencer(3, 4, 1, (1,), "float32", LSTM)
    zeros = np.zeros((3, LSTM), np.float32)
    sent = []
    for k in range(6):
        ended = np.array([k == 1, False, False])
        obs, nxt = np.full((3, 1), k, np.float32), np.full((3, 1), k + 1, np.float32)
        out = seq.add(
            obs, np.zeros(3, int), np.ones(3), nxt, ended, np.zeros(3, bool), zeros, zeros
        )
        sent += list(zip(seq.slots, [s["steps"] for s in out], strict=True))
    assert sent == [(0, 2), (1, 4), (2, 4), (0, 4)]


def _unroll_by_steps(net, s):
    """Q-values one LSTM step at a time from the stored state: [B, T + 1, A]."""
    state, qs = (s.h0, s.c0), []
    for k in range(s.obs.shape[1]):
        q, state = net(s.obs[:, k : k + 1], state)
        qs.append(q[:, 0])
    return torch.stack(qs, dim=1)


def test_double_q_targets_unroll_from_the_stored_state_and_rescale():
    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    net, target = RecurrentQNetwork((3,), 2, (8,), LSTM), RecurrentQNetwork((3,), 2, (8,), LSTM)
    s = Sequences.of(random_sequences(rng, 16, 7))
    rule = Rule(n=3, gamma=0.95, burn_in=2, rescale_eps=1e-3, eta=0.9)
    q_taken, y, mask = sequence_td(net, target, s, rule)
    with torch.no_grad():
        q, qt = _unroll_by_steps(net, s), _unroll_by_steps(target, s)
    np.testing.assert_allclose(
        q_taken.detach().numpy(),
        q[:, :-1].gather(-1, s.action[..., None])[..., 0].numpy(),
        rtol=1e-5,
        atol=1e-6,
    )
    boot = value_rescale_inv(qt.gather(-1, q.argmax(-1, keepdim=True))[..., 0], 1e-3)
    want = _targets_by_loop(
        s.reward.numpy(), s.steps.numpy(), s.terminal.numpy(), boot.numpy(), 3, 0.95
    )
    want = value_rescale(torch.from_numpy(want), 1e-3).numpy()
    np.testing.assert_allclose(
        np.where(mask, y.numpy(), 0), np.where(mask, want, 0), rtol=1e-4, atol=1e-5
    )


def test_burn_in_passes_no_gradient_unless_the_sequence_starts_an_episode():
    """A sequence that starts mid-episode only warms its stored state up in the burn-in:
    no gradient reaches its burn-in observations, and the parameters get the gradient of a
    burn-in unrolled without one. A sequence that starts an episode trains on every step."""
    torch.manual_seed(0)
    rng = np.random.default_rng(2)
    net, target = RecurrentQNetwork((3,), 2, (8,), LSTM), RecurrentQNetwork((3,), 2, (8,), LSTM)
    s = Sequences.of({**random_sequences(rng, 6, 7), "steps": np.full(6, 7, np.int32)})
    s.first[:] = torch.tensor([False, True, False, False, True, False])
    s.obs.requires_grad_(True)
    burn = 3
    rule = Rule(n=2, gamma=0.95, burn_in=burn, rescale_eps=1e-3, eta=0.9)
    q, y, mask = sequence_td(net, target, s, rule)
    sequence_loss(q, y, mask, torch.ones(6)).backward()
    later, first = ~s.first, s.first
    assert (s.obs.grad[later, :burn] == 0).all()
    assert (s.obs.grad[later, burn:7] != 0).any() and (s.obs.grad[first, :burn] != 0).any()
    # the parameters' gradient from the later sequences alone: that of a stop-gradient burn-in
    net.zero_grad()
    sub = Sequences(**{k: getattr(s, k)[later].detach() for k in vars(s)})
    q, y, mask = sequence_td(net, target, sub, rule)
    sequence_loss(q, y, mask, torch.ones(len(q))).backward()
    got = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    with torch.no_grad():
        _, state = net(sub.obs[:, :burn], (sub.h0, sub.c0))
    q_rest, _ = net(sub.obs[:, burn:], state)
    q_ref = q_rest[:, :-1].gather(-1, sub.action[:, burn:, None])[..., 0]
    sequence_loss(q_ref, y[:, burn:], mask[:, burn:], torch.ones(len(q))).backward()
    for a, p in zip(got, net.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-7)


def test_sequence_priority_mixes_max_and_mean_over_the_masked_steps():
    delta = torch.tensor([[1.0, -3.0, 2.0, 100.0], [-0.5, 0.5, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[True, True, True, False], [True, False, False, False], [False] * 4])
    p = sequence_priority(delta, mask, 0.9)
    np.testing.assert_allclose(p.numpy(), [0.9 * 3 + 0.1 * 2, 0.5, 0.0], rtol=1e-6)
    np.testing.assert_allclose(sequence_priority(delta, mask, 0.0).numpy()[:2], [2.0, 0.5])


def test_stored_state_round_trips_through_the_codec_and_the_replay(r, keys):
    """Sequences -> message -> decode (validated) -> filler records -> replay -> sample:
    every field, the LSTM state bit for bit."""
    cfg = R2D2Config(sequence_length=7, overlap=2, burn_in=2, lstm=LSTM, env="qrl/CartPoleNoVel-v1")
    create_run(r, keys, "r2d2", cfg)
    rng = np.random.default_rng(2)
    batch = random_sequences(rng, 12, 7, obs_dim=2)
    layout, schema = sequence_spec(cfg, EnvSpec.of(cfg.env), max_rows(cfg))
    msg = decode(encode("r2d2.sequences", sequence_message(batch)), schema)
    filler = SequenceFiller(r, keys, cfg)
    records = filler.records(msg)
    assert len(records) == 12 and {len(x) for x in records} == {layout.size}
    replay = make_replay(r, keys, cfg, layout=layout)
    replay.insert(records, np.arange(1, 13, dtype=np.float64), batch_id="b1")
    assert replay.size() == 12  # one replay item per sequence
    sample = replay.sample(64)
    order = [int(i) for i in sample.ids]
    for name, value in batch.items():
        np.testing.assert_array_equal(sample.batch[name], value[order], err_msg=name)
    s = Sequences.of(sample.batch)
    assert s.h0.dtype == torch.float32 and torch.equal(s.h0, torch.from_numpy(batch["h0"][order]))


def test_sequences_in_a_sharded_replay(r, keys):
    cfg = R2D2Config(
        sequence_length=5, overlap=2, burn_in=2, lstm=LSTM, replay_shards=3, replay_capacity=30
    )
    layout, _ = sequence_spec(cfg, EnvSpec.of(cfg.env))
    rng = np.random.default_rng(3)
    for shard in range(3):
        b = random_sequences(rng, 4, 5, obs_dim=2)
        b["steps"][:] = shard + 1
        records = layout.pack_columns(**b)
        make_replay(r, keys, cfg, shard=shard, layout=layout).insert(records, np.ones(4))
    sharded = ShardedReplay(r, keys, layout, cfg.replay_capacity, shards=3, seed=0)
    assert sharded.size() == 12
    s = sharded.sample(60)
    assert {i.split(b":")[0] for i in s.ids} == {b"0", b"1", b"2"}
    for i, steps in zip(s.ids, s.batch["steps"], strict=True):
        assert int(i.split(b":")[0]) + 1 == steps


def test_hostile_sequences_are_rejected():
    cfg = R2D2Config(sequence_length=5, overlap=2, burn_in=2, lstm=LSTM)
    _, schema = sequence_spec(cfg, EnvSpec.of(cfg.env), max_rows=8)
    good = random_sequences(np.random.default_rng(4), 3, 5, obs_dim=2)
    msg = decode(encode("r2d2.sequences", sequence_message(good)), schema)
    assert msg["obs"].shape == (3, 6, 2)

    def bad(**change):
        return {**good, **change}

    nan_obs = good["obs"].copy()
    nan_obs[0, 0, 0] = np.nan
    short = {k: v.copy() for k, v in good.items()}  # row 0: 2 real steps, zeros after
    short["steps"][0] = 2
    short["action"][0, 2:], short["reward"][0, 2:], short["obs"][0, 3:] = 0, 0, 0
    assert decode(encode("r2d2.sequences", sequence_message(short)), schema)["steps"][0] == 2
    pad_reward, pad_action, pad_obs = (short[k].copy() for k in ("reward", "action", "obs"))
    pad_reward[0, 4], pad_action[0, 2], pad_obs[0, 5] = 1.0, 1, 1.0
    cases = {
        "NaN observation": bad(obs=nan_obs),
        "obs one step short": bad(obs=good["obs"][:, :5]),
        "obs of another width": bad(obs=np.zeros((3, 6, 3), np.float32)),
        "float64 obs": bad(obs=good["obs"].astype(np.float64)),
        "action out of range": bad(action=np.full((3, 5), 2, np.int32)),
        "int64 actions": bad(action=good["action"].astype(np.int64)),
        "reward beyond the bound": bad(reward=np.full((3, 5), 1e7, np.float32)),
        "steps 0": bad(steps=np.zeros(3, np.int32)),
        "steps beyond the length": bad(steps=np.full(3, 6, np.int32)),
        "a padded reward": {**short, "reward": pad_reward},
        "a padded action": {**short, "action": pad_action},
        "a padded observation": {**short, "obs": pad_obs},
        "h0 outside [-1, 1]": bad(h0=np.full((3, LSTM), 1.5, np.float32)),
        "c0 infinite": bad(c0=np.full((3, LSTM), np.inf, np.float32)),
        "state of another size": bad(h0=np.zeros((3, LSTM + 1), np.float32)),
        "rows disagree": bad(terminal=np.zeros(2, bool)),
        "terminal not bool": bad(terminal=np.zeros(3, np.int32)),
    }
    for what, batch in cases.items():
        with pytest.raises(CodecError):
            decode(encode("r2d2.sequences", sequence_message(batch)), schema)
            pytest.fail(f"{what} was accepted")
    with pytest.raises(CodecError):
        decode(
            encode("r2d2.sequences", sequence_message(good, priority=np.full(3, -1, np.float32))),
            schema,
        )
    nine = {k: np.concatenate([v] * 3) for k, v in good.items()}
    with pytest.raises(CodecError, match="9 sequences"):
        decode(encode("r2d2.sequences", sequence_message(nine)), schema)


def test_config_refuses_a_burn_in_or_overlap_that_fills_the_sequence():
    with pytest.raises(ConfigError, match="burn_in"):
        parse_config(R2D2Config, {"sequence_length": 8, "burn_in": 8})
    with pytest.raises(ConfigError, match="overlap"):
        parse_config(R2D2Config, {"sequence_length": 8, "overlap": 8})


@settings(max_examples=150, deadline=None)
@given(
    length=st.integers(2, 24),
    overlap=st.integers(0, 23),
    burn_in=st.integers(0, 23),
    episodes=st.lists(
        st.tuples(st.integers(1, 70), st.sampled_from(["terminated", "truncated"])),
        min_size=1,
        max_size=4,
    ),
)
def test_every_step_is_in_some_loss_for_every_accepted_config(length, overlap, burn_in, episodes):
    """Sequences cut by the actors' Sequencer and masked by the learner's rule: every step
    of every episode is in the loss of some sequence, whatever config is accepted; the
    configs refused are exactly those whose burn-in is longer than the overlap."""
    try:
        cfg = R2D2Config(sequence_length=length, overlap=overlap, burn_in=burn_in)
    except ValidationError:
        assert burn_in > overlap or length <= max(overlap, burn_in)
        return
    seq = Sequencer(1, cfg.sequence_length, cfg.overlap, (2,), "float32", LSTM)
    lengths, ends = zip(*episodes, strict=True)
    s = Sequences.of(stack(_episode_stream(seq, list(lengths), list(ends), lambda e, k: 0.0)))
    net = RecurrentQNetwork((2,), 2, (4,), LSTM)
    _, _, mask = sequence_td(net, net, s, rule_of(cfg))
    covered = {tuple(map(int, s.obs[b, t])) for b, t in zip(*torch.nonzero(mask).T, strict=True)}
    assert covered == {(e, k) for e, n in enumerate(lengths) for k in range(n)}


def test_config_refuses_a_burn_in_longer_than_the_overlap():
    with pytest.raises(ConfigError, match="burn_in=8 .* overlap=4"):
        parse_config(R2D2Config, {"sequence_length": 20, "burn_in": 8, "overlap": 4})
    # the paper's Atari setting (docs/algorithms/r2d2.md)
    parse_config(R2D2Config, {"sequence_length": 80, "burn_in": 40, "overlap": 40})
    assert R2D2Config().burn_in <= R2D2Config().overlap


def test_cartpole_without_velocities():
    import qrl  # noqa: F401  (registers the env)

    env, full = gym.make("qrl/CartPoleNoVel-v1"), gym.make("CartPole-v1")
    obs, _ = env.reset(seed=3)
    ref, _ = full.reset(seed=3)
    assert env.observation_space.shape == (2,) and obs.dtype == np.float32
    np.testing.assert_array_equal(obs, ref[[0, 2]])
    for a in (0, 1, 1, 0, 1):
        obs, rew, *_ = env.step(a)
        ref, *_ = full.step(a)
        np.testing.assert_array_equal(obs, ref[[0, 2]])
    assert env.spec.max_episode_steps == 500 and env.spec.reward_threshold == 475.0
    code = "import gymnasium as g, qrl; print(g.make('qrl/CartPoleNoVel-v1').observation_space)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert "(2,)" in out.stdout, out.stderr
