"""IMPALA (Espeholt et al. 2018): actors -> trajectory stream -> V-trace learner -> weights."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qrl.algos.impala.config import ImpalaConfig
from qrl.algos.impala.keys import trajectories
from qrl.algos.impala.messages import KIND
from qrl.inference.roles import inference_role, stepper_role
from qrl.runtime.algorithm import Algorithm, RoleContext, actor_role, learner_role, torch_policy
from qrl.runtime.config import central
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
    from qrl.actors.impala import trajectory_sink
    from qrl.actors.unrolls import SampledPolicy
    from qrl.actors.weights import Weights, local_net

    cfg = ctx.cfg
    runner = EnvRunner(cfg, ctx.ident, ctx.env)
    sink = trajectory_sink(ctx.client, ctx.keys, cfg, ctx.ident, runner.env)
    net = local_net(_policy_value_net(cfg, runner.env))
    return Actor(
        cfg,
        runner,
        SampledPolicy(net, cfg, ctx.ident),
        Weights(ctx.client, ctx.keys, net, cfg.weight_poll),
        sink,
    )


def _learner(ctx: RoleContext) -> Any:
    """IMPALA's learner: the V-trace rule on the trajectory stream's unrolls (lagging ones
    dropped, a batch taken again while no fresh one waits)."""
    from qrl.algos.impala.messages import unroll_schema
    from qrl.learners.base import Learner, prepare
    from qrl.learners.impala import LOADER_NICE, ImpalaRule, Lag, Passes
    from qrl.learners.unrolls import UnrollSource

    cfg = ctx.cfg
    device, env = prepare(ctx)
    rule = ImpalaRule(cfg, env, device)
    unrolls = UnrollSource(
        ctx.connect,
        ctx.keys,
        cfg,
        env,
        device,
        stream=trajectories(ctx.keys),
        schema=unroll_schema,
        admit=Lag(cfg.max_policy_lag),
        nice=LOADER_NICE,
    )
    source = Passes(unrolls, cfg.passes)
    return Learner.publishing(ctx, device, rule, source, "impala", cfg.publish_every)


def _policy_value_net(cfg: ImpalaConfig, env: EnvSpec) -> Any:
    from qrl.rl.models import policy_value_net

    return policy_value_net(cfg, env)


def _server(ctx: RoleContext) -> Any:
    from qrl.inference.server import server_maker
    from qrl.inference.unrolls import unroll_agent

    return server_maker(unroll_agent(_policy_value_net, trajectories, KIND))(ctx)


ALGORITHM = Algorithm(
    name="impala",
    config=ImpalaConfig,
    summary="""IMPALA: learner and actor processes around one Redis, V-trace off-policy
    correction; exits 0 iff the greedy evaluation reached the target return (1: budget ran
    out, 2: a role failed).

    \b
    qrl train impala --env CartPole-v1 --seed 0
    qrl train impala --env LunarLander-v3 --max-time 1200 --eval-every 30
    """,
    roles=(
        learner_role(
            "learner",
            ("learner", "impala"),
            _learner,
            "An IMPALA learner of a run: V-trace on the actors' unrolls, publishes weights; "
            "with the config's `learners` > 1, one of a pool that meets through Redis and "
            "averages its gradients.",
            writes=("trajectories", *chunked("weights"), "learners:*"),
            scripts=(*CONSUMER_SCRIPTS, *PUBLISHER_SCRIPTS, *POOL_SCRIPTS),
            # the lag it measures on the unrolls it trains on, and the unrolls it dropped
            progress=(Feed(POLICY_LAG, "policy_lag"), shown_only("dropped")),
            count="learners",
            group=True,
        ),
        actor_role(
            "actor",
            ("actor", "impala"),
            _actor,
            "An IMPALA actor: joins the run, samples from the policy, pushes unrolls.",
            reads=chunked("weights"),
            writes=("trajectories",),
            scripts=PRODUCER_SCRIPTS,
            count="actors",
            when=lambda cfg: not central(cfg),
        ),
        inference_role("impala", _server, writes=("trajectories",)),
        stepper_role("impala"),
    ),
    policy=torch_policy(_policy_value_net),
    weights_key=lambda keys: keys.weights,
    streams=lambda keys, config: {"trajectories": trajectories(keys)},
    pbt="snapshot",
)
