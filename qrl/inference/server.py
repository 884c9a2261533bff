"""The inference server of central inference (SEED RL): it pops the requests of its actors
(those with ``id % inference_servers`` equal to its own), acts on all of them in one forward
pass with the latest published weights, answers each actor, and assembles each actor's
steps into the unrolls the learner consumes, pushed to the same stream local actors would
push to. It keeps no state a restart loses beyond half-built unrolls, which are dropped.

Follow one batch: :meth:`InferenceServer.gather` pops requests (waiting up to
``inference_wait_ms`` for the rest of its actors), :meth:`InferenceServer.admit` validates
each and files it under its actor's :class:`Track`, one forward pass samples the actions,
:meth:`InferenceServer.answer` pushes the replies in one round trip, and each unroll a
request completed goes to the stream.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis
import torch

from qrl.inference import protocol
from qrl.learners.base import pick_device
from qrl.rl.envspec import EnvSpec
from qrl.runtime.loop import Role, StopCheck
from qrl.wire.codec import CodecError, decode, encode
from qrl.wire.faults import warn_once
from qrl.wire.keys import RunKeys
from qrl.wire.stream_scripts import stored_cap
from qrl.wire.streams import StreamProducer, dead_letter
from qrl.wire.weights import WeightStore


@dataclass
class Track:
    """One actor's conversation: its ``life`` and last ``seq``, the reply to it, and the
    unroll being built from its steps (``t`` of ``T`` done; step ``t`` waits for its
    result)."""

    actor: int
    life: int
    seq: int
    obs: np.ndarray
    action: np.ndarray
    logits: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    t: int = 0
    version: int = 2**62  # the oldest weights that acted in this unroll
    trunc: list[tuple[int, int]] = field(default_factory=list)
    trunc_obs: list[np.ndarray] = field(default_factory=list)
    reply: bytes = b""

    @classmethod
    def new(cls, req: dict[str, Any], t_len: int, n_actions: int) -> Track:
        """A fresh track of the actor that sent ``req``, its unroll starting there."""
        obs = req["obs"]
        b = len(obs)
        tr = cls(
            req["actor"],
            req["life"],
            req["seq"],
            obs=np.empty((t_len + 1, b, *obs.shape[1:]), obs.dtype),
            action=np.empty((t_len, b), np.int32),
            logits=np.empty((t_len, b, n_actions), np.float32),
            reward=np.empty((t_len, b), np.float32),
            terminated=np.empty((t_len, b), bool),
            truncated=np.empty((t_len, b), bool),
        )
        tr.obs[0] = obs
        return tr

    def record(self, req: dict[str, Any]) -> None:
        """What the actions of step ``t`` gave."""
        t = self.t
        self.reward[t], self.terminated[t], self.truncated[t] = (
            req["reward"], req["terminated"], req["truncated"],
        )  # fmt: skip
        self.trunc += [(t, int(j)) for j in req["trunc_idx"]]
        self.trunc_obs += list(req["trunc_obs"])
        self.t += 1

    def unroll(self, kind: str) -> bytes:
        """The finished unroll, encoded as a local actor would send it; the next starts
        where it ended."""
        shape = self.obs.shape[2:]
        msg = {
            "obs": self.obs,
            "action": self.action,
            "reward": self.reward,
            "terminated": self.terminated,
            "truncated": self.truncated,
            "logits": self.logits,
            "trunc_obs": np.array(self.trunc_obs, self.obs.dtype).reshape(-1, *shape),
            "trunc_idx": np.array(self.trunc, np.int32).reshape(-1, 2),
            "version": self.version,
            "actor": self.actor,
            "batch": uuid.uuid4().hex,
        }
        payload = encode(kind, msg)
        self.obs[0] = self.obs[-1]
        self.t, self.version, self.trunc, self.trunc_obs = 0, 2**62, [], []
        return payload


class InferenceServer(Role):
    """Server ``server_id`` of a run with ``cfg.inference_servers``; ``net`` maps a batch
    of observations to (logits, ...) and gets the published weights; the unrolls go to
    ``stream`` as messages of ``kind``."""

    name = "inference"
    counter = "requests"

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        cfg: Any,
        server_id: int,
        net: torch.nn.Module,
        stream: str,
        kind: str,
        *,
        device: str = "auto",
        threads: int = 1,
        env: EnvSpec | None = None,
    ) -> None:
        torch.set_num_threads(threads)
        self.client, self.keys, self.cfg, self.server_id = client, keys, cfg, server_id
        self.env = env or EnvSpec.of(cfg.env)
        self.n_actions = self.env.discrete_actions()
        self.device = pick_device(device)
        self.net = net.to(self.device).eval()
        self.kind = kind
        self.weights = WeightStore(client, keys)
        self.version = -1
        self.producer = StreamProducer(client, stream, maxlen=cfg.stream_maxlen, keys=keys)
        k = cfg.inference_servers
        self.list = protocol.requests(keys, server_id)
        self.expect = max(1, len(range(server_id, cfg.actors, k)))  # actors it serves
        b = cfg.envs_per_actor
        self.schema = protocol.request_schema(self.env.obs_shape, self.env.obs_dtype, b)
        self.cap = stored_cap(self.schema.max_bytes)
        # the actors it talks to, least recently heard from first; a writer inventing actor
        # ids cannot make it keep more than ``keep`` (each holds an unroll's buffers)
        self.tracks: OrderedDict[int, Track] = OrderedDict()
        self.keep = 2 * self.expect + 16
        self.finished: list[bytes] = []  # unrolls the last batch completed, encoded
        self.gen = torch.Generator(device=self.device).manual_seed(cfg.seed * 10_000 + server_id)
        self.requests = self.unrolls = self.dropped = self.rejected = self.repeats = 0
        self.batches: list[int] = []
        self.queue_s: list[float] = []
        self.forward_s: list[float] = []
        self.idle = 1e-4

    def start(self, should_stop: StopCheck) -> bool:
        while not should_stop():  # all actors act with the learner's first weights
            if self.refresh():
                return True
            time.sleep(0.05)
        return False

    def refresh(self) -> bool:
        v = self.weights.load_into(self.net, newer_than=self.version)
        if v is None:
            return False
        self.version = v
        return True

    def step(self, should_stop: StopCheck) -> bool:
        """One batch: gather requests, act on them, answer, push finished unrolls."""
        raw = self.gather()
        if not raw:
            time.sleep(self.idle)
            self.idle = min(self.idle * 2, 1e-3)
            return True
        self.idle = 1e-4
        self.refresh()
        todo, again = self.admit(raw)
        if todo:
            self.act(todo)
        self.answer([tr for tr, _ in todo] + again)
        for payload in self.finished:
            if self.producer.add(payload, should_stop=should_stop) is None:
                return False
            self.unrolls += 1
        self.finished = []
        return True

    def gather(self) -> list[bytes | int]:
        """Popped requests: what is there, and if that is not one from each of its actors,
        what comes within ``inference_wait_ms``."""
        got = self._popped(4 * self.expect)
        if not got or len(got) >= self.expect:
            return got
        deadline = time.monotonic() + self.cfg.inference_wait_ms / 1000
        while len(got) < self.expect and time.monotonic() < deadline:
            time.sleep(1e-4)
            got += self._popped(4 * self.expect - len(got))
        return got

    def _popped(self, count: int) -> list[bytes | int]:
        return protocol.pop(self.client, self.list, count, self.cap)

    def admit(self, raw: list[bytes | int]) -> tuple[list[tuple[Track, dict]], list[Track]]:
        """Validate each request and file it under its actor: the requests to act on, and
        the tracks whose last reply is answered again (a resent request)."""
        self.finished = []
        todo: list[tuple[Track, dict]] = []
        again: list[Track] = []
        now = time.time()
        for payload in raw:
            req = self._valid(payload)
            if req is None:
                continue
            self.requests += 1
            self.queue_s.append(max(0.0, now - req["sent"]))
            a, tr = req["actor"], self.tracks.get(req["actor"])
            if tr is not None:
                self.tracks.move_to_end(a)
            if tr is not None and tr.life == req["life"] and tr.seq == req["seq"]:
                self.repeats += 1
                if tr.reply and tr not in again:
                    again.append(tr)
                continue  # (no reply yet: it is being acted on in this batch)
            if tr is not None and tr.life == req["life"] and tr.seq + 1 == req["seq"]:
                tr.record(req)
                tr.seq = req["seq"]
                tr.obs[tr.t] = req["obs"]
                if tr.t == self.cfg.unroll:
                    self.finished.append(tr.unroll(self.kind))
            else:  # a new actor, a restarted one, or a gap: start its unroll afresh
                if tr is not None and tr.t:
                    self.dropped += 1
                tr = self.tracks[a] = Track.new(req, self.cfg.unroll, self.n_actions)
                if len(self.tracks) > self.keep:
                    self.tracks.popitem(last=False)
                    self.dropped += 1
            tr.reply = b""
            todo.append((tr, req))
        return todo, again

    def _valid(self, payload: bytes | int) -> dict[str, Any] | None:
        try:
            if isinstance(payload, int):
                raise CodecError(f"request of {payload} bytes is over the {self.cap} allowed")
            req = decode(payload, self.schema)
            k = self.cfg.inference_servers
            if req["actor"] % k != self.server_id:
                raise CodecError(f"actor {req['actor']} is not served by server {self.server_id}")
            return req
        except CodecError as e:
            self.rejected += 1
            body = payload if isinstance(payload, bytes) else None
            size = payload if isinstance(payload, int) else None
            dead_letter(self.client, self.keys, "inference", str(e), body, size=size)
            return None

    @torch.no_grad()
    def act(self, todo: list[tuple[Track, dict]]) -> None:
        """One forward pass over every request's observations; sampled actions."""
        start = time.monotonic()
        obs = np.concatenate([req["obs"] for _, req in todo])
        logits = self.net(torch.from_numpy(obs).to(self.device))[0]
        actions = torch.multinomial(torch.softmax(logits, 1), 1, generator=self.gen)[:, 0]
        logits, actions = logits.float().cpu().numpy(), actions.int().cpu().numpy()
        self.forward_s.append(time.monotonic() - start)
        self.batches.append(len(todo))
        b = self.cfg.envs_per_actor
        for i, (tr, _) in enumerate(todo):
            tr.action[tr.t], tr.logits[tr.t] = (
                actions[i * b : (i + 1) * b],
                logits[i * b : (i + 1) * b],
            )
            tr.version = min(tr.version, self.version)
            tr.reply = encode(
                protocol.REPLY,
                {"life": tr.life, "seq": tr.seq, "action": tr.action[tr.t],
                 "version": self.version},
            )  # fmt: skip

    def answer(self, items: list[Track]) -> None:
        """Every reply in one round trip (a reply list someone broke: that actor resends)."""
        pipe = self.client.pipeline(transaction=False)
        for tr in items:
            key = protocol.reply(self.keys, tr.actor)
            pipe.rpush(key, tr.reply)
            pipe.ltrim(key, -protocol.REPLY_KEEP, -1)
            pipe.expire(key, protocol.REPLY_TTL_S)
        for res in pipe.execute(raise_on_error=False):
            if isinstance(res, redis.ResponseError):
                warn_once(f"reply: {res}", "a reply could not be written: %s", res)

    def metrics(self) -> dict[str, Any]:
        out = {
            "requests": self.requests,
            "batch": float(np.mean(self.batches)) if self.batches else 0.0,
            "queue_ms": float(np.mean(self.queue_s) * 1e3) if self.queue_s else 0.0,
            "forward_ms": float(np.mean(self.forward_s) * 1e3) if self.forward_s else 0.0,
            "unrolls": self.unrolls,
            "dropped": self.dropped,
            "rejected": self.rejected,
            "repeats": self.repeats,
            "version": self.version,
        }
        self.batches, self.queue_s, self.forward_s = [], [], []
        return out


def server_maker(
    net: Callable[[Any, EnvSpec], torch.nn.Module], stream: Callable[[RunKeys], str], kind: str
) -> Callable[[Any], InferenceServer]:
    """A builder's ``make`` of the inference role: ``net(cfg, env)`` acts, the unrolls go to
    ``stream(keys)`` as ``kind``."""

    def make(ctx: Any) -> InferenceServer:
        env = ctx.env or EnvSpec.of(ctx.cfg.env)
        return InferenceServer(
            ctx.client, ctx.keys, ctx.cfg, ctx.ident, net(ctx.cfg, env), stream(ctx.keys),
            kind, device=ctx.device, threads=ctx.threads, env=env,
        )  # fmt: skip

    return make
