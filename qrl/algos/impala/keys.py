"""IMPALA's key names."""

from __future__ import annotations

from qrl.wire.keys import RunKeys


def trajectories(keys: RunKeys) -> str:
    """The actors' trajectory stream (unrolls)."""
    return keys.key("trajectories")
