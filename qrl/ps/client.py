"""What a worker (an A3C actor-learner, a Gorila learner) needs of the parameter server:
the network's parameters as one flat vector split in blocks (:class:`Flat`), pulled from
the shards and pushed to them as gradients (:class:`PSClient`).

Far from Redis (:class:`qrl.runtime.background.Background`: round trips of a millisecond or
more) a gradient's push runs on a thread of its own while the worker computes the next one
(a push still under way is waited for first, so a full stream still holds it back), and a
pull can be split in two: :meth:`PSClient.fetch` on another thread (it touches nothing the
worker reads) and :meth:`PSClient.load` between two steps (A3C's actors:
:class:`qrl.actors.a3c.PSWeights`). At a 5 ms round trip a push and a pull in line cost an
A3C worker about two thirds of its loopback rate."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import redis
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from qrl.ps import protocol
from qrl.ps.config import ParameterServerConfig
from qrl.runtime.background import Background
from qrl.runtime.loop import StopCheck
from qrl.wire.codec import encode
from qrl.wire.keys import RunKeys
from qrl.wire.streams import StreamProducer
from qrl.wire.weights import WeightStore


class Flat:
    """A network's parameters (in ``parameters()`` order) as one vector of ``total``
    floats in ``n`` blocks."""

    def __init__(self, net: torch.nn.Module, n: int) -> None:
        self.params = list(net.parameters())
        self.total = sum(p.numel() for p in self.params)
        if self.total < n:
            raise ValueError(f"{self.total} parameters cannot make {n} shards")
        self.bounds = protocol.bounds(self.total, n)

    def block(self, k: int) -> slice:
        return slice(self.bounds[k], self.bounds[k + 1])

    def vector(self) -> torch.Tensor:
        return parameters_to_vector(self.params).detach()

    def load(self, vector: torch.Tensor) -> None:
        vector_to_parameters(vector.to(self.params[0].device), self.params)

    def grad(self) -> torch.Tensor:
        return parameters_to_vector(
            [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        )


def fetch_blocks(
    stores: list[WeightStore],
    versions: list[int],
    flat: Flat,
    vector: torch.Tensor,
    skip: int | None = None,
) -> bool:
    """Copy into ``vector`` every shard's block (but ``skip``'s) published since
    ``versions``, which it updates; whether any came. A block that is not a float32 block of
    this network (a writer's) is passed over: the old one is kept."""
    changed = False
    for k, store in enumerate(stores):
        if k == skip:
            continue
        w = store.fetch(newer_than=versions[k])
        block = None if w is None else w.params.get("block")
        sl = flat.block(k)
        if block is None or block.shape != (sl.stop - sl.start,) or block.dtype != np.float32:
            continue
        vector.numpy()[sl] = block
        versions[k] = w.version
        changed = True
    return changed


class Fetched(NamedTuple):
    """Blocks a :meth:`PSClient.fetch` brought: the versions it began from, those it brought
    and the vector holding them."""

    since: list[int]
    versions: list[int]
    vector: torch.Tensor


class PSClient:
    """Pulls the blocks of ``net``'s parameters from the shards (only those with a new
    version) and pushes its gradients to them, each tagged with the version of the block it
    was computed on, to worker ``worker``'s own stream of each shard (its user may write no
    other). Each of the run's ``pushers`` workers has its share of ``ps_queue`` waiting per
    shard (at least one) before it backs off. ``versions`` are the blocks' versions held."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        cfg: ParameterServerConfig,
        net: torch.nn.Module,
        worker: int,
        pushers: int = 1,
    ) -> None:
        self.cfg, self.worker, self.net = cfg, worker, net
        n = cfg.ps_shards
        self.flat = Flat(net, n)
        shards = [protocol.shard_keys(keys, n, k) for k in range(n)]
        self.stores = [WeightStore(client, keys, protocol.params(sk)) for sk in shards]
        room = -(-cfg.ps_queue // max(pushers, 1))
        self.producers = [
            StreamProducer(client, protocol.gradients(sk, worker), room, keys=sk) for sk in shards
        ]
        self.versions = [-1] * n
        self.vector = self.flat.vector().cpu()
        self.pushed = 0
        self.sending = Background("gradients")

    @property
    def version(self) -> int:
        """The newest block's version: how many gradients the pulled parameters hold (each
        gradient goes to every shard), the run's weights version's measure."""
        return max(self.versions)

    def pull(self) -> bool:
        """Load the blocks published since the last pull into the network, in line (into the
        vector held: no copy); True when every block has been published (the parameters are
        the server's)."""
        if fetch_blocks(self.stores, self.versions, self.flat, self.vector):
            self.flat.load(self.vector)
        return min(self.versions) >= 0

    def fetch(self) -> Fetched | None:
        """The blocks published since the versions held, in a copy of the vector (nothing
        the network or the pushes read changes: another thread may fetch); ``None`` if none
        came."""
        versions, vector = list(self.versions), self.vector.clone()
        if not fetch_blocks(self.stores, versions, self.flat, vector):
            return None
        return Fetched(list(self.versions), versions, vector)

    def load(self, fetched: Fetched | None) -> bool:
        """Load what :meth:`fetch` brought into the network, unless the blocks held changed
        since it began (another pull loaded newer ones); whether it did."""
        if fetched is None or fetched.since != self.versions:
            return False
        self.versions, self.vector = fetched.versions, fetched.vector
        self.flat.load(self.vector)
        return True

    def push(self, loss: float, should_stop: StopCheck) -> bool:
        """Send the network's gradient (``.grad``, already clipped), a block to each shard,
        tagged with the versions of the blocks it was computed on: on the sending thread far
        from Redis; False if that push (in line: this one) was stopped while a shard's
        stream was full."""
        grad = self.flat.grad().detach().cpu().numpy().astype(self.cfg.ps_grad_dtype, copy=False)
        payloads = [
            encode(
                protocol.GRADIENT,
                {
                    "shard": k,
                    "version": self.versions[k],
                    "loss": float(loss),
                    "grad": np.ascontiguousarray(grad[self.flat.block(k)]),
                },
            )
            for k in range(len(self.producers))
        ]

        def send() -> bool:
            for producer, payload in zip(self.producers, payloads, strict=True):
                if producer.add(payload, should_stop) is None:
                    return False
            self.pushed += 1
            return True

        return self.sending.submit(send) is not False

    def close(self) -> None:
        """Wait for the push under way."""
        self.sending.close()

    def waited_s(self) -> float:
        return sum(p.waited_s for p in self.producers)
