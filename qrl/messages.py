"""The schemas of every message qrl sends, in one place. Decoding validates against them."""

from __future__ import annotations

from typing import Any

import numpy as np

from qrl.codec import CodecError, Field, Schema

FLOATS = ("float32",)


def _same_length(msg: dict[str, Any], names: tuple[str, ...]) -> int:
    n = len(msg[names[0]])
    for name in names[1:]:
        if len(msg[name]) != n:
            raise CodecError(f"{name} has {len(msg[name])} rows, {names[0]} has {n}")
    return n


def experience_schema(obs_shape: tuple[int, ...], obs_dtype: str, n_actions: int) -> Schema:
    """An Ape-X actor's batch of n-step transitions with initial priorities."""
    obs_shape = tuple(obs_shape)

    def check(msg: dict[str, Any]) -> None:
        _same_length(msg, ("obs", "action", "ret", "disc", "next_obs", "priority"))
        for name in ("obs", "next_obs"):
            if msg[name].shape[1:] != obs_shape:
                raise CodecError(f"{name} rows have shape {msg[name].shape[1:]}, not {obs_shape}")
        a = msg["action"]
        if len(a) and (a.min() < 0 or a.max() >= n_actions):
            raise CodecError(f"action out of range [0, {n_actions})")
        d = msg["disc"]
        if len(d) and (d.min() < 0 or d.max() > 1):
            raise CodecError("discount out of [0, 1]")
        if (msg["priority"] < 0).any():
            raise CodecError("negative priority")
        if not msg["batch"] or len(msg["batch"]) > 64:
            raise CodecError("batch id must be 1-64 characters")

    obs = Field(np.ndarray, dtypes=(obs_dtype,), ndim=1 + len(obs_shape), finite=True)
    return Schema(
        "apex.experience",
        {
            "obs": obs,
            "action": Field(np.ndarray, dtypes=("int32",), ndim=1),
            "ret": Field(np.ndarray, dtypes=FLOATS, ndim=1, finite=True),
            "disc": Field(np.ndarray, dtypes=FLOATS, ndim=1, finite=True),
            "next_obs": obs,
            "priority": Field(np.ndarray, dtypes=FLOATS, ndim=1, finite=True),
            "version": Field(int),
            "actor": Field(int),
            "batch": Field(str),
        },
        check=check,
    )


def _check_metrics(msg: dict[str, Any]) -> None:
    for k, v in msg["values"].items():
        ok = isinstance(v, (int, float)) or (
            isinstance(v, list) and all(isinstance(x, (int, float)) for x in v)
        )
        if not ok:
            raise CodecError(f"metric {k!r} is not a number or a list of numbers")


METRICS = Schema(
    "metrics",
    {"role": Field(str), "id": Field(int), "time": Field(float), "values": Field(dict)},
    check=_check_metrics,
)


def unroll_schema(
    obs_shape: tuple[int, ...], obs_dtype: str, n_actions: int, unroll: int
) -> Schema:
    """An IMPALA actor's batch of B unrolls of length T, time-major: observations ``[T+1, B]``
    (the last one bootstraps), actions, rewards, terminations and truncations ``[T, B]``,
    behaviour logits ``[T, B, A]``, and for truncated steps the episode's final observation
    (``trunc_obs[k]`` belongs to step ``trunc_idx[k] = (t, b)``) so the learner can bootstrap."""
    obs_shape = tuple(obs_shape)

    def check(msg: dict[str, Any]) -> None:
        obs = msg["obs"]
        if obs.shape[0] != unroll + 1 or obs.shape[2:] != obs_shape:
            raise CodecError(f"obs has shape {obs.shape}, expected ({unroll + 1}, B, *{obs_shape})")
        tb = (unroll, obs.shape[1])
        for name in ("action", "reward", "terminated", "truncated"):
            if msg[name].shape != tb:
                raise CodecError(f"{name} has shape {msg[name].shape}, expected {tb}")
        if msg["logits"].shape != (*tb, n_actions):
            raise CodecError(
                f"logits have shape {msg['logits'].shape}, expected {(*tb, n_actions)}"
            )
        a = msg["action"]
        if a.size and (a.min() < 0 or a.max() >= n_actions):
            raise CodecError(f"action out of range [0, {n_actions})")
        idx, tobs = msg["trunc_idx"], msg["trunc_obs"]
        if idx.shape != (len(tobs), 2) or tobs.shape[1:] != obs_shape:
            raise CodecError("trunc_idx and trunc_obs disagree")
        if len(idx) and (idx.min() < 0 or idx[:, 0].max() >= tb[0] or idx[:, 1].max() >= tb[1]):
            raise CodecError("trunc_idx out of range")
        if int(msg["truncated"].sum()) != len(idx) or (
            len(idx) and not msg["truncated"][idx[:, 0], idx[:, 1]].all()
        ):
            raise CodecError("every truncated step needs exactly one final observation")
        if msg["version"] < 0:
            raise CodecError("negative policy version")

    obs = Field(np.ndarray, dtypes=(obs_dtype,), finite=True)
    return Schema(
        "impala.unrolls",
        {
            "obs": obs,
            "action": Field(np.ndarray, dtypes=("int32",), ndim=2),
            "reward": Field(np.ndarray, dtypes=FLOATS, ndim=2, finite=True),
            "terminated": Field(np.ndarray, dtypes=("bool",), ndim=2),
            "truncated": Field(np.ndarray, dtypes=("bool",), ndim=2),
            "logits": Field(np.ndarray, dtypes=FLOATS, ndim=3, finite=True),
            "trunc_obs": obs,
            "trunc_idx": Field(np.ndarray, dtypes=("int32",), ndim=2),
            "version": Field(int),
            "actor": Field(int),
            "batch": Field(str),
        },
        check=check,
    )


def es_results_schema(obs_dim: int, noise_size: int, dim: int) -> Schema:
    """An ES worker's batch of antithetic pair results for one generation, with the sums of
    the raw observations it saw (for the master's observation normalization)."""

    def check(msg: dict[str, Any]) -> None:
        n = _same_length(msg, ("index", "return_pos", "return_neg", "length_pos", "length_neg"))
        if n == 0:
            raise CodecError("empty results batch")
        if msg["index"].min() < 0 or msg["index"].max() > noise_size - dim:
            raise CodecError(f"noise index out of [0, {noise_size - dim}]")
        for name in ("obs_sum", "obs_sumsq"):
            if msg[name].shape != (obs_dim,):
                raise CodecError(f"{name} has shape {msg[name].shape}, expected ({obs_dim},)")
        if msg["obs_count"] < 0 or msg["generation"] < 0:
            raise CodecError("negative count or generation")

    def vec(dtype: str) -> Field:
        return Field(np.ndarray, dtypes=(dtype,), ndim=1, finite=True)

    return Schema(
        "es.results",
        {
            "generation": Field(int),
            "index": vec("int64"),
            "return_pos": vec("float32"),
            "return_neg": vec("float32"),
            "length_pos": vec("int32"),
            "length_neg": vec("int32"),
            "obs_sum": vec("float64"),
            "obs_sumsq": vec("float64"),
            "obs_count": Field(float, finite=True),
            "worker": Field(int),
            "batch": Field(str),
        },
        check=check,
    )
