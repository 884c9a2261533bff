"""The weight store: a learner publishes its parameters with a version, actors poll.

The parameters are a message of :data:`WEIGHTS` in a :class:`~qrl.wire.chunks.ChunkedStore`:
a manifest switched by a Lua script that refuses a version not newer than the stored one,
the arrays inline in it for a network of up to 16 MiB and in chunks beside it for a larger
one (any size: :mod:`qrl.wire.chunks`), so readers always see one whole version and
versions only increase. Checking for new weights is one HGET; the rest is fetched only when
the version changed. The same store carries ES parameters (with the generation as version)
and a parameter server's blocks. ``wire``: the dtype float parameters travel as
(``"bfloat16"``, ``"float16"``; default their own), cast back to the module's as loaded.

A key has one writer, its learner. Should another write it (a second learner, an old one
restarted, anyone with access to the run's keys), :meth:`WeightStore.publish` stores the
learner's parameters above whatever version it finds and returns that version: the learner
carries on from it, with one warning. Garbage in the key (a version that is not a number, a
manifest or chunk that does not decode or match, a key that is not a hash) is never fatal:
readers ignore it and keep their weights, the next publish overwrites it. So is a version at
or past :data:`MAX_VERSION`, or more than :data:`MAX_AHEAD` ahead of the publishing
learner's: the learner overwrites it with its own version instead of counting on from it (so
no one write can carry its count to where versions stop being numbers), and readers that
took it see the version go back and load what the learner published.

A reader rejects a version once. So a writer that puts its blob under the learner's version
while the learner has nothing new to publish (it waits for data that actors, waiting for
weights, do not send) would stall the run: :meth:`WeightStore.kept` tells a publisher its
weights are gone, and it publishes again as a new version.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis
import torch

from qrl.wire import clock
from qrl.wire.chunks import (
    MAX_AHEAD,
    MAX_ARRAYS,
    MAX_VERSION,
    ChunkedStore,
    Manifest,
    ahead,
)
from qrl.wire.codec import CodecError, Field, Schema
from qrl.wire.keys import RunKeys

__all__ = [
    "MAX_AHEAD",
    "MAX_VERSION",
    "WEIGHTS",
    "WeightStore",
    "Weights",
    "ahead",
    "fits",
    "load_arrays",
    "module_arrays",
    "wait_for_weights",
]

log = logging.getLogger(__name__)

WEIGHTS = Schema(
    "weights",
    {
        "params": Field(dict, values=Field(np.ndarray, finite=True), max_len=MAX_ARRAYS),
        "meta": Field(dict, optional=True),
    },
)


class Unfit(Exception):
    """Weights that do not fit the reader's module: refused before their chunks are read,
    not garbage (no dead letter), and read again at the next poll."""


@dataclass
class Weights:
    version: int
    params: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)


def fitting(module: torch.nn.Module) -> Callable[[Manifest], None]:
    """A check of a manifest against ``module`` (for :meth:`WeightStore.fetch`'s
    ``accept``): :class:`Unfit` unless its names, shapes and dtypes are the module's."""
    want = {
        k: (tuple(v.shape), torch.empty(0, dtype=v.dtype).numpy().dtype)
        for k, v in module.state_dict().items()
    }

    def fit(manifest: Manifest) -> None:
        have = {p.name: (p.shape, p.dtype) for p in manifest.parts}
        if have != want:
            odd = sorted(set(have.items()) ^ set(want.items()), key=str)[:4]
            raise Unfit(f"names, shapes or dtypes differ: {odd}")

    return fit


def module_arrays(module: torch.nn.Module) -> dict[str, np.ndarray]:
    """A module's state dict as numpy arrays (on the CPU)."""
    return {k: v.detach().cpu().numpy() for k, v in module.state_dict().items()}


def load_arrays(module: torch.nn.Module, params: Mapping[str, np.ndarray]) -> None:
    """Load ``params`` into ``module`` after checking names, shapes and dtypes match."""
    module.load_state_dict(fitted_arrays(module, params))


def fits(module: torch.nn.Module, w: Weights | None) -> bool:
    """Whether ``w`` are weights ``module`` can load (what a reader of them needs)."""
    try:
        return w is not None and bool(fitted_arrays(module, w.params))
    except CodecError:
        return False


