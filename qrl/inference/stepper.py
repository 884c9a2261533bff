"""The actor of central inference (:func:`stepper`, :class:`Stepper`): several env batches
(:func:`qrl.inference.protocol.batches`: more the farther it is from Redis), each an
:class:`qrl.actors.envs.EnvRunner` whose actions an :class:`Asker` asks its inference server
for (:mod:`qrl.inference.protocol`), with no weights and no sink (the server assembles what
the steps make). It imports no torch and holds no network, so an actor machine needs neither
(a test checks the import).

The batches are in flight together, as SEED RL's actors keep them: each batch's round trip
runs on a thread of its own while this one steps the batch whose actions came, so an actor
far from its server steps its batches x ``envs_per_actor`` envs per round trip rather
than ``envs_per_actor`` (the env steps stay on the role's thread, with the episode
counts).

Follow one batch's step: :meth:`Asker.act` sends the request (the observations, and what
the last actions gave) and waits on the batch's reply list for the answer in the same round
trip (resending it every ``reply_timeout`` seconds while no server answers); the stepper
steps the batch's envs with the actions, and :meth:`Asker.observe` keeps what they gave for
the next request.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from functools import partial
from typing import Any

import numpy as np
import redis

from qrl.actors.envs import EnvRunner, Step
from qrl.inference import protocol
from qrl.rl.envspec import EnvSpec
from qrl.runtime.config import Config
from qrl.runtime.loop import Role, StopCheck
from qrl.wire import clock
from qrl.wire.codec import CodecError, decode, encode
from qrl.wire.faults import warn_once
from qrl.wire.keys import RunKeys

log = logging.getLogger(__name__)

WAIT_S = 0.25  # one blocking pop: the stop flag is checked between two
# Redis takes BLPOP's timeout in whole milliseconds and, before 7.0, waits forever on one
# that truncates to 0: the last slice of a wait is never shorter than this.
MIN_WAIT_S = 0.01


class Asker:
    """The policy of env batch ``batch`` of a stepper: actor ``actor_id``'s requests to its
    server (number ``actor_id`` modulo ``inference_servers``) for that batch, and the
    replies' actions. ``life``: the process's, drawn once for all its batches."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        cfg: Config,
        actor_id: int,
        env: EnvSpec,
        batch: int = 0,
        life: int | None = None,
        batches: int = 1,
    ) -> None:
        self.client, self.cfg, self.actor_id = client, cfg, actor_id
        self.batch, self.batches = batch, batches
        self.obs_dtype = env.obs_dtype
        b = cfg.envs_per_actor
        mine = protocol.actor_keys(keys, cfg.inference_servers, actor_id)
        self.requests = protocol.requests(mine, actor_id)
        self.replies = protocol.reply(mine, actor_id, batch)
        self.schema = protocol.reply_schema(env.discrete_actions(), b, batches)
        # this process's requests, told from a dead one's
        self.life = secrets.randbelow(2**53) if life is None else life
        self.seq = 0
        self.version = -1  # of the weights that chose the last actions
        self.result: dict[str, np.ndarray] = {
            "reward": np.zeros(b, np.float32),
            "terminated": np.zeros(b, bool),
            "truncated": np.zeros(b, bool),
            "final_obs": np.zeros((0, *env.obs_shape), self.obs_dtype),
            "final_idx": np.zeros(0, np.int32),
        }
        self.rtt: list[float] = []
        self.resent = self.rejected = 0

    def act(self, obs: np.ndarray, should_stop: StopCheck) -> tuple[np.ndarray, None] | None:
        """The actions for ``obs``, asked of the server (:meth:`ask`); ``None`` if stopped."""
        sent = time.monotonic()
        actions = self.ask(obs, should_stop)
        if actions is None:
            return None
        self.rtt.append(time.monotonic() - sent)
        return actions, None

    def observe(self, step: Step) -> None:
        """What the actions gave, for the next request."""
        ended = np.flatnonzero(step.terminated | step.truncated)
        self.result = {
            "reward": step.rewards.astype(np.float32),
            "terminated": step.terminated,
            "truncated": step.truncated,
            "final_obs": step.true_next[ended].astype(self.obs_dtype),
            "final_idx": ended.astype(np.int32),
        }
        self.seq += 1

    def reconfigure(self, cfg: Config) -> None:
        self.cfg = cfg

    def ask(self, obs: np.ndarray, should_stop: StopCheck) -> np.ndarray | None:
        """The actions for ``obs``: send the request, wait for its reply (resending it
        every ``reply_timeout``); ``None`` if stopped first."""
        msg = {
            "actor": self.actor_id,
            "batch": self.batch,
            "batches": self.batches,
            "life": self.life,
            "seq": self.seq,
            "obs": np.asarray(obs, self.obs_dtype),
            **self.result,
            "sent": time.time(),
        }
        payload = encode(protocol.REQUEST, msg)
        while not should_stop():
            deadline = time.monotonic() + self.cfg.reply_timeout
            got = self._exchange(payload, min(self.cfg.reply_timeout, WAIT_S))
            while got is None and (left := deadline - time.monotonic()) > 0:
                if should_stop():
                    return None
                got = self._exchange(None, min(left, WAIT_S))
            if got is not None:
                return got
            self.resent += 1
        return None

    def _exchange(self, payload: bytes | None, timeout: float) -> np.ndarray | None:
        """Send ``payload`` (if any) and wait up to ``timeout`` for the reply to the current
        request, in one round trip; other replies (stale, malformed, someone else's) are
        thrown away. A key someone replaced by another type: the request list is the
        server's to repair (the request goes again after ``reply_timeout``), the reply list
        this actor's."""
        pipe = self.client.pipeline(transaction=False)
        if payload is not None:
            pipe.rpush(self.requests, payload)
        pipe.blpop([self.replies], timeout=max(timeout, MIN_WAIT_S))
        *sent, got = pipe.execute(raise_on_error=False)
        for e in sent:
            if isinstance(e, redis.ResponseError):
                warn_once(f"{self.requests}: {e}", "%s: %s; resending", self.requests, e)
        if isinstance(got, redis.ResponseError):
            warn_once(f"{self.replies}: {got}", "%s: %s; deleted", self.replies, got)
            self.client.delete(self.replies)
            return None
        if got is None:
            return None
        try:
            reply = decode(got[1], self.schema)
        except CodecError as e:
            self.rejected += 1
            warn_once(f"bad reply {self.replies}", "%s: rejected a reply: %s", self.replies, e)
            return None
        if (reply["life"], reply["batch"], reply["seq"]) != (self.life, self.batch, self.seq):
            return None
        self.version = reply["version"]
        return reply["action"]

    def metrics(self) -> dict[str, Any]:
        rtt, self.rtt = self.rtt, []  # (the thread asking appends to the new list)
        return {"rtt": rtt, "resent": self.resent, "rejected": self.rejected}


