"""The learner's sampler process far from Redis (issue 71): the slots the learner gives back
together are filled in one round trip, where one batch per trip held an Ape-X learner 5 ms
from Redis to half its loopback rate."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np

from qrl.replay.sampler import Sampler
from qrl.replay.store import PrioritizedReplay
from tests.helpers import LAYOUT, check_records, int_ids, make_records, spec_of


class CountingProxy:
    """A TCP proxy to ``port`` that holds each request ``delay`` seconds (so requests sent
    one after another's reply cannot merge) and counts them: ``requests`` is how many reads
    it took from its clients, one per round trip a client makes."""

    def __init__(self, port: int, delay: float) -> None:
        self.port, self.delay = port, delay
        self.requests = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(("127.0.0.1", self.port))
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, request: bool) -> None:
        try:
            while data := src.recv(65536):
                if request:
                    self.requests += 1
                    time.sleep(self.delay)  # the delay is the point: requests cannot merge
                dst.sendall(data)
        except OSError:
            pass
        finally:
            dst.close()

    def close(self) -> None:
        self.listener.close()


def test_slots_given_back_together_are_filled_in_one_round_trip(r, keys, redis_server):
    replay = PrioritizedReplay(r, keys, LAYOUT, 1000)
    replay.insert(make_records(range(200)), np.ones(200))
    proxy = CountingProxy(redis_server.port, delay=0.05)
    host, port = proxy.address
    spec = spec_of(f"redis://{host}:{port}", keys, batch_size=32)
    sampler = Sampler(spec, prefetch=4)
    try:
        first = [sampler.get(timeout=30) for _ in range(4)]
        before = proxy.requests
        for s in first:
            sampler.release(s.slot, np.full(len(s.ids), 2.0))
        again = [sampler.get(timeout=30) for _ in range(4)]
        trips = proxy.requests - before
    finally:
        sampler.stop()
        proxy.close()
    for s in again:
        assert s is not None and len(s.ids) == 32
        check_records(s.batch, int_ids(s.ids))
    # the priorities of the four (one write) and four new batches (one draw); a draw per
    # batch took five or more
    assert trips <= 3, trips
    written = {i for s in first for i in s.ids}
    assert all(r.zscore(keys.replay_priorities, i) == 2.0 for i in written)
