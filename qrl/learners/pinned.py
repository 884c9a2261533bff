"""Page-locked ring memory for a learner on CUDA: copies from a pinned ring slot to the GPU
run asynchronously (``non_blocking``), overlapping the compute of the update before."""

from __future__ import annotations

import logging

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
