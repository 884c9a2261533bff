"""Redis memory per Ape-X transition on Atari (ALE/Pong-v5, 84x84 grayscale, stack 4,
n-step 3), against the LZ4-compressed size of one 84x84 frame.

    python benchmarks/atari_bytes.py [--transitions 20000] [--envs 8] [--actor-batch 256]

A real Ape-X actor (Nature CNN with the initial weights, the per-slot epsilons) plays Pong
and pushes its batches to the experience stream; a real replay filler drains them into the
frame replay (qrl/replay/frames.py), whose capacity is ``--transitions`` (measured full, as a
replay runs). Bytes per transition, two ways, each divided by the transitions present:
the ``used_memory`` Redis frees when the replay's keys are deleted (exactly what they hold;
the growth of ``used_memory`` over the fill also counts client buffers and the weights, and
moves with them) and the sum of ``MEMORY USAGE`` over those keys. Then the chunks stored are
inserted again and again into a replay of ``--million`` transitions (default 1M), whose
``used_memory`` freed on delete is the memory 1M Pong transitions take. One frame's LZ4 size is
the mean over every distinct frame stored, each compressed alone with the settings the
replay stores with (``lz4.block``, default mode, no size header). For scale, the plain
layout (obs and next obs stacks raw in every record) is measured on 1000 transitions.
"""

from __future__ import annotations

import argparse
from typing import Any

import lz4.block
import numpy as np
import redis

from qrl.actors.actor import Actor
from qrl.algos import ALGOS
from qrl.algos.apex.config import ApexConfig
from qrl.replay.frames import FrameBatch, FrameLayout, FrameReplay
from qrl.replay.role import ReplayFiller
from qrl.replay.store import PrioritizedReplay, RecordLayout
from qrl.runtime.algorithm import RoleContext
from qrl.runtime.runs import create_run
from qrl.server.embedded import EmbeddedRedis
from qrl.wire.connection import connect
from qrl.wire.keys import RunKeys
from qrl.wire.weights import WeightStore

ENV = "ALE/Pong-v5"


def replay_keys(keys: RunKeys) -> list[str]:
    return [
        keys.replay_priorities,
        keys.replay_data,
        keys.replay_frames,
        keys.replay_index,
        keys.replay_meta,
        keys.replay_batches,
    ]


def replay_bytes(client: redis.Redis, keys: RunKeys) -> int:
    return sum(client.memory_usage(k, samples=0) or 0 for k in replay_keys(keys))


def frame_sizes(client: redis.Redis, keys: RunKeys, layout: FrameLayout) -> list[int]:
    """The LZ4 size of every frame stored, each compressed alone."""
    sizes = []
    for _, chunk in client.hscan_iter(keys.replay_frames):
        for row in layout.chunk_frames(chunk):
            sizes.append(len(lz4.block.compress(row.tobytes(), store_size=False)))
    return sizes


def actor_of(algo: str, client: redis.Redis, keys: RunKeys, cfg: Any, ident: int = 0) -> Actor:
    """``algo``'s actor as its builder makes it for process ``ident``."""
    return ALGOS[algo].role("actor").make(RoleContext(client, lambda: client, keys, cfg, ident))


def fill_from_actor(
    client: redis.Redis,
    keys: RunKeys,
    cfg: ApexConfig,
    n: int,
    algo: str = "apex",
    filler_type: type = ReplayFiller,
) -> Actor:
    """A real actor (with the initial weights, published) and a replay filler for each replay
    shard on the run; they play until ``n`` items (transitions; R2D2's sequences) were
    inserted."""
    actor = actor_of(algo, client, keys, cfg)
    shards = getattr(cfg, "replay_shards", 1)
    fillers = [filler_type(client, keys, cfg, ident) for ident in range(shards)]
    WeightStore(client, keys).publish(actor.weights.net, version=0)
    never = lambda: False  # noqa: E731
    actor.start(never)
    while sum(f.inserted for f in fillers) < n:
        actor.step(never)
        if actor.weights.units % 32 == 0:
            for f in fillers:
                while f.consumer.process(f.handle, block_ms=1):
                    pass
    return actor


