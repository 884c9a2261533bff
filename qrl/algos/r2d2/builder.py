"""R2D2 (Kapturowski et al. 2019): actors with an LSTM Q-network -> overlapping sequences
with their starting recurrent state -> the Ape-X stream, fillers and prioritized replay
(one item per sequence) -> a learner that replays a burn-in before its n-step double-Q
loss under value rescaling -> weights -> actors.

The streams and the status lines are Ape-X's; its replay role is its own (``qrl replay``
of an R2D2 run fills the replay with sequences)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qrl.algos.apex_family import builder as family
from qrl.algos.apex_family.builder import replay_role, status, streams
from qrl.algos.r2d2.config import R2D2Config
from qrl.inference.roles import inference_role, stepper_role
from qrl.runtime.algorithm import Algorithm, Policy, RoleContext, actor_role, learner_role
from qrl.runtime.config import central

if TYPE_CHECKING:
    from qrl.rl.envspec import EnvSpec


def _actor(ctx: RoleContext) -> Any:
    from qrl.actors.actor import Actor
    from qrl.actors.envs import EnvRunner
    from qrl.actors.r2d2 import RecurrentEpsilonGreedy, SequenceItems
    from qrl.actors.replay import ReplaySink
    from qrl.actors.weights import Weights, local_net

    cfg, client, keys = ctx.cfg, ctx.client, ctx.keys
    runner = EnvRunner(cfg, ctx.ident, ctx.env)
    net = local_net(_q_network(cfg, runner.env))
    return Actor(
        cfg,
        runner,
        RecurrentEpsilonGreedy(net, cfg, ctx.ident, runner.env.discrete_actions()),
        Weights(client, keys, net, cfg.weight_poll),
        ReplaySink(client, keys, cfg, ctx.ident, SequenceItems(net, cfg, runner.env)),
    )


def _replay(ctx: RoleContext) -> Any:
    from qrl.replay.sequences import SequenceFiller

    return SequenceFiller(ctx.client, ctx.keys, ctx.cfg, ctx.ident, env=ctx.env)


def _learner(ctx: RoleContext) -> Any:
    """R2D2's learner: its rule on the replay's sequences, once it holds start_sequences."""
    from qrl.learners.base import Learner, prepare
    from qrl.learners.r2d2 import R2D2Rule, SequenceBatch
    from qrl.learners.replay import ReplaySource

    cfg = ctx.cfg
    device, env = prepare(ctx)
    rule = R2D2Rule(cfg, env, device)
    source = ReplaySource(
        ctx.connect,
        ctx.keys,
        cfg,
        device,
        rule.layout,
        batch=SequenceBatch,
        start_items=cfg.start_sequences,
    )
    return Learner.publishing(ctx, device, rule, source, "r2d2", cfg.publish_every)


def _q_network(cfg: R2D2Config, env: EnvSpec) -> Any:
    from qrl.rl.models import recurrent_q_network

    return recurrent_q_network(cfg, env)


def _server(ctx: RoleContext) -> Any:
    from qrl.inference.sequences import sequence_agent
    from qrl.inference.server import server_maker

    return server_maker(sequence_agent(_q_network))(ctx)


def _policy(cfg: R2D2Config, env: EnvSpec, params: dict[str, Any]) -> Policy:
    """The greedy policy of the LSTM Q-network; it keeps the LSTM state between calls
    (``.reset()`` starts new episodes; so does a new batch size)."""
    from qrl.algos.r2d2.rule import RecurrentPolicy
    from qrl.wire.weights import load_arrays

    net = _q_network(cfg, env)
    load_arrays(net, params)
    return RecurrentPolicy(net)


ALGORITHM = Algorithm(
    name="r2d2",
    config=R2D2Config,
    summary="""R2D2: Ape-X with an LSTM Q-network trained on stored sequences (for partially
    observed tasks); exits 0 iff the greedy evaluation reached the target return (1: budget
    ran out, 2: a role failed).

    \b
    qrl train r2d2 --env qrl/CartPoleNoVel-v1 --seed 0 --max-time 300
    qrl train r2d2 --set inference=central   # SEED RL: actors only step envs
    """,
    roles=(
        replay_role(_replay),
        learner_role(
            "learner",
            ("learner", "r2d2"),
            _learner,
            "The R2D2 learner of a run: trains on the replay's sequences and publishes the "
            "weights.",
            writes=family.LEARNER_WRITES,
            scripts=family.LEARNER_SCRIPTS,
            progress=family.LEARNER_PROGRESS,
        ),
        actor_role(
            "actor",
            ("actor", "r2d2"),
            _actor,
            "An R2D2 actor: plays epsilon-greedy with an LSTM, pushes overlapping sequences.",
            reads=family.ACTOR_READS,
            writes=family.ACTOR_WRITES,
            scripts=family.ACTOR_SCRIPTS,
            count="actors",
            when=lambda cfg: not central(cfg),
        ),
        inference_role("r2d2", _server, reads=family.ACTOR_READS, writes=family.ACTOR_WRITES),
        stepper_role("r2d2"),
    ),
    policy=_policy,
    weights_key=lambda keys: keys.weights,
    streams=streams,
    status=status,
    pbt="snapshot",
)
