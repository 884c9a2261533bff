"""Live: ``qrl train apex|impala|es`` on CartPole reaches its target while one process keeps
adding hostile-but-decodable entries to the run's stream and garbage to its weights key
(``tests/_hostile_writer.py``) and another keeps attacking the run's keys: replay counters,
weights version, wrong key types, the consumer group, floods, fake consumers, metrics and
leases (``tests/_key_attacker.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
import redis

from tests.cli import ROOT, qrl


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("algo", ["apex", "impala", "es"])
def test_train_reaches_its_target_under_hostile_writes(algo, redis_server, tmp_path):
    run, url = f"hostile-{algo}-{uuid.uuid4().hex[:8]}", redis_server.url
    writer, attacker = (
        subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / script), url, run, algo, "0.25"],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for script in ("_hostile_writer.py", "_key_attacker.py")
    )
    try:
        proc = qrl(
            "train", algo, "--redis", url, "--run", run, "--run-dir", str(tmp_path / "run"),
            "--seed", "0", "--target-return", "200", "--max-time", "150",
            timeout=300,
        )  # fmt: skip
        assert writer.poll() is None, "the hostile writer stopped"
        assert attacker.poll() is None, "the key attacker stopped"
    finally:
        writer.kill()
        attacker.kill()
        sent = writer.communicate()[0].split()
        attacks = attacker.communicate()[0].splitlines()
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["reached"] and result["eval_return"] >= 200
    # hostile entries and weights garbage went in all along (one pair every 0.25 s; ES may
    # solve in a few seconds, so the bar is set by how long the job ran)
    assert len(sent) >= max(5, 0.5 * result["time_s"] / 0.25), (len(sent), result["time_s"])
    r = redis.Redis.from_url(url)
    stats_key = f"qrl:{{{run}}}:stats"  # the attacker may have just made it a string
    raw = r.hgetall(stats_key) if r.type(stats_key) == b"hash" else {}
    stats = {k.decode(): v.decode() for k, v in raw.items()}
    print(algo, "hostile writes:", len(sent), "key attacks:", len(attacks), "stats:", stats)
    assert len(attacks) >= max(5, 0.5 * result["time_s"] / 0.25), (len(attacks), attacks[-5:])
