"""A learner's batches from ring slots (:mod:`qrl.replay.ring`) as tensors: on CPU the slot's
own memory; on CUDA the ring is page-locked, so copies from a slot to the GPU run
asynchronously (``non_blocking``), overlapping the compute of the update before."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from qrl.replay.ring import SlotRing

log = logging.getLogger(__name__)


def pin(ring: SlotRing) -> bool:
    """Page-lock ``ring``'s memory; False (copies stay synchronous) if CUDA refuses."""
    err = int(torch.cuda.cudart().cudaHostRegister(ring.address, ring.nbytes, 1))  # 1: portable
    if err:
        log.warning("could not pin the batch ring (cudaError %d): copies are synchronous", err)
    return not err


def unpin(ring: SlotRing) -> None:
    torch.cuda.cudart().cudaHostUnregister(ring.address)


def tensor_on(device: torch.device) -> Callable[[np.ndarray], torch.Tensor]:
    """Arrays as tensors on ``device``: on CPU the same memory, on CUDA an asynchronous copy
    (from pinned memory: a ring slot)."""
    if device.type == "cpu":
        return torch.from_numpy
    return lambda a: torch.from_numpy(a).to(device, non_blocking=True)
