"""Central inference (SEED RL) on a real Redis: the unrolls a server assembles are exactly
the steps its actors took, in order; the actor process imports no torch; SIGKILLed actors
and servers (real processes) lose only half-built unrolls, never join two actors' or two
lives' steps, and nothing deadlocks; hostile requests are dead-lettered and the server
serves on.

An unroll's steps are checked against CartPole's physics: between two steps of one episode
the cart's position moves by tau x its velocity and the pole's angle by tau x its angular
velocity, so steps of two different episodes joined together show."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

from qrl.actors.envs import EnvRunner
from qrl.algos.impala.builder import _policy_value_net
from qrl.algos.impala.config import ImpalaConfig
from qrl.algos.impala.keys import trajectories
from qrl.algos.impala.messages import KIND, unroll_schema
from qrl.inference import protocol
from qrl.inference.server import InferenceServer
from qrl.inference.stepper import round_trip_ms, stepper
from qrl.inference.unrolls import UnrollAgent
from qrl.rl.envspec import EnvSpec
from qrl.runtime.runs import create_run
from qrl.wire.codec import decode, encode
from qrl.wire.connection import connect
from qrl.wire.keys import RunKeys
from qrl.wire.weights import WeightStore
from tests.cli import ROOT
from tests.helpers import Roles, far_redis, run_reader, wait_until

TAU = 0.02  # CartPole's time step
T, B = 8, 4
SMALL = {"inference": "central", "actors": 2, "envs_per_actor": B, "unroll": T}


def _setup(r, keys, **over) -> ImpalaConfig:
    cfg = ImpalaConfig(**{**SMALL, **over})
    create_run(r, keys, "impala", cfg)
    WeightStore(r, keys).publish(_policy_value_net(cfg, EnvSpec.of(cfg.env)), version=0)
    return cfg


def _server(r, keys, cfg, ident: int = 0) -> InferenceServer:
    env = EnvSpec.of(cfg.env)
    net = _policy_value_net(cfg, env)
    agent = UnrollAgent(
        r, keys, cfg, ident, env, net, trajectories(keys), KIND, torch.device("cpu")
    )
    return InferenceServer(r, keys, cfg, ident, agent, device="cpu")


_SCHEMA = unroll_schema((4,), "float32", 2, T)


def _drain(r, keys) -> list[dict]:
    """Take every unroll out of the stream (the server waits while it holds 8)."""
    rows = r.xrange(trajectories(keys))
    if rows:
        r.xdel(trajectories(keys), *[eid for eid, _ in rows])
    return [decode(f[b"d"], _SCHEMA) for _, f in rows]


def _physical(u: dict) -> None:
    """Every step of ``u`` follows from the one before (within an episode), and every
    final observation of a cut episode from its last step."""
    obs, done = u["obs"].astype(np.float64), u["terminated"] | u["truncated"]
    moved = obs[1:, :, [0, 2]] - obs[:-1, :, [0, 2]]
    want = TAU * obs[:-1, :, [1, 3]]
    ok = np.isclose(moved, want, atol=1e-4).all(-1) | done
    assert ok.all(), f"steps of actor {u['actor']} do not follow: {np.argwhere(~ok)}"
    for (t, b), final in zip(u["trunc_idx"], u["trunc_obs"], strict=True):
        assert np.allclose(final[[0, 2]] - obs[t, b, [0, 2]], TAU * obs[t, b, [1, 3]], atol=1e-4)


class _Recording(EnvRunner):
    """An actor's envs that keep what it saw and did."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.seen: list[tuple[np.ndarray, np.ndarray]] = []

    def step(self, actions):
        self.seen.append((np.array(self.obs), np.array(actions)))
        return super().step(actions)


def _recording(r, keys, cfg, ident: int):
    """A stepper whose envs (each batch's) keep what they saw and did."""
    runners = [_Recording(cfg, ident, batch=i) for i in range(cfg.inference_batches)]
    return stepper(r, keys, cfg, ident, runners=runners)


