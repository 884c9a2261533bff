"""The parameter server's keys and messages. No torch here.

The parameters, flattened in the network's order, are split into ``ps_shards`` contiguous
blocks (:func:`bounds`); shard ``k`` lives under the run's ``k``-th shard keys
(:meth:`qrl.wire.keys.RunKeys.shards`: its own Cluster slot, the run's own keys with one
shard) and has these keys there:

- ``ps:gradients:N``: worker N's stream of gradient messages for the block
  (:func:`gradient_schema`), one per worker step, with the block's version they were
  computed on and their loss. One stream per worker number, each writable by that
  worker's user only (``qrl run join``'s: ``Access.mine`` of the worker roles), so the
  stream a gradient came from says which worker sent it: the server counts each worker's
  share of what it applies by its stream, and a message names no worker (a field that
  could only repeat the stream's number or lie about it);
- ``ps:params``: its block in a weight store (one array, ``block``),
  the version being the gradients it applied;
- ``ps:state``: what a restarted server resumes from (:func:`state_schema`): the block, the
  optimizer's state, the version, the last entry applied of each worker's stream and the
  loss statistics, a chunked store (:class:`qrl.wire.chunks.ChunkedStore`: a block of any
  size) replaced after each cycle (before the block is published and the gradients
  acknowledged).

The optimizers (Adam, RMSProp) work element by element, so K shards stepping their blocks
step the whole vector exactly as one server would.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qrl.runtime.ids import id_limit
from qrl.wire.chunks import ChunkedStore
from qrl.wire.codec import CodecError
from qrl.wire.keys import MAX_SHARDS, RunKeys
from qrl.wire.schema import INT_BOUND, Field, Schema, size_cap

GRADIENT = "ps.gradient"
STATE = "ps.state"
GRAD_DTYPES = ("float32", "float16")
MAX_LOSS = 1e15  # |loss| a gradient may claim (a real one is far below; squares stay finite)
MAX_STATE_VERSION = 1 << 50  # a saved version (the weight store's versions stop at 2^53)
# |parameter| a saved state may hold: an honest one is a few units (each optimizer step moves
# a parameter by about lr, at most 1, from a clipped gradient); a 1e30 (a writer's) is refused
MAX_PARAM = 1e4
# the key names under a shard's prefix: worker {id} pushes to the first (its own) and reads
# the second; only the servers write the second and third (the roles' Access say so:
# qrl/ps/roles.py)
GRADIENTS_KEY, PARAMS_KEY, STATE_KEY = "ps:gradients:{id}", "ps:params", "ps:state"


def shard_keys(keys: RunKeys, n: int, k: int) -> RunKeys:
    """The keys shard ``k`` of ``n`` lives under."""
    return keys.shards(n)[k]


def gradients(sk: RunKeys, worker: int) -> str:
    """Worker ``worker``'s gradient stream among shard keys ``sk``."""
    return sk.key(GRADIENTS_KEY.replace("{id}", str(worker)))


def workers(pushers: int) -> range:
    """The worker numbers whose streams a server reads, of a run configured for ``pushers``
    workers: every number a worker process may hold (:func:`qrl.runtime.ids.id_limit`: a
    worker restarted elsewhere, or one added by hand, takes a number above them)."""
    return range(id_limit(pushers))


def params(sk: RunKeys) -> str:
    return sk.key(PARAMS_KEY)


def state(sk: RunKeys) -> str:
    return sk.key(STATE_KEY)


def state_store(client: Any, sk: RunKeys, length: int, streams: int) -> ChunkedStore:
    """Shard ``sk``'s saved state (of a block of ``length``, ``streams`` worker streams): in
    chunks, any size; its dead letters in the shard's slot."""
    return ChunkedStore(client, sk, state(sk), state_schema(length, streams))


def bounds(total: int, n: int) -> list[int]:
    """Where each of ``n`` blocks of a ``total``-long vector starts (and the end)."""
    return [total * k // n for k in range(n + 1)]


def _length(field: str, length: int) -> Any:
    def check(msg: dict[str, Any]) -> None:
        if msg[field].shape != (length,):
            raise CodecError(f"{field} of shape {msg[field].shape}, the block is ({length},)")

    return check


def gradient_schema(length: int) -> Schema:
    """A gradient for a block of ``length`` parameters."""
    return Schema(
        GRADIENT,
        {
            "shard": Field(int, bounds=(0, MAX_SHARDS - 1)),
            "version": Field(int, bounds=(0, INT_BOUND)),
            "loss": Field(float, finite=True, bounds=(-MAX_LOSS, MAX_LOSS)),
            "grad": Field(np.ndarray, dtypes=GRAD_DTYPES, ndim=1, finite=True),
        },
        check=_length("grad", length),
        max_bytes=size_cap(4 * length),
    )


def state_schema(length: int, streams: int) -> Schema:
    """A shard's saved state of a server reading ``streams`` worker streams (``opt``: the
    optimizer's per-element arrays and its step; ``last_ids``: worker number -> the last
    entry of its stream applied). A state without ``last_ids`` (an older server's, whose
    ``last_id`` was of one stream that all workers shared and no server reads now) is read
    as having applied nothing of the workers' streams."""

    def check(msg: dict[str, Any]) -> None:
        _length("params", length)(msg)
        for name, arr in msg["opt"].items():
            if arr.shape not in ((length,), ()):
                raise CodecError(f"optimizer state {name} of shape {arr.shape}")
            if arr.shape == () and not 0 <= arr <= np.float32(msg["version"]):
                # a scalar counts the optimizer's steps: each of them made a version
                raise CodecError(f"optimizer step count {name}={arr} is not within 0..version")
            if "sq" in name and arr.size and arr.min() < 0:
                # a running average of squares (Adam's exp_avg_sq, RMSProp's square_avg): its
                # square root divides the step
                raise CodecError(f"optimizer state {name} holds a negative square")

    return Schema(
        STATE,
        {
            "version": Field(int, bounds=(0, MAX_STATE_VERSION)),
            "last_ids": Field(dict, values=Field(str, max_len=64), max_len=streams, optional=True),
            "last_id": Field(str, max_len=64, optional=True),  # an older server's: not read
            "params": Field(
                np.ndarray, dtypes=("float32",), ndim=1, finite=True, bounds=(-MAX_PARAM, MAX_PARAM)
            ),
            "opt": Field(dict, values=Field(np.ndarray, dtypes=("float32",), finite=True)),
            "loss": Field(list, max_len=3),
        },
        check=check,
        max_bytes=size_cap(16 * length + 64 * streams),
    )


def entry_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id as a comparable pair."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
