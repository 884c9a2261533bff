"""Weights through Redis by network size: publish and fetch time of 1M, 10M and 100M float32
parameters (in chunks under a manifest above 16 MiB: qrl/wire/chunks.py), and with bfloat16
on the wire.

    python benchmarks/weights.py [--sizes 1,10,100] [--rounds 3] [--rtts 0 5 20] [--redis URL]

Without ``--redis`` a private redis-server is started. ``--rtts``: the same through a relay
that delays every byte by half the round trip each way (``tests/_relay.py``, the delay the
emulated hosts of ``benchmarks/network.py`` use; on loopback, so no bandwidth limit). Each
row is the median of ``rounds``
publishes (``WeightStore.publish``: encode, compress, write the chunks, switch the manifest)
and fetches into a module (``WeightStore.load_into``: read, check, decompress, load).
Random weights (LZ4 gains little on them, as on trained ones).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time
from pathlib import Path

import redis
import torch

from qrl.server.embedded import EmbeddedRedis, free_port
from qrl.wire.keys import RunKeys
from qrl.wire.weights import WeightStore


def network(millions: int) -> torch.nn.Module:
    """A module of about ``millions`` million parameters (square linear layers of 1000)."""
    layers = max(1, round(millions))  # 1000 x 1000 + 1000: about a million each
    return torch.nn.Sequential(*(torch.nn.Linear(1000, 1000) for _ in range(layers)))


def row(client: redis.Redis, millions: int, wire: str | None, rounds: int) -> dict:
    net, twin = network(millions), network(millions)
    keys = RunKeys(f"bench-weights-{millions}-{wire or 'f32'}")
    writer = WeightStore(client, keys, wire=wire)
    reader = WeightStore(client, keys)
    pub, fetch = [], []
    for v in range(rounds):
        t = time.perf_counter()
        writer.publish(net, v)
        pub.append(time.perf_counter() - t)
        t = time.perf_counter()
        assert reader.load_into(twin, newer_than=v - 1) == v
        fetch.append(time.perf_counter() - t)
    stored = sum(client.memory_usage(k) or 0 for k in client.scan_iter(f"{keys.prefix}*"))
    for k in client.scan_iter(f"{keys.prefix}*"):
        client.delete(k)
    params = sum(p.numel() for p in net.parameters())
    return {
        "params": params,
        "wire": wire or "float32",
        "publish_s": statistics.median(pub),
        "fetch_s": statistics.median(fetch),
        "stored_mb": stored / 1e6,
    }


def relayed(stack: contextlib.ExitStack, url: str, rtt_ms: float) -> str:
    """``url`` reached through a relay adding ``rtt_ms`` to every round trip (started on
    ``stack``); ``url`` itself at 0."""
    if rtt_ms <= 0:
        return url
    to = redis.connection.parse_url(url)
    port = free_port("127.0.0.1")
    relay = subprocess.Popen(
        [sys.executable, "-m", "tests._relay", "--listen", f"127.0.0.1:{port}"]
        + ["--to", f"{to.get('host', '127.0.0.1')}:{to.get('port', 6379)}"]
        + ["--delay-ms", str(rtt_ms / 2)],
        cwd=Path(__file__).resolve().parent.parent,
        stdout=subprocess.PIPE,
        text=True,
    )
    stack.callback(relay.wait)
    stack.callback(relay.terminate)
    assert relay.stdout is not None and relay.stdout.readline().strip() == "ready"
    return url.replace(f":{to.get('port', 6379)}", f":{port}", 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,10,100", help="millions of parameters, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--redis", default=None, help="a Redis URL (default: a private one)")
    ap.add_argument("--rtts", nargs="+", type=float, default=[0.0], help="added round trip, ms")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        url = args.redis or stack.enter_context(EmbeddedRedis()).url
        print(
            f"{'RTT ms':>6} {'params':>12} {'wire':>9} {'publish s':>10} {'fetch s':>9} "
            f"{'stored MB':>10}"
        )
        for rtt in args.rtts:
            client = redis.Redis.from_url(relayed(stack, url, rtt))
            for millions in (int(s) for s in args.sizes.split(",")):
                for wire in (None, "bfloat16"):
                    r = row(client, millions, wire, args.rounds)
                    print(
                        f"{rtt:>6.1f} {r['params']:>12,} {r['wire']:>9} {r['publish_s']:>10.3f} "
                        f"{r['fetch_s']:>9.3f} {r['stored_mb']:>10.1f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
