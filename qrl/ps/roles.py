"""The parameter-server role an algorithm adds (no torch here: builders import it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qrl.ps.protocol import GRADIENTS_KEY, PARAMS_KEY, STATE_KEY
from qrl.runtime.algorithm import RoleContext, RoleDef
from qrl.runtime.roles import (
    CONSUMER_SCRIPTS,
    LEARNER_PROGRESS,
    PRODUCER_SCRIPTS,
    PUBLISHER_SCRIPTS,
    Access,
    Reports,
)
from qrl.wire.chunks import chunked

SHOWN = (
    "staleness_p50",
    "staleness_max",
    "lag_0",
    "lag_1_3",
    "lag_4_15",
    "lag_16_up",
    "stale",
    "future",
    "outlier",
    "norm",
    "flood",
    "rejected",
)
# what a worker (A3C's actor-learner, Gorila's learner) needs of the servers' keys: it reads
# the blocks and appends gradients to its own streams (``mine``: a per-instance user, qrl
# run join's, writes its own number's only, so the server can tell whose a gradient is);
# it never writes a block or a server's saved state, so (on Redis 7, whose read-only key
# patterns this takes) one worker's user cannot set the parameters a restarted server
# resumes from. The servers write them all.
PS_WORKER = Access(reads=chunked(PARAMS_KEY), mine=(GRADIENTS_KEY,), scripts=PRODUCER_SCRIPTS)
PS_SERVER = Access(
    writes=(GRADIENTS_KEY.replace("{id}", "*"), *chunked(PARAMS_KEY, STATE_KEY, "weights")),
    scripts=(*CONSUMER_SCRIPTS, *PUBLISHER_SCRIPTS),
)


def ps_role(
    algo: str,
    build: Callable[[Any, Any], Any],
    optimizer: Callable[[list[Any], Any], Any],
    pushers: str,
) -> RoleDef:
    """``ps_shards`` server processes (``--id K``: shard K) of the network ``build(cfg, env)``
    makes, stepping it with ``optimizer(params, cfg)``, for the config field ``pushers``'s
    number of workers; shard 0 writes the checkpoint and follows the run's metrics into the
    run dir."""

    def make(ctx: RoleContext) -> Any:
        import torch

        from qrl.ps.server import ParameterServer
        from qrl.rl.envspec import EnvSpec

        torch.manual_seed(ctx.cfg.seed)  # every shard cuts its block of the same network
        net = build(ctx.cfg, ctx.env or EnvSpec.of(ctx.cfg.env))
        return ParameterServer(
            ctx.client,
            ctx.keys,
            ctx.cfg,
            ctx.ident,
            net,
            optimizer,
            algo=algo,
            checkpoint=ctx.checkpoint,
            workers=getattr(ctx.cfg, pushers),
        )

    return RoleDef(
        "ps",
        ("ps", algo),
        make,
        f"A parameter-server shard of an {algo} run: applies its block's gradients as they "
        "come, publishes the block (shard 0 also the whole network, and the checkpoint); "
        "resumes from Redis after a restart.",
        PS_SERVER,
        Reports("updates", SHOWN, LEARNER_PROGRESS),
        order=1,
        count="ps_shards",
        limit="updates",
        checkpoints=True,
        logs_run=True,
        group=True,
        turns=True,  # its waits (the gradient reads, its publish and share timers) read the clock
    )


def gradient_streams(pushers: str) -> Callable[[Any, dict[str, Any]], dict[str, str]]:
    """``qrl status``'s streams of a run whose config field ``pushers`` counts its workers:
    each shard's gradient streams of those workers, ``gradients:SHARD:WORKER`` (the servers
    also read the streams of numbers above them, which a restarted or added worker may hold:
    not listed)."""

    def streams(keys: Any, config: dict[str, Any]) -> dict[str, str]:
        from qrl.ps.protocol import gradients, shard_keys
        from qrl.wire.keys import MAX_SHARDS

        def number(field: str, most: int) -> int:  # (the config as stored: checked)
            n = config.get(field, 1)
            return n if isinstance(n, int) and 1 <= n <= most else 1

        n, workers = number("ps_shards", MAX_SHARDS), number(pushers, 4096)  # (configs' cap)
        return {
            f"gradients:{k}:{w}": gradients(shard_keys(keys, n, k), w)
            for k in range(n)
            for w in range(workers)
        }

    return streams
