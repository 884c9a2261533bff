"""Ape-X (Horgan et al. 2018): actors -> experience stream -> replay fillers -> prioritized
replay in Redis -> learner (double DQN, dueling, n-step) -> weights -> actors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qrl.algos.apex.config import ApexConfig
from qrl.algos.apex_family import builder as family
from qrl.algos.apex_family.builder import replay_role, status, streams, transition_filler
from qrl.runtime.algorithm import Algorithm, RoleContext, actor_role, learner_role, torch_policy

if TYPE_CHECKING:
    from qrl.rl.envspec import EnvSpec


def _actor(ctx: RoleContext) -> Any:
    from qrl.actors.dqn import dqn_actor

    return dqn_actor(ctx)


def _learner(ctx: RoleContext) -> Any:
    """Ape-X's learner: the double-DQN rule on the replay's batches."""
    from qrl.learners.base import Learner, prepare
    from qrl.learners.dqn import DQNRule
    from qrl.learners.replay import ReplaySource

    cfg = ctx.cfg
    device, env = prepare(ctx)
    rule = DQNRule(cfg, env, device)
    source = ReplaySource(ctx.connect, ctx.keys, cfg, device, rule.layout)
    return Learner.publishing(ctx, device, rule, source, "apex", cfg.publish_every)


def _q_network(cfg: ApexConfig, env: EnvSpec) -> Any:
    from qrl.rl.models import q_network

    return q_network(cfg, env)


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
        replay_role(transition_filler),
        learner_role(
            "learner",
            ("learner", "apex"),
            _learner,
            "The Ape-X learner of a run: trains on the replay and publishes the weights.",
            writes=family.LEARNER_WRITES,
            scripts=family.LEARNER_SCRIPTS,
            progress=family.LEARNER_PROGRESS,
        ),
        actor_role(
            "actor",
            ("actor", "apex"),
            _actor,
            "An Ape-X actor: joins the run, plays epsilon-greedy, pushes n-step transitions.",
            reads=family.ACTOR_READS,
            writes=family.ACTOR_WRITES,
            scripts=family.ACTOR_SCRIPTS,
            count="actors",
        ),
    ),
    policy=torch_policy(_q_network),
    weights_key=lambda keys: keys.weights,
    streams=streams,
    status=status,
    pbt="snapshot",
)