def _check_unrolls(got: list[dict], a: int, actor) -> int:
    """Actor ``a``'s unrolls in ``got`` are the steps its env batches took, each batch's
    in order: unroll k of a batch holds its steps kT .. kT+T-1, and then the next one's
    observation. The number of batches that sent any."""
    sent = [0] * len(actor.runners)  # each batch's unrolls met so far
    for u in (u for u in got if u["actor"] == a):
        _physical(u)
        assert u["version"] == 0
        batch = [
            i
            for i, runner in enumerate(actor.runners)
            if len(runner.seen) >= (sent[i] + 1) * T
            and np.array_equal(u["obs"][0], runner.seen[sent[i] * T][0])
        ]
        assert len(batch) == 1, f"an unroll of actor {a} is no batch's next"
        runner, k = actor.runners[batch[0]], sent[batch[0]]
        for t in range(T):
            obs, action = runner.seen[k * T + t]
            np.testing.assert_array_equal(u["obs"][t], obs)
            np.testing.assert_array_equal(u["action"][t], action)
        # the observation after: the next step's, or, where the stop came before the batch
        # acted on it, the one it asked its last actions for
        after = runner.seen[(k + 1) * T][0] if len(runner.seen) > (k + 1) * T else runner.obs
        np.testing.assert_array_equal(u["obs"][T], after)
        sent[batch[0]] += 1
    return sum(n > 0 for n in sent)


def _threads(*loops) -> tuple[threading.Event, list[threading.Thread]]:
    stop = threading.Event()
    threads = [threading.Thread(target=lambda f=f: f(stop), daemon=True) for f in loops]
    for t in threads:
        t.start()
    return stop, threads


def _loop(role):
    def run(stop: threading.Event) -> None:
        assert role.start(stop.is_set)
        try:
            while not stop.is_set() and role.step(stop.is_set):
                pass
        finally:
            role.close(stop.is_set)  # (a stepper's asks under way stop)

    return run


def test_the_unrolls_are_the_steps_each_actor_took(r, keys, redis_server):
    cfg = _setup(r, keys)
    server = _server(r, keys, cfg)
    actors = [_recording(r, keys, cfg, i) for i in range(2)]
    stop, threads = _threads(_loop(server), *map(_loop, actors))
    got: list[dict] = []
    try:
        wait_until(lambda: got.extend(_drain(r, keys)) or len(got) >= 12, "12 unrolls", 60)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    got += _drain(r, keys)
    for a, actor in enumerate(actors):
        assert sum(u["actor"] == a for u in got) >= 3
        _check_unrolls(got, a, actor)
    m = server.metrics()
    assert m["unrolls"] == len(got) and m["dropped"] == 0 and m["rejected"] == 0
    assert 1 <= m["batch"] <= 2 * cfg.inference_batches


def test_an_actor_keeps_each_env_batch_in_flight_and_each_gets_its_unrolls(r, keys, redis_server):
    """SEED RL's actors keep several env batches in flight: with no server, an actor of 3
    batches has a request of each at its server's list at once (not one waiting for the
    others); served, every batch steps and its unrolls are its own steps."""
    cfg = _setup(r, keys, inference_batches=3, stream_maxlen=100_000)
    actor = _recording(r, keys, cfg, 0)
    stop, threads = _threads(_loop(actor))
    lst, schema = protocol.requests(keys, 0), protocol.request_schema((4,), "float32", B, 3)
    try:
        wait_until(lambda: r.llen(lst) >= 3, "a request of each batch", 30)
        reqs = [decode(p, schema) for p in r.lrange(lst, 0, -1)]
        assert sorted(q["batch"] for q in reqs) == [0, 1, 2]
        assert {q["seq"] for q in reqs} == {0} and len({q["life"] for q in reqs}) == 1
        assert actor.steps == 0  # each waits for its actions
        server = _server(r, keys, cfg)
        serving = threading.Thread(target=_loop(server), args=(stop,), daemon=True)
        serving.start()
        threads.append(serving)
        wait_until(
            lambda: min(len(x.seen) for x in actor.runners) >= 4 * T, "every batch to step", 60
        )
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    got = _drain(r, keys)
    assert _check_unrolls(got, 0, actor) == 3
    assert server.dropped == 0 and server.rejected == 0
    assert set(server.tracks) == {(0, 0), (0, 1), (0, 2)}


