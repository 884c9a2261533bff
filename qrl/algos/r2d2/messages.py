"""R2D2's message: an actor's batch of overlapping sequences with their recurrent states."""

from __future__ import annotations

from typing import Any

import numpy as np

from qrl.algos.apex_family.messages import batch_fields
from qrl.rl.fields import floats, obs_bytes, obs_field, same_length
from qrl.wire.schema import CodecError, Field, Schema, size_cap

KIND = "r2d2.sequences"


def sequence_schema(
    obs_shape: tuple[int, ...],
    obs_dtype: str,
    n_actions: int,
    length: int,
    lstm: int,
    max_rows: int = 4096,
) -> Schema:
    """An R2D2 actor's batch of N <= ``max_rows`` sequences of ``length`` steps, each with the
    LSTM state at its start: observations ``obs [N, length + 1, *obs_shape]`` (the one after
    the last step bootstraps), ``action``, ``reward [N, length]``, ``steps [N]`` (the real
    steps, 1..length: a sequence cut at an episode's end is padded with zeros after
    ``obs[steps]``, its final observation), ``terminal [N]`` (the episode terminated at
    its last real step, no bootstrap), ``first [N]`` (it starts an episode), ``h0``, ``c0``
    ``[N, lstm]`` and initial priorities."""
    obs_shape = tuple(obs_shape)

    def check(msg: dict[str, Any]) -> None:
        names = ("obs", "action", "reward", "steps", "terminal", "first", "h0", "c0", "priority")
        n = same_length(msg, names)
        if not 0 < n <= max_rows:
            raise CodecError(f"{n} sequences, expected 1 to {max_rows}")
        if msg["obs"].shape[1:] != (length + 1, *obs_shape):
            raise CodecError(
                f"obs rows have shape {msg['obs'].shape[1:]}, not {(length + 1, *obs_shape)}"
            )
        for name, width in (("action", length), ("reward", length), ("h0", lstm), ("c0", lstm)):
            if msg[name].shape[1:] != (width,):
                raise CodecError(f"{name} rows have shape {msg[name].shape[1:]}, not ({width},)")
        pad = np.arange(length) >= msg["steps"][:, None]  # steps past a sequence's end
        if msg["action"][pad].any() or msg["reward"][pad].any():
            raise CodecError("a padded step has a non-zero action or reward")
        if msg["obs"][np.concatenate([np.zeros((n, 1), bool), pad], axis=1)].any():
            raise CodecError("a padded step has a non-zero observation")
        if not msg["batch"]:
            raise CodecError("batch id must be 1-64 characters")

    flags = Field(np.ndarray, dtypes=("bool",), ndim=1)
    row = (length + 1) * obs_bytes(obs_shape, obs_dtype) + 8 * length + 8 * lstm + 10
    return Schema(
        KIND,
        {
            "obs": obs_field(obs_shape, obs_dtype, 2),
            "action": Field(np.ndarray, dtypes=("int32",), ndim=2, bounds=(0, n_actions - 1)),
            "reward": floats(2),
            "steps": Field(np.ndarray, dtypes=("int32",), ndim=1, bounds=(1, length)),
            "terminal": flags,
            "first": flags,
            "h0": floats(2, bound=1.0),  # h = o * tanh(c)
            "c0": floats(2),
            **batch_fields(),
        },
        check=check,
        max_bytes=size_cap(max_rows * row),
    )