def scale_up(client: redis.Redis, keys: RunKeys, layout: FrameLayout, total: int) -> float:
    """Bytes per transition of a replay of ``total`` transitions (its capacity): the stored
    chunks re-inserted again and again, each as one batch, into a new run's replay."""
    chunks = []
    for _, blob in client.hscan_iter(keys.replay_frames):
        recs, _, _, _ = layout.parse(blob)
        frames = layout.chunk_frames(blob)
        counts = np.asarray([(len(recs), len(frames))], np.int32)
        chunks.append(
            FrameBatch(frames, counts, recs["refs"], *(recs[k] for k in ("action", "ret", "disc")))
        )
    big = RunKeys("bench-atari-1m")
    replay = FrameReplay(client, big, layout, total)
    while replay.size() < total:
        for c in chunks:
            replay.insert(c, np.ones(len(c)))
    held = int(client.info("memory")["used_memory"])
    n = replay.size()
    client.delete(*replay_keys(big))
    return (held - int(client.info("memory")["used_memory"])) / n


def plain_bytes(client: redis.Redis, actor: Actor, n: int) -> float:
    """Bytes per transition with obs and next obs raw in every record (today's layout)."""
    keys = RunKeys("bench-plain")
    replay = PrioritizedReplay(client, keys, RecordLayout(actor.runner.obs_shape, "uint8"), n)
    obs = actor.runner.obs
    stacks = np.repeat(obs, -(-n // len(obs)), axis=0)[:n]
    recs = replay.layout.pack(stacks, np.zeros(n), np.zeros(n), np.ones(n), stacks)
    for s in range(0, n, 100):
        replay.insert(recs[s : s + 100], np.ones(len(recs[s : s + 100])))
    return replay_bytes(client, keys) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transitions", type=int, default=20_000)
    ap.add_argument("--envs", type=int, default=8, help="envs per actor (chunks per batch)")
    ap.add_argument("--actor-batch", type=int, default=256, help="transitions per batch")
    ap.add_argument("--million", type=int, default=1_000_000, help="replay size to scale to")
    args = ap.parse_args()
    cfg = ApexConfig(
        env=ENV,
        n_step=3,
        envs_per_actor=args.envs,
        actor_batch=args.actor_batch,
        replay_capacity=args.transitions,  # measured full, as a replay runs
        steps_per_update=0,
        stream_maxlen=1_000_000,
    )
    with EmbeddedRedis() as server:
        client = connect(server.url)
        keys = RunKeys("bench-atari")
        create_run(client, keys, "apex", cfg)
        actor = fill_from_actor(client, keys, cfg, args.transitions)
        n = int(client.zcard(keys.replay_priorities))
        usage = replay_bytes(client, keys) / n
        layout = FrameLayout(actor.runner.obs_shape, "uint8", actor.runner.env.discrete_actions())
        sizes = frame_sizes(client, keys, layout)
        held = int(client.info("memory")["used_memory"])
        big = scale_up(client, keys, layout, args.million) if args.million else 0.0
        client.delete(*replay_keys(keys))
        freed = (held - int(client.info("memory")["used_memory"])) / n
        frame = float(np.mean(sizes))
        plain = plain_bytes(client, actor, 1000)
    print(f"{ENV}, stack 4, n-step 3: {n} transitions from 1 actor x {args.envs} envs, ")
    print(f"batches of {args.actor_batch} (~{args.actor_batch // args.envs} per env-slot chunk)")
    print(f"{'one 84x84 frame, LZ4 block (mean)':<42} {frame:>10.0f} B")
    print(f"{'frames stored per transition':<42} {len(sizes) / n:>10.3f}")
    for what, b in (("freed on DEL", freed), ("MEMORY USAGE", usage)):
        print(f"{'bytes/transition (' + what + ')':<42} {b:>10.0f} B  ratio {b / frame:.2f}")
    print(f"{'1M transitions, projected from those':<42} {freed * 1e6 / 2**30:>10.3f} GiB")
    if big:
        m = args.million
        print(
            f"{f'bytes/transition, {m} in the replay':<42} {big:>10.0f} B  ratio {big / frame:.2f}"
        )
        print(f"{f'{m} transitions (freed on DEL)':<42} {big * m / 2**30:>10.3f} GiB")
    print(f"{'plain layout bytes/transition':<42} {plain:>10.0f} B  ({plain / freed:.0f}x)")


if __name__ == "__main__":
    main()
