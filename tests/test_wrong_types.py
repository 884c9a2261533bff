"""Keys of a run holding the wrong Redis type (anyone with the run's keys can SET, HSET or
LPUSH any of them): no command prints a traceback. The run's config is its identity, so a
config nobody can read is a one-line error naming the key, never repaired; every other key a
role reads is repaired and the role goes on. Real redis-server, the real CLI."""

from __future__ import annotations

import pytest

from qrl.configs.apex import ApexConfig
from qrl.configs.base import parse_config
from qrl.runs import create_run
from tests.cli import qrl

WRONG = {  # a write of each Redis type, over whatever the key held
    "string": lambda r, key: r.set(key, "x"),
    "hash": lambda r, key: r.delete(key) + r.hset(key, "a", "b"),
    "list": lambda r, key: r.delete(key) + r.lpush(key, "x"),
}
UNREADABLE_CONFIG = {**WRONG, "garbage": lambda r, key: r.set(key, "not a run config")}
del UNREADABLE_CONFIG["string"]  # a plain "x" is garbage too: once is enough


@pytest.mark.parametrize("write", sorted(UNREADABLE_CONFIG))
@pytest.mark.parametrize(
    "command", [("actor", "apex"), ("learner", "impala"), ("replay",), ("run", "create", "apex")]
)
def test_an_unreadable_run_config_is_a_one_line_error_and_kept(r, keys, command, write):
    UNREADABLE_CONFIG[write](r, keys.config)
    kind = r.type(keys.config)
    out = qrl(*command, "--run", keys.run, timeout=60)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert keys.config in out.stderr and "not readable" in out.stderr, out.stderr
    assert r.type(keys.config) == kind, "the run's config was changed"


def test_run_create_repairs_a_control_key_of_the_wrong_type(r, keys):
    r.set(keys.control, "x")
    out = qrl("run", "create", "apex", "--run", keys.run, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert r.type(keys.control) in (b"none", b"hash")
    create_run(r, keys, "apex", parse_config(ApexConfig, {}))  # it made the run