def fitted_arrays(module: torch.nn.Module, params: Mapping[str, np.ndarray]) -> dict:
    """``params`` as tensors for ``module``'s state dict; CodecError unless names, shapes and
    dtypes match (nothing is loaded)."""
    state = module.state_dict()
    missing, extra = set(state) - set(params), set(params) - set(state)
    if missing or extra:
        raise CodecError(
            f"weights do not fit the model: missing {sorted(missing)}, extra {sorted(extra)}"
        )
    new = {}
    for name, tensor in state.items():
        arr = params[name]
        if tuple(arr.shape) != tuple(tensor.shape):
            raise CodecError(f"{name}: shape {tuple(arr.shape)} != model's {tuple(tensor.shape)}")
        if torch.from_numpy(np.empty(0, arr.dtype)).dtype != tensor.dtype:
            raise CodecError(f"{name}: dtype {arr.dtype} != model's {tensor.dtype}")
        # a writable array as it is (one a chunked read made); a codec's read-only view copied
        new[name] = torch.from_numpy(arr if arr.flags.writeable else np.array(arr))
    return new


class WeightStore:
    """Versioned parameters under ``key`` (default: the run's weights key), float arrays on
    the wire as ``wire`` (default: their own dtype)."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        key: str | None = None,
        wire: str | None = None,
    ) -> None:
        self.client, self.keys, self.key = client, keys, key or keys.weights
        self.store = ChunkedStore(client, keys, self.key, WEIGHTS, wire=wire)

    def publish(
        self,
        params: Mapping[str, np.ndarray] | torch.nn.Module,
        version: int,
        meta: Mapping[str, Any] | None = None,
    ) -> int:
        """Store ``params`` (arrays, or a module's state dict) as ``version``, atomically;
        returns the version stored, which the caller carries on from
        (:meth:`qrl.wire.chunks.ChunkedStore.publish`: above another writer's newer one)."""
        arrays = module_arrays(params) if isinstance(params, torch.nn.Module) else dict(params)
        return self.store.publish({"params": arrays, "meta": meta}, version)

    def kept(self, every_s: float = 1.0) -> bool:
        """Whether the key still holds the weights this store last published (True if it
        published none); checked in Redis at most once every ``every_s`` seconds. False
        means another writer's took their place: readers that rejected them wait for a new
        version."""
        return self.store.kept(every_s)

    def version(self) -> int:
        """The stored version, -1 if nothing (or garbage) was published (one HGET)."""
        return self.store.version()

    def fetch(
        self, newer_than: int = -1, accept: Callable[[Manifest], None] | None = None
    ) -> Weights | None:
        """The stored weights if their version is not ``newer_than``, else ``None``.
        An older stored version is taken too: versions only go up, unless a learner
        overwrote garbage (a version far ahead of its own) that ``newer_than`` came from.
        Weights that fail validation are dead-lettered and ``None`` returned, so a reader
        keeps its current weights. ``accept``: see :meth:`ChunkedStore.read`."""
        got = self.store.read(newer_than, accept)
        if got is None:
            return None
        version, msg = got
        return Weights(version, msg["params"], msg["meta"] or {})

    def load_into(self, module: torch.nn.Module, newer_than: int = -1) -> int | None:
        """Fetch newer weights and load them into ``module``; returns the version loaded or
        ``None`` if there was nothing newer (or nothing valid). Weights that do not fit it
        (names, shapes, dtypes: read from the manifest) are not fetched."""
        try:
            w = self.fetch(newer_than, fitting(module))
            if w is None:
                return None
            load_arrays(module, w.params)
        except (CodecError, Unfit) as e:
            log.warning("weights at %s do not fit the model: %s", self.key, e)
            return None
        return w.version


def wait_for_weights(
    refresh: Callable[[], bool], should_stop: Callable[[], bool], timeout: float = 600
) -> bool:
    """Call ``refresh`` (load newer weights; True if it did) until the learner has published
    weights, so that everyone acting starts from the same ones; False if stopped first,
    ``RuntimeError`` after ``timeout`` seconds."""
    deadline = clock.now() + timeout
    while not should_stop():
        if refresh():
            return True
        if clock.now() > deadline:
            raise RuntimeError(f"no weights published in {timeout:.0f}s: is a learner running?")
        clock.sleep(0.05)
    return False
