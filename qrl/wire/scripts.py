"""Every Lua script qrl runs, each declared once (:class:`Lua`: a name, one fixed text and
its SHA1), so the complete set is known without running anything (:func:`every_script`).
A role's ACL user (:mod:`qrl.jobs.acl`) may run exactly these, by SHA (``+evalsha|SHA``):
no EVAL, no SCRIPT LOAD, no FUNCTION, so no Lua of its own (an endless loop stalls the whole
Redis, and SCRIPT KILL cannot stop one that wrote).

A script's text never depends on a config: what differs per run goes in ARGV.

Loading: the admin loads every script on every node (:func:`load_scripts`: ``qrl run create
--acl`` and ``qrl run scripts``), also after a restart or failover, which lose Redis's script
cache. A client that may load (no ACL user, the admin, ``qrl train``'s own Redis) loads a
missing script and runs it again, as redis-py's ``Script`` does; one whose user may not
waits for the admin as for a lost Redis (:class:`qrl.wire.faults.ScriptsMissing`: one log
line, backoff, no exit).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
from collections.abc import Sequence
from typing import Any

from redis.client import Pipeline
from redis.cluster import ClusterPipeline, RedisCluster
from redis.exceptions import NoPermissionError, NoScriptError, RedisError

from qrl.wire.cluster import ClusterClient
from qrl.wire.faults import awaiting_scripts

# the modules that declare scripts: every_script() imports them. They sit in every layer (a
# script lives beside the code that runs it), so they are named here rather than imported;
# tests/test_scripts.py checks that no module outside this list declares one
DECLARING = (
    "qrl.wire.stream_scripts",
    "qrl.wire.streams",
    "qrl.wire.weights",
    "qrl.runtime.ids",
    "qrl.runtime.live",
    "qrl.replay.store",
    "qrl.replay.frames",
    "qrl.inference.protocol",
    "qrl.learners.group",
    "qrl.pbt.population",
)

_declared: dict[str, Lua] = {}


class Lua:
    """One of qrl's Lua scripts. ``read_only``: run with EVALSHA_RO too, on keys the user
    may only read (Redis 7's ``%R~``)."""

    def __init__(self, name: str, text: str, *, read_only: bool = False) -> None:
        if name in _declared:
            raise ValueError(f"two Lua scripts named {name}")
        self.name, self.text, self.read_only = name, text, read_only
        self.sha = hashlib.sha1(text.encode()).hexdigest()
        _declared[name] = self

    def __call__(
        self, client: Any, keys: Sequence[Any] = (), args: Sequence[Any] = (), ro: bool = False
    ) -> Any:
        """The script's reply, run on ``client`` (``ro``: with EVALSHA_RO). On a pipeline it
        is queued, and a NOSCRIPT comes back in its replies (see
        :func:`qrl.wire.cluster.run_scripts`)."""
        call = ("EVALSHA_RO" if ro else "EVALSHA", self.sha, len(keys), *keys, *args)
        if isinstance(client, Pipeline | ClusterPipeline):
            return client.execute_command(*call)
        try:
            return client.execute_command(*call)
        except NoScriptError:
            with contextlib.suppress(NoPermissionError):  # a role's user: the admin loads
                client.script_load(self.text)
        with awaiting_scripts():
            return client.execute_command(*call)

    def on(self, client: Any) -> Bound:
        """This script bound to ``client``."""
        return Bound(self, client)


class Bound:
    """A :class:`Lua` bound to a client: ``bound(keys, args)`` runs it there. A read-only one
    runs with EVALSHA_RO (Redis 7: a user that may only read its keys, ``%R~``, may run it on
    them), or EVALSHA where the server has no EVALSHA_RO (Redis 6.2, whose users read with
    plain ``~`` patterns) or the user may not run it (the README's per-run rule, which may
    write every key of its run)."""

    def __init__(self, script: Lua, client: Any) -> None:
        self.script, self.client, self.sha = script, client, script.sha
        self.ro = script.read_only

    def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        if self.ro:
            try:
                return self.script(self.client, keys, args, ro=True)
            except RedisError as e:  # the server's refusal, or the cluster client's
                text = str(e)
                unknown = "unknown command" in text or "doesn't exist" in text
                if not (unknown or isinstance(e, NoPermissionError)):
                    raise
            self.ro = False
        return self.script(self.client, keys, args)

    def queue(self, pipe: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """Queue it on ``pipe``, a pipeline of the client's."""
        return self.script(pipe, keys, args)


def every_script() -> dict[str, Lua]:
    """Every script qrl runs, by name (in order of name: the ACL rules come out the same
    whatever was imported first)."""
    for module in DECLARING:
        importlib.import_module(module)
    return dict(sorted(_declared.items()))


def load_scripts(client: Any) -> int:
    """Load every script of qrl on every node ``client`` reaches (a cluster's primaries and
    replicas: Redis 7 does not pass SCRIPT LOAD on to replicas, and a replica that takes
    over must have them); returns how many. Needs a user that may load them (the admin)."""
    scripts = every_script().values()
    for script in scripts:
        if isinstance(client, ClusterClient):
            client.execute_command(
                "SCRIPT", "LOAD", script.text, target_nodes=RedisCluster.ALL_NODES
            )
        else:
            client.execute_command("SCRIPT", "LOAD", script.text)
    return len(scripts)
