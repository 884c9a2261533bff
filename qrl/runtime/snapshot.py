"""A learner's whole state in Redis: what population-based training moves between workers and
copies from one trial into another (the checkpoint is a file in torch's own format, a pickle:
never for what crosses Redis).

Only a PBT slot reads and writes a trial's ``snapshot`` key, as the trial's user: it hands
the snapshot to the segment's learner in a file (:meth:`SnapshotStore.to_file`), and the
learner, which runs as a user of its own that may not write the key, leaves its state in that
file as it stops, for the slot to check and store (:meth:`SnapshotStore.from_file`).

One message in the run's ``snapshot`` key, in chunks under a manifest of any size
(:class:`qrl.wire.chunks.ChunkedStore`; in the file the same layout): the update count, the
network's state dict (``model``) and the optimizer's per-parameter state (``opt``,
``"I.NAME"``: parameter I of the optimizer's groups, e.g. Adam's ``step``, ``exp_avg``,
``exp_avg_sq``). The learning rates are not in it: they are the run's config. Anyone with the
trial's keys can write anything there, so a snapshot is checked against the network and the
optimizer it goes into before any of it is loaded: names, shapes and dtypes as the network's,
the optimizer state's names those its kind of optimizer keeps, shapes its parameter's (or a
scalar), every number finite.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch

from qrl.runtime.files import write_atomically
from qrl.wire import chunks
from qrl.wire.chunks import MAX_ARRAYS, ChunkedStore
from qrl.wire.codec import CodecError, Field, Schema
from qrl.wire.keys import RunKeys
from qrl.wire.weights import MAX_VERSION, load_arrays, module_arrays

log = logging.getLogger(__name__)

KIND = "snapshot"
SCHEMA = Schema(
    KIND,
    {
        "updates": Field(int, bounds=(0, MAX_VERSION - 1)),
        "model": Field(dict, values=Field(np.ndarray), max_len=MAX_ARRAYS),
        "opt": Field(dict, values=Field(np.ndarray, finite=True), max_len=MAX_ARRAYS),
    },
)
_OPT_KEY = re.compile(r"(0|[1-9][0-9]{0,5})\.([a-z_][a-z0-9_]{0,31})")


def key(keys: RunKeys) -> str:
    return keys.key("snapshot")


@dataclass
class Snapshot:
    updates: int
    model: dict[str, np.ndarray]
    opt: dict[str, np.ndarray]


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def capture(net: torch.nn.Module, opt: torch.optim.Optimizer, updates: int) -> Snapshot:
    """The state of ``net`` and ``opt`` after ``updates`` updates, as arrays."""
    state = opt.state_dict()["state"]
    arrays = {
        f"{i}.{name}": v.detach().cpu().numpy().copy()
        for i, per in state.items()
        for name, v in per.items()
        if isinstance(v, torch.Tensor)
    }
    return Snapshot(int(updates), module_arrays(net), arrays)


def state_names(opt: torch.optim.Optimizer) -> set[str]:
    """The names of the state ``opt``'s kind of optimizer keeps per parameter (after a step of
    a twin with the same settings)."""
    p = torch.nn.Parameter(torch.zeros(1, device=_params(opt)[0].device))
    twin = type(opt)([p], **opt.defaults)
    p.grad = torch.zeros_like(p)
    twin.step()
    return set(twin.state[p])


def optimizer_state(arrays: dict[str, np.ndarray], opt: torch.optim.Optimizer) -> dict[str, Any]:
    """``arrays`` (a snapshot's ``opt``) as a state dict for ``opt``, checked to fit it;
    raises CodecError if it does not."""
    params, names = _params(opt), state_names(opt)
    per: dict[int, dict[str, torch.Tensor]] = {}
    for k, arr in arrays.items():
        m = _OPT_KEY.fullmatch(k)
        if m is None or int(m.group(1)) >= len(params) or m.group(2) not in names:
            raise CodecError(f"optimizer state {k!r} does not fit the optimizer")
        p = params[int(m.group(1))]
        if arr.shape not in (tuple(p.shape), ()) or arr.dtype != np.float32:
            raise CodecError(f"optimizer state {k!r}: {arr.dtype} {arr.shape}, param {p.shape}")
        per.setdefault(int(m.group(1)), {})[m.group(2)] = torch.from_numpy(np.array(arr))
    for i, got in per.items():
        if set(got) != names:
            raise CodecError(f"optimizer state of parameter {i}: {sorted(got)}, not {names}")
    return {"state": per, "param_groups": opt.state_dict()["param_groups"]}


def load_model(model: dict[str, np.ndarray], net: torch.nn.Module) -> None:
    """Load ``model`` into ``net`` if it fits (names, shapes, dtypes, finite); else raise
    CodecError with ``net`` untouched."""
    for name, arr in model.items():
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise CodecError(f"{name}: not finite")
    load_arrays(net, model)  # checks every array before it loads any


def _message(snap: Snapshot) -> dict[str, Any]:
    return {"updates": snap.updates, "model": snap.model, "opt": snap.opt}


def _snapshot(msg: dict[str, Any]) -> Snapshot:
    return Snapshot(msg["updates"], msg["model"], msg["opt"])


def write_file(path: Path, snap: Snapshot) -> None:
    """``snap`` into ``path``, whole (a reader never sees half of one), a chunk at a time."""
    write_atomically(path, lambda f: chunks.write_file(f, SCHEMA, _message(snap)))


def read_file(path: Path) -> Snapshot | None:
    """The snapshot in ``path``; ``None`` if there is none or it is not one (logged)."""
    try:
        return _snapshot(chunks.read_file(path, SCHEMA))
    except FileNotFoundError:
        return None
    except CodecError as e:
        log.warning("rejected the snapshot in %s: %s", path, e)
        return None


class SnapshotStore:
    """The run's snapshot: :meth:`save` one, :meth:`fetch` it (``None`` if there is none or
    it does not decode: dead-lettered, logged); pass it to a learner's file and back."""

    def __init__(self, client: redis.Redis, keys: RunKeys) -> None:
        self.client, self.keys, self.key = client, keys, key(keys)
        self.store = ChunkedStore(client, keys, self.key, SCHEMA)

    def save(self, snap: Snapshot) -> None:
        self.store.replace(_message(snap))

    def to_file(self, path: Path) -> None:
        """The snapshot, checked, into ``path`` for a learner to resume from; with none
        (or none that decodes), no file, so the learner never takes an older one left there."""
        snap = self.fetch()
        if snap is None:
            path.unlink(missing_ok=True)
        else:
            write_file(path, snap)

    def from_file(self, path: Path) -> bool:
        """Store the snapshot a learner left in ``path`` (checked as :meth:`fetch` checks
        one) and remove the file; False if there was none to store."""
        snap = read_file(path)
        if snap is not None:
            self.save(snap)
        path.unlink(missing_ok=True)
        return snap is not None

    def fetch(self) -> Snapshot | None:
        got = self.store.read()
        return None if got is None else _snapshot(got[1])
