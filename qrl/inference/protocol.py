"""The wire of central inference, on Redis lists (no torch here: the actors import it).

* Actor ``a`` keeps several env batches in flight (SEED RL's actors do: while one batch's
  request is at the server, another steps): ``inference_batches``, and more the farther it
  is from Redis (:func:`batches`), :data:`MAX_BATCHES` at most. It sends each batch's requests to
  its own request list (:func:`requests`, RPUSH), which server ``a % inference_servers``
  pops, and waits on the batch's own reply list (:func:`reply`, BLPOP). All its lists have
  the server's hash tag (:func:`server_keys`): on a Redis Cluster each server's traffic is
  on a slot of its own, and an actor's request and wait are one round trip to one node.
  Each list is one actor's, so its key names the sender: a per-instance user (``qrl run
  join``) reaches its own lists only, and a server takes a request only as from the actor
  whose list it came from.
* A request carries the actor's id, its batch and how many it has in flight, a random
  ``life`` drawn when the actor process starts, the batch's sequence number, the
  observations to act on, and what the previous action gave (rewards, terminations,
  truncations and the final observation of each episode that ended: ``final_obs`` for the
  env slots ``final_idx``).
* A reply carries ``life``, ``batch``, ``seq``, the actions and the weights version that
  chose them. A batch takes only the reply to its own ``life``, ``batch`` and ``seq``; one
  that waited ``reply_timeout`` sends the same request again (the server answers a repeated
  ``seq`` from its last reply, so nothing is stepped twice). A server that does not know a
  batch's ``life``, or sees a gap in its ``seq``, starts that batch's unroll afresh: a
  half-built unroll is dropped, never joined to another's steps.
* The server pops requests with :data:`POP` from the lists of the actors it has heard from
  and a turning window of the others it may have, at most :data:`EACH` per batch from each
  list and ``count`` in all, and drops (returning only the size of) any bigger than the
  cap, so a planted huge value costs the server nothing but its size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import redis

from qrl.rl.fields import NATURAL, floats, obs_bytes, obs_field
from qrl.wire.keys import RunKeys
from qrl.wire.schema import CodecError, Field, Schema, size_cap
from qrl.wire.scripts import Lua
from qrl.wire.stream_scripts import warn_once

if TYPE_CHECKING:
    from qrl.runtime.config import CentralInference

REQUEST = "inference.request"
REPLY = "inference.reply"
REPLY_KEEP = 4  # replies kept on an actor's list (older ones are stale anyway)
REPLY_TTL_S = 60  # a dead actor's reply list goes away


def server_keys(keys: RunKeys, servers: int, server: int) -> RunKeys:
    """The keys of server ``server`` of a run's ``servers``: with one, the run's own; with
    more, each its own hash tag, spread over the slot space (:meth:`RunKeys.shards`)."""
    return keys.shards(servers)[server]


def actor_keys(keys: RunKeys, servers: int, actor: int) -> RunKeys:
    """The keys of actor ``actor``'s server (number ``actor`` modulo ``servers``)."""
    return server_keys(keys, servers, actor % servers)


def requests(keys: RunKeys, actor: int) -> str:
    """Actor ``actor``'s request list, among its server's keys ``keys``."""
    return keys.key(f"inference:requests:{actor}")


def reply(keys: RunKeys, actor: int, batch: int) -> str:
    """The reply list of actor ``actor``'s env batch ``batch``, among its server's keys
    ``keys`` (a list per batch: each batch waits on its own in a thread of its own)."""
    return keys.key(f"inference:reply:{actor}:{batch}")


MAX_BATCHES = 16  # env batches one actor may keep in flight (a server pops EACH of each)


def most_batches(cfg: CentralInference) -> int:
    """The most env batches an actor of a run configured ``cfg`` keeps in flight."""
    return cfg.inference_batches if cfg.inference_batches_per_ms == 0 else MAX_BATCHES


def batches(cfg: CentralInference, rtt_ms: float) -> int:
    """The env batches an actor ``rtt_ms`` from Redis keeps in flight: ``inference_batches``
    and ``inference_batches_per_ms`` more for every whole millisecond of that round trip,
    :data:`MAX_BATCHES` at most. Why more: a batch steps once per request's round trip
    (about two network round trips and a server batch), so an actor steps at most its envs
    in flight per round trip (Little's law), and a far actor needs more in flight to keep
    its rate (docs/benchmarks.md, 'Many machines')."""
    more = int(cfg.inference_batches_per_ms * max(rtt_ms, 0.0))
    return min(most_batches(cfg), cfg.inference_batches + more)


