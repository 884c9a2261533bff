"""A3C: actor-learner processes -> each its own gradient stream of each shard ->
parameter-server shards (a shared RMSProp) -> the parameters, pulled by the workers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qrl.algos.a3c.config import A3CConfig
from qrl.ps.roles import PS_WORKER, gradient_streams, ps_role
from qrl.runtime.algorithm import Algorithm, RoleContext, actor_role, torch_policy

if TYPE_CHECKING:
    import torch

    from qrl.rl.envspec import EnvSpec


def _policy_value_net(cfg: A3CConfig, env: EnvSpec) -> Any:
    from qrl.rl.models import policy_value_net

    return policy_value_net(cfg, env)


def make_optimizer(params: list[torch.nn.Parameter], cfg: A3CConfig) -> torch.optim.Optimizer:
    import torch

    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, eps=cfg.rms_eps)
    return torch.optim.RMSprop(params, lr=cfg.lr, alpha=cfg.rms_alpha, eps=cfg.rms_eps)


def _worker(ctx: RoleContext) -> Any:
    from qrl.actors.a3c import A3CPolicy, GradientSink, PSWeights
    from qrl.actors.actor import Actor
    from qrl.actors.envs import EnvRunner
    from qrl.actors.weights import local_net
    from qrl.ps.client import PSClient

    cfg = ctx.cfg
    runner = EnvRunner(cfg, ctx.ident, ctx.env, cfg.envs_per_worker)
    net = local_net(_policy_value_net(cfg, runner.env))
    ps = PSClient(ctx.client, ctx.keys, cfg, net, ctx.ident, cfg.workers)
    policy = A3CPolicy(net, cfg, ctx.ident)
    sink = GradientSink(net, ps, cfg)
    return Actor(cfg, runner, policy, PSWeights(ps, cfg.pull_every), sink, name="worker")


ALGORITHM = Algorithm(
    name="a3c",
    config=A3CConfig,
    summary="""A3C: actor-learner processes (--workers N) push n-step advantage actor-critic
    gradients to parameter-server shards in Redis (ps_shards), which apply them
    asynchronously with a shared RMSProp; exits 0 iff the greedy evaluation reached the
    target return (1: budget ran out, 2: a role failed).

    \b
    qrl train a3c --env CartPole-v1 --seed 0
    qrl train a3c --env Acrobot-v1 --max-time 300 --workers 2
    """,
    roles=(
        ps_role("a3c", _policy_value_net, make_optimizer, "workers"),
        actor_role(
            "worker",
            ("worker", "a3c"),
            _worker,
            "An A3C actor-learner: steps its envs, pushes gradients to the parameter server "
            "and pulls the parameters it publishes.",
            reads=PS_WORKER.reads,
            writes=(),
            mine=PS_WORKER.mine,
            scripts=PS_WORKER.scripts,
            count="workers",
            shown=("version", "gradients", "skipped"),
        ),
    ),
    policy=torch_policy(_policy_value_net),
    weights_key=lambda keys: keys.weights,
    streams=gradient_streams("workers"),
)
