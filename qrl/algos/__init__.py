"""The algorithms qrl runs, one registry line each. An algorithm is its package here
(``qrl/algos/NAME/``: config, builder, message schemas, key names, maths), its actor in
``qrl/actors/NAME.py`` and its learner in ``qrl/learners/NAME.py``."""

from __future__ import annotations

from qrl.algos.a3c.builder import ALGORITHM as A3C
from qrl.algos.apex.builder import ALGORITHM as APEX
from qrl.algos.apex_dpg.builder import ALGORITHM as APEX_DPG
from qrl.algos.es.builder import ALGORITHM as ES
from qrl.algos.gorila.builder import ALGORITHM as GORILA
from qrl.algos.impala.builder import ALGORITHM as IMPALA
from qrl.algos.ppo.builder import ALGORITHM as PPO
from qrl.algos.r2d2.builder import ALGORITHM as R2D2
from qrl.runtime.algorithm import Algorithm, RoleContext, RoleDef

ALGOS: dict[str, Algorithm] = {
    a.name: a for a in (APEX, APEX_DPG, R2D2, IMPALA, PPO, ES, A3C, GORILA)
}

__all__ = ["ALGOS", "Algorithm", "RoleContext", "RoleDef"]
