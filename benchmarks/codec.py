"""Codec throughput: qrl's encode+decode against raw lz4.frame + msgpack on the same bytes.

    python benchmarks/codec.py [--seconds 4] [--rounds 40]

Both sides compress the same array bytes with LZ4 (level 0) inside msgpack; qrl adds the
envelope, the array header and full validation on decode. Rounds alternate between the two
so machine noise hits both; the ratio is the median of the
per-round ratios qrl / raw (goal >= 0.9).
"""

from __future__ import annotations

import argparse
import statistics
import time

import lz4.frame
import msgpack
import numpy as np

from qrl.wire.codec import Field, Schema, decode, encode

SCHEMA = Schema("batch", {"x": Field(np.ndarray)})


def frames(n: int) -> np.ndarray:
    """Atari-like uint8 frames: flat background, a few bright blocks, a little noise."""
    rng = np.random.default_rng(0)
    f = np.full((n, 84, 84), 40, np.uint8)
    for i in range(n):
        for _ in range(6):
            y, x = rng.integers(0, 76, 2)
            f[i, y : y + 8, x : x + 4] = rng.integers(100, 255)
    f[rng.random(f.shape) < 0.02] = 0
    return f


def qrl_round(arr: np.ndarray) -> int:
    payload = encode("batch", {"x": arr})
    out = decode(payload, SCHEMA)["x"]
    assert out.shape == arr.shape
    return arr.nbytes


def raw_round(arr: np.ndarray) -> int:
    payload = lz4.frame.compress(  # library defaults, as the codec uses them: level 0
        msgpack.packb({"x": arr.tobytes(), "dtype": arr.dtype.str, "shape": arr.shape})
    )
    msg = msgpack.unpackb(lz4.frame.decompress(payload))
    out = np.frombuffer(msg["x"], dtype=msg["dtype"]).reshape(msg["shape"])
    assert out.shape == arr.shape
    return arr.nbytes


def rate(fn, arr: np.ndarray, seconds: float) -> float:
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        done += fn(arr)
    return done / (time.perf_counter() - start) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0, help="total seconds per case and side")
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    cases = {
        "256x84x84 uint8": frames(256),
        "1024x4 float32": rng.standard_normal((1024, 4)).astype(np.float32),
        "16384x4 float32": rng.standard_normal((16384, 4)).astype(np.float32),
    }
    print(f"{'batch':<18} {'qrl MB/s':>10} {'raw MB/s':>10} {'ratio':>7}")
    for name, arr in cases.items():
        ours, raw, ratios = [], [], []
        for i in range(args.rounds):
            # short paired rounds, alternating which side goes first: each ratio compares
            # two measurements taken moments apart, so slow spells of the machine cancel
            sides = (qrl_round, raw_round) if i % 2 == 0 else (raw_round, qrl_round)
            got = {fn: rate(fn, arr, args.seconds / args.rounds) for fn in sides}
            ours.append(got[qrl_round])
            raw.append(got[raw_round])
            ratios.append(got[qrl_round] / got[raw_round])
        q, b, r = statistics.median(ours), statistics.median(raw), statistics.median(ratios)
        print(f"{name:<18} {q:>10.0f} {b:>10.0f} {r:>7.2f}")


if __name__ == "__main__":
    main()
