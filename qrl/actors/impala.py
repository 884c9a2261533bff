"""The IMPALA actor: unrolls with the behaviour logits to the trajectory stream
(:class:`qrl.actors.unrolls.UnrollActor`); ``qrl/learners/impala.py`` consumes them."""

from __future__ import annotations

from qrl.actors.unrolls import UnrollActor
from qrl.algos.impala.keys import trajectories
from qrl.algos.impala.messages import unroll_schema


class ImpalaActor(UnrollActor):
    schema = staticmethod(unroll_schema)
    stream = staticmethod(trajectories)
