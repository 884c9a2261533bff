"""The weight store: a learner publishes its parameters with a version, actors poll.

The parameters live in one hash ``{version, blob}`` written by a Lua script that refuses a
version not newer than the stored one, so readers always see a matching pair and versions
only increase. Checking for new weights is one HGET; the blob is fetched only when the
version changed. The same store carries ES parameters (with the generation as version).

A key has one writer, its learner. Should another write it (a second learner, an old one
restarted, anyone with access to the run's keys), :meth:`WeightStore.publish` stores the
learner's parameters above whatever version it finds and returns that version: the learner
carries on from it, with one warning. Garbage in the key (a version that is not a number, a
blob that does not decode, a key that is not a hash) is never fatal: readers ignore it and
keep their weights, the next publish overwrites it. So is a version at or past
:data:`MAX_VERSION`, or more than :data:`MAX_AHEAD` ahead of the publishing learner's: the
learner overwrites it with its own version instead of counting on from it (so no one write
can carry its count to where versions stop being numbers), and readers that took it see the
version go back and load what the learner published.

A reader rejects a blob once per version. So a writer that puts its blob under the
learner's version while the learner has nothing new to publish (it waits for data that
actors, waiting for weights, do not send) would stall the run: :meth:`WeightStore.kept`
tells a publisher its blob is gone, and it publishes again as a new version.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis
import torch

from qrl.wire import clock
from qrl.wire.codec import CodecError, Field, Schema, decode, encode
from qrl.wire.keys import RunKeys
from qrl.wire.scripts import Lua
from qrl.wire.stream_scripts import dead_letter

log = logging.getLogger(__name__)

# a writer's versioned publish, and its check that the key still holds what it published
# (qrl/wire/lua/weights.*.lua): WeightStore.publish and .kept
PUBLISH, KEPT = Lua("weights.publish"), Lua("weights.kept")

MAX_VERSION = 2**53 - 1  # stored versions this large or larger are garbage (Lua's doubles)
# how far ahead of a learner's own version another writer's may be for the learner to count
# on from it (a second learner, one restarted from an older checkpoint); further is garbage.
# One write moves a learner's count at most this far: 2**33 of them to reach MAX_VERSION.
MAX_AHEAD = 2**20


def ahead(stored: int, own: int) -> bool:
    """Whether ``stored`` is a newer version a writer at ``own`` counts on from, not garbage
    (at most :data:`MAX_AHEAD` ahead, below :data:`MAX_VERSION`)."""
    return own < stored <= _ceiling(own)


def _ceiling(own: int) -> int:
    return min(own + MAX_AHEAD, MAX_VERSION - 1)


_PUBLISH_TRIES = 5


def _check_version(msg: dict[str, Any]) -> None:
    if msg["version"] < 0:
        raise CodecError(f"negative version {msg['version']}")


WEIGHTS = Schema(
    "weights",
    {
        "version": Field(int),
        "params": Field(dict, values=Field(np.ndarray, finite=True)),
        "meta": Field(dict, optional=True),
    },
    check=_check_version,
)


@dataclass
class Weights:
    version: int
    params: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)


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
        new[name] = torch.from_numpy(np.array(arr))  # writable copy
    return new


class WeightStore:
    """Versioned parameters under ``key`` (default: the run's weights key)."""

    def __init__(self, client: redis.Redis, keys: RunKeys, key: str | None = None) -> None:
        self.client = client
        self.keys = keys
        self.key = key or keys.weights
        self._publish, self._kept = PUBLISH.on(client), KEPT.on(client)
        self._mine: tuple[int, str, int] | None = None  # version, SHA1, length: its last blob
        self._checked = 0.0  # monotonic time of the last publish or kept() check
        self._rejected: bytes | None = None  # version whose blob failed, not fetched again
        self._overtaken = self._wrongtype = False  # warned about (once)

    def publish(
        self,
        params: Mapping[str, np.ndarray] | torch.nn.Module,
        version: int,
        meta: Mapping[str, Any] | None = None,
    ) -> int:
        """Store ``params`` (arrays, or a module's state dict) as ``version``, atomically;
        returns the version stored, which the caller carries on from.

        Versions only go up. If the key already holds ``version`` or a newer one, another
        writer got there first (a second learner of the run, an old one restarted, anyone
        with access to the run's keys): the parameters are stored above it, as that version
        + 1, with a warning the first time. A stored version that is not a whole number from
        0 to :data:`MAX_AHEAD` past ``version`` (below :data:`MAX_VERSION`), or a key that is
        not a hash, is garbage and overwritten."""
        arrays = module_arrays(params) if isinstance(params, torch.nn.Module) else dict(params)
        version = int(version)
        for _ in range(_PUBLISH_TRIES):
            blob = encode("weights", {"version": version, "params": arrays, "meta": meta})
            done, stored = self._publish(keys=[self.key], args=[version, blob, _ceiling(version)])
            if done:
                sha = hashlib.sha1(blob, usedforsecurity=False).hexdigest()
                self._mine = (version, sha, len(blob))
                self._checked = time.monotonic()
                return version
            if not self._overtaken:
                self._overtaken = True
                log.warning(
                    "%s holds version %d, not older than this writer's %d: another writer? "
                    "publishing above it (version %d) and carrying on from there",
                    self.key,
                    stored,
                    version,
                    stored + 1,
                )
            version = int(stored) + 1
        log.warning("%s: another writer keeps getting ahead; not published this time", self.key)
        return version

    def kept(self, every_s: float = 1.0) -> bool:
        """Whether the key still holds the version and blob this store last published (True
        if it published none); checked in Redis at most once every ``every_s`` seconds
        after the last publish or check, True in between. False means another writer's blob
        or version took its place: readers that rejected it wait for a new version."""
        now = time.monotonic()
        if self._mine is None or now - self._checked < every_s:
            return True
        self._checked = now
        return bool(self._kept(keys=[self.key], args=list(self._mine)))

    def version(self) -> int:
        """The stored version, -1 if nothing (or garbage) was published (one HGET)."""
        v = self._read(lambda: self.client.hget(self.key, "version"))
        try:
            v = int(v) if v is not None else -1
        except ValueError:
            return -1
        return v if 0 <= v < MAX_VERSION else -1

    def _read(self, command: Callable[[], Any]) -> Any:
        """``command()``, or None if the key is not a hash (garbage: logged once)."""
        try:
            return command()
        except redis.ResponseError as e:
            if not str(e).startswith("WRONGTYPE"):
                raise
            if not self._wrongtype:
                self._wrongtype = True
                log.warning("%s is not a hash (written by something else): ignored", self.key)
            return None

    def fetch(self, newer_than: int = -1) -> Weights | None:
        """The stored weights if their version is newer than ``newer_than``, else ``None``.
        An older stored version is taken too: versions only go up, unless a learner
        overwrote garbage (a version far ahead of its own) that ``newer_than`` came from.
        A stored blob that fails validation is dead-lettered and ``None`` returned, so a
        reader keeps its current weights."""
        if self.version() in (-1, newer_than):
            return None
        pair = self._read(lambda: self.client.hmget(self.key, ["version", "blob"]))
        version, blob = pair or (None, None)
        if blob is None or (version is not None and version == self._rejected):
            return None
        try:
            msg = decode(blob, WEIGHTS)
            if version is None or int(version) != msg["version"]:
                raise CodecError(f"blob version {msg['version']} != key version {version!r}")
        except (CodecError, ValueError) as e:
            log.warning("rejected weights at %s: %s", self.key, e)
            self._rejected = version
            dead_letter(
                self.client, self.keys, self.key.removeprefix(self.keys.prefix), str(e), blob
            )
            return None
        if msg["version"] == newer_than:
            return None
        return Weights(msg["version"], msg["params"], msg["meta"] or {})

    def load_into(self, module: torch.nn.Module, newer_than: int = -1) -> int | None:
        """Fetch newer weights and load them into ``module``; returns the version loaded or
        ``None`` if there was nothing newer (or nothing valid)."""
        w = self.fetch(newer_than)
        if w is None:
            return None
        try:
            load_arrays(module, w.params)
        except CodecError as e:
            log.warning("weights version %d do not fit the model: %s", w.version, e)
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
