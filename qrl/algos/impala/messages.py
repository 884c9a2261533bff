"""IMPALA's message: an actor's batch of unrolls (:mod:`qrl.rl.unrolls`)."""

from __future__ import annotations

from qrl.rl.unrolls import unroll_schema as _unrolls
from qrl.wire.schema import Schema

KIND = "impala.unrolls"


def unroll_schema(
    obs_shape: tuple[int, ...], obs_dtype: str, n_actions: int, unroll: int, envs: int = 1024
) -> Schema:
    """An IMPALA actor's batch of B <= ``envs`` unrolls of length T (no value estimates)."""
    return _unrolls(KIND, obs_shape, obs_dtype, n_actions, unroll, envs)
