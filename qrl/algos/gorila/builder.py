"""Gorila: actors -> experience stream -> replay fillers -> prioritized replay -> learners
-> each its own gradient stream of each shard -> parameter-server shards (Adam) -> weights
-> actors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qrl.algos.apex_family import builder as family
from qrl.algos.apex_family.builder import replay_role, status, transition_filler
from qrl.algos.gorila.config import GorilaConfig
from qrl.ps.roles import PS_WORKER, gradient_streams, ps_role
from qrl.runtime.algorithm import Algorithm, RoleContext, actor_role, learner_role, torch_policy
from qrl.runtime.roles import Access, Reports

if TYPE_CHECKING:
    import torch

    from qrl.rl.envspec import EnvSpec
    from qrl.wire.keys import RunKeys


def _q_network(cfg: GorilaConfig, env: EnvSpec) -> Any:
    from qrl.rl.models import q_network

    return q_network(cfg, env)


def _optimizer(params: list[torch.nn.Parameter], cfg: GorilaConfig) -> torch.optim.Optimizer:
    import torch

    return torch.optim.Adam(params, lr=cfg.lr, eps=cfg.adam_eps)


def _learner(ctx: RoleContext) -> Any:
    """A Gorila learner: the double-DQN rule on the replay's batches (each learner its own
    draws), its gradients pushed to the parameter server; it publishes nothing and keeps no
    checkpoint (the servers do)."""
    from qrl.learners.base import Learner, prepare
    from qrl.learners.dqn import DQNRule
    from qrl.learners.gorila import PSStep
    from qrl.learners.replay import ReplaySource

    cfg = ctx.cfg
    device, env = prepare(ctx)
    rule = DQNRule(cfg, env, device, own_target=False)
    seed = cfg.seed * 1000 + ctx.ident
    source = ReplaySource(ctx.connect, ctx.keys, cfg, device, rule.layout, seed=seed)
    client = ctx.connect()
    step = PSStep(client, ctx.keys, cfg, rule, ctx.ident)
    return Learner(ctx, device, rule, source, step=step, client=client)


def _actor(ctx: RoleContext) -> Any:
    from qrl.actors.dqn import dqn_actor

    return dqn_actor(ctx)


def _streams(keys: RunKeys, config: dict[str, Any]) -> dict[str, str]:
    return {**family.streams(keys, config), **gradient_streams("learners")(keys, config)}


ALGORITHM = Algorithm(
    name="gorila",
    config=GorilaConfig,
    summary="""Gorila: Ape-X's actors and replay, learner processes (--learners N) that push
    double-DQN gradients to parameter-server shards in Redis (ps_shards), which apply them
    asynchronously and drop stale and outlier-loss ones; exits 0 iff the greedy evaluation
    reached the target return (1: budget ran out, 2: a role failed).

    \b
    qrl train gorila --env CartPole-v1 --seed 0 --learners 2
    """,
    roles=(
        replay_role(transition_filler),
        ps_role("gorila", _q_network, _optimizer, "learners"),
        learner_role(
            "learner",
            ("learner", "gorila"),
            _learner,
            "A Gorila learner: samples the replay, pushes double-DQN gradients to the "
            "parameter server, pulls its parameters; several may run.",
            writes=(),
            scripts=(),
            access=Access(
                reads=PS_WORKER.reads,
                writes=("replay:*",),
                mine=PS_WORKER.mine,
                scripts=(*family.SAMPLER_SCRIPTS, *PS_WORKER.scripts),
            ),
            # the servers' updates are the run's: a learner's feed only the replay's size
            reports=Reports("updates", ("skipped", "version"), family.LEARNER_PROGRESS),
            count="learners",
            checkpoints=False,
            logs_run=False,
        ),
        actor_role(
            "actor",
            ("actor", "gorila"),
            _actor,
            "A Gorila actor (Ape-X's): plays epsilon-greedy, pushes n-step transitions.",
            reads=family.ACTOR_READS,
            writes=family.ACTOR_WRITES,
            scripts=family.ACTOR_SCRIPTS,
            count="actors",
        ),
    ),
    policy=torch_policy(_q_network),
    weights_key=lambda keys: keys.weights,
    streams=_streams,
    status=status,
)
