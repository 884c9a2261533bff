"""The Ape-X family's messages: an actor's batch of n-step transitions (plain, or as frames
shared by stacked observations), and the fields every message of replay items holds."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from qrl.rl.fields import (
    BATCH_ID,
    FLOATS,
    NATURAL,
    VALUE_BOUND,
    floats,
    obs_bytes,
    obs_field,
    same_length,
)
from qrl.wire.schema import CodecError, Field, Schema, size_cap

EXPERIENCE = "apex.experience"  # n-step transitions
FRAMES = "apex.frames"  # n-step transitions over stacked frames, each frame sent once


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
        n = same_length(msg, ("obs", "action", "ret", "disc", "next_obs", "priority"))
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

    obs = obs_field(obs_shape, obs_dtype, 1)
    if action_bounds is None:
        action = discrete_action(n_actions)
        action_bytes = 4
    else:
        low, high = action_bounds
        box = (float(low.min()), float(high.max()))
        action = Field(np.ndarray, dtypes=FLOATS, ndim=2, finite=True, bounds=box)
        action_bytes = 4 * low.size
    row = 2 * obs_bytes(obs_shape, obs_dtype) + 12 + action_bytes
    return Schema(
        EXPERIENCE,
        {
            "obs": obs,
            "action": action,
            "next_obs": obs,
            **transition_fields(action),
        },
        check=check,
        max_bytes=size_cap(max_rows * row),
    )


def discrete_action(n_actions: int) -> Field:
    return Field(np.ndarray, dtypes=("int32",), ndim=1, bounds=(0, n_actions - 1))


def transition_fields(action: Field) -> dict[str, Field]:
    """What every Ape-X experience message holds besides its observations: per transition
    the action, n-step return, discount and priority; the policy version, actor and batch id."""
    return {
        "action": action,
        "ret": floats(1),
        "disc": Field(np.ndarray, dtypes=FLOATS, ndim=1, finite=True, bounds=(0, 1)),
        **batch_fields(),
    }


def batch_fields() -> dict[str, Field]:
    """What every message of replay items holds: per item its initial priority; the policy
    version, actor and batch id."""
    return {
        "priority": Field(np.ndarray, dtypes=FLOATS, ndim=1, finite=True, bounds=(0, VALUE_BOUND)),
        "version": NATURAL,
        "actor": NATURAL,
        "batch": BATCH_ID,
    }


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
        n = same_length(msg, ("refs", "action", "ret", "disc", "priority"))
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
        FRAMES,
        {
            "frames": Field(np.ndarray, dtypes=("uint8",), ndim=3),
            "counts": Field(np.ndarray, dtypes=("int32",), ndim=2, bounds=(1, max_frames)),
            "refs": Field(np.ndarray, dtypes=("uint16",), ndim=2),
            **transition_fields(discrete_action(n_actions)),
        },
        check=check,
        max_bytes=size_cap(max_frames * math.prod(frame) + max_rows * (4 * stack + 16)),
    )
