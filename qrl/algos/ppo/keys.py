"""PPO's key names (the learner pool's rendezvous keys are qrl/learners/group.py's)."""

from __future__ import annotations

from qrl.wire.keys import RunKeys


def rollouts(keys: RunKeys) -> str:
    """The actors' rollout stream."""
    return keys.key("rollouts")
