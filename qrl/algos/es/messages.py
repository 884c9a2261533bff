"""ES's message: a worker's batch of antithetic pair results with its observation sums."""

from __future__ import annotations

from typing import Any

import numpy as np

from qrl.algos.es.config import ESConfig
from qrl.rl.fields import BATCH_ID, NATURAL, RETURN_BOUND, VALUE_BOUND, same_length
from qrl.wire.schema import INT_BOUND, CodecError, Field, Schema, size_cap

KIND = "es.results"
MAX_COUNT = 2.0**40  # observations counted in one ES results message


def check_obs_stats(count: float, total: np.ndarray, sumsq: np.ndarray) -> None:
    """Raise CodecError unless ``count`` observations could have these sums: a whole count of
    at least 1, ``|sum| <= count x VALUE_BOUND``, ``0 <= sumsq <= count x VALUE_BOUND^2`` and
    ``sum^2 <= count x sumsq`` (Cauchy-Schwarz, with room for rounding)."""
    if not (1 <= count <= MAX_COUNT and count == int(count)):
        raise CodecError(f"observation count {count} is not a whole number in [1, {MAX_COUNT}]")
    if (np.abs(total) > count * VALUE_BOUND).any():
        raise CodecError("observation sum out of count x bound")
    if (sumsq < 0).any() or (sumsq > count * VALUE_BOUND**2).any():
        raise CodecError("observation sum of squares out of [0, count x bound^2]")
    if (total**2 > count * sumsq * (1 + 1e-3) + 1e-6).any():
        raise CodecError("observation sums disagree (sum^2 > count x sum of squares)")


def pairs_per_message(cfg: ESConfig) -> int:
    """The most pairs one results message carries: a generation's worth (``population / 2``).
    With episodes of at most the env's limit, one message then weighs in the observation
    statistics at most as much as a generation of honest episodes can."""
    return max(1, cfg.population // 2)


def es_results_schema(
    obs_dim: int, noise_size: int, dim: int, max_pairs: int = 65_536, max_steps: int = 2**31 - 1
) -> Schema:
    """An ES worker's batch of at most ``max_pairs`` antithetic pair results for one
    generation (each with its pair's job id, unique in the batch, and episodes of at most
    ``max_steps`` steps), with the sums of the raw observations of those episodes (for the
    master's observation normalization). The count may not exceed the steps the episodes
    report: a message weighs in the statistics at most as much as the episodes it carries,
    so honest messages dilute any one (a count of 2^40 with a mean of 1e6 pinned every real
    observation at -5 for good)."""

    def check(msg: dict[str, Any]) -> None:
        names = ("job", "index", "return_pos", "return_neg", "length_pos", "length_neg")
        n = same_length(msg, names)
        if not 0 < n <= max_pairs:
            raise CodecError(f"{n} results, expected 1 to {max_pairs}")
        if len(np.unique(msg["job"])) != n:
            raise CodecError("job ids repeat: each result is one antithetic pair's")
        for name in ("obs_sum", "obs_sumsq"):
            if msg[name].shape != (obs_dim,):
                raise CodecError(f"{name} has shape {msg[name].shape}, expected ({obs_dim},)")
        check_obs_stats(msg["obs_count"], msg["obs_sum"], msg["obs_sumsq"])
        steps = int(msg["length_pos"].sum(dtype=np.int64) + msg["length_neg"].sum(dtype=np.int64))
        if msg["obs_count"] > steps:
            raise CodecError(
                f"observation count {msg['obs_count']} exceeds the {steps} steps "
                "of the episodes reported"
            )

    def vec(dtype: str, lo: float, hi: float) -> Field:
        return Field(np.ndarray, dtypes=(dtype,), ndim=1, finite=True, bounds=(lo, hi))

    return Schema(
        KIND,
        {
            "generation": NATURAL,
            "job": vec("int64", 0, INT_BOUND),
            "index": vec("int64", 0, noise_size - dim),
            "return_pos": vec("float32", -RETURN_BOUND, RETURN_BOUND),
            "return_neg": vec("float32", -RETURN_BOUND, RETURN_BOUND),
            "length_pos": vec("int32", 1, max_steps),
            "length_neg": vec("int32", 1, max_steps),
            "obs_sum": Field(np.ndarray, dtypes=("float64",), ndim=1, finite=True),
            "obs_sumsq": Field(np.ndarray, dtypes=("float64",), ndim=1, finite=True),
            "obs_count": Field(float, finite=True),
            "worker": NATURAL,
            "batch": BATCH_ID,
        },
        check=check,
        max_bytes=size_cap(max_pairs * 32 + obs_dim * 16),
    )