class Stepper(Role):
    """Actor ``actor_id`` of central inference: its env batches (``runners``) in flight
    together, each asking with its :class:`Asker`."""

    name = "stepper"
    counter = "steps"

    def __init__(self, cfg: Config, runners: list[EnvRunner], askers: list[Asker]) -> None:
        self.cfg, self.runners, self.askers = cfg, runners, askers
        self.pool = ThreadPoolExecutor(len(runners), thread_name_prefix="stepper")
        self.asking: dict[Future[tuple[np.ndarray, None] | None], int] = {}
        self.closing = threading.Event()  # the asks under way stop waiting

    @property
    def steps(self) -> int:
        return sum(r.steps for r in self.runners)

    def start(self, should_stop: StopCheck) -> bool:
        for runner in self.runners:
            runner.reset()
        return True

    def step(self, should_stop: StopCheck) -> bool:
        """Every batch not waiting asks for its actions; then the batches whose actions
        came step. False if stopped while waiting. The run's stop flag is looked at here
        only (it reads the live config on the way): the asks stop on :attr:`closing`."""
        waiting = set(self.asking.values())
        for i, (runner, asker) in enumerate(zip(self.runners, self.askers, strict=True)):
            if i not in waiting:
                self.asking[self.pool.submit(asker.act, runner.obs, self.closing.is_set)] = i
        while not (done := wait(self.asking, WAIT_S, FIRST_COMPLETED)[0]):
            if should_stop():
                self.closing.set()
                return False
        for future in done:
            i, acted = self.asking.pop(future), future.result()
            if acted is None:
                return False
            self.askers[i].observe(self.runners[i].step(acted[0]))
        return True

    def reconfigure(self, cfg: Config) -> None:
        super().reconfigure(cfg)
        for asker in self.askers:
            asker.reconfigure(cfg)

    def close(self, should_stop: StopCheck) -> None:
        self.closing.set()
        self.pool.shutdown(wait=True)

    def metrics(self) -> dict[str, Any]:
        """Env steps, the episodes finished since the last report, and the round trips."""
        out: dict[str, Any] = {"steps": self.steps, "episode_returns": [], "episode_lengths": []}
        for runner in self.runners:
            ep = runner.episodes()
            out["episode_returns"] += ep["episode_returns"]
            out["episode_lengths"] += ep["episode_lengths"]
        asked = [a.metrics() for a in self.askers]
        rtt = np.asarray([t for m in asked for t in m["rtt"]])
        return {
            **out,
            "version": max(a.version for a in self.askers),
            "batches": len(self.runners),
            "rtt_p50_ms": float(np.percentile(rtt, 50) * 1e3) if len(rtt) else 0.0,
            "rtt_p99_ms": float(np.percentile(rtt, 99) * 1e3) if len(rtt) else 0.0,
            "resent": sum(m["resent"] for m in asked),
            "rejected": sum(m["rejected"] for m in asked),
        }


