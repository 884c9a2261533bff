"""The algorithms qrl runs: one line each. A new algorithm is its own modules (config,
actor, learner, builder) plus its line here."""

from __future__ import annotations

from qrl.algos import apex, apex_dpg, es, impala, r2d2
from qrl.algos.base import Algorithm, RoleContext, RoleDef

ALGOS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        apex.ALGORITHM,
        apex_dpg.ALGORITHM,
        r2d2.ALGORITHM,
        impala.ALGORITHM,
        es.ALGORITHM,
    )
}

__all__ = ["ALGOS", "Algorithm", "RoleContext", "RoleDef"]
