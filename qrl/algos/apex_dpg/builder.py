"""Ape-X DPG (Horgan et al. 2018, the continuous-action half of Ape-X): actors with a
deterministic policy and per-actor Gaussian noise -> the Ape-X experience stream, replay
fillers and prioritized replay -> a TD3-style learner -> the actor network -> actors.

The replay role, the streams and the status lines are Ape-X's own (one replay for both)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qrl.algos.apex_dpg.config import ApexDPGConfig
from qrl.algos.apex_family import builder as family
from qrl.algos.apex_family.builder import replay_role, status, streams, transition_filler
from qrl.runtime.algorithm import Algorithm, Policy, RoleContext, actor_role, learner_role

if TYPE_CHECKING:
    from qrl.rl.envspec import EnvSpec


def _actor(ctx: RoleContext) -> Any:
    from functools import partial

    import numpy as np

    from qrl.actors.actor import Actor
    from qrl.actors.apex_dpg import NoisyDPG, initial_priorities
    from qrl.actors.envs import EnvRunner
    from qrl.actors.replay import ReplaySink, Transitions
    from qrl.actors.weights import Weights, local_net
    from qrl.algos.apex_dpg.dpg import policy_net

    cfg, client, keys = ctx.cfg, ctx.client, ctx.keys
    runner = EnvRunner(cfg, ctx.ident, ctx.env)
    low, high = runner.env.box_actions()
    net = local_net(policy_net(runner.obs_shape, len(low), cfg.hidden))
    priorities = partial(initial_priorities, cfg.initial_priority)
    return Actor(
        cfg,
        runner,
        NoisyDPG(net, cfg, ctx.ident, low, high),
        Weights(client, keys, net, cfg.weight_poll),
        ReplaySink(
            client, keys, cfg, ctx.ident, Transitions(cfg, runner.env, np.float32, priorities)
        ),
    )


def _learner(ctx: RoleContext) -> Any:
    """Ape-X DPG's learner: the TD3-style rule on the replay's batches."""
    from qrl.learners.apex_dpg import DPGRule
    from qrl.learners.base import Learner, prepare
    from qrl.learners.replay import ReplaySource

    cfg = ctx.cfg
    device, env = prepare(ctx)
    rule = DPGRule(cfg, env, device)
    source = ReplaySource(ctx.connect, ctx.keys, cfg, device, rule.layout)
    return Learner.publishing(ctx, device, rule, source, "apex-dpg", cfg.publish_every)


def _policy(cfg: ApexDPGConfig, env: EnvSpec, params: dict[str, Any]) -> Policy:
    """The deterministic actor, scaled to the Box's bounds; ``params`` are published
    weights (``actor.*``) or a checkpoint's whole model (the critics are left out)."""
    import numpy as np
    import torch

    from qrl.algos.apex_dpg.dpg import policy_net, scale_action
    from qrl.wire.weights import load_arrays

    low, high = env.box_actions()
    net = policy_net(env.obs_shape, len(low), cfg.hidden)
    load_arrays(net, {k: v for k, v in params.items() if k.startswith("actor.")})

    @torch.no_grad()
    def act(obs: np.ndarray) -> np.ndarray:
        return scale_action(net["actor"](torch.as_tensor(np.asarray(obs))).numpy(), low, high)

    return act


ALGORITHM = Algorithm(
    name="apex-dpg",
    config=ApexDPGConfig,
    summary="""Ape-X DPG: Ape-X for continuous (Box) actions, with a TD3-style learner; exits
    0 iff the greedy evaluation reached the target return (1: budget ran out, 2: a role
    failed).

    \b
    qrl train apex-dpg --env Pendulum-v1 --seed 0 --target-return -200
    """,
    roles=(
        replay_role(transition_filler),
        learner_role(
            "learner",
            ("learner", "apex-dpg"),
            _learner,
            "The Ape-X DPG learner of a run: twin critics and an actor trained on the replay; "
            "publishes the actor.",
            writes=family.LEARNER_WRITES,
            scripts=family.LEARNER_SCRIPTS,
            progress=family.LEARNER_PROGRESS,
        ),
        actor_role(
            "actor",
            ("actor", "apex-dpg"),
            _actor,
            "An Ape-X DPG actor: plays the published actor plus Gaussian noise, pushes n-step "
            "transitions.",
            reads=family.ACTOR_READS,
            writes=family.ACTOR_WRITES,
            scripts=family.ACTOR_SCRIPTS,
            count="actors",
        ),
    ),
    policy=_policy,
    weights_key=lambda keys: keys.weights,
    streams=streams,
    status=status,
    actions=frozenset({"continuous"}),
    pbt="snapshot",
)
