"""The inference server of central inference (SEED RL): it pops the requests of its actors
(those with ``id % inference_servers`` equal to its own), acts on all of them in one forward
pass with the latest published weights, answers each actor, and assembles each actor's
steps into what the learner consumes, pushed where local actors would push it. What it
assembles is its algorithm's :class:`Agent` (IMPALA's unrolls:
:mod:`qrl.inference.unrolls`; R2D2's sequences with the LSTM state kept here:
:mod:`qrl.inference.sequences`). It keeps no state a restart loses beyond half-built
unrolls or sequences, which are dropped.

Follow one batch: :meth:`InferenceServer.gather` pops requests (waiting up to
``inference_wait_ms`` for the rest of its actors), :meth:`InferenceServer.admit` validates
each and files it under its actor's :class:`Track`, the agent acts on them in one forward
pass, :meth:`InferenceServer.answer` pushes the replies in one round trip, and the agent
pushes what the requests completed.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import redis
import torch

from qrl.actors.weights import Weights
from qrl.inference import protocol
from qrl.learners.base import pick_device
from qrl.rl.envspec import EnvSpec
from qrl.runtime.background import Background
from qrl.runtime.config import Config
from qrl.runtime.ids import id_limit
from qrl.runtime.loop import Role, StopCheck
from qrl.wire.codec import CodecError, decode, encode
from qrl.wire.faults import warn_once
from qrl.wire.keys import RunKeys
from qrl.wire.stream_scripts import dead_letter, stored_cap

SWEEP = 16  # lists of actors it has not heard from that each pop looks at


@dataclass
class Track:
    """The conversation of one env batch of an actor (:mod:`qrl.inference.protocol`): its
    ``life`` and last ``seq``, and the reply to it. An agent's track also holds what it is
    assembling from the batch's steps."""

    actor: int
    batch: int
    life: int
    seq: int
    reply: bytes = b""

    def advance(self, req: dict[str, Any]) -> None:
        """The next request: what the last actions gave, and the observations to act on."""
        raise NotImplementedError

    def held(self) -> bool:
        """Whether a restart of the actor drops steps: here, the step its last reply chose
        the actions of (its result comes with the next request); an agent's track adds the
        steps it holds."""
        return bool(self.reply)


class Agent:
    """What an algorithm gives its inference servers: the network (it gets the published
    weights), a track per actor, the batched action choice and the push of what the
    actors' steps completed."""

    net: torch.nn.Module

    def track(self, req: dict[str, Any], old: Track | None) -> Track:
        """A fresh track of the actor's batch that sent ``req`` (``old``: its previous one,
        whose half-built work is dropped)."""
        raise NotImplementedError

    def act(self, tracks: list[Track], obs: torch.Tensor, version: int) -> np.ndarray:
        """The actions for ``obs`` (the tracks' requests' observations, concatenated)."""
        raise NotImplementedError

    def push(
        self,
        tracks: list[Track],
        version: int,
        progress: Callable[[], int],
        should_stop: StopCheck,
    ) -> bool:
        """Push what ``tracks`` completed (acted on with weights ``version``; ``progress()``
        loads newer ones and returns their version); False if stopped while waiting."""
        raise NotImplementedError

    def reconfigure(self, cfg: Config, tracks: list[Track]) -> None:
        """Live config changes (the server's ``cfg`` is swapped)."""
        self.cfg = cfg

    def metrics(self) -> dict[str, Any]:
        return {}