def round_trip_ms(client: redis.Redis, key: str, pings: int = 5) -> float:
    """The median of ``pings`` PINGs' round trips to the Redis that holds ``key``, in
    milliseconds (on a Cluster its node's: redis-py sends a plain PING to every node, one
    after the other); 0 in a one-process run (whose envs are the same in every run of a
    seed)."""
    if clock.current() is not clock.REAL:
        return 0.0
    ping: Any = client.ping
    if isinstance(client, redis.RedisCluster):
        ping = partial(client.ping, target_nodes=client.get_node_from_key(key))
    took = []
    for _ in range(pings):
        start = time.perf_counter()
        ping()
        took.append(time.perf_counter() - start)
    return float(np.median(took) * 1e3)


def stepper(
    client: redis.Redis,
    keys: RunKeys,
    cfg: Config,
    actor_id: int,
    env: EnvSpec | None = None,
    runners: list[EnvRunner] | None = None,
) -> Stepper:
    """Actor ``actor_id`` of central inference: its env batches (``runners``: given, or
    as many as its round trip to Redis asks for, made of ``cfg``), asking its server for
    every action."""
    env = env or EnvSpec.of(cfg.env)
    if runners is None:
        mine = protocol.actor_keys(keys, cfg.inference_servers, actor_id)
        rtt = round_trip_ms(client, protocol.requests(mine, actor_id))
        k = protocol.batches(cfg, rtt)
        log.info("actor %d: %d env batches in flight (%.2f ms to Redis)", actor_id, k, rtt)
        runners = [EnvRunner(cfg, actor_id, env, batch=i) for i in range(k)]
    k = len(runners)
    life = secrets.randbelow(2**53)
    askers = [Asker(client, keys, cfg, actor_id, env, i, life, k) for i in range(k)]
    return Stepper(cfg, runners, askers)
