"""The PPO actor: rollouts with the behaviour logits and values to the rollout stream
(:class:`qrl.actors.unrolls.UnrollActor`); ``qrl/learners/ppo.py`` consumes them."""

from __future__ import annotations

from qrl.actors.unrolls import UnrollActor
from qrl.algos.ppo.keys import rollouts
from qrl.algos.ppo.messages import KIND


class PPOActor(UnrollActor):
    kind = KIND
    values = True
    stream = staticmethod(rollouts)
