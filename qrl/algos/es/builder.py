"""Evolution Strategies (Salimans et al. 2017): workers evaluate antithetic perturbations ->
results stream -> master (fitness shaping, Adam) -> parameters with their generation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qrl.algos.es.config import ESConfig
from qrl.algos.es.keys import es_params, es_results
from qrl.runtime.algorithm import Algorithm, RoleContext, actor_role, learner_role
from qrl.runtime.roles import (
    CONSUMER_SCRIPTS,
    PRODUCER_SCRIPTS,
    PUBLISHER_SCRIPTS,
    shown_only,
)
from qrl.wire.chunks import chunked

if TYPE_CHECKING:
    from qrl.rl.envspec import EnvSpec


def _worker(ctx: RoleContext) -> Any:
    from qrl.actors.es import ESWorker

    return ESWorker(ctx.client, ctx.keys, ctx.cfg, ctx.ident, env=ctx.env)


def _master(ctx: RoleContext) -> Any:
    from qrl.learners.es import ESMaster

    return ESMaster(ctx.connect, ctx.keys, ctx.cfg, checkpoint=ctx.checkpoint, env=ctx.env)


def _center_policy(cfg: ESConfig, env: EnvSpec, params: dict[str, Any]) -> Any:
    from qrl.learners.es import policy_from_params

    return policy_from_params(cfg, env, params)


ALGORITHM = Algorithm(
    name="es",
    config=ESConfig,
    summary="""Evolution Strategies: a master and --workers worker processes around one Redis;
    exits 0 iff the center policy's evaluation reached the target return (1: budget ran out,
    2: a role failed).

    \b
    qrl train es --env CartPole-v1 --workers 2
    qrl train es --env Pendulum-v1 --target-return -250 --max-time 1200 --eval-every 30
    """,
    roles=(
        learner_role(
            "master",
            ("es", "master"),
            _master,
            "The ES master of a run: folds results into generations, publishes parameters.",
            writes=("es:results", *chunked("es:params")),
            scripts=(*CONSUMER_SCRIPTS, *PUBLISHER_SCRIPTS),
            progress=(shown_only("generation"), shown_only("stale")),
            shown=("generation",),
            device=False,  # numpy only
        ),
        actor_role(
            "worker",
            ("es", "worker"),
            _worker,
            "An ES worker: joins the run, evaluates antithetic perturbations, pushes results.",
            reads=chunked("es:params"),
            writes=("es:results",),
            scripts=PRODUCER_SCRIPTS,
            count="workers",
            shown=("generation",),
            acts_on=None,  # its generation: qrl status shows no policy lag for ES
            nice=False,  # the master only folds results: no one to yield the CPU to
        ),
    ),
    policy=_center_policy,
    actions=frozenset({"discrete", "continuous"}),
    weights_key=lambda keys: es_params(keys),
    streams=lambda keys, config: {"es_results": es_results(keys)},
    pbt="weights",
)
