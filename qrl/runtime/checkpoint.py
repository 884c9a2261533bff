"""Checkpoints: model, optimizer, step and config, written atomically and loaded with
``weights_only=True`` (no arbitrary pickled objects)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qrl.runtime.config import Config, live_fields
from qrl.runtime.files import write_atomically
from qrl.version import __version__

FORMAT = 1  # bump when the checkpoint layout changes; older files are refused, not misread


class CheckpointError(ValueError):
    """A checkpoint that cannot be used here (other algorithm, other config, corrupt)."""


def save_checkpoint(
    path: Path,
    algo: str,
    cfg: Config,
    model: torch.nn.Module | dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    step: int,
    extra: dict[str, Any] | None = None,
) -> None:
    state = {
        "format": FORMAT,
        "algo": algo,
        "qrl_version": __version__,
        "config": cfg.to_dict(),
        "step": int(step),
        "model": model.state_dict() if isinstance(model, torch.nn.Module) else model,
        "optimizer": optimizer.state_dict() if optimizer is not None else {},
        "extra": extra or {},
    }
    _write(path, state)


def load_checkpoint(
    path: Path, algo: str | None = None, cfg: Config | None = None
) -> dict[str, Any]:
    """Load a checkpoint; with ``algo``/``cfg`` given, check it was written by that
    algorithm with the same configuration (but for the fields that may change while a run
    runs: :data:`qrl.runtime.config.LIVE`; a field the file lacks had its default)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for corrupt or unsafe files
        raise CheckpointError(f"cannot load checkpoint {path}: {e}") from e
    if not isinstance(state, dict) or "model" not in state or "algo" not in state:
        raise CheckpointError(f"{path} is not a qrl checkpoint")
    if state.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} has checkpoint format {state.get('format')!r} (written by qrl "
            f"{state.get('qrl_version', '?')}); this qrl {__version__} reads format {FORMAT}"
        )
    if algo is not None and state["algo"] != algo:
        raise CheckpointError(f"{path} is a {state['algo']} checkpoint, not {algo}")
    if cfg is not None:
        want, live = cfg.to_dict(), set(live_fields(type(cfg)))
        # a field the file does not name came later: the file was written with its default
        have = {**type(cfg)().to_dict(), **state["config"]}
        diff = sorted(k for k in (set(want) | set(have)) - live if want.get(k) != have.get(k))
        if diff:
            raise CheckpointError(
                f"{path} was written with a different configuration (differs in {diff}); "
                "use a new run directory or the same settings"
            )
    return state


def replace_model(
    path: Path, params: dict[str, Any], step: int, extra: dict[str, Any] | None = None
) -> None:
    """Swap the model in checkpoint ``path`` for ``params`` (name -> array) at ``step``,
    atomically, with ``extra`` (the state published beside them, if any); the optimizer
    state and everything else stay. ``params`` are the whole model or whole submodules of it
    (``actor.*``: a learner that publishes only its actor); the rest of the model stays."""
    import numpy as np

    state = torch.load(path, map_location="cpu", weights_only=True)
    model = state["model"]
    if not _whole_parts(set(params), set(model)):
        raise CheckpointError(f"{path}: parameters do not match the checkpoint's model")
    state["model"] = {
        k: torch.from_numpy(np.array(params[k])).to(v.dtype) if k in params else v
        for k, v in model.items()
    }
    state["step"] = int(step)
    if extra:
        state["extra"] = dict(extra)
    _write(path, state)


def _whole_parts(params: set[str], model: set[str]) -> bool:
    """Whether ``params`` are all of ``model``, or every parameter of some of its top-level
    submodules (``actor.*``) and nothing else."""
    if params == model:
        return True
    parts = {k.split(".", 1)[0] for k in params if "." in k}
    whole = {k for k in model if "." in k and k.split(".", 1)[0] in parts}
    return bool(params) and params == whole


def _write(path: Path, state: dict[str, Any]) -> None:
    """Save ``state`` to ``path`` atomically (a reader never sees half a file)."""
    write_atomically(path, lambda f: torch.save(state, f))