_NO_TORCH = """
import runpy, sys
sys.argv = ["qrl", "stepper", "impala", "--max-steps", "64"]
try:
    runpy.run_module("qrl.cli", run_name="__main__")
except SystemExit as e:
    print("exit", e.code)
print("torch loaded" if "torch" in sys.modules else "no torch")
"""


def test_an_actor_far_from_redis_keeps_more_env_batches_in_flight(r, keys, redis_server):
    """An actor steps at most its envs in flight per request's round trip (Little's law), so
    one 5 ms from Redis (through a delaying relay) keeps ``inference_batches_per_ms`` more
    batches for each millisecond, one near it ``inference_batches``; each says how many it
    has, and the server waits for that many of each (not a fixed count per actor)."""
    cfg = _setup(r, keys, inference_batches=2, stream_maxlen=100_000)
    with far_redis(redis_server.port, rtt_ms=5.0) as far_client:
        near, far = stepper(r, keys, cfg, 0), stepper(far_client, keys, cfg, 1)
        assert len(near.runners) == 2
        assert 2 + 5 <= len(far.runners) <= protocol.MAX_BATCHES
        fixed = cfg.model_copy(update={"inference_batches_per_ms": 0.0})
        assert len(stepper(far_client, keys, fixed, 1).runners) == 2
        server = _server(r, keys, cfg)
        assert server.expect == 2 * 2  # before it hears from them: inference_batches each
        stop, threads = _threads(_loop(server), _loop(near), _loop(far))
        try:
            wait_until(lambda: min(x.steps for x in (near, far)) >= 200, "both to step", 60)
            assert server.expect == len(near.runners) + len(far.runners)
            assert far.metrics()["batches"] == len(far.runners)
        finally:
            stop.set()
            for t in threads:
                t.join(10)
    assert server.rejected == 0


