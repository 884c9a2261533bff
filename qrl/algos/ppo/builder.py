"""PPO: actors -> rollout stream -> a pool of synchronous learners (all-reduced gradients)
-> weights."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qrl.algos.ppo.config import PPOConfig
from qrl.algos.ppo.keys import rollouts
from qrl.runtime.algorithm import Algorithm, RoleContext, actor_role, learner_role, torch_policy
from qrl.runtime.roles import (
    CONSUMER_SCRIPTS,
    POLICY_LAG,
    POOL_SCRIPTS,
    PRODUCER_SCRIPTS,
    PUBLISHER_SCRIPTS,
    Feed,
    shown_only,
)
from qrl.wire.chunks import chunked

if TYPE_CHECKING:
    from qrl.rl.envspec import EnvSpec


def _actor(ctx: RoleContext) -> Any:
    from qrl.actors.actor import Actor
    from qrl.actors.envs import EnvRunner
    from qrl.actors.ppo import PacedWeights, rollout_sink
    from qrl.actors.unrolls import SampledPolicy
    from qrl.actors.weights import local_net

    cfg = ctx.cfg
    runner = EnvRunner(cfg, ctx.ident, ctx.env)
    sink = rollout_sink(ctx.client, ctx.keys, cfg, ctx.ident, runner.env)
    net = local_net(_policy_value_net(cfg, runner.env))
    return Actor(
        cfg,
        runner,
        SampledPolicy(net, cfg, ctx.ident),
        PacedWeights(ctx.client, ctx.keys, net, cfg),
        sink,
    )


def _learner(ctx: RoleContext) -> Any:
    """PPO's learner: the clipped objective's epochs of minibatches on the rollout stream's
    fresh rollouts, published every update. With ``pace_actors`` its loader reads nothing
    ahead (one batch per version)."""
    from qrl.algos.ppo.messages import rollout_schema
    from qrl.learners.base import Learner, prepare
    from qrl.learners.ppo import Fresh, PPORule
    from qrl.learners.unrolls import SLOTS, UnrollSource

    cfg = ctx.cfg
    device, env = prepare(ctx)
    rule = PPORule(cfg, env, device)
    source = UnrollSource(
        ctx.connect,
        ctx.keys,
        cfg,
        env,
        device,
        stream=rollouts(ctx.keys),
        schema=rollout_schema,
        admit=Fresh(cfg.max_policy_lag),
        slots=1 if cfg.pace_actors else SLOTS,
    )
    return Learner.publishing(ctx, device, rule, source, "ppo")


def _policy_value_net(cfg: PPOConfig, env: EnvSpec) -> Any:
    from qrl.rl.models import policy_value_net

    return policy_value_net(cfg, env)


ALGORITHM = Algorithm(
    name="ppo",
    config=PPOConfig,
    summary="""PPO: actor processes and a pool of synchronous learners (--learners N: their
    gradients are averaged by torch.distributed, the pool forms through Redis) around one
    Redis; exits 0 iff the greedy evaluation reached the target return (1: budget ran out,
    2: a role failed).

    \b
    qrl train ppo --env CartPole-v1 --seed 0
    qrl train ppo --env LunarLander-v3 --max-time 1200 --eval-every 30 --learners 2
    """,
    roles=(
        learner_role(
            "learner",
            ("learner", "ppo"),
            _learner,
            "A PPO learner of a run: joins the run's learner pool (the config's `learners` "
            "processes, on any machines: they meet through Redis), trains on its share of "
            "the rollouts; the pool's leader publishes weights.",
            writes=("rollouts", *chunked("weights"), "learners:*"),
            scripts=(*CONSUMER_SCRIPTS, *PUBLISHER_SCRIPTS, *POOL_SCRIPTS),
            # the lag it measures on the rollouts it trains on, and those it dropped
            progress=(Feed(POLICY_LAG, "policy_lag"), shown_only("stale")),
            shown=("skipped", "stale", "allreduce_s"),
            count="learners",
            group=True,
        ),
        actor_role(
            "actor",
            ("actor", "ppo"),
            _actor,
            "A PPO actor: joins the run, samples from the policy, pushes rollouts.",
            reads=chunked("weights"),
            writes=("rollouts",),
            scripts=PRODUCER_SCRIPTS,
            count="actors",
        ),
    ),
    policy=torch_policy(_policy_value_net),
    weights_key=lambda keys: keys.weights,
    streams=lambda keys, config: {"rollouts": rollouts(keys)},
    pbt="snapshot",
)
