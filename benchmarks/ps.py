"""Parameter-server throughput: gradients applied per second by ``ParameterServer`` shards
(qrl/ps/server.py) fed by ``PSClient`` pushers (qrl/ps/client.py), against the raw Redis
bandwidth for the same bytes.

    python benchmarks/ps.py [--nets mlp cnn] [--modes node cluster] [--pushers 2]
                            [--seconds 8] [--rounds 2] [--warmup 3] [--pull-every 0]

Networks (``--nets``), A3C's policy-value net (``qrl.algos.a3c.builder._policy_value_net``):
``mlp`` on CartPole-v1 (64-64, 4,675 parameters) and ``cnn`` on 84x84x4 uint8 frames (an
Atari-shaped spec, no ALE needed): the Nature DQN convnet with its 512 hidden layer, 6
actions, 1,687,719 parameters (the exact count is printed). Modes (``--modes``): ``node``, one
embedded Redis, 1 shard; ``cluster``, a local 3-node Redis Cluster, 1 and 3 shards
(``ps_shards``; each shard's keys in a slot of its own node).

For each setting: a fresh A3C run (``A3CConfig(ps_shards=K)``, otherwise the defaults: the
shared RMSProp ``_optimizer``, ``ps_batch`` 16; ``ps_queue`` is ``--queue``, default 8), K
server processes (each builds the net from the seed and loops ``ParameterServer.step``) and
``--pushers`` processes, each a ``PSClient`` that pulls once, sets ``.grad`` once to random
values of norm half of ``grad_clip`` and then pushes them again and again (``--pull-every
N``: pulls after every N pushes; default never). ``ps_max_staleness`` is set to 10^9 so that
no gradient is dropped as stale: this measures the push / read / apply / persist / publish
path, not the learning. Processes are spawned; after the first gradient of every shard and
``--warmup`` seconds, ``--rounds`` alternating rounds of ``--seconds / --rounds`` each: the
servers' applied gradients (their ``updates``) over the window, then, with the pushers
paused and the servers drained, the raw side: one client (qrl's ``connect``) doing SET then
GET of a blob of one shard's gradient block (4 bytes x block length of random float32) on
each shard's hash tag in turn (so on the node(s) holding the shards). ``upd/s all``: the
shards' updates (blocks applied) per second, summed; ``grads/s``: per shard, i.e. whole-
network gradients applied per second (every gradient goes to every shard). ``raw pairs/s``
counts SET+GET pairs; ``ratio`` is grads/s over it (a pair moves a block in and out of
Redis, as a gradient pushed and read does). Goals: ratio >= 0.8 per shard; on the cluster, 3
shards >= 2x the grads/s of 1 shard (``3s/1s``). ``wait``: the share of the pushers' time
spent waiting on a full gradient stream (high: the servers are the bound); ``dropped``:
gradients the servers dropped or rejected (should be 0). On 2 cores the servers, pushers,
raw client and Redis nodes all share the same CPUs, so the 3-shard goal measures contention
too."""

from __future__ import annotations

import argparse
import multiprocessing
import time

import gymnasium as gym
import numpy as np
import torch

from qrl.algos.a3c.builder import _optimizer, _policy_value_net
from qrl.algos.a3c.config import A3CConfig
from qrl.ps import protocol
from qrl.ps.client import PSClient
from qrl.ps.server import ParameterServer
from qrl.rl.envspec import EnvSpec
from qrl.runtime.runs import create_run, delete_run
from qrl.server.embedded import EmbeddedRedis
from qrl.server.embedded_cluster import EmbeddedCluster
from qrl.wire.connection import connect
from qrl.wire.keys import RunKeys

SHARDS = {"node": (1,), "cluster": (1, 3)}
HEAD = [
    "net",
    "params",
    "mode",
    "K",
    "block MB",
    "upd/s all",
    "grads/s",
    "raw pairs/s",
    "ratio",
    "3s/1s",
    "wait",
    "dropped",
]
WIDTHS = [-4, 9, -8, 2, 8, 9, 8, 11, 6, 6, 5, 7]
FRAMES = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)


