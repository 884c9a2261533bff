"""The schemas of every message qrl sends, in one place. Decoding validates against them.

Besides types, dtypes and shapes, every schema bounds what its numbers may be (semantic
bounds), so a message that decodes cannot overflow what consumes it: rewards, n-step
returns, logits, priorities and float observations within ``+-VALUE_BOUND``, episode returns
within ``+-RETURN_BOUND``, counts where a mean is taken at least 1, sums of squares at least
0 and consistent with their sums, versions and ids non-negative. Each schema's payload cap
(``max_bytes``) is sized to the largest message the run's config makes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from qrl.schema import INT_BOUND, CodecError, Field, Schema, size_cap

FLOATS = ("float32",)
VALUE_BOUND = 1e6  # |reward|, |n-step return|, |logit|, priority, |float observation|
RETURN_BOUND = 1e9  # |episode return|
MAX_COUNT = 2.0**40  # observations counted in one ES results message
NATURAL = Field(int, bounds=(0, INT_BOUND))
BATCH_ID = Field(str, max_len=64)


def _same_length(msg: dict[str, Any], names: tuple[str, ...]) -> int:
    n = len(msg[names[0]])
    for name in names[1:]:
        if len(msg[name]) != n:
            raise CodecError(f"{name} has {len(msg[name])} rows, {names[0]} has {n}")
    return n


def _floats(ndim: int | None, bound: float = VALUE_BOUND) -> Field:
    return Field(np.ndarray, dtypes=FLOATS, ndim=ndim, finite=True, bounds=(-bound, bound))


def _obs(obs_shape: tuple[int, ...], obs_dtype: str, lead: int) -> Field:
    """Observations with ``lead`` leading axes; float ones finite and bounded."""
    is_float = np.dtype(obs_dtype).kind == "f"
    bounds = (-VALUE_BOUND, VALUE_BOUND) if is_float else None
    ndim = lead + len(obs_shape)
    return Field(np.ndarray, dtypes=(obs_dtype,), ndim=ndim, finite=True, bounds=bounds)


def _obs_bytes(obs_shape: tuple[int, ...], obs_dtype: str) -> int:
    return math.prod(obs_shape) * np.dtype(obs_dtype).itemsize


def experience_schema(
    obs_shape: tuple[int, ...],
    obs_dtype: str,
    n_actions: int,
    max_rows: int = 4096,
    action_bounds: tuple[np.ndarray, np.ndarray] | None = None,
) -> Schema:
    """An Ape-X actor's batch of at most ``max_rows`` n-step transitions with initial
    priorities. Actions are int32 in ``[0, n_actions)``, or with ``action_bounds`` ``(low,
    high)`` (Ape-X DPG) float32 vectors ``[N, d]``, finite and within ``low..high`` per
    dimension."""
    obs_shape = tuple(obs_shape)

    def check(msg: dict[str, Any]) -> None:
        n = _same_length(msg, ("obs", "action", "ret", "disc", "next_obs", "priority"))
        if not 0 < n <= max_rows:
            raise CodecError(f"{n} transitions, expected 1 to {max_rows}")
        for name in ("obs", "next_obs"):
            if msg[name].shape[1:] != obs_shape:
                raise CodecError(f"{name} rows have shape {msg[name].shape[1:]}, not {obs_shape}")
        if action_bounds is not None:
            low, high = action_bounds
            a = msg["action"]
            if a.shape[1:] != low.shape:
                raise CodecError(f"action rows have shape {a.shape[1:]}, not {low.shape}")
            if (a < low).any() or (a > high).any():
                raise CodecError("an action is outside the action space's bounds")
        if not msg["batch"]:
            raise CodecError("batch id must be 1-64 characters")

    obs = _obs(obs_shape, obs_dtype, 1)
    if action_bounds is None:
        action = _discrete_action(n_actions)
        action_bytes = 4
    else:
        low, high = action_bounds
        box = (float(low.min()), float(high.max()))
        action = Field(np.ndarray, dtypes=FLOATS, ndim=2, finite=True, bounds=box)
        action_bytes = 4 * low.size
    row = 2 * _obs_bytes(obs_shape, obs_dtype) + 12 + action_bytes
    return Schema(
        "apex.experience",
        {
            "obs": obs,
            "action": action,
            "next_obs": obs,
            **_transition_fields(action),
        },
        check=check,
        max_bytes=size_cap(max_rows * row),
    )


def _discrete_action(n_actions: int) -> Field:
    return Field(np.ndarray, dtypes=("int32",), ndim=1, bounds=(0, n_actions - 1))


def _transition_fields(action: Field) -> dict[str, Field]:
    """What every Ape-X experience message holds besides its observations: per transition
    the action, n-step return, discount and priority; the policy version, actor and batch id."""
    return {
        "action": action,
        "ret": _floats(1),
        "disc": Field(np.ndarray, dtypes=FLOATS, ndim=1, finite=True, bounds=(0, 1)),
        **_batch_fields(),
    }


def _batch_fields() -> dict[str, Field]:
    """What every message of replay items holds: per item its initial priority; the policy
    version, actor and batch id."""
    return {
        "priority": Field(np.ndarray, dtypes=FLOATS, ndim=1, finite=True, bounds=(0, VALUE_BOUND)),
        "version": NATURAL,
        "actor": NATURAL,
        "batch": BATCH_ID,
    }


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
        n = _same_length(msg, names)
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
    row = (length + 1) * _obs_bytes(obs_shape, obs_dtype) + 8 * length + 8 * lstm + 10
    return Schema(
        "r2d2.sequences",
        {
            "obs": _obs(obs_shape, obs_dtype, 2),
            "action": Field(np.ndarray, dtypes=("int32",), ndim=2, bounds=(0, n_actions - 1)),
            "reward": _floats(2),
            "steps": Field(np.ndarray, dtypes=("int32",), ndim=1, bounds=(1, length)),
            "terminal": flags,
            "first": flags,
            "h0": _floats(2, bound=1.0),  # h = o * tanh(c)
            "c0": _floats(2),
            **_batch_fields(),
        },
        check=check,
        max_bytes=size_cap(max_rows * row),
    )


def check_chunks(counts: np.ndarray, refs: np.ndarray, n_frames: int) -> None:
    """Raise CodecError unless the chunks are consistent: ``counts[c] = (transitions,
    frames)`` of chunk ``c``, each at least 1, summing to the rows of ``refs`` and to
    ``n_frames``; every row's frame references fall inside its own chunk's frames."""
    if counts.ndim != 2 or counts.shape[1] != 2 or not len(counts) or counts.min() < 1:
        raise CodecError("chunk counts must be rows of (transitions >= 1, frames >= 1)")
    if int(counts[:, 0].sum()) != len(refs) or int(counts[:, 1].sum()) != n_frames:
        raise CodecError(f"chunk counts do not add up to {len(refs)} rows and {n_frames} frames")
    if len(refs) and (refs >= np.repeat(counts[:, 1], counts[:, 0])[:, None]).any():
        raise CodecError("a frame reference points outside its chunk")


def frames_schema(
    obs_shape: tuple[int, ...], n_actions: int, max_rows: int = 4096, max_frames: int = 65_535
) -> Schema:
    """An Ape-X actor's batch of n-step transitions over stacked frames (``obs_shape`` =
    ``(stack, H, W)`` uint8), each frame sent once: ``frames [F, H, W]``, chunk ``c`` (one
    env slot's run of steps) owning ``counts[c] = (transitions, frames)`` of them in order,
    and per transition ``refs [N, 2 x stack]``: the obs then next-obs frames, as indices
    into its chunk's frames (see :mod:`qrl.replay.frames`)."""
    stack, frame = obs_shape[0], tuple(obs_shape[1:])
    max_frames = min(max_frames, max_rows * 2 * stack)

    def check(msg: dict[str, Any]) -> None:
        n = _same_length(msg, ("refs", "action", "ret", "disc", "priority"))
        if not 0 < n <= max_rows:
            raise CodecError(f"{n} transitions, expected 1 to {max_rows}")
        f = msg["frames"]
        if f.shape[1:] != frame or not 0 < len(f) <= max_frames:
            raise CodecError(f"frames have shape {f.shape}, expected (1-{max_frames}, *{frame})")
        if msg["refs"].shape[1] != 2 * stack:
            raise CodecError(f"refs rows hold {msg['refs'].shape[1]}, expected {2 * stack}")
        check_chunks(msg["counts"], msg["refs"], len(f))
        if not msg["batch"]:
            raise CodecError("batch id must be 1-64 characters")

    return Schema(
        "apex.frames",
        {
            "frames": Field(np.ndarray, dtypes=("uint8",), ndim=3),
            "counts": Field(np.ndarray, dtypes=("int32",), ndim=2, bounds=(1, max_frames)),
            "refs": Field(np.ndarray, dtypes=("uint16",), ndim=2),
            **_transition_fields(_discrete_action(n_actions)),
        },
        check=check,
        max_bytes=size_cap(max_frames * math.prod(frame) + max_rows * (4 * stack + 16)),
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
    {
        "role": Field(str),
        "id": Field(int),
        "time": Field(float),
        "values": Field(dict, max_len=16_384),  # lists of up to this many numbers, too
    },
    check=_check_metrics,
    max_bytes=1 << 20,
)


def unroll_schema(
    obs_shape: tuple[int, ...], obs_dtype: str, n_actions: int, unroll: int, envs: int = 1024
) -> Schema:
    """An IMPALA actor's batch of B <= ``envs`` unrolls of length T, time-major:
    observations ``[T+1, B]`` (the last one bootstraps), actions, rewards, terminations and
    truncations ``[T, B]``, behaviour logits ``[T, B, A]``, and for truncated steps the
    episode's final observation (``trunc_obs[k]`` belongs to step ``trunc_idx[k] = (t, b)``)
    so the learner can bootstrap."""
    obs_shape = tuple(obs_shape)

    def check(msg: dict[str, Any]) -> None:
        obs = msg["obs"]
        want = (unroll + 1, obs_shape)
        if (obs.shape[0], obs.shape[2:]) != want or not 0 < obs.shape[1] <= envs:
            raise CodecError(
                f"obs has shape {obs.shape}, expected ({want[0]}, 1-{envs}, *{want[1]})"
            )
        tb = (unroll, obs.shape[1])
        for name in ("action", "reward", "terminated", "truncated"):
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

    step = 2 * _obs_bytes(obs_shape, obs_dtype) + 4 * n_actions + 18
    return Schema(
        "impala.unrolls",
        {
            "obs": _obs(obs_shape, obs_dtype, 2),
            "action": Field(np.ndarray, dtypes=("int32",), ndim=2, bounds=(0, n_actions - 1)),
            "reward": _floats(2),
            "terminated": Field(np.ndarray, dtypes=("bool",), ndim=2),
            "truncated": Field(np.ndarray, dtypes=("bool",), ndim=2),
            "logits": _floats(3),
            "trunc_obs": _obs(obs_shape, obs_dtype, 1),
            "trunc_idx": Field(np.ndarray, dtypes=("int32",), ndim=2, bounds=(0, 2**31 - 1)),
            "version": NATURAL,
            "actor": NATURAL,
            "batch": BATCH_ID,
        },
        check=check,
        max_bytes=size_cap((unroll + 1) * envs * step),
    )


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


def es_results_schema(obs_dim: int, noise_size: int, dim: int, max_pairs: int = 65_536) -> Schema:
    """An ES worker's batch of at most ``max_pairs`` antithetic pair results for one
    generation (each with its pair's job id, unique in the batch), with the sums of the raw
    observations it saw (for the master's observation normalization)."""

    def check(msg: dict[str, Any]) -> None:
        names = ("job", "index", "return_pos", "return_neg", "length_pos", "length_neg")
        n = _same_length(msg, names)
        if not 0 < n <= max_pairs:
            raise CodecError(f"{n} results, expected 1 to {max_pairs}")
        if len(np.unique(msg["job"])) != n:
            raise CodecError("job ids repeat: each result is one antithetic pair's")
        for name in ("obs_sum", "obs_sumsq"):
            if msg[name].shape != (obs_dim,):
                raise CodecError(f"{name} has shape {msg[name].shape}, expected ({obs_dim},)")
        check_obs_stats(msg["obs_count"], msg["obs_sum"], msg["obs_sumsq"])

    def vec(dtype: str, lo: float, hi: float) -> Field:
        return Field(np.ndarray, dtypes=(dtype,), ndim=1, finite=True, bounds=(lo, hi))

    return Schema(
        "es.results",
        {
            "generation": NATURAL,
            "job": vec("int64", 0, INT_BOUND),
            "index": vec("int64", 0, noise_size - dim),
            "return_pos": vec("float32", -RETURN_BOUND, RETURN_BOUND),
            "return_neg": vec("float32", -RETURN_BOUND, RETURN_BOUND),
            "length_pos": vec("int32", 1, 2**31 - 1),
            "length_neg": vec("int32", 1, 2**31 - 1),
            "obs_sum": Field(np.ndarray, dtypes=("float64",), ndim=1, finite=True),
            "obs_sumsq": Field(np.ndarray, dtypes=("float64",), ndim=1, finite=True),
            "obs_count": Field(float, finite=True),
            "worker": NATURAL,
            "batch": BATCH_ID,
        },
        check=check,
        max_bytes=size_cap(max_pairs * 32 + obs_dim * 16),
    )
