"""Every Lua script qrl runs, each declared once (:class:`Lua`: a name, one fixed text and
its SHA1), so the complete set is known without running anything (:func:`every_script`).
The texts are Lua files shipped with the package, in ``qrl/wire/lua/`` (:data:`LUA`); the
declarations sit beside the code that runs them.
A role's ACL user (:mod:`qrl.jobs.acl`) may run those of them its role declares (by name,
``Access.scripts``), by SHA (``+evalsha|SHA``): no EVAL, no SCRIPT LOAD, no FUNCTION, so no
Lua of its own (an endless loop stalls the whole Redis, and SCRIPT KILL cannot stop one that
wrote). A refused EVALSHA is logged with the script's name (:meth:`Lua.refused`): a role
that runs a script it does not declare says so.

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
import importlib.resources
import re
from collections.abc import Mapping, Sequence
from typing import Any

from redis.client import Pipeline
from redis.cluster import ClusterPipeline, RedisCluster
from redis.exceptions import NoPermissionError, NoScriptError, RedisError

from qrl.wire.cluster import ClusterClient
from qrl.wire.faults import awaiting_scripts, warn_every

# the modules that declare scripts: every_script() imports them. They sit in every layer (a
# script lives beside the code that runs it), so they are named here rather than imported;
# tests/test_scripts.py checks that no module outside this list declares one
DECLARING = (
    "qrl.wire.stream_scripts",
    "qrl.wire.streams",
    "qrl.wire.chunks",
    "qrl.runtime.ids",
    "qrl.runtime.live",
    "qrl.replay.store",
    "qrl.replay.frames",
    "qrl.inference.protocol",
    "qrl.learners.group",
    "qrl.pbt.population",
)

# every script's Lua, one folder for them all (package data, see pyproject.toml): each file is
# named for the script it is (or for the part several share, e.g. streams.fix.lua), the name
# that roles' declarations (Access.scripts), the ACL rules and the logs use
LUA = importlib.resources.files("qrl.wire") / "lua"
_PLAIN = re.compile(r"[\w.:-]*")  # a string constant needs no escaping in a Lua literal

_declared: dict[str, Lua] = {}


def _lua_file(part: str) -> str:
    """The text of ``qrl/wire/lua/PART.lua``."""
    return (LUA / f"{part}.lua").read_text(encoding="utf-8")


def _literal(value: int | str) -> str:
    """``value`` as a Lua literal: a whole number, or a plain string (letters, digits, ``_.:-``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str) and _PLAIN.fullmatch(value):
        return f"'{value}'"
    raise ValueError(f"{value!r} is no whole number or plain string")


class Lua:
    """One of qrl's Lua scripts, ``name``: the text of the files ``parts`` (``qrl/wire/lua/
    PART.lua``, in order; by default the one of its own name) after ``local NAME = VALUE`` for
    each of ``constants`` (what the Python that runs it knows too, e.g. a bound both keep).
    ``read_only``: run with EVALSHA_RO too, on keys the user may only read (Redis 7's
    ``%R~``)."""

    def __init__(
        self,
        name: str,
        *parts: str,
        read_only: bool = False,
        constants: Mapping[str, int | str] | None = None,
    ) -> None:
        if name in _declared:
            raise ValueError(f"two Lua scripts named {name}")
        self.name, self.parts, self.read_only = name, parts or (name,), read_only
        head = "".join(f"local {k} = {_literal(v)}\n" for k, v in (constants or {}).items())
        self.text = head + "".join(map(_lua_file, self.parts))
        self.sha = hashlib.sha1(self.text.encode()).hexdigest()
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
        except NoPermissionError as e:
            self.refused(e)
            raise
        with awaiting_scripts():
            return client.execute_command(*call)

    def refused(self, error: Exception) -> None:
        """Log (once a minute) that this user may not run this script, where ``error`` is
        Redis's refusal of EVALSHA (Redis's own words name no script). That is never what
        data did, but a rule that lacks the script: its role's ``Access.scripts`` (a role
        that runs a script it does not declare), or users made by another qrl. A refused
        EVALSHA_RO is not: a client falls back to EVALSHA (:mod:`qrl.runtime.live`)."""
        if isinstance(error, NoPermissionError) and "'evalsha' command" in str(error):
            warn_every(
                f"script:{self.name}",
                "NOPERM: this user may not run qrl's script %s (its role's Access.scripts "
                "lacks it, or its ACL rule was made by another version of qrl)",
                self.name,
            )

    def on(self, client: Any) -> Bound:
        """This script bound to ``client``."""
        return Bound(self, client)


class Bound:
    """A :class:`Lua` bound to a client: ``bound(keys, args)`` runs it there. A read-only one
    runs with EVALSHA_RO (Redis 7: a user that may only read its keys, ``%R~``, may run it on
    them), or EVALSHA where the server has no EVALSHA_RO (Redis 6.2, whose users read with
    plain ``~`` patterns) or the user may not run it (the per-run rule of docs/many-machines.md,
    which may write every key of its run)."""

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

    def refused(self, error: Exception) -> None:
        """:meth:`Lua.refused`, for a reply of a pipeline it was queued on."""
        self.script.refused(error)


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