def never() -> bool:
    return False


def build(net: str, cfg: A3CConfig) -> torch.nn.Module:
    """The network every process builds alike (same seed: the servers cut the same blocks)."""
    if net == "mlp":
        spec = EnvSpec.of("CartPole-v1")
    else:
        spec = EnvSpec.read("frames-84x84x4", FRAMES, gym.spaces.Discrete(6))
    torch.manual_seed(cfg.seed)
    return _policy_value_net(cfg, spec)


def serve(url: str, run: str, cfg: A3CConfig, net: str, shard: int, updates, dropped, stop):
    """A server process: steps until ``stop``, its counts in the shared arrays."""
    ps = ParameterServer(
        connect(url), RunKeys(run), cfg, shard, build(net, cfg), _optimizer, algo="a3c"
    )
    ps.start(never)
    while not stop.is_set():
        ps.step(never)
        updates[shard] = ps.updates
        dropped[shard] = sum(ps.drops.values()) + ps.rejected + ps.consumer.rejected
    ps.close(never)


def push(
    url: str, run: str, cfg: A3CConfig, net: str, worker: int, pull_every: int, waited, go, stop
):
    """A pusher process: one fixed gradient, pushed while ``go`` is set, until ``stop``;
    its seconds waiting on a full stream in ``waited``."""
    torch.set_num_threads(1)
    model = build(net, cfg)
    client = PSClient(connect(url), RunKeys(run), cfg, model, worker)
    while not client.pull():  # every shard has published its block
        if stop.wait(0.05):
            return
    grads = [torch.randn_like(p) for p in model.parameters()]
    scale = 0.5 * cfg.grad_clip / float(torch.cat([g.flatten() for g in grads]).norm())
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g * scale
    halt = lambda: stop.is_set() or not go.is_set()  # noqa: E731
    while not stop.is_set():
        if go.wait(0.1) and client.push(1.0, halt):
            waited[worker] = client.waited_s()
            if pull_every and client.pushed % pull_every == 0:
                client.pull()


def raw_pairs(client, keys: list[str], blob: bytes, seconds: float) -> tuple[int, float]:
    """SET+GET pairs of ``blob`` on ``keys`` in turn for ``seconds``: (pairs, seconds)."""
    n, t0 = 0, time.perf_counter()
    while (dt := time.perf_counter() - t0) < seconds:
        key = keys[n % len(keys)]
        client.set(key, blob)
        client.get(key)
        n += 1
    for key in keys:
        client.delete(key)
    return n, dt


def settle(updates, timeout: float) -> None:
    """Wait until the servers' counts stop moving (the streams drained)."""
    end, last = time.monotonic() + timeout, -1
    while sum(updates) != last and time.monotonic() < end:
        last = sum(updates)
        time.sleep(0.3)


