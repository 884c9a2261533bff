"""PPO's message: an actor's batch of rollouts, an unroll message (:mod:`qrl.rl.unrolls`) that
carries the behaviour value estimates besides the logits."""

from __future__ import annotations

from qrl.rl.unrolls import unroll_schema
from qrl.wire.schema import Schema

KIND = "ppo.rollouts"


def rollout_schema(
    obs_shape: tuple[int, ...], obs_dtype: str, n_actions: int, unroll: int, envs: int = 1024
) -> Schema:
    return unroll_schema(KIND, obs_shape, obs_dtype, n_actions, unroll, envs, values=True)
