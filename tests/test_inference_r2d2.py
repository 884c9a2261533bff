"""R2D2 with central inference on a real Redis: the server keeps each actor's LSTM state,
and every sequence it pushes to the replay's stream is a run of steps one env slot of one
actor process took, with the LSTM state that slot's episode had reached at its start
(recomputed here from what the actor saw); an actor that restarts starts fresh (its
half-built sequences dropped, never joined to the new process's steps)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qrl.actors.envs import EnvRunner
from qrl.algos.r2d2.builder import _q_network
from qrl.algos.r2d2.config import R2D2Config
from qrl.inference import protocol
from qrl.inference.sequences import SequenceAgent
from qrl.inference.server import InferenceServer
from qrl.inference.stepper import stepper
from qrl.replay.sequences import max_rows, sequence_spec
from qrl.rl.envspec import EnvSpec
from qrl.runtime.runs import create_run
from qrl.wire.codec import decode, encode
from qrl.wire.weights import WeightStore
from tests.helpers import wait_until
from tests.test_inference import TAU, _loop, _threads, kill_and_restart

B = 3
CFG = {
    "inference": "central",
    "env": "CartPole-v1",
    "actors": 2,
    "envs_per_actor": B,
    "sequence_length": 8,
    "overlap": 4,
    "burn_in": 2,
    "actor_batch": 4,
    "lstm": 16,
    "hidden": (16,),
    "steps_per_update": 0.0,
    "stream_maxlen": 100_000,
}


class _Recording(EnvRunner):
    """An actor's envs that keep what it saw, did, and which of its episodes ended."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.seen: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def step(self, actions):
        obs = np.array(self.obs)
        s = super().step(actions)
        self.seen.append((obs, np.array(actions), s.terminated | s.truncated))
        return s


def _recording(r, keys, cfg, ident: int):
    """A stepper whose envs (each batch's) keep what they saw, did, and which of their
    episodes ended."""
    runners = [_Recording(cfg, ident, batch=i) for i in range(cfg.inference_batches)]
    return stepper(r, keys, cfg, ident, runners=runners)


@torch.no_grad()
def _states(net, seen) -> list[np.ndarray]:
    """The LSTM state ``h`` each step of ``seen`` was acted in (zeros at episode starts)."""
    h, c = net.initial_state(B)
    out = []
    for obs, _, ended in seen:
        out.append(h.numpy().copy())
        _, (h, c) = net(torch.from_numpy(obs)[:, None], (h, c))
        keep = torch.from_numpy(~ended)[:, None]
        h, c = h * keep, c * keep
    return out


def _find(seq: dict, seen) -> tuple[int, int] | None:
    """The (step, slot) of ``seen`` where ``seq``'s steps are, if they are a run there."""
    n = int(seq["steps"])
    for t in range(len(seen) - n + 1):
        for j in range(B):
            if all(
                np.array_equal(seen[t + i][0][j], seq["obs"][i])
                and seen[t + i][1][j] == seq["action"][i]
                for i in range(n)
            ):
                return t, j
    return None


def _steps_of(actor, n: int) -> None:
    stop, threads = _threads(_loop(actor))
    try:
        wait_until(lambda: actor.steps >= n * B, f"{n} steps of an actor", 60)
    finally:
        stop.set()
        threads[0].join(10)


def test_r2d2_sequences_are_one_slots_steps_with_their_lstm_state(r, keys, redis_server):
    cfg = R2D2Config(**CFG)
    create_run(r, keys, "r2d2", cfg)
    env = EnvSpec.of(cfg.env)
    net = _q_network(cfg, env)
    WeightStore(r, keys).publish(net, version=0)
    agent = SequenceAgent(r, keys, cfg, 0, env, _q_network(cfg, env), torch.device("cpu"))
    server = InferenceServer(r, keys, cfg, 0, agent, device="cpu")
    other = _recording(r, keys, cfg, 1)
    lives = [_recording(r, keys, cfg, 0), _recording(r, keys, cfg, 0)]  # one process, restarted
    stop, threads = _threads(_loop(server), _loop(other))
    try:
        for actor in lives:  # the first one stops mid-sequence; the second starts afresh
            _steps_of(actor, 60)
        wait_until(lambda: other.steps >= 60 * B, "the other actor to step", 60)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    _, schema = sequence_spec(cfg, env, max_rows(cfg))
    found = {id(a): 0 for a in (*lives, other)}
    # each env batch of each actor process: its steps and the LSTM state of each
    batches = {id(a): [(x.seen, _states(net, x.seen)) for x in a.runners] for a in (*lives, other)}
    for _, fields in r.xrange(keys.experience):
        msg = decode(fields[b"d"], schema)
        mine = [other] if msg["actor"] == 1 else lives
        for k in range(len(msg["steps"])):
            seq = {f: msg[f][k] for f in ("obs", "action", "steps", "h0", "first")}
            where = [
                (a, seen, states, w)
                for a in mine
                for seen, states in batches[id(a)]
                if (w := _find(seq, seen)) is not None
            ]
            assert where, f"a sequence of actor {msg['actor']} is no run of its steps"
            actor, seen, states, (t, j) = where[0]
            start = t == 0 or seen[t - 1][2][j]
            assert bool(seq["first"]) == start
            np.testing.assert_allclose(seq["h0"], states[t][j], atol=1e-5)
            found[id(actor)] += 1
    assert all(found.values()), "sequences of each actor process"
    assert server.dropped >= 1  # the first process's half-built sequences


