"""The Redis keys of a run: those every run has and the replay's (``qrl/replay/``, which the
Ape-X family shares) here; another algorithm's own keys in its package's ``keys.py``
(``qrl/algos/NAME/keys.py``, named through :meth:`RunKeys.key`).

All keys share the prefix ``qrl:{RUN}:`` where ``{RUN}`` is a Redis Cluster hash tag, so one
run's keys live on one node and multi-key Lua scripts stay legal. A sharded replay
(``replay_shards`` > 1) gives shard ``s`` its own tag, ``qrl:{RUN~TAG}:`` (run names cannot
contain ``~``), with ``TAG`` chosen so that the shards' slots spread over the slot space
(:meth:`RunKeys.shards`). No other module spells a prefix: they ask a :class:`RunKeys`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")  # the whole name: fullmatch


_KEY = re.compile(r"^qrl:\{([A-Za-z0-9][A-Za-z0-9_.\-]{0,63})\}:")
MAX_SHARDS = 64  # replay shards a run may have
_TAG = re.compile(r"[0-9]{1,2}\.[0-9]{1,6}")  # a shard's tag: SHARD.SALT


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def check_run_name(run: str) -> str:
    """Return ``run`` if it is a valid run name (letters, digits, ``_.-``, at most 64)."""
    if not isinstance(run, str) or not _RUN_NAME.fullmatch(run):
        raise ValueError(
            f"invalid run name {run!r}: use 1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return run


@dataclass(frozen=True)
class RunKeys:
    """The key names of one run, or (with a ``tag``) of one shard of its replay."""

    run: str
    tag: str = ""

    def __post_init__(self) -> None:
        check_run_name(self.run)
        if self.tag and not _TAG.fullmatch(self.tag):
            raise ValueError(f"invalid shard tag {self.tag!r}")

    @property
    def prefix(self) -> str:
        """``qrl:{RUN}:``, or ``qrl:{RUN~TAG}:`` for a shard."""
        return f"qrl:{{{self.run}~{self.tag}}}:" if self.tag else f"qrl:{{{self.run}}}:"

    def key(self, name: str) -> str:
        """The run's key ``name`` (an algorithm names its own keys with this)."""
        return self.prefix + name

    def pattern(self) -> str:
        """A SCAN/KEYS pattern matching every key of this run, its shards' included:
        ``qrl:{RUN[}~]*`` (no run name holds ``}`` or ``~``, so no other run's keys match)."""
        return _glob_escape(f"qrl:{{{self.run}") + "[}~]*"

    def acl_patterns(self) -> list[str]:
        """The key patterns an ACL user limited to this run needs."""
        return [f"qrl:{{{self.run}}}:*", f"qrl:{{{self.run}~*}}:*"]

    def shards(self, n: int) -> list[RunKeys]:
        """The keys of the ``n`` replay shards: for ``n == 1`` this run's own keys (the
        unsharded layout); otherwise shard ``s`` gets the tag ``s.SALT`` with the smallest
        SALT whose hash slot lies in the middle half of the ``s``-th of ``n`` equal slot
        ranges, so that on a cluster whose masters own equal ranges (``redis-cli --cluster
        create``) the shards land on different nodes. Deterministic: every process finds
        the same tags."""
        if self.tag:
            raise ValueError("a shard has no shards")
        if n == 1:
            return [self]
        return [RunKeys(self.run, _shard_tag(self.run, s, n)) for s in range(n)]

    @staticmethod
    def config_pattern() -> str:
        """A SCAN pattern matching the config key of every run."""
        return "qrl:{*}:config"

    @staticmethod
    def run_of(key: bytes | str) -> str | None:
        """The run name in a key ``qrl:{RUN}:...``, or None if it is not a valid run key."""
        text = key.decode() if isinstance(key, bytes) else key
        m = _KEY.match(text)
        return m.group(1) if m else None

    def slot(self) -> int:
        """The Redis Cluster hash slot of every key with this prefix."""
        return key_slot(self.prefix.encode())

    # run metadata
    @property
    def config(self) -> str:
        """The run's configuration, written once (string, codec payload)."""
        return self.key("config")

    @property
    def config_live(self) -> str:
        """The changes made to the config while the run runs (hash: version, values, changed,
        time; see :mod:`qrl.runtime.live`)."""
        return self.key("config:live")

    @property
    def weights(self) -> str:
        """Learner weights: hash {version, blob} written atomically."""
        return self.key("weights")

    def metrics(self, role: str, ident: int) -> str:
        """The reports of process number ``ident`` of ``role`` (capped stream, see
        :mod:`qrl.runtime.metrics`): one per process, which only that process's user writes."""
        return self.key(f"metrics:{role}.{ident}")

    @property
    def stats(self) -> str:
        """Counters (hash): rejected payloads, dropped unrolls, stale results, ..."""
        return self.key("stats")

    @property
    def deadletter(self) -> str:
        """Payloads that failed validation, with the reason (capped stream)."""
        return self.key("deadletter")

    @property
    def control(self) -> str:
        """Run control flags (hash), e.g. ``stop``."""
        return self.key("control")

    def lease(self, role: str, ident: int) -> str:
        """Who holds process number ``ident`` of ``role`` (string with a TTL, see
        :mod:`qrl.runtime.ids`)."""
        return self.key(f"lease:{role}.{ident}")

    def proc(self, name: str) -> str:
        """One process's heartbeat (string with a TTL), ``name`` = ``role.id@host:pid``."""
        return self.key("proc:" + name)

    def procs_pattern(self) -> str:
        """A SCAN pattern matching every heartbeat key of this run."""
        return _glob_escape(self.prefix) + "proc:*"

    # the Ape-X family's (Ape-X, Ape-X DPG, R2D2) experience stream and replay
    @property
    def experience(self) -> str:
        """The actors' experience stream (n-step transitions, frame chunks or R2D2
        sequences, with their priorities)."""
        return self.key("experience")

    @property
    def replay_priorities(self) -> str:
        """Prioritized replay: sorted set member -> priority."""
        return self.key("replay:prio")

    @property
    def replay_data(self) -> str:
        """Prioritized replay: hash member -> fixed-size record (a transition, or an R2D2
        sequence)."""
        return self.key("replay:data")

    @property
    def replay_batches(self) -> str:
        """Prioritized replay: ids of the producer batches inserted (sorted set, trimmed)."""
        return self.key("replay:batches")

    @property
    def replay_frames(self) -> str:
        """Frame-stack replay: hash chunk (its first transition id) -> LZ4 frames + records."""
        return self.key("replay:frames")

    @property
    def replay_index(self) -> str:
        """Frame-stack replay: string, 4 bytes per ring slot ``id % capacity``: the distance
        from transition ``id`` to the first transition of its chunk."""
        return self.key("replay:index")

    @property
    def replay_meta(self) -> str:
        """Prioritized replay: hash of the id range (``hi`` next id, ``lo`` oldest present;
        ``clo`` the oldest chunk's first id in a frame replay) and the counters
        ``inserted``, ``evicted``, ``batches`` (see :mod:`qrl.replay.store`)."""
        return self.key("replay:meta")


@cache
def _shard_tag(run: str, shard: int, n: int) -> str:
    if not 0 <= shard < n <= MAX_SHARDS:
        raise ValueError(f"shard {shard} of {n}: need 0 <= shard < n <= {MAX_SHARDS}")
    # the middle half of the shard's range: clear of the edges, which a cluster's split
    # may place a slot or two either way
    width = REDIS_CLUSTER_HASH_SLOTS / n
    lo, hi = (shard + 0.25) * width, (shard + 0.75) * width
    for salt in range(1_000_000):
        tag = f"{shard}.{salt}"
        if lo <= key_slot(f"{{{run}~{tag}}}".encode()) < hi:
            return tag
    raise ValueError(f"no tag found for shard {shard} of {n}")  # pragma: no cover
