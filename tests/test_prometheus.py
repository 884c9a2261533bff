"""``qrl status --serve``: a run's status as Prometheus metrics, read from a real Redis by
the exporter's collector, served by the CLI, and scraped by a real Prometheus server."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.parse
import urllib.request

import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from qrl.algos import ALGOS
from qrl.cli.status import _collector
from qrl.runtime import prometheus
from qrl.runtime.metrics import report
from qrl.runtime.prometheus import StatusCollector
from qrl.runtime.runs import create_run
from qrl.wire.codec import encode
from tests.cli import ROOT
from tests.helpers import kill_all, skip_or_fail, wait_until


def _scrape(client: redis.Redis, keys, server: redis.Redis | None = None) -> dict[str, list]:
    """One scrape of the collector of ``keys``' run, its status read through ``client`` and
    Redis's memory through ``server`` (default ``client``): samples by metric family name."""
    collect, reports = _collector(client, keys, 10.0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(keys.run, collect, reports, server or client))
    text = generate_latest(registry).decode()
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), f"a family twice: {names}"
    return {f.name: f.samples for f in families}


def _value(samples: dict, family: str, **labels: str) -> float:
    """The one sample of ``family`` with ``labels``."""
    found = [s.value for s in samples[family] if all(s.labels[k] == v for k, v in labels.items())]
    assert len(found) == 1, (family, labels, samples.get(family))
    return found[0]


def _impala_run(r, keys) -> None:
    algo = ALGOS["impala"]
    assert create_run(r, keys, "impala", algo.config())


def test_a_scrape_shows_the_runs_progress_processes_and_streams(r, keys):
    _impala_run(r, keys)
    report(r, keys, "actor", 0, steps=1000, steps_per_s=400.0, version=3, episode_returns=[])
    report(r, keys, "actor", 1, steps=3000, steps_per_s=600.0, version=5, episode_returns=[])
    report(r, keys, "learner", 0, updates=7, updates_per_s=2.5, loss=0.25)
    r.xadd(keys.key("trajectories"), {"d": b"x"})
    s = _scrape(r, keys)
    assert _value(s, "qrl_up") == 1
    assert _value(s, "qrl_env_steps") == 4000
    assert _value(s, "qrl_env_steps_per_s") == 1000.0
    assert _value(s, "qrl_updates_per_s") == 2.5
    assert _value(s, "qrl_role_rate", role="actor", counter="steps") == 1000.0
    assert _value(s, "qrl_process_up", role="actor", id="1") == 1
    assert _value(s, "qrl_process_value", role="actor", id="1", name="steps") == 3000
    assert _value(s, "qrl_stream_length", stream="trajectories") == 1
    assert _value(s, "qrl_redis_used_memory_bytes") > 0
    assert _value(s, "qrl_dead_letters") == 0


def test_what_a_writer_puts_in_heartbeats_is_bounded_and_redis_gone_reads_as_down(
    r, keys, monkeypatch
):
    """A heartbeat's values that are no finite numbers make no samples; a writer adding
    heartbeats by the thousand gets MAX_PROCESSES of them exported; Redis gone: qrl_up 0."""
    _impala_run(r, keys)
    now = float(r.time()[0])
    for i in range(5):  # written by hand, as any writer with the run's keys may
        values = {"steps": "lots", "steps_per_s": float("inf")} if i == 0 else {"steps": 1}
        beat = {"role": "actor", "id": i, "host": "h\n}", "pid": 1, "started": now, "time": now}
        r.set(keys.proc(f"actor.{i}@h:1"), encode("heartbeat", {**beat, "values": values}))
    monkeypatch.setattr(prometheus, "MAX_PROCESSES", 3)
    s = _scrape(r, keys)
    assert len(s["qrl_process_up"]) == 3
    assert [x.labels["id"] for x in s["qrl_process_value"]] == ["1", "2"]
    gone = redis.Redis(port=_free_port(), socket_connect_timeout=0.5)
    assert _scrape(r, keys, server=gone)["qrl_up"][0].value == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(run: str, url: str, port: int = 0) -> tuple[subprocess.Popen, str]:
    """``qrl status --run RUN --serve PORT``, and the address it printed."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "qrl.cli",
            "status",
            "--redis",
            url,
            "--run",
            run,
            "--serve",
            str(port),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for _ in range(3):
        line = proc.stdout.readline()
        if "serving" in line:
            return proc, line.split(" on ")[1].split()[0]
    kill_all([proc])
    raise AssertionError(f"no address printed: {line!r} {proc.stderr.read()}")


def test_the_cli_serves_metrics_and_stops_cleanly(r, keys, redis_server):
    _impala_run(r, keys)
    report(r, keys, "learner", 0, updates=7, updates_per_s=2.5, loss=0.25)
    proc, address = _serve(keys.run, redis_server.url)
    try:
        text = urllib.request.urlopen(address, timeout=10).read().decode()
        assert f'qrl_updates_per_s{{run="{keys.run}"}} 2.5' in text
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


@pytest.mark.slow
def test_a_prometheus_server_scrapes_a_running_training(tmp_path, redis_server):
    """Debian's prometheus scrapes ``qrl status --serve`` beside a ``qrl train impala`` and
    its query for the run's env steps/s answers a positive rate."""
    binary = shutil.which("prometheus") or "/usr/bin/prometheus"
    if not os.path.exists(binary):
        skip_or_fail("no prometheus server here (Debian: apt-get install prometheus)")
    promtool = shutil.which("promtool") or "/usr/bin/promtool"
    if os.path.exists(promtool):  # the compose profile's scrape config and alert rules
        check = [promtool, "check", "config", str(ROOT / "docker/prometheus/prometheus.yml")]
        checked = subprocess.run(check, capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    run, port, web = f"prom-{os.getpid()}", _free_port(), _free_port()
    env = {**os.environ, "QRL_REDIS_URL": redis_server.url}
    train = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "qrl.cli",
            "train",
            "impala",
            "--run",
            run,
            "--max-time",
            "60",
            "--target-return",
            "1e9",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    exporter, _ = _serve(run, redis_server.url, port)
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs: [{job_name: qrl, static_configs: "
        f"[{{targets: ['127.0.0.1:{port}']}}]}}]\n"
    )
    server = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    query = urllib.parse.urlencode({"query": f'qrl_env_steps_per_s{{run="{run}"}}'})

    def rate() -> float:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{web}/api/v1/query?{query}", timeout=5
            ) as f:
                result = json.load(f)["data"]["result"]
        except OSError:
            return 0.0
        return float(result[0]["value"][1]) if result else 0.0

    try:
        assert (
            wait_until(
                rate, "a positive env steps/s from Prometheus", 90, until=lambda x: x > 0, every=1.0
            )
            > 0
        )
    finally:
        kill_all([train, exporter, server])