def test_the_actor_process_imports_no_torch(r, keys, redis_server):
    cfg = _setup(r, keys)
    stop, threads = _threads(_loop(_server(r, keys, cfg)))
    try:
        env = {**os.environ, "QRL_RUN": keys.run, "QRL_REDIS_URL": redis_server.url}
        out = subprocess.run(
            [sys.executable, "-c", _NO_TORCH],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        stop.set()
        threads[0].join(10)
    assert "exit 0" in out.stdout and "no torch" in out.stdout, out.stdout + out.stderr[-2000:]


def _reports(r, keys, role: str) -> list[dict]:
    reader, out = run_reader(r, keys), []
    while batch := reader.read():
        out += [m["values"] for m in batch if m["role"] == role]
    return out


def kill_and_restart(r, keys, tmp_path, algo: str, drain: Callable[[], list[dict]]) -> list[dict]:
    """SIGKILL an actor of a central-inference run of ``algo`` (its config created) and
    restart it, then the server: every role a real process. Returns every message
    ``drain`` took off the stream (each with its ``actor``) meanwhile, after checking that
    the server dropped the killed actor's half-built work, that both actors went on with
    the new server, and that they resent while it was away."""
    roles = Roles(keys.run, tmp_path)
    got: list[dict] = []

    def from_(actor: int, n: int, what: str) -> None:
        def more() -> bool:
            got.extend(drain())
            return sum(u["actor"] == actor for u in got) >= n

        roles.until(more, what, 90, every=0.05)

    try:
        roles.start("server", "inference", algo, "--device", "cpu")
        for a in (0, 1):
            roles.start(f"actor{a}", "stepper", algo, "--id", str(a))
        from_(0, 3, "messages of both actors")
        roles.kill("actor0")  # mid-request or mid-step: its unroll is half-built
        roles.start("actor0", "stepper", algo, "--id", "0")
        before = sum(u["actor"] == 0 for u in got)
        from_(0, before + 3, "messages of the restarted actor")

        def dropped() -> (
            int
        ):  # (draining meanwhile: a server held by a full stream reports nothing)
            got.extend(drain())
            return max((v["dropped"] for v in _reports(r, keys, "inference")), default=0)

        roles.until(dropped, "the server to drop the killed actor's half-built work")

        roles.kill("server")
        # the actors wait and resend (one server, so the run's own keys)

        def resent() -> bool:
            return max((v["resent"] for v in _reports(r, keys, "stepper")), default=0) >= 1

        roles.until(resent, "an actor to resend", 60)
        got.extend(drain())
        roles.start("server", "inference", algo, "--device", "cpu")
        counts = [sum(u["actor"] == a for u in got) for a in (0, 1)]
        from_(0, counts[0] + 3, "actor 0 to go on with the new server")
        from_(1, counts[1] + 3, "actor 1 to go on with the new server")
    finally:
        roles.cleanup()
    assert max(v["resent"] for v in _reports(r, keys, "stepper")) >= 1
    return got


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_killed_actors_and_servers_lose_only_half_built_unrolls(r, keys, tmp_path):
    _setup(r, keys, reply_timeout=0.5)
    for u in kill_and_restart(r, keys, tmp_path, "impala", lambda: _drain(r, keys)):
        _physical(u)


def test_a_wait_shorter_than_a_millisecond_is_not_a_wait_forever(r, keys, redis_server):
    """The last slice of an actor's wait for its reply can be a few microseconds; Redis 6.2
    truncates BLPOP's timeout to whole milliseconds and blocks forever on 0 (the client's
    socket timeout then kills the actor's loop: CI, 2026-11-30)."""
    actor = stepper(r, keys, _setup(r, keys), 0)
    for timeout in (0.0, 1e-5, 9e-4):
        assert actor.askers[0]._exchange(None, timeout) is None  # no server: nothing to wait for


def test_hostile_requests_are_dead_lettered_and_the_server_serves_on(r, keys, redis_server):
    cfg = _setup(r, keys, stream_maxlen=100_000)  # no learner: room for every unroll
    server = _server(r, keys, cfg)
    actor = stepper(r, keys, cfg, 0)
    stop, threads = _threads(_loop(server), _loop(actor))
    lst = protocol.requests(keys, 1)  # actor 1's: nobody runs it
    good = {
        "actor": 1,
        "batch": 0,
        "batches": 1,
        "life": 5,
        "seq": 0,
        "obs": np.zeros((B, 4), np.float32),
        "reward": np.zeros(B, np.float32),
        "terminated": np.zeros(B, bool),
        "truncated": np.zeros(B, bool),
        "final_obs": np.zeros((0, 4), np.float32),
        "final_idx": np.zeros(0, np.int32),
        "sent": 1.0,
    }
    hostile = [
        b"garbage",
        b"x" * (8 << 20),  # over the cap: popped and dropped unread
        encode(protocol.REQUEST, {**good, "obs": np.zeros((B + 1, 4), np.float32)}),
        encode(protocol.REQUEST, {**good, "obs": np.full((B, 4), np.nan, np.float32)}),
        encode(protocol.REQUEST, {**good, "truncated": np.ones(B, bool)}),  # no final obs
        encode(protocol.REQUEST, {**good, "terminated": np.ones(B, bool)}),  # nor here
        encode(
            protocol.REQUEST,
            {
                **good,
                "final_idx": np.array([9], np.int32),
                "final_obs": np.zeros((1, 4), np.float32),
            },
        ),
        encode(protocol.REQUEST, {**good, "batch": 1}),  # no such batch of 1
        encode(protocol.REQUEST, {**good, "batches": protocol.MAX_BATCHES + 1}),  # too many
        encode(protocol.REQUEST, {**good, "batches": 0}),
        encode(
            protocol.REPLY,
            {"life": 1, "batch": 0, "seq": 0, "action": np.zeros(B, np.int32), "version": 0},
        ),
        encode(protocol.REQUEST, {**good, "actor": 0}),  # posing as actor 0 from 1's list
    ]
    try:
        wait_until(lambda: actor.steps >= 100, "the actor to step", 60)
        r.delete(lst)
        r.set(lst, "not a list")  # repaired by the server's next pop
        r.delete(protocol.reply(keys, 0, 1))
        r.hset(protocol.reply(keys, 0, 1), "x", "1")  # repaired by the actor
        r.rpush(protocol.reply(keys, 1, 0), b"x" * 100)  # a reply list nobody reads
        wait_until(lambda: r.type(lst) != b"string", "the server to repair its list")
        for h in hostile:
            r.rpush(lst, h)
        for a in list(server.lists)[1:]:  # well-formed, from actors nobody runs
            r.rpush(protocol.requests(keys, a), encode(protocol.REQUEST, {**good, "actor": a}))
        steps = actor.steps
        wait_until(lambda: actor.steps >= steps + 200, "the actor to go on", 60)
        assert len(server.tracks) <= server.keep and (0, 1) in server.tracks
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert server.rejected == len(hostile)
    assert int(r.hget(keys.stats, "rejected:inference")) == len(hostile)
    assert r.xlen(keys.deadletter) >= len(hostile)


@pytest.mark.cluster
def test_servers_on_a_cluster_each_serve_their_actors_on_a_slot_of_their_own(redis_cluster):
    keys = RunKeys(f"inf-cluster-{time.time_ns()}")
    client = connect(redis_cluster.urls[0])  # a cluster client: every role's own below
    cfg = _setup(client, keys, actors=4, inference_servers=2, stream_maxlen=100_000)
    mine = [protocol.server_keys(keys, 2, s) for s in (0, 1)]
    assert len({keys.slot(), *(k.slot() for k in mine)}) == 3
    servers = [_server(connect(redis_cluster.urls[s]), keys, cfg, s) for s in (0, 1)]
    actors = [stepper(connect(redis_cluster.urls[a % 3]), keys, cfg, a) for a in range(4)]
    stop, threads = _threads(*map(_loop, servers), *map(_loop, actors))
    try:
        wait_until(lambda: min(a.steps for a in actors) >= 20 * T * B, "every actor to step", 90)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    got = [u for _, f in client.xrange(trajectories(keys)) for u in [decode(f[b"d"], _SCHEMA)]]
    assert {u["actor"] for u in got} == {0, 1, 2, 3}
    for s in servers:
        mine = (s.server_id, s.server_id + 2)
        # each stepper's own batches (a loaded machine's PINGs may have asked for more)
        tracks = {(a, b) for a in mine for b in range(len(actors[a].runners))}
        assert s.requests and set(s.tracks) == tracks
    assert all(s.rejected == 0 and s.dropped == 0 for s in servers)
    client.close()


def test_a_stepper_on_a_cluster_pings_only_its_servers_node(redis_cluster):
    """redis-py sends a plain PING to every node of a Cluster, one after the other: a far
    stepper would take three nodes' round trips for its own and keep too many batches."""
    keys = RunKeys(f"inf-ping-{time.time_ns()}")
    client = connect(redis_cluster.urls[0])
    key = protocol.requests(protocol.server_keys(keys, 1, 0), 0)

    def pings() -> list[int]:
        stats = [redis_cluster.client(i).info("commandstats") for i in range(3)]
        return [s.get("cmdstat_ping", {}).get("calls", 0) for s in stats]

    before = pings()
    round_trip_ms(client, key, pings=5)
    grown = [a - b for a, b in zip(pings(), before, strict=True)]
    assert sorted(grown) == [0, 0, 5]
    client.close()
