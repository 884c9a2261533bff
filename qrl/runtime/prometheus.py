"""What ``qrl status`` shows, as Prometheus metrics (``qrl status --serve PORT``).

One exporter per run, beside the run rather than inside its roles: it reads everything from
Redis (:func:`qrl.runtime.status.collect`, the same reading as ``qrl status``), so no role
opens a port, an actor behind NAT or a firewall is still seen, processes that come and go
need no scrape targets of their own, and a scrape never stalls a role. Each scrape reads
Redis afresh; a Redis that is gone or refuses answers ``qrl_up 0`` (the scrape itself
succeeds, so an alert can say which).

Every value comes from keys any writer with the run's keys can write: the status reading
drops what is not a finite number, and a run with more processes than :data:`MAX_PROCESSES`
exports the first of them only (one series per process and value: a writer must not be able
to make the exporter's answer unbounded)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from itertools import chain
from typing import Any

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from qrl.runtime.roles import Reports
from qrl.runtime.runlog import Progress

log = logging.getLogger(__name__)

MAX_PROCESSES = 4096  # processes exported per scrape (heartbeats are anyone's to add)
PREFIX = "qrl_"


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, labels=["run", *labels])


class StatusCollector(Collector):
    """A Prometheus collector of one run: ``status()`` is its ``qrl status`` reading
    (:func:`qrl.cli.status` builds it), ``reports`` what its roles report (by role name),
    ``client`` the Redis it reads (for its memory)."""

    def __init__(
        self,
        run: str,
        status: Callable[[], dict[str, Any]],
        reports: Mapping[str, Reports],
        client: redis.Redis,
    ) -> None:
        self.run, self.status, self.reports, self.client = run, status, reports, client

    def collect(self) -> Iterator[Metric]:
        up = _gauge("up", "1 if the run's status could be read from Redis, else 0", [])
        try:
            s = self.status()
            memory = self.client.info("memory")
        except redis.RedisError as e:
            log.warning("could not read the status of run %s: %s", self.run, e)
            up.add_metric([self.run], 0)
            yield up
            return
        up.add_metric([self.run], 1)
        yield up
        names = set()  # a progress column the status also has (policy lag): the status's
        for family in chain(
            self._run(s),
            self._progress(s["processes"]),
            self._processes(s["processes"]),
            self._streams(s["streams"]),
            self._redis(memory),
        ):
            if family.name not in names:
                names.add(family.name)
                yield family

    def _run(self, s: dict[str, Any]) -> Iterator[Metric]:
        r = [self.run]
        for name, doc, value in (
            ("stopped", "1 once the run was told to stop", int(s["stopped"])),
            (
                "weights_version",
                "the published weights' version (-1: none yet)",
                s["weights_version"],
            ),
        ):
            g = _gauge(name, doc, [])
            g.add_metric(r, value)
            yield g
        if s["policy_lag"] is not None:
            g = _gauge(
                "policy_lag", "updates between the published weights and those acted with", []
            )
            g.add_metric(r, s["policy_lag"])
            yield g
        for key in s.get("extra", []):  # what the algorithm adds, e.g. the replay size
            if isinstance(s.get(key), int | float):
                g = _gauge(key, f"{key.replace('_', ' ')} (the algorithm's status)", [])
                g.add_metric(r, s[key])
                yield g
        rate = _gauge(
            "role_rate",
            "per role: the sum of its live processes' counter rates",
            ["role", "counter"],
        )
        for role, value in sorted(s["throughput"].items()):
            rate.add_metric([self.run, role, self.reports[role].counter], value)
        yield rate
        dead = CounterMetricFamily(
            PREFIX + "dead_letters",
            "rejected entries kept in the dead-letter stream (capped)",
            labels=["run"],
        )
        dead.add_metric(r, s["dead_letters"])
        yield dead
        rejected = CounterMetricFamily(
            PREFIX + "rejected",
            "payloads rejected, by where they came from",
            labels=["run", "source"],
        )
        for key, value in sorted(s["stats"].items()):
            if key.startswith("rejected:"):
                rejected.add_metric([self.run, key.removeprefix("rejected:")], value)
        yield rejected

    def _progress(self, procs: list[dict[str, Any]]) -> Iterator[Metric]:
        """The run's progress columns (env steps and their rate, updates and theirs, the
        replay size, the loss...) folded from its live processes' last reports as ``qrl
        train`` folds their metrics (:class:`qrl.runtime.runlog.Progress`); the columns no
        report fed yet, and the run log's own (time, evaluations), left out."""
        progress = Progress(self.reports)
        for p in procs:
            if not p["stale"]:
                progress.fold(p)
        for column in progress.columns:
            if column.name in progress.source:
                value = progress.value(column)
                if value is not None:
                    g = _gauge(
                        column.name,
                        f"the run's {column.name.replace('_', ' ')} (its live processes' reports)",
                        [],
                    )
                    g.add_metric([self.run], value)
                    yield g

    def _processes(self, procs: list[dict[str, Any]]) -> Iterator[Metric]:
        labels = ["role", "id", "host"]
        live = _gauge(
            "process_up", "1 for a process whose heartbeat is fresh, 0 for a stale one", labels
        )
        age = _gauge(
            "process_heartbeat_age_seconds", "seconds since the process's last heartbeat", labels
        )
        value = _gauge(
            "process_value",
            "what a process reports of its role's listed values and its rate",
            [*labels, "name"],
        )
        for p in procs[:MAX_PROCESSES]:
            at = [self.run, p["role"], str(p["id"]), p["host"]]
            live.add_metric(at, 0 if p["stale"] else 1)
            age.add_metric(at, p["age_s"])
            role = self.reports.get(p["role"])
            for name in (role.rate, *role.listed) if role else ():
                v = p["values"].get(name)
                if isinstance(v, int | float):
                    value.add_metric([*at, name], v)
        if len(procs) > MAX_PROCESSES:
            log.warning(
                "run %s: %d processes, exported the first %d", self.run, len(procs), MAX_PROCESSES
            )
        yield from (live, age, value)

    def _streams(self, streams: dict[str, dict[str, Any]]) -> Iterator[Metric]:
        docs = {
            "length": "entries in the stream",
            "pending": "entries delivered to a consumer and not yet acknowledged",
            "lag": "entries not yet delivered to the consumer group (Redis 7 and later)",
            "consumers": "consumers in the stream's groups",
        }
        for field, doc in docs.items():
            g = _gauge(f"stream_{field}", doc, ["stream"])
            for name, info in sorted(streams.items()):
                if info[field] is not None:
                    g.add_metric([self.run, name], info[field])
            yield g

    def _redis(self, memory: dict[str, Any]) -> Iterator[Metric]:
        for field, name, doc in (
            ("used_memory", "redis_used_memory_bytes", "the memory Redis uses"),
            ("maxmemory", "redis_maxmemory_bytes", "Redis's maxmemory (0: no limit)"),
        ):
            g = _gauge(name, doc, [])
            if isinstance(memory.get(field), int):
                g.add_metric([self.run], memory[field])
            yield g
