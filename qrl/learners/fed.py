"""What the batch sources fed by processes through a ring (:mod:`qrl.replay.feed`) share: the
replay's (its samplers) and the unrolls' (their loader). :class:`FedSource` starts and stops
the feed and takes batches from it as tensors.

On CPU a batch's tensors are the ring slot's own memory; on CUDA the ring is page-locked,
so copies from a slot to the GPU run asynchronously (``non_blocking``), overlapping the
compute of the update before."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

from qrl.replay.feed import Feed
from qrl.replay.ring import SlotRing

log = logging.getLogger(__name__)
B = TypeVar("B")


def pin(ring: SlotRing, device: torch.device) -> bool:
    """Page-lock ``ring``'s memory for copies to a CUDA ``device``; False if it was not
    (not CUDA, or CUDA refused: copies stay synchronous)."""
    if device.type != "cuda":
        return False
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


class FedSource:
    """A batch source fed by a :class:`~qrl.replay.feed.Feed` (:meth:`open`: started with the
    learner, stopped with it; its ring pinned for copies to CUDA). A subclass opens its feed
    and makes its items batches."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.feed: Feed | None = None
        self.transfer_s = 0.0  # seconds making batches' tensors
        self._pinned = False
        self._fail: Callable[[str], None] = _unheard

    def open(self) -> Feed:
        raise NotImplementedError

    def start(self, fail: Callable[[str], None]) -> None:
        """Start the feed's processes (no thread); ``fail`` hears why it cannot go on."""
        self._fail = fail
        self.feed = self.open()
        self._pinned = pin(self.feed.ring, self.device)

    def stop(self) -> None:
        if self.feed is not None:
            self.feed.stop()
            if self._pinned:
                unpin(self.feed.ring)
                self._pinned = False
            self.feed = None

    def fetch(self, timeout: float, make: Callable[[Any], B]) -> B | None:
        """The feed's next item made a batch of tensors by ``make`` (its time counted as
        transfer), ``None`` if none came within ``timeout`` or the feed failed (then the
        learner stops, saying why)."""
        try:
            item = self.feed.get(timeout) if self.feed is not None else None
        except RuntimeError as e:
            self._fail(str(e))
            return None
        if item is None:
            return None
        t0 = time.monotonic()
        batch = make(item)
        self.transfer_s += time.monotonic() - t0
        return batch

    def metrics(self) -> dict[str, float]:
        return {}


def _unheard(what: str) -> None:
    raise RuntimeError(what)
