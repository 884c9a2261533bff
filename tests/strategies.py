"""Hypothesis strategies for hostile-but-decodable messages: every schema of
:mod:`qrl.messages` (and the weights), filled with extreme finite values (the bounds, zero,
subnormals, float32's largest), the smallest and largest batches, empty arrays beside huge
dimensions and every allowed dtype where the schema leaves them free (the weights). Each
strategy gives the message's fields; ``encode(kind, fields)`` decodes with the matching
schema (the tests check that it does).

``HOSTILE`` is the hypothesis settings the property tests run with: 2,000 examples each
(``QRL_HOSTILE_EXAMPLES`` to change), derandomized so that CI is repeatable.
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qrl.algos.es.messages import MAX_COUNT
from qrl.rl.fields import RETURN_BOUND, VALUE_BOUND
from qrl.wire.codec import ALLOWED_DTYPES
from qrl.wire.schema import INT_BOUND, MAX_ARRAY_EXTENT

HOSTILE = settings(
    max_examples=int(os.environ.get("QRL_HOSTILE_EXAMPLES", "2000")),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)

F32_MAX = float(np.finfo(np.float32).max)


@functools.cache
def floats(bound: float, width: int = 32) -> st.SearchStrategy[float]:
    """Finite floats within ``+-bound``, the extremes often."""
    tiny = float(np.finfo(np.float32 if width == 32 else np.float64).smallest_subnormal)
    edges = [0.0, -0.0, bound, -bound, tiny, -tiny, 1.0, -1.0]
    if width == 32:
        edges = [float(np.float32(x)) for x in edges if abs(np.float32(x)) <= bound]
    return st.sampled_from(edges) | st.floats(-bound, bound, width=width)


@functools.cache
def ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.sampled_from([lo, hi]) | st.integers(lo, hi)


@st.composite
def array(draw, dtype: str, shape: tuple[int, ...], values: st.SearchStrategy) -> np.ndarray:
    """An array of ``shape`` made of up to four drawn values, placed at random (cheap to
    draw however large the array)."""
    palette = np.array(draw(st.lists(values, min_size=1, max_size=4)), dtype)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return rng.choice(palette, size=shape)


def rows(most: int) -> st.SearchStrategy[int]:
    """A batch size: one, the most allowed, or anything between."""
    return st.sampled_from([1, most]) | st.integers(1, most)


NATURAL = ints(0, INT_BOUND)
BATCH_ID = st.text(st.characters(codec="utf-8"), min_size=1, max_size=64)


@st.composite
def experience(draw, obs_shape=(4,), n_actions=2, max_rows=64) -> dict:
    n = draw(rows(max_rows))
    obs = (n, *obs_shape)
    return {
        "obs": draw(array("float32", obs, floats(VALUE_BOUND))),
        "action": draw(array("int32", (n,), ints(0, n_actions - 1))),
        "ret": draw(array("float32", (n,), floats(VALUE_BOUND))),
        "disc": draw(array("float32", (n,), floats(1.0).map(abs))),
        "next_obs": draw(array("float32", obs, floats(VALUE_BOUND))),
        "priority": draw(array("float32", (n,), floats(VALUE_BOUND).map(abs))),
        "version": draw(NATURAL),
        "actor": draw(NATURAL),
        "batch": draw(BATCH_ID),
    }


@st.composite
def frames(draw, frame=(6, 6), stack=4, n_actions=6, max_rows=64) -> dict:
    """An ``apex.frames`` message: 1-4 chunks, each any number of frames with any pixels
    and transitions whose references point anywhere inside their own chunk."""
    counts = draw(
        st.lists(st.tuples(rows(max_rows // 4), ints(1, 3 * stack)), min_size=1, max_size=4)
    )
    counts = np.asarray(counts, np.int32)
    n, f = int(counts[:, 0].sum()), int(counts[:, 1].sum())
    refs = np.concatenate(
        [draw(array("uint16", (m, 2 * stack), ints(0, k - 1))) for m, k in counts.tolist()]
    )
    return {
        "frames": draw(array("uint8", (f, *frame), ints(0, 255))),
        "counts": counts,
        "refs": refs,
        "action": draw(array("int32", (n,), ints(0, n_actions - 1))),
        "ret": draw(array("float32", (n,), floats(VALUE_BOUND))),
        "disc": draw(array("float32", (n,), floats(1.0).map(abs))),
        "priority": draw(array("float32", (n,), floats(VALUE_BOUND).map(abs))),
        "version": draw(NATURAL),
        "actor": draw(NATURAL),
        "batch": draw(BATCH_ID),
    }


@st.composite
def unrolls(draw, unroll: int, envs: int, obs_shape=(4,), n_actions=2) -> dict:
    b = draw(rows(envs))
    tb = (unroll, b)
    truncated = draw(array("bool", tb, st.booleans()))
    idx = np.argwhere(truncated).astype(np.int32).reshape(-1, 2)
    return {
        "obs": draw(array("float32", (unroll + 1, b, *obs_shape), floats(VALUE_BOUND))),
        "action": draw(array("int32", tb, ints(0, n_actions - 1))),
        "reward": draw(array("float32", tb, floats(VALUE_BOUND))),
        "terminated": draw(array("bool", tb, st.booleans())),
        "truncated": truncated,
        "logits": draw(array("float32", (*tb, n_actions), floats(VALUE_BOUND))),
        "trunc_obs": draw(array("float32", (len(idx), *obs_shape), floats(VALUE_BOUND))),
        "trunc_idx": idx,
        "version": draw(NATURAL),
        "actor": draw(NATURAL),
        "batch": draw(BATCH_ID),
    }


@st.composite
def sequences(draw, length: int, lstm: int, obs_shape=(2,), n_actions=2, max_rows=16) -> dict:
    """An ``r2d2.sequences`` message: the steps past each sequence's ``steps`` (and the
    observations after its final one) zero, as the schema requires."""
    n = draw(rows(max_rows))
    steps = draw(array("int32", (n,), ints(1, length)))
    pad = np.arange(length)[None] >= steps[:, None]
    obs = draw(array("float32", (n, length + 1, *obs_shape), floats(VALUE_BOUND)))
    obs[np.concatenate([np.zeros((n, 1), bool), pad], axis=1)] = 0
    action = draw(array("int32", (n, length), ints(0, n_actions - 1)))
    reward = draw(array("float32", (n, length), floats(VALUE_BOUND)))
    return {
        "obs": obs,
        "action": np.where(pad, 0, action).astype(np.int32),
        "reward": np.where(pad, 0, reward).astype(np.float32),
        "steps": steps,
        "terminal": draw(array("bool", (n,), st.booleans())),
        "first": draw(array("bool", (n,), st.booleans())),
        "h0": draw(array("float32", (n, lstm), floats(1.0))),
        "c0": draw(array("float32", (n, lstm), floats(VALUE_BOUND))),
        "priority": draw(array("float32", (n,), floats(VALUE_BOUND).map(abs))),
        "version": draw(NATURAL),
        "actor": draw(NATURAL),
        "batch": draw(BATCH_ID),
    }


@st.composite
def obs_stats(
    draw, obs_dim: int, most: int = int(MAX_COUNT)
) -> tuple[float, np.ndarray, np.ndarray]:
    """An observation count of at most ``most`` and sums that some observations could have (at
    the bounds often)."""
    count = float(draw(ints(1, min(most, int(MAX_COUNT)))))
    sumsq = np.array([draw(floats(count * VALUE_BOUND**2, 64).map(abs)) for _ in range(obs_dim)])
    top = np.minimum(np.sqrt(count * sumsq), count * VALUE_BOUND)
    frac = np.array([draw(floats(1.0, 64)) for _ in range(obs_dim)])
    return count, sumsq, frac * top


@st.composite
def es_results(
    draw, obs_dim: int, noise_size: int, dim: int, max_pairs: int = 256, max_steps: int = 2**31 - 1
) -> dict:
    n = draw(rows(max_pairs))
    lengths = [draw(array("int32", (n,), ints(1, max_steps))) for _ in "pn"]
    steps = int(sum(x.sum(dtype=np.int64) for x in lengths))  # what the count may not exceed
    count, sumsq, total = draw(obs_stats(obs_dim, steps))
    return {
        "generation": draw(NATURAL),
        "job": np.arange(n, dtype=np.int64) + draw(ints(0, 2**53 - max_pairs)),
        "index": draw(array("int64", (n,), ints(0, noise_size - dim))),
        "return_pos": draw(array("float32", (n,), floats(RETURN_BOUND))),
        "return_neg": draw(array("float32", (n,), floats(RETURN_BOUND))),
        "length_pos": lengths[0],
        "length_neg": lengths[1],
        "obs_sum": total,
        "obs_sumsq": sumsq,
        "obs_count": count,
        "worker": draw(NATURAL),
        "batch": draw(BATCH_ID),
    }


def _values(dtype: str) -> st.SearchStrategy:
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return st.booleans()
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return ints(int(info.min), int(info.max))
    return floats(float(np.finfo(dt).max), 64 if dt.itemsize == 8 else 32).map(dt.type)


@st.composite
def any_array(draw) -> np.ndarray:
    """Any allowed dtype, up to 8 dimensions, possibly empty beside huge dimensions."""
    dtype = draw(st.sampled_from(sorted(ALLOWED_DTYPES)))
    ndim = draw(st.integers(0, 8))
    if draw(st.booleans()):  # empty: one zero, the others as large as the codec allows
        shape = [draw(st.integers(1, 1 << 12)) for _ in range(ndim)]
        if shape:
            shape[draw(st.integers(0, ndim - 1))] = 0
            while math.prod(d or 1 for d in shape) * np.dtype(dtype).itemsize > MAX_ARRAY_EXTENT:
                shape[shape.index(max(shape))] //= 2
        return np.zeros(shape, dtype)
    shape = draw(hnp.array_shapes(min_dims=ndim, max_dims=ndim, min_side=1, max_side=4))
    return draw(array(dtype, shape, _values(dtype)))


def weights(fitting: dict[str, np.ndarray]) -> st.SearchStrategy[dict]:
    """A weights message but its version: parameters that fit ``fitting`` (names, shapes,
    dtypes) holding extreme finite values, or anything at all the schema admits."""
    fit = st.fixed_dictionaries(
        {k: array(v.dtype.name, v.shape, _values(v.dtype.name)) for k, v in fitting.items()}
    )
    anything = st.dictionaries(st.text(max_size=16), any_array(), max_size=6)
    meta = st.none() | st.dictionaries(
        st.text(max_size=8), st.floats() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8)
    )
    return st.fixed_dictionaries({"params": fit | anything, "meta": meta})


NUMBER = st.integers(-(2**63), 2**64 - 1) | st.floats()  # msgpack's numbers, NaN and inf too
NAMES = st.sampled_from(["steps", "updates", "episode_returns", "loss", "size", "x"])
VALUES = st.dictionaries(NAMES | st.text(max_size=8), NUMBER | st.lists(NUMBER, max_size=8))


def metrics() -> st.SearchStrategy[dict]:
    """A metrics report: any time and values the schema admits (whose it is, the stream it
    goes in says)."""
    return st.fixed_dictionaries({"time": st.floats(), "values": VALUES})


def heartbeat() -> st.SearchStrategy[dict]:
    """A heartbeat: any role, id, host, pid, finite times and values the schema admits."""
    finite = st.floats(allow_nan=False, allow_infinity=False)
    return st.fixed_dictionaries(
        {
            "role": st.text(max_size=16),
            "id": ints(-INT_BOUND, INT_BOUND),
            "host": st.text(max_size=16),
            "pid": ints(-INT_BOUND, INT_BOUND),
            "started": finite,
            "time": finite,
            "values": VALUES,
        }
    )
