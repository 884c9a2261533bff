"""The two roles central inference adds to an algorithm (no torch here: builders import it):
the inference servers, and the actors that only step environments."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qrl.runtime.algorithm import RoleContext, RoleDef, actor_role
from qrl.runtime.config import central
from qrl.runtime.roles import ACTOR_COMMANDS, PRODUCER_SCRIPTS, Access, Reports, shown_only
from qrl.wire.chunks import chunked

# an env stepper sends requests and pops its replies; nothing else of the run it writes
STEPPER_COMMANDS = ACTOR_COMMANDS + " +rpush +blpop"
# its own request list and its env batches' reply lists, under its server's keys
# (qrl.inference.protocol): a per-instance user (qrl run join) reaches no other stepper's
STEPPER_LISTS = ("inference:requests:{id}", "inference:reply:{id}:*")


def _stepper(ctx: RoleContext) -> Any:
    from qrl.inference.stepper import stepper

    return stepper(ctx.client, ctx.keys, ctx.cfg, ctx.ident, env=ctx.env)


def stepper_role(algo: str) -> RoleDef:
    """The actors of ``algo`` with ``inference=central``: ``actors`` processes."""
    return actor_role(
        "stepper",
        ("stepper", algo),
        _stepper,
        f"An actor of an {algo} run with central inference (inference=central): steps its "
        "envs and asks an inference server for every action; imports no torch.",
        reads=(),
        writes=(),
        scripts=(),
        count="actors",
        when=central,
        shown=("version", "rtt_p50_ms", "rtt_p99_ms", "resent"),
        access=Access((), (), STEPPER_COMMANDS, mine=STEPPER_LISTS),
        turns=False,  # it waits for its actions in a blocking Redis pop
    )


def inference_role(
    algo: str,
    make: Callable[[RoleContext], Any],
    *,
    writes: tuple[str, ...],
    reads: tuple[str, ...] = chunked("weights"),
) -> RoleDef:
    """The inference servers of ``algo`` with ``inference=central``: ``inference_servers``
    processes, each acting for its share of the actors with the weights (``reads``) and
    pushing what they assemble to the keys ``writes``."""
    return RoleDef(
        "inference",
        ("inference", algo),
        make,
        f"An inference server of an {algo} run (inference=central): batches its actors' "
        "requests, acts with the published weights, answers them and assembles what the "
        "learner trains on.",
        # it pops its actors' requests (qrl.inference.protocol) and pushes what it assembles
        Access(reads, ("inference:*", *writes), scripts=("inference.pop", *PRODUCER_SCRIPTS)),
        Reports(
            "requests",
            ("batch", "queue_ms", "forward_ms", "dropped", "rejected", "version"),
            (shown_only("batch"),),
            "version",
        ),
        order=2,
        count="inference_servers",
        when=central,
        device=True,
    )
