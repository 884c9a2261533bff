"""Until killed: issue 68's attacks, made in turn with ONE role's own credentials (a joined
actor, stepper or worker: ``qrl run join``), as the holder of one compromised machine would
make them. ``python tests/_role_attacker.py URL RUN ALGO ROLE EVERY`` (the URL names the
attacker's user, the password comes from ``QRL_REDIS_PASSWORD_FILE``); prints how many
kinds of attack it makes, then one line per attack: its name, a colon, then ``refused``
(Redis said no) or ``made`` (it went in: the honest roles must ride it out).

Where ``tests/_key_attacker.py`` attacks with the run's whole key space, this has only what
one role's user has: Lua of its own, exhausted stream ids, a counter at the int64 edge,
oversized metrics entries, reports posing as the learner (in its own metrics stream and
in others'), the weights, config and control, other processes' leases, heartbeats and reply
lists, the parameter server's state, another worker's gradient stream and a flood of
in-bounds gradients on its own, a poisoned ES statistics message. Against a PBT population
(ALGO ``pbt``): with trial I's worker user (ROLE ``worker``) or the user of a process of its
segment (any other ROLE), the population's and another trial's keys, and its own trial's
records. It ends, exit code 0, when its user is deleted."""

import os
import sys
import time

import numpy as np
import redis

from qrl.algos.es.keys import es_results
from qrl.algos.impala.keys import trajectories
from qrl.inference import protocol as inference
from qrl.ps import protocol as ps
from qrl.runtime.ids import user_ident
from qrl.wire.codec import encode
from qrl.wire.connection import connect, url_user
from qrl.wire.keys import RunKeys
from qrl.wire.weights import WeightStore

url, run, algo, role, every = sys.argv[1:5] + [float(sys.argv[5])]
r = connect(url, deadline=5.0)
keys = RunKeys(run)
rng = np.random.default_rng(68)
# an A3C worker's number (its joined user is RUN.worker.N): its own gradient stream's
ME = int(r.acl_whoami().rsplit(".", 1)[-1]) if algo == "a3c" else 0
TOP = "18446744073709551615-18446744073709551615"  # the last stream id there is
LOOP = "redis.call('SET', KEYS[1], 'x') local i = 0 while true do i = i + 1 end"
FEEDS = {  # the stream a role of each algorithm feeds
    "apex": keys.experience,
    "impala": trajectories(keys),
    "es": es_results(keys),
    "a3c": ps.gradients(ps.shard_keys(keys, 1, 0), ME),  # its own stream
}
FEED = FEEDS.get(algo, keys.experience)
other = keys.lease(role, 0)  # another process's key (the attacker is never number 0)
MINE = keys.metrics(role, user_ident(url_user(url), run, role) or 0)  # its own metrics


def counter_edge() -> None:
    """Finding 3: the next HINCRBY of the stats overflows."""
    now = int(r.hget(keys.stats, "env_steps") or 0)
    r.hincrby(keys.stats, "env_steps", 2**63 - 1 - now)


def big_metrics() -> None:
    """Finding 8: entries a reader would fetch whole (in its own stream, started afresh:
    its ids were used up by its other attack)."""
    r.delete(MINE)
    for _ in range(5):
        r.xadd(MINE, {"d": b"x" * (30 << 20)})


def forged_metrics(stream: str) -> None:
    """Reports as the learner, of a million updates: to ``stream`` (another process's,
    refused; its own, started afresh, which the readers refuse: a report names no one)."""
    claim = {"role": "learner", "id": 0, "time": time.time(), "values": {"updates": 10**6}}
    if stream == MINE:
        r.delete(MINE)
    r.xadd(stream, {"d": encode("metrics", claim)})


def poisoned_stats() -> None:
    """Finding 4: one well-formed ES message of huge weight and near-zero variance."""
    n = 4
    msg = {
        "generation": 0,
        "job": np.arange(n, dtype=np.int64),
        "index": np.arange(n),
        "return_pos": np.zeros(n, np.float32),
        "return_neg": np.zeros(n, np.float32),
        "length_pos": np.ones(n, np.int32),
        "length_neg": np.ones(n, np.int32),
        "obs_sum": np.full(4, 1e6 * 2**40),
        "obs_sumsq": np.full(4, 1e12 * 2**40),
        "obs_count": float(2**40),
        "worker": 0,
        "batch": os.urandom(8).hex(),
    }
    r.xadd(es_results(keys), {"d": encode("es.results", msg)})


def _block() -> tuple[RunKeys, int]:
    """Shard 0 of 1 and the length of its block (0 before its server published one)."""
    sk = ps.shard_keys(keys, 1, 0)
    w = WeightStore(r, keys, ps.params(sk)).fetch()
    return sk, 0 if w is None else sum(a.size for a in w.params.values())


def ps_state() -> None:
    """Finding 5: a saved state that a restarted shard would resume from, every parameter
    1e30 at version 2^50."""
    sk, length = _block()
    msg = {
        "version": 2**50,
        "last_id": "0-0",
        "params": np.full(length, 1e30, np.float32),
        "opt": {},
        "loss": [],
    }
    ps.state_store(r, sk, length, 1).replace(msg)


def _gradient(length: int) -> bytes:
    grad = rng.normal(0, 1e-2, length).astype(np.float32)
    return encode(ps.GRADIENT, {"shard": 0, "version": 0, "loss": 0.0, "grad": grad})


