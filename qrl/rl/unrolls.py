"""The unroll message IMPALA and PPO actors send: a batch of B vector-env unrolls of T steps,
time-major, with the behaviour policy's logits and (PPO) its value estimates."""

from __future__ import annotations

from typing import Any

import numpy as np

from qrl.rl.fields import BATCH_ID, NATURAL, floats, obs_bytes, obs_field
from qrl.wire.schema import CodecError, Field, Schema, size_cap


def unroll_schema(
    kind: str,
    obs_shape: tuple[int, ...],
    obs_dtype: str,
    n_actions: int,
    unroll: int,
    envs: int = 1024,
    values: bool = False,
) -> Schema:
    """A batch of B <= ``envs`` unrolls of length T, time-major: observations ``[T+1, B]``
    (the last one bootstraps), actions, rewards, terminations and truncations ``[T, B]``,
    behaviour logits ``[T, B, A]`` (the log-probabilities of every action, unnormalized),
    with ``values`` the behaviour value estimates ``[T, B]``, and for truncated steps the
    episode's final observation (``trunc_obs[k]`` belongs to step ``trunc_idx[k] = (t, b)``)
    so the learner can bootstrap."""
    obs_shape = tuple(obs_shape)
    per_step = ("action", "reward", "terminated", "truncated") + (("value",) if values else ())

    def check(msg: dict[str, Any]) -> None:
        obs = msg["obs"]
        want = (unroll + 1, obs_shape)
        if (obs.shape[0], obs.shape[2:]) != want or not 0 < obs.shape[1] <= envs:
            raise CodecError(
                f"obs has shape {obs.shape}, expected ({want[0]}, 1-{envs}, *{want[1]})"
            )
        tb = (unroll, obs.shape[1])
        for name in per_step:
            if msg[name].shape != tb:
                raise CodecError(f"{name} has shape {msg[name].shape}, expected {tb}")
        if msg["logits"].shape != (*tb, n_actions):
            raise CodecError(
                f"logits have shape {msg['logits'].shape}, expected {(*tb, n_actions)}"
            )
        idx, tobs = msg["trunc_idx"], msg["trunc_obs"]
        if idx.shape != (len(tobs), 2) or tobs.shape[1:] != obs_shape:
            raise CodecError("trunc_idx and trunc_obs disagree")
        if len(idx) and (idx[:, 0].max() >= tb[0] or idx[:, 1].max() >= tb[1]):
            raise CodecError("trunc_idx out of range")
        if int(msg["truncated"].sum()) != len(idx) or (
            len(idx) and not msg["truncated"][idx[:, 0], idx[:, 1]].all()
        ):
            raise CodecError("every truncated step needs exactly one final observation")

    step = 2 * obs_bytes(obs_shape, obs_dtype) + 4 * n_actions + 18 + 4 * values
    fields = {
        "obs": obs_field(obs_shape, obs_dtype, 2),
        "action": Field(np.ndarray, dtypes=("int32",), ndim=2, bounds=(0, n_actions - 1)),
        "reward": floats(2),
        "terminated": Field(np.ndarray, dtypes=("bool",), ndim=2),
        "truncated": Field(np.ndarray, dtypes=("bool",), ndim=2),
        "logits": floats(3),
        "trunc_obs": obs_field(obs_shape, obs_dtype, 1),
        "trunc_idx": Field(np.ndarray, dtypes=("int32",), ndim=2, bounds=(0, 2**31 - 1)),
        "version": NATURAL,
        "actor": NATURAL,
        "batch": BATCH_ID,
    }
    if values:
        fields["value"] = floats(2)
    return Schema(kind, fields, check=check, max_bytes=size_cap((unroll + 1) * envs * step))