def _batch(msg: dict[str, Any], batches: int) -> None:
    if msg["batch"] >= batches:
        raise CodecError(f"batch {msg['batch']} of {batches}")


def request_schema(obs_shape: tuple[int, ...], obs_dtype: str, envs: int, batches: int) -> Schema:
    """One vector step of an env batch of ``envs`` envs, of an actor that keeps at most
    ``batches`` in flight."""
    obs_shape = tuple(obs_shape)

    def check(msg: dict[str, Any]) -> None:
        if not 1 <= msg["batches"] <= batches:
            raise CodecError(f"{msg['batches']} batches in flight, at most {batches} allowed")
        _batch(msg, msg["batches"])
        b = (envs, *obs_shape)
        if msg["obs"].shape != b:
            raise CodecError(f"obs has shape {msg['obs'].shape}, expected {b}")
        for name in ("reward", "terminated", "truncated"):
            if msg[name].shape != (envs,):
                raise CodecError(f"{name} has shape {msg[name].shape}, expected ({envs},)")
        idx, final = msg["final_idx"], msg["final_obs"]
        if final.shape != (len(idx), *obs_shape):
            raise CodecError("final_idx and final_obs disagree")
        if len(idx) and idx.max() >= envs:
            raise CodecError("final_idx out of range")
        ended = np.flatnonzero(msg["terminated"] | msg["truncated"])
        if sorted(idx.tolist()) != ended.tolist():
            raise CodecError("every env whose episode ended needs exactly one final observation")

    step = 2 * obs_bytes(obs_shape, obs_dtype) + 10
    return Schema(
        REQUEST,
        {
            "actor": NATURAL,
            "batch": NATURAL,
            "batches": NATURAL,
            "life": NATURAL,
            "seq": NATURAL,
            "obs": obs_field(obs_shape, obs_dtype, 1),
            "reward": floats(1),
            "terminated": Field(np.ndarray, dtypes=("bool",), ndim=1),
            "truncated": Field(np.ndarray, dtypes=("bool",), ndim=1),
            "final_obs": obs_field(obs_shape, obs_dtype, 1),
            "final_idx": Field(np.ndarray, dtypes=("int32",), ndim=1, bounds=(0, 2**31 - 1)),
            "sent": Field(float, bounds=(0, 1e11)),
        },
        check=check,
        max_bytes=size_cap(envs * step),
    )


def reply_schema(n_actions: int, envs: int, batches: int) -> Schema:
    """The actions for one request."""

    def check(msg: dict[str, Any]) -> None:
        _batch(msg, batches)
        if msg["action"].shape != (envs,):
            raise CodecError(f"action has shape {msg['action'].shape}, expected ({envs},)")

    return Schema(
        REPLY,
        {
            "life": NATURAL,
            "batch": NATURAL,
            "seq": NATURAL,
            "action": Field(np.ndarray, dtypes=("int32",), ndim=1, bounds=(0, n_actions - 1)),
            "version": NATURAL,
        },
        check=check,
        max_bytes=size_cap(4 * envs),
    )


# requests of one env batch popped at a time: its request and a resent copy (EACH x
# MAX_BATCHES is the most of one list that inference.pop.lua pops)
EACH = 2

# a server's pop of its actors' requests (qrl/wire/lua/inference.pop.lua, after
# streams.fix's repair of a key of another type): see pop
POP_LUA = Lua("inference.pop", "streams.fix", "inference.pop")


def pop(
    client: redis.Redis, lists: list[str], count: int, cap: int, batches: int
) -> list[tuple[int, bytes | int]]:
    """Up to ``count`` requests from ``lists`` (:data:`EACH` of each of an actor's
    ``batches`` at most from each): ``(the index of its list, the request or the size of one
    over cap bytes, popped and dropped)``. A key of another type is deleted (one warning)."""
    out, *notes = POP_LUA(client, lists, [count, cap, EACH * batches])
    warn_once(*notes)
    return list(zip(out[::2], out[1::2], strict=True))