class InferenceServer(Role):
    """Server ``server_id`` of a run with ``cfg.inference_servers``, acting for its actors
    with ``agent`` (whose network gets the published weights) on ``device``."""

    name = "inference"
    counter = "requests"

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        cfg: Config,
        server_id: int,
        agent: Agent,
        *,
        device: str | torch.device = "auto",
        threads: int = 1,
        env: EnvSpec | None = None,
    ) -> None:
        torch.set_num_threads(threads)
        self.client, self.keys, self.cfg, self.server_id = client, keys, cfg, server_id
        self.env = env or EnvSpec.of(cfg.env)
        self.device = pick_device(str(device))
        self.agent = agent
        self.net = agent.net.to(self.device).eval()
        # looked for after every batch: far from Redis on a thread of its own (the round
        # trips of the look off the batch's path), the weights it brought loaded before
        # the next batch's forward pass
        self.weights = Weights(client, keys, self.net, poll=1)
        self.answering = Background("answer")
        k = cfg.inference_servers
        self.mine = protocol.server_keys(keys, k, server_id)
        # every number one of its actors may have (claim_id's) and its request list
        actors = range(server_id, id_limit(cfg.actors), k)
        self.lists = {a: protocol.requests(self.mine, a) for a in actors}
        self.turn = 0  # where the window over the actors it has not heard from starts
        # the most env batches an actor may have in flight, and how many each of those it
        # heard from said it has (a far actor has more: protocol.batches)
        self.batches = protocol.most_batches(cfg)
        self.declared: dict[int, int] = {}
        b = cfg.envs_per_actor
        self.schema = protocol.request_schema(
            self.env.obs_shape, self.env.obs_dtype, b, self.batches
        )
        self.cap = stored_cap(self.schema.max_bytes)
        # the actors' batches it talks to, (actor, batch), least recently heard from first; a
        # writer inventing actor ids cannot make it keep more than ``keep`` (each holds an
        # unroll's buffers)
        self.tracks: OrderedDict[tuple[int, int], Track] = OrderedDict()
        # the actors of the run it serves (at least one)
        self.served = max(1, len(range(server_id, cfg.actors, k)))
        self.keep = 2 * self.served * self.batches + 16
        self.requests = self.dropped = self.rejected = self.repeats = 0
        self.sizes: list[int] = []
        self.queue_s: list[float] = []
        self.forward_s: list[float] = []
        self.idle = 1e-4

    @property
    def version(self) -> int:
        """Of the weights it acts with."""
        return self.weights.version

    def start(self, should_stop: StopCheck) -> bool:
        return self.weights.wait(should_stop)

    def progress(self) -> int:
        """The version of the weights it acts with, newer ones loaded first (in line)."""
        self.weights.refresh()
        return self.version

    def reconfigure(self, cfg: Config) -> None:
        super().reconfigure(cfg)
        self.agent.reconfigure(cfg, list(self.tracks.values()))

    def step(self, should_stop: StopCheck) -> bool:
        """One batch: gather requests, act on them, answer, push finished unrolls."""
        raw = self.gather()
        if not raw:
            time.sleep(self.idle)
            self.idle = min(self.idle * 2, 1e-3)
            return True
        self.idle = 1e-4
        self.weights.fresh()
        todo, again = self.admit(raw)
        if todo:
            self.act(todo)
        tracks = [tr for tr, _ in todo]
        self.answer(tracks + again)
        self.weights.done()
        return self.agent.push(tracks, self.version, self.progress, should_stop)

    def close(self, should_stop: StopCheck) -> None:
        try:
            self.answering.close()
        finally:
            self.weights.close()

    @property
    def expect(self) -> int:
        """The env batches of the actors it serves: the requests a batch could have (before
        it hears from them, ``inference_batches`` each of the actors the run has)."""
        if self.declared:
            return sum(self.declared.values())
        return self.served * self.cfg.inference_batches

    def gather(self) -> list[tuple[int, bytes | int]]:
        """Popped requests: what is there, and if that is not one from each of its actors'
        batches, what comes within ``inference_wait_ms``. A poll is made only while it
        ends within the wait: far from Redis (a round trip longer than the wait) one more
        would hold every request popped a round trip longer, and the batches in flight
        bring the rest to the next pop anyway."""
        t0, expect = time.monotonic(), self.expect
        got = self._popped(4 * expect, sweep=True)
        now = time.monotonic()
        took, deadline = now - t0, now + self.cfg.inference_wait_ms / 1000
        if not got:
            return got
        while len(got) < expect and time.monotonic() + took < deadline:
            time.sleep(1e-4)
            t0 = time.monotonic()
            got += self._popped(4 * expect - len(got), sweep=False)
            took = time.monotonic() - t0
        return got

    def _popped(self, count: int, sweep: bool) -> list[tuple[int, bytes | int]]:
        """Requests from the lists of the actors it talks to and, with ``sweep`` (once a
        batch: the waits between are for the actors it knows, each poll one LPOP a list), of
        :data:`SWEEP` others in turn, so a new actor is heard within a few batches whatever
        the number of actors: ``(the actor whose list it came from, the request or its
        size)``."""
        window = []
        if sweep:
            numbers = list(self.lists)
            window = [numbers[(self.turn + i) % len(numbers)] for i in range(SWEEP)]
            self.turn = (self.turn + SWEEP) % len(numbers)
        actors = list(dict.fromkeys([*(a for a, _ in self.tracks), *window]))
        lists = [self.lists[a] for a in actors]
        got = protocol.pop(self.client, lists, count, self.cap, self.batches)
        return [(actors[i], payload) for i, payload in got]

    def admit(
        self, raw: list[tuple[int, bytes | int]]
    ) -> tuple[list[tuple[Track, dict]], list[Track]]:
        """Validate each request and file it under its actor: the requests to act on, and
        the tracks whose last reply is answered again (a resent request)."""
        todo: list[tuple[Track, dict]] = []
        again: list[Track] = []
        now = time.time()
        for sender, payload in raw:
            req = self._valid(sender, payload)
            if req is None:
                continue
            self.requests += 1
            self.queue_s.append(max(0.0, now - req["sent"]))
            a = req["actor"], req["batch"]
            tr = self.tracks.get(a)
            if tr is not None:
                self.tracks.move_to_end(a)
            if tr is not None and tr.life == req["life"] and tr.seq == req["seq"]:
                self.repeats += 1
                if tr.reply and tr not in again:
                    again.append(tr)
                continue  # (no reply yet: it is being acted on in this batch)
            if tr is not None and tr.life == req["life"] and tr.seq + 1 == req["seq"] and tr.reply:
                tr.seq = req["seq"]
                tr.advance(req)
            else:  # a new actor, a restarted one, a gap, or the next step sent before the
                # last was answered (no actor of ours does): start its track afresh
                self.dropped += tr is not None and tr.held()
                tr = self.tracks[a] = self.agent.track(req, tr)
                if len(self.tracks) > self.keep:
                    self.dropped += self.tracks.popitem(last=False)[1].held()
            tr.reply = b""
            todo.append((tr, req))
        return todo, again

    def _valid(self, sender: int, payload: bytes | int) -> dict[str, Any] | None:
        """The request ``payload`` from ``sender``'s list, decoded; ``None`` if it is not a
        valid one of that actor's (a writer posing as another actor included)."""
        try:
            if isinstance(payload, int):
                raise CodecError(f"request of {payload} bytes is over the {self.cap} allowed")
            req = decode(payload, self.schema)
            if req["actor"] != sender:
                raise CodecError(f"a request of actor {req['actor']} on actor {sender}'s list")
            self.declared[sender] = req["batches"]  # (senders: the actors it serves, bounded)
            return req
        except CodecError as e:
            self.rejected += 1
            body = payload if isinstance(payload, bytes) else None
            size = payload if isinstance(payload, int) else None
            dead_letter(self.client, self.keys, "inference", str(e), body, size=size)
            return None

    @torch.no_grad()
    def act(self, todo: list[tuple[Track, dict]]) -> None:
        """One forward pass over every request's observations; the replies."""
        start = time.monotonic()
        obs = torch.from_numpy(np.concatenate([req["obs"] for _, req in todo]))
        tracks = [tr for tr, _ in todo]
        actions = self.agent.act(tracks, obs.to(self.device), self.version)
        self.forward_s.append(time.monotonic() - start)
        self.sizes.append(len(todo))
        b = self.cfg.envs_per_actor
        for i, tr in enumerate(tracks):
            tr.reply = encode(
                protocol.REPLY,
                {
                    "life": tr.life,
                    "batch": tr.batch,
                    "seq": tr.seq,
                    "action": actions[i * b : (i + 1) * b],
                    "version": self.version,
                },
            )

    def answer(self, items: list[Track]) -> None:
        """Every reply in one round trip, far from Redis on a thread of its own while the
        next batch is popped (one answer at a time, in order: :class:`Background`)."""
        replies = [(protocol.reply(self.mine, tr.actor, tr.batch), tr.reply) for tr in items]
        self.answering.submit(partial(self._send, replies))

    def _send(self, replies: list[tuple[str, bytes]]) -> None:
        """Push ``replies`` (a reply list someone broke: that actor resends)."""
        pipe = self.client.pipeline(transaction=False)
        for key, reply in replies:
            pipe.rpush(key, reply)
            pipe.ltrim(key, -protocol.REPLY_KEEP, -1)
            pipe.expire(key, protocol.REPLY_TTL_S)
        for res in pipe.execute(raise_on_error=False):
            if isinstance(res, redis.ResponseError):
                warn_once(f"reply: {res}", "a reply could not be written: %s", res)

    def metrics(self) -> dict[str, Any]:
        out = {
            "requests": self.requests,
            "batch": float(np.mean(self.sizes)) if self.sizes else 0.0,
            "queue_ms": float(np.mean(self.queue_s) * 1e3) if self.queue_s else 0.0,
            "forward_ms": float(np.mean(self.forward_s) * 1e3) if self.forward_s else 0.0,
            "dropped": self.dropped,
            "rejected": self.rejected,
            "repeats": self.repeats,
            "version": self.version,
            **self.agent.metrics(),
        }
        self.sizes, self.queue_s, self.forward_s = [], [], []
        return out


def server_maker(
    agent: Callable[[Any, EnvSpec, torch.device], Agent],
) -> Callable[[Any], InferenceServer]:
    """A builder's ``make`` of the inference role: ``agent(ctx, env, device)`` acts for it
    (the env read once, for both)."""

    def make(ctx: Any) -> InferenceServer:
        env, device = ctx.env or EnvSpec.of(ctx.cfg.env), pick_device(ctx.device)
        return InferenceServer(
            ctx.client,
            ctx.keys,
            ctx.cfg,
            ctx.ident,
            agent(ctx, env, device),
            device=device,
            threads=ctx.threads,
            env=env,
        )

    return make