def test_an_actor_met_mid_episode_starts_no_sequence_as_an_episodes_first(r, keys):
    """A server that meets an actor past its first request (the server restarted, or
    requests were lost) holds zeros for a state it never saw: those sequences are not
    marked as starting an episode (the learner trusts a first sequence's state as exact)."""
    cfg = R2D2Config(**CFG)
    env = EnvSpec.of(cfg.env)
    agent = SequenceAgent(r, keys, cfg, 0, env, _q_network(cfg, env), torch.device("cpu"))
    req = {"actor": 0, "batch": 0, "life": 1, "obs": np.zeros((B, 4), np.float32)}
    assert agent.track({**req, "seq": 0}, None).sequencer.first == [True] * B
    assert agent.track({**req, "seq": 9}, None).sequencer.first == [False] * B


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_killed_r2d2_actors_and_servers_never_join_two_episodes_in_a_sequence(r, keys, tmp_path):
    cfg = R2D2Config(**CFG, reply_timeout=0.5)
    create_run(r, keys, "r2d2", cfg)
    env = EnvSpec.of(cfg.env)
    WeightStore(r, keys).publish(_q_network(cfg, env), version=0)
    _, schema = sequence_spec(cfg, env, max_rows(cfg))

    def drain() -> list[dict]:
        rows = r.xrange(keys.experience)
        if rows:
            r.xdel(keys.experience, *[eid for eid, _ in rows])
        return [decode(f[b"d"], schema) for _, f in rows]

    for msg in kill_and_restart(r, keys, tmp_path, "r2d2", drain):
        for obs, n in zip(msg["obs"].astype(np.float64), msg["steps"], strict=True):
            moved = obs[1 : n + 1, [0, 2]] - obs[:n, [0, 2]]  # the last: the next or final obs
            assert np.allclose(moved, TAU * obs[:n, [1, 3]], atol=1e-4), "steps do not follow"


def test_an_r2d2_server_serves_on_past_hostile_requests(r, keys, redis_server):
    """Garbage, and well-formed requests from actors nobody runs, the largest number a
    server serves among them (its epsilons and shards are computed from it), crash nothing."""
    cfg = R2D2Config(**CFG)
    create_run(r, keys, "r2d2", cfg)
    env = EnvSpec.of(cfg.env)
    WeightStore(r, keys).publish(_q_network(cfg, env), version=0)
    agent = SequenceAgent(r, keys, cfg, 0, env, _q_network(cfg, env), torch.device("cpu"))
    server = InferenceServer(r, keys, cfg, 0, agent, device="cpu")
    actor = stepper(r, keys, cfg, 0)
    stop, threads = _threads(_loop(server), _loop(actor))
    good = {
        "batch": 0,
        "batches": 1,
        "life": 5,
        "obs": np.zeros((B, 4), np.float32),
        "reward": np.zeros(B, np.float32),
        "terminated": np.zeros(B, bool),
        "truncated": np.zeros(B, bool),
        "final_obs": np.zeros((0, 4), np.float32),
        "final_idx": np.zeros(0, np.int32),
        "sent": 1.0,
    }
    others = (1, max(server.lists))  # the largest number a server takes requests of
    lists = [protocol.requests(keys, a) for a in others]
    try:
        wait_until(lambda: actor.steps >= 50, "the actor to step", 60)
        r.rpush(lists[0], b"garbage")
        for seq in range(3 * cfg.sequence_length):  # whole sequences, pushed to the replay
            for a, lst in zip(others, lists, strict=True):
                r.rpush(lst, encode(protocol.REQUEST, {**good, "actor": a, "seq": seq}))
        steps = actor.steps
        wait_until(lambda: actor.steps >= steps + 200, "the actor to go on", 60)
        wait_until(lambda: not any(map(r.llen, lists)), "the server to take every request")
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert server.rejected == 1 and {(a, 0) for a in (*others, 0)} <= set(server.tracks)
    assert agent.sequences > 0
