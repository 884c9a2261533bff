"""Ape-X (Horgan et al. 2018): actors -> experience stream -> replay fillers -> prioritized
replay in Redis -> learner (double DQN, dueling, n-step) -> weights -> actors."""

from __future__ import annotations

from typing import Any

import redis

from qrl.algos.base import Algorithm, RoleContext, RoleDef, torch_policy
from qrl.configs.apex import ApexConfig
from qrl.keys import MAX_SHARDS, RunKeys


def _actor(ctx: RoleContext) -> Any:
    from qrl.actors.apex import ApexActor

    return ApexActor(ctx.client, ctx.keys, ctx.cfg, ctx.ident)


def _replay(ctx: RoleContext) -> Any:
    from qrl.replay.role import ReplayFiller

    return ReplayFiller(ctx.client, ctx.keys, ctx.cfg, ctx.ident)


def _learner(ctx: RoleContext) -> Any:
    from qrl.learners.apex import ApexLearner

    return ApexLearner(
        ctx.connect, ctx.keys, ctx.cfg, ctx.device, checkpoint=ctx.checkpoint, threads=ctx.threads
    )


def _shards(keys: RunKeys, config: dict[str, Any]) -> list[RunKeys]:
    """The keys of the run's replay shards, as its stored config says (1 if it says
    nothing sensible)."""
    n = config.get("replay_shards", 1)
    return keys.shards(n if isinstance(n, int) and 1 <= n <= MAX_SHARDS else 1)


def _streams(keys: RunKeys, config: dict[str, Any]) -> dict[str, str]:
    shards = _shards(keys, config)
    if len(shards) == 1:
        return {"experience": keys.experience}
    return {f"experience.{s}": k.experience for s, k in enumerate(shards)}


def _status(client: redis.Redis, keys: RunKeys, config: dict[str, Any]) -> dict[str, Any]:
    shards = _shards(keys, config)
    size = sum(client.zcard(k.replay_priorities) for k in shards)
    if len(shards) == 1:
        return {"replay_size": size}
    dead = sum(client.xlen(k.deadletter) for k in shards)
    return {"replay_size": size, "replay_shards": len(shards), "shard_dead_letters": dead}


def _q_network(cfg: ApexConfig) -> Any:
    from qrl.envs import env_spec
    from qrl.models import QNetwork

    obs_shape, _, n_actions = env_spec(cfg.env)
    return QNetwork(obs_shape, n_actions, cfg.hidden, cfg.dueling)


ALGORITHM = Algorithm(
    name="apex",
    config=ApexConfig,
    summary="""Ape-X: replay, learner and actor processes around one Redis; exits 0 iff the
    greedy evaluation reached the target return (1: budget ran out, 2: a role failed).

    \b
    qrl train apex --env CartPole-v1 --seed 0
    qrl train apex --env LunarLander-v3 --max-time 1200 --eval-every 30 --set lr=5e-4
    """,
    roles=(
        RoleDef(
            "replay",
            ("replay",),
            "service",
            _replay,
            "Drain a run's experience stream into its prioritized replay (several may run; "
            "filler i drains shard i mod replay_shards).",
            count="replays",
            least=lambda cfg: cfg.replay_shards,  # one filler per shard at least
        ),
        RoleDef(
            "learner",
            ("learner", "apex"),
            "learner",
            _learner,
            "The Ape-X learner of a run: trains on the replay and publishes the weights.",
            torch=True,
        ),
        RoleDef(
            "actor",
            ("actor", "apex"),
            "actor",
            _actor,
            "An Ape-X actor: joins the run, plays epsilon-greedy, pushes n-step transitions.",
            count="actors",
        ),
    ),
    policy=torch_policy(_q_network),
    weights_key=lambda keys: keys.weights,
    streams=_streams,
    status=_status,
)