def measure(url: str, net: str, shards: int, args: argparse.Namespace) -> dict[str, float]:
    cfg = A3CConfig(ps_shards=shards, ps_max_staleness=10**9, ps_queue=args.queue)
    keys = RunKeys(f"bench-ps-{net}-{shards}")
    client = connect(url)
    create_run(client, keys, "a3c", cfg)
    total = sum(p.numel() for p in build(net, cfg).parameters())
    length = max(np.diff(protocol.bounds(total, shards)))
    blob = np.random.default_rng(0).standard_normal(length).astype(np.float32).tobytes()
    raw_keys = [sk.key("bench:raw") for sk in keys.shards(shards)]
    ctx = multiprocessing.get_context("spawn")
    updates, dropped = ctx.Array("q", shards, lock=False), ctx.Array("q", shards, lock=False)
    waited, go, stop = ctx.Array("d", args.pushers, lock=False), ctx.Event(), ctx.Event()
    run = keys.run
    procs = [
        ctx.Process(target=serve, args=(url, run, cfg, net, k, updates, dropped, stop), daemon=True)
        for k in range(shards)
    ]
    procs += [
        ctx.Process(
            target=push,
            args=(url, run, cfg, net, w, args.pull_every, waited, go, stop),
            daemon=True,
        )
        for w in range(args.pushers)
    ]
    applied = ps_s = pairs = raw_s = wait = 0.0
    try:
        for p in procs:
            p.start()
        go.set()
        end = time.monotonic() + 180
        while min(updates) == 0:
            if not all(p.is_alive() for p in procs):
                raise RuntimeError("a server or pusher died (its traceback is above)")
            if time.monotonic() > end:
                raise RuntimeError("no gradient applied on some shard in 180 s")
            time.sleep(0.1)
        time.sleep(args.warmup)
        window = args.seconds / args.rounds
        for r in range(args.rounds):
            if r:
                go.set()
                time.sleep(0.5)  # the pushers wake and the streams fill again
            u0, w0, t0 = sum(updates), sum(waited), time.perf_counter()
            time.sleep(window)
            applied, wait = applied + sum(updates) - u0, wait + sum(waited) - w0
            ps_s += time.perf_counter() - t0
            go.clear()
            settle(updates, 10.0)
            n, dt = raw_pairs(client, raw_keys, blob, window)
            pairs, raw_s = pairs + n, raw_s + dt
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
                p.join()
        for k in {keys, *keys.shards(shards)}:
            delete_run(client, k)
        client.close()
    return {
        "params": total,
        "block": 4 * length,
        "applied": applied / ps_s,
        "raw": pairs / raw_s,
        "dropped": sum(dropped),
        "wait": wait / (ps_s * args.pushers),
    }


def row(cells: list[object]) -> str:
    return " ".join(
        f"{c:<{-w}}" if w < 0 else f"{c:>{w}}" for c, w in zip(cells, WIDTHS, strict=False)
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--nets", nargs="+", default=["mlp", "cnn"], choices=["mlp", "cnn"])
    ap.add_argument("--modes", nargs="+", default=["node", "cluster"], choices=list(SHARDS))
    ap.add_argument("--pushers", type=int, default=2, help="pusher processes")
    ap.add_argument("--seconds", type=float, default=8.0, help="measured window, all rounds")
    ap.add_argument("--rounds", type=int, default=2, help="alternating ps / raw rounds")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring")
    ap.add_argument("--pull-every", type=int, default=0, help="pull every N pushes (0: never)")
    ap.add_argument("--queue", type=int, default=8, help="ps_queue: gradients waiting per shard")
    args = ap.parse_args()
    print(
        f"{args.pushers} pushers, {args.rounds} rounds of {args.seconds / args.rounds:g} s "
        f"each side, pull every {args.pull_every or 'never'}"
    )
    print(row(HEAD))
    for mode in args.modes:
        with EmbeddedRedis() if mode == "node" else EmbeddedCluster(3) as server:
            for net in args.nets:
                one = None
                for shards in SHARDS[mode]:
                    try:
                        m = measure(server.url, net, shards, args)
                    except RuntimeError as e:
                        print(row([net, "", mode, shards, f"failed: {e}"]), flush=True)
                        continue
                    per = m["applied"] / shards
                    one = per if shards == 1 else one
                    scale = f"{per / one:.2f}" if shards > 1 and one else ""
                    cells = [
                        net,
                        f"{m['params']:,}",
                        mode,
                        shards,
                        f"{m['block'] / 1e6:.3f}",
                        f"{m['applied']:,.1f}",
                        f"{per:,.1f}",
                        f"{m['raw']:,.1f}",
                        f"{per / m['raw']:.2f}",
                        scale,
                        f"{m['wait']:.0%}",
                        m["dropped"],
                    ]
                    print(row(cells), flush=True)


if __name__ == "__main__":
    main()