def gradient_flood() -> None:
    """Finding 10: as many in-bounds gradients as one worker can push (to its own stream: the
    only one its user may write; deleted first, with the ids the exhaust attack used up and
    the server's group: the server's next read makes the group again)."""
    sk, length = _block()
    pipe = r.pipeline(transaction=False)
    pipe.delete(ps.gradients(sk, ME))
    for _ in range(200):
        pipe.xadd(ps.gradients(sk, ME), {"d": _gradient(length)})
    pipe.execute()


def others_gradient() -> None:
    """Finding 10: a gradient in worker 0's stream, to be counted as worker 0's."""
    sk, length = _block()
    r.xadd(ps.gradients(sk, 0), {"d": _gradient(length)})


SK = inference.server_keys(keys, 1, 0)
ATTACKS = [  # name, one command each: one refused does not spare the next
    ("lua_loop", lambda: r.eval(LOOP, 1, other)),  # finding 1: every client of Redis BUSY
    ("lua_load", lambda: r.script_load(LOOP)),
    ("function_load", lambda: r.function_load(f"#!lua name=evil\n{LOOP}")),
    *[
        (f"exhaust {s.rsplit(':', 1)[-1]}", lambda s=s: r.xadd(s, {"d": b"x"}, id=TOP))
        for s in (MINE, keys.deadletter, FEED)
    ],  # finding 2
    ("counter_edge", counter_edge),  # finding 3
    ("big_metrics", big_metrics),  # finding 8
    ("metrics as learner", lambda: forged_metrics(keys.metrics("learner", 0))),
    ("metrics as 0", lambda: forged_metrics(keys.metrics(role, 0))),
    ("forged metrics", lambda: forged_metrics(MINE)),
    ("set weights", lambda: r.set(keys.weights, b"x")),  # finding 7
    ("del config", lambda: r.delete(keys.config)),
    ("set control", lambda: r.set(keys.control, b"x")),
    ("take lease 0", lambda: r.set(other, "evil:1:x")),  # finding 12
    ("heartbeat as 0", lambda: r.set(keys.proc(f"{role}.0@evil:1"), b"x")),
]
POPULATION, _, TRIAL = run.rpartition("-t")  # a PBT trial's run: POPULATION-tI
OTHER = f"{POPULATION}-t{1 - int(TRIAL)}" if algo == "pbt" else ""
PBT = [  # finding 9, as trial I's worker or a process of its segment: the population's keys,
    # another trial's
    ("forge solved", lambda: r.set(RunKeys(POPULATION).key("pbt:solved"), '{"trial": "x"}')),
    ("other's score", lambda: r.set(RunKeys(OTHER).key("pbt:score"), '{"score": -1e9}')),
    ("other's config", lambda: r.delete(RunKeys(OTHER).config)),
    ("other's lease", lambda: r.set(RunKeys(OTHER).key("pbt:lease"), "evil")),
]
LIES = [  # as trial I's worker, its own trial's records: its to write, lies within bounds
    ("score 1e300", lambda: r.set(keys.key("pbt:score"), '{"score": 1e300, "time": 0}')),
    ("claim reached", lambda: r.set(keys.key("pbt:reached"), '{"return": 1e9, "time": 0}')),
    ("escapes", lambda: r.set(keys.key("pbt:reached"), '{"return": "\x1b[2J\x1b]0;x\x07"}')),
]
RECORDS = [  # as a process of trial I's segment (its own user): the records are the slot's
    ("own score", lambda: r.set(keys.key("pbt:score"), '{"score": 1e12, "time": 0}')),
    ("own lineage", lambda: r.set(keys.key("pbt:lineage"), '[{"n": 1, "event": {}}]')),
    ("own claim", lambda: r.set(keys.key("pbt:reached"), '{"return": 1e9, "time": 0}')),
    ("own snapshot", lambda: r.set(keys.key("snapshot"), b"x")),
    ("own lease", lambda: r.set(keys.key("pbt:lease"), "evil")),
]
if algo == "pbt":  # the population is the target (and, but for its worker, the trial's records)
    ATTACKS = [a for a in ATTACKS if a[0] in ("lua_loop", "lua_load", "function_load")]
    ATTACKS += PBT + (LIES if role == "worker" else RECORDS)
ATTACKS += {
    "es": [("poisoned_stats", poisoned_stats)],  # finding 4
    "a3c": [  # findings 5, 10
        ("ps_state", ps_state),
        ("gradient_flood", gradient_flood),
        ("other's gradient", others_gradient),
    ],
    "impala": [  # finding 6
        ("steal replies", lambda: r.blpop([inference.reply(SK, 0, 0)], timeout=0.05)),
        ("read requests", lambda: r.lrange(inference.requests(SK, 0), 0, -1)),
        ("drop requests", lambda: r.delete(inference.requests(SK, 0))),
    ],
}.get(algo, [])

print(f"attacks: {len(ATTACKS)}", flush=True)
made = 0
while True:
    name, attack = ATTACKS[made % len(ATTACKS)]
    try:
        attack()
        outcome = "made"
    except redis.exceptions.AuthenticationError:  # its user was deleted (a population ended)
        print("user gone", flush=True)
        break
    except redis.exceptions.NoPermissionError:
        outcome = "refused"
    except redis.ResponseError as e:  # e.g. the id is exhausted already: it went in before
        outcome = f"answered {str(e)[:60]!r}"
    made += 1
    print(f"{name}: {outcome}", flush=True)
    time.sleep(every)  # the attacks' pace (argv): nothing to wait for, it runs till killed
