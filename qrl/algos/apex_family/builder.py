"""What the Ape-X family's builders (Ape-X, Ape-X DPG, R2D2) share: the `qrl replay` role
(its filler per algorithm), what its actors and learner read and write, and the streams and
status lines of a sharded replay."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis

from qrl.runtime.algorithm import RoleContext, RoleDef
from qrl.runtime.roles import (
    CONSUMER_SCRIPTS,
    PRODUCER_SCRIPTS,
    PUBLISHER_SCRIPTS,
    REPLAY_SIZE,
    Access,
    Feed,
    Reports,
)
from qrl.wire.chunks import chunked
from qrl.wire.keys import MAX_SHARDS, RunKeys

# the keys (within the run's prefix and its shards') each role reads and writes, and the
# scripts it runs: actors push to the experience streams, fillers drain them into the
# replay, the learner samples the replay and publishes the weights. A replay's scripts are
# those of transitions (qrl.replay.store) and of stacked frames (qrl.replay.frames): the
# config picks one
ACTOR_READS = chunked("weights")
ACTOR_WRITES = ("experience",)
ACTOR_SCRIPTS = PRODUCER_SCRIPTS
FILLER_SCRIPTS = ("replay.insert", "frames.insert")
SAMPLER_SCRIPTS = (
    "replay.fetch_ranks",
    "replay.sample_proportional",
    "frames.fetch_ranks",
    "frames.sample_proportional",
)
LEARNER_WRITES = ("replay:*", *chunked("weights"))
LEARNER_SCRIPTS = (*SAMPLER_SCRIPTS, *PUBLISHER_SCRIPTS)
LEARNER_PROGRESS = (Feed(REPLAY_SIZE, "replay_size"),)


def replay_role(filler: Callable[[RoleContext], Any]) -> RoleDef:
    """``qrl replay``: the processes that drain a run's experience streams into its replay
    (``filler`` makes one: the transitions' or R2D2's sequences' filler). Started first;
    the replay's size is the sum of the latest size a filler of each shard reported."""
    return RoleDef(
        "replay",
        ("replay",),
        filler,
        "Drain a run's experience stream into its prioritized replay (several may run; "
        "filler i drains shard i mod replay_shards).",
        access=Access(
            writes=(*ACTOR_WRITES, "replay:*"), scripts=(*CONSUMER_SCRIPTS, *FILLER_SCRIPTS)
        ),
        reports=Reports(
            "inserted",
            ("rejected",),
            (Feed(REPLAY_SIZE, "size", "sum", by="shard", bound=MAX_SHARDS),),
        ),
        order=0,
        count="replays",
        least=lambda cfg: cfg.replay_shards,  # one filler per shard at least
        turns=True,
    )


def transition_filler(ctx: RoleContext) -> Any:
    """The filler of n-step transitions (Ape-X and Ape-X DPG)."""
    from qrl.replay.role import ReplayFiller

    return ReplayFiller(ctx.client, ctx.keys, ctx.cfg, ctx.ident, env=ctx.env)


def _shards(keys: RunKeys, config: dict[str, Any]) -> list[RunKeys]:
    """The keys of the run's replay shards, as its stored config says (1 if it says
    nothing sensible)."""
    n = config.get("replay_shards", 1)
    return keys.shards(n if isinstance(n, int) and 1 <= n <= MAX_SHARDS else 1)


def streams(keys: RunKeys, config: dict[str, Any]) -> dict[str, str]:
    shards = _shards(keys, config)
    if len(shards) == 1:
        return {"experience": keys.experience}
    return {f"experience.{s}": k.experience for s, k in enumerate(shards)}


def status(client: redis.Redis, keys: RunKeys, config: dict[str, Any]) -> dict[str, Any]:
    shards = _shards(keys, config)
    size = sum(client.zcard(k.replay_priorities) for k in shards)
    if len(shards) == 1:
        return {"replay_size": size}
    dead = sum(client.xlen(k.deadletter) for k in shards)
    return {"replay_size": size, "replay_shards": len(shards), "shard_dead_letters": dead}
