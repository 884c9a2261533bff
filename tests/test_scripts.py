"""qrl's Lua scripts (:mod:`qrl.wire.scripts`): one registry holds every script qrl runs,
each loads into Redis 6.2 and 7, and a role's ACL user may run exactly these: no EVAL, no
script of its own, no SCRIPT LOAD or FUNCTION (issue 68, finding 1: one role's Lua loop
stalled every client of the Redis, and SCRIPT KILL could not end it). A role whose Redis lost
the scripts waits for the admin to load them again. Real redis-servers."""

from __future__ import annotations

import importlib
import re

import pytest

from qrl.server.embedded import EmbeddedRedis
from qrl.wire.connection import connect
from qrl.wire.scripts import DECLARING, every_script, load_scripts
from tests.cli import ROOT
from tests.helpers import redis_binaries

ADMIN = "admin-pw-for-script-tests"
BINARIES = redis_binaries()
BY_VERSION = pytest.mark.parametrize(
    "binary", BINARIES.values(), ids=[f"redis{v}" for v in BINARIES]
)
# the finding's attack: a write, then a loop (after a write SCRIPT KILL cannot stop it)
LOOP = "redis.call('SET', KEYS[1], '1') for i = 1, 1e8 do end return 1"
FUNCTION = "#!lua name=mine\nredis.register_function('mine', function() return 1 end)"
# running Lua other than by EVALSHA of qrl's: the module's own name for it
_OWN_LUA = re.compile(r"register_script\(|\.eval(sha)?(_ro)?\([^)]|script_load\(|[\"']EVAL")


def test_the_registry_holds_every_script_qrl_runs():
    """No module of qrl runs Lua but through the registry, each module that declares a
    script is one that :func:`every_script` imports, and every Lua text in qrl's modules is
    (part of) a registered script's, so the ACL rules list every script qrl runs."""
    root = ROOT / "qrl"
    texts = [s.text for s in every_script().values()]
    declaring = set()
    for path in sorted(root.rglob("*.py")):
        if path.name == "__main__.py":  # runs the CLI when imported
            continue
        name = ".".join(("qrl", *path.relative_to(root).with_suffix("").parts))
        source = path.read_text()
        if name == "qrl.wire.scripts":
            continue
        assert not _OWN_LUA.search(source), f"{path} runs Lua outside qrl/wire/scripts.py"
        if re.search(r"\bLua\(", source):
            declaring.add(name)
        for attr, value in vars(importlib.import_module(name)).items():
            if isinstance(value, str) and "redis.call(" in value:
                assert any(value in text for text in texts), f"{name}.{attr} is not registered"
    assert declaring == set(DECLARING)
    assert len({s.sha for s in every_script().values()}) == len(every_script())


@BY_VERSION
def test_every_script_loads(binary):
    with EmbeddedRedis(binary=binary) as server:
        client = connect(server.url)
        assert load_scripts(client) == len(every_script()) > 20
        assert all(client.script_exists(*(s.sha for s in every_script().values())))
