"""The actor of central inference (:func:`stepper`): an :class:`qrl.actors.actor.Actor`
whose policy asks its inference server for every action (:class:`Asker`,
:mod:`qrl.inference.protocol`), with no weights client and no sink (the server assembles
what the steps make). It imports no torch and holds no network, so an actor machine needs
neither (a test checks the import).

Follow one step: :meth:`Asker.act` sends the request (the observations, and what the last
actions gave) and waits on its reply list for the answer in the same round trip (resending
it every ``reply_timeout`` seconds while no server answers); the actor steps the envs with
the actions, and :meth:`Asker.observe` keeps what they gave for the next request.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import numpy as np
import redis

from qrl.actors.actor import Actor
from qrl.actors.envs import EnvRunner, Step
from qrl.inference import protocol
from qrl.rl.envspec import EnvSpec
from qrl.runtime.config import Config
from qrl.runtime.loop import StopCheck
from qrl.wire.codec import CodecError, decode, encode
from qrl.wire.faults import warn_once
from qrl.wire.keys import RunKeys

WAIT_S = 0.25  # one blocking pop: the stop flag is checked between two
# Redis takes BLPOP's timeout in whole milliseconds and, before 7.0, waits forever on one
# that truncates to 0: the last slice of a wait is never shorter than this.
MIN_WAIT_S = 0.01


class Asker:
    """The policy of a stepper: actor ``actor_id``'s requests to its server (number
    ``actor_id`` modulo ``inference_servers``), and the replies' actions."""

    def __init__(
        self, client: redis.Redis, keys: RunKeys, cfg: Config, actor_id: int, env: EnvSpec
    ) -> None:
        self.client, self.cfg, self.actor_id = client, cfg, actor_id
        self.obs_dtype = env.obs_dtype
        b = cfg.envs_per_actor
        n = cfg.inference_servers
        mine = protocol.server_keys(keys, n, actor_id % n)
        self.requests = protocol.requests(mine, actor_id)
        self.replies = protocol.reply(mine, actor_id)
        self.schema = protocol.reply_schema(env.discrete_actions(), b)
        self.life = secrets.randbelow(2**53)  # this process's requests, told from a dead one's
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
        if reply["life"] != self.life or reply["seq"] != self.seq:
            return None
        self.version = reply["version"]
        return reply["action"]

    def metrics(self) -> dict[str, Any]:
        rtt, self.rtt = np.asarray(self.rtt), []
        return {
            "version": self.version,
            "rtt_p50_ms": float(np.percentile(rtt, 50) * 1e3) if len(rtt) else 0.0,
            "rtt_p99_ms": float(np.percentile(rtt, 99) * 1e3) if len(rtt) else 0.0,
            "resent": self.resent,
            "rejected": self.rejected,
        }


def stepper(
    client: redis.Redis,
    keys: RunKeys,
    cfg: Config,
    actor_id: int,
    env: EnvSpec | None = None,
    runner: EnvRunner | None = None,
) -> Actor:
    """Actor ``actor_id`` of central inference: its envs (``runner``: given, or made of
    ``cfg``), asking its server for every action."""
    runner = runner or EnvRunner(cfg, actor_id, env)
    return Actor(cfg, runner, Asker(client, keys, cfg, actor_id, runner.env), name="stepper")
