"""Every Redis key of a run, in one place.

All keys share the prefix ``qrl:{RUN}:`` where ``{RUN}`` is a Redis Cluster hash tag, so one
run's keys live on one shard and multi-key Lua scripts stay legal. No other module spells a
key: they ask a :class:`RunKeys`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")  # the whole name: fullmatch


_KEY = re.compile(r"^qrl:\{([A-Za-z0-9][A-Za-z0-9_.\-]{0,63})\}:")


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
    """The key names of one run."""

    run: str

    def __post_init__(self) -> None:
        check_run_name(self.run)

    @property
    def prefix(self) -> str:
        """``qrl:{RUN}:`` -- also the pattern for an ACL rule limited to this run."""
        return f"qrl:{{{self.run}}}:"

    def _k(self, name: str) -> str:
        return self.prefix + name

    def pattern(self) -> str:
        """A SCAN/KEYS pattern matching every key of this run."""
        return _glob_escape(self.prefix) + "*"

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

    # run metadata
    @property
    def config(self) -> str:
        """The run's configuration, written once (string, codec payload)."""
        return self._k("config")

    @property
    def weights(self) -> str:
        """Learner weights: hash {version, blob} written atomically."""
        return self._k("weights")

    @property
    def metrics(self) -> str:
        """Metrics reported by every role (capped stream)."""
        return self._k("metrics")

    @property
    def stats(self) -> str:
        """Counters (hash): rejected payloads, dropped unrolls, stale results, ..."""
        return self._k("stats")

    @property
    def deadletter(self) -> str:
        """Payloads that failed validation, with the reason (capped stream)."""
        return self._k("deadletter")

    @property
    def control(self) -> str:
        """Run control flags (hash), e.g. ``stop``."""
        return self._k("control")

    def lease(self, role: str, ident: int) -> str:
        """Who holds process number ``ident`` of ``role`` (string with a TTL, see
        :mod:`qrl.ids`)."""
        return self._k(f"lease:{role}.{ident}")

    def proc(self, name: str) -> str:
        """One process's heartbeat (string with a TTL), ``name`` = ``role.id@host:pid``."""
        return self._k("proc:" + name)

    def procs_pattern(self) -> str:
        """A SCAN pattern matching every heartbeat key of this run."""
        return _glob_escape(self.prefix) + "proc:*"

    # Ape-X
    @property
    def experience(self) -> str:
        """Ape-X actors' experience stream (n-step transitions with priorities)."""
        return self._k("experience")

    @property
    def replay_priorities(self) -> str:
        """Prioritized replay: sorted set member -> priority."""
        return self._k("replay:prio")

    @property
    def replay_data(self) -> str:
        """Prioritized replay: hash member -> transition payload."""
        return self._k("replay:data")

    @property
    def replay_batches(self) -> str:
        """Prioritized replay: ids of the producer batches inserted (sorted set, trimmed)."""
        return self._k("replay:batches")

    @property
    def replay_frames(self) -> str:
        """Frame-stack replay: hash chunk (its first transition id) -> LZ4 frames + records."""
        return self._k("replay:frames")

    @property
    def replay_index(self) -> str:
        """Frame-stack replay: string, 4 bytes per ring slot ``id % capacity``: the distance
        from transition ``id`` to the first transition of its chunk."""
        return self._k("replay:index")

    @property
    def replay_meta(self) -> str:
        """Prioritized replay: counters (hash: seq, inserted, evicted, batches seen)."""
        return self._k("replay:meta")

    # IMPALA
    @property
    def trajectories(self) -> str:
        """IMPALA actors' trajectory stream (unrolls)."""
        return self._k("trajectories")

    # ES
    @property
    def es_params(self) -> str:
        """ES master's parameters: hash {version (= generation), blob}."""
        return self._k("es:params")

    @property
    def es_results(self) -> str:
        """ES workers' results stream."""
        return self._k("es:results")
