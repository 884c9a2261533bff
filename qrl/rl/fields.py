"""Field builders every algorithm's message schemas share, and the semantic bounds they
enforce: rewards, n-step returns, logits, priorities and float observations within
``+-VALUE_BOUND``, episode returns within ``+-RETURN_BOUND``, versions and ids non-negative.
Each schema's payload cap (``max_bytes``) is sized to the largest message the run's config
makes (:func:`qrl.wire.schema.size_cap`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from qrl.wire.schema import INT_BOUND, CodecError, Field

FLOATS = ("float32",)
VALUE_BOUND = 1e6  # |reward|, |n-step return|, |logit|, priority, |float observation|
RETURN_BOUND = 1e9  # |episode return|
NATURAL = Field(int, bounds=(0, INT_BOUND))
BATCH_ID = Field(str, max_len=64)


def same_length(msg: dict[str, Any], names: tuple[str, ...]) -> int:
    n = len(msg[names[0]])
    for name in names[1:]:
        if len(msg[name]) != n:
            raise CodecError(f"{name} has {len(msg[name])} rows, {names[0]} has {n}")
    return n


def floats(ndim: int | None, bound: float = VALUE_BOUND) -> Field:
    return Field(np.ndarray, dtypes=FLOATS, ndim=ndim, finite=True, bounds=(-bound, bound))


def obs_field(obs_shape: tuple[int, ...], obs_dtype: str, lead: int) -> Field:
    """Observations with ``lead`` leading axes; float ones finite and bounded."""
    is_float = np.dtype(obs_dtype).kind == "f"
    bounds = (-VALUE_BOUND, VALUE_BOUND) if is_float else None
    ndim = lead + len(obs_shape)
    return Field(np.ndarray, dtypes=(obs_dtype,), ndim=ndim, finite=True, bounds=bounds)


def obs_bytes(obs_shape: tuple[int, ...], obs_dtype: str) -> int:
    return math.prod(obs_shape) * np.dtype(obs_dtype).itemsize
