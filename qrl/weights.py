"""The weight store: a learner publishes its parameters with a version, actors poll.

The parameters live in one hash ``{version, blob}`` written by a Lua script that refuses a
version not newer than the stored one, so readers always see a matching pair and versions
only increase. Checking for new weights is one HGET; the blob is fetched only when the
version changed. The same store carries ES parameters (with the generation as version).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis
import torch

from qrl.codec import CodecError, Field, Schema, decode, encode
from qrl.keys import RunKeys
from qrl.streams import dead_letter

log = logging.getLogger(__name__)

_PUBLISH = """
local cur = tonumber(redis.call('HGET', KEYS[1], 'version') or '-1')
if tonumber(ARGV[1]) <= cur then
  return redis.error_reply('QRL version ' .. ARGV[1] .. ' is not newer than ' .. cur)
end
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'blob', ARGV[2])
return 1
"""


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
    module.load_state_dict(new)


class WeightStore:
    """Versioned parameters under ``key`` (default: the run's weights key)."""

    def __init__(self, client: redis.Redis, keys: RunKeys, key: str | None = None) -> None:
        self.client = client
        self.keys = keys
        self.key = key or keys.weights
        self._publish = client.register_script(_PUBLISH)
        self._rejected: bytes | None = None  # version whose blob failed, not fetched again

    def publish(
        self,
        params: Mapping[str, np.ndarray] | torch.nn.Module,
        version: int,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        """Store ``params`` (arrays, or a module's state dict) as ``version``, atomically.
        Raises ``ValueError`` if ``version`` is not newer than the stored one."""
        if isinstance(params, torch.nn.Module):
            params = module_arrays(params)
        blob = encode("weights", {"version": int(version), "params": dict(params), "meta": meta})
        try:
            self._publish(keys=[self.key], args=[int(version), blob])
        except redis.ResponseError as e:
            if "QRL version" in str(e):
                raise ValueError(str(e).removeprefix("QRL ")) from e
            raise

    def version(self) -> int:
        """The stored version, -1 if nothing was published (one HGET)."""
        v = self.client.hget(self.key, "version")
        try:
            return int(v) if v is not None else -1
        except ValueError:
            return -1

    def fetch(self, newer_than: int = -1) -> Weights | None:
        """The stored weights if their version is newer than ``newer_than``, else ``None``.
        A stored blob that fails validation is dead-lettered and ``None`` returned, so a
        reader keeps its current weights."""
        if self.version() <= newer_than:
            return None
        version, blob = self.client.hmget(self.key, ["version", "blob"])
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
        if msg["version"] <= newer_than:
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
