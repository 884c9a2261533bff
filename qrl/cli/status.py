"""``qrl status``: a running run at a glance."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from typing import Any

import click

from qrl.cli.options import (
    connect_or_fail,
    redis_option,
    run_keys,
    run_option,
)


@click.command("status")
@redis_option()
@run_option(required=False, help="Run name (default: $QRL_RUN, or the only run).")
@click.option("--watch", is_flag=True, help="Refresh until Ctrl-C.")
@click.option(
    "--interval", type=float, default=2.0, show_default=True, help="Seconds between refreshes."
)
@click.option(
    "--stale-after",
    type=float,
    default=10.0,
    show_default=True,
    help="Flag a process whose last heartbeat is older than this many seconds.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON (for scripts).")
@click.option(
    "--serve",
    "port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve the status as Prometheus metrics on this port (/metrics) until stopped.",
)
@click.option(
    "--bind",
    default="127.0.0.1",
    show_default=True,
    help="The address --serve listens on (0.0.0.0: every interface).",
)
def status_cmd(
    redis_url: str | None,
    run: str | None,
    watch: bool,
    interval: float,
    stale_after: float,
    as_json: bool,
    port: int | None,
    bind: str,
) -> None:
    """Every live process of a run, throughput per role, streams and consumer-group lag,
    replay size, weight version, policy lag and dead letters; stale heartbeats flagged.
    With --serve, the same as Prometheus metrics (qrl_env_steps_per_s, qrl_updates_per_s,
    qrl_policy_lag, qrl_stream_pending, qrl_process_up, ...), read afresh at each scrape."""
    from qrl.runtime.runs import list_runs

    client = connect_or_fail(redis_url)
    if run is None:
        runs = [r["run"] for r in list_runs(client)]
        if len(runs) != 1:
            raise click.UsageError(f"pass --run (runs in this Redis: {', '.join(runs) or 'none'})")
        run = runs[0]
    keys = run_keys(run)
    if port is not None and not client.exists(keys.config):  # an exporter may start first
        click.echo(f"waiting for run {run!r} to be created")
        while not client.exists(keys.config):
            time.sleep(1.0)
    if not client.exists(keys.config) and client.exists(keys.key("pbt:config")):
        from qrl.pbt.status import show  # a population (qrl pbt)

        show(client, run, as_json)
        return
    if not client.exists(keys.config):
        raise click.ClickException(f"no run {run!r} in this Redis")
    collect, reports = _collector(client, keys, stale_after)
    if port is not None:
        _serve(client, run, collect, reports, bind, port)
        return
    if as_json:
        while True:
            click.echo(json.dumps(collect()))
            if not watch:
                return
            time.sleep(interval)
    from rich.console import Console
    from rich.live import Live

    from qrl.runtime.status import render

    console = Console() if sys.stdout.isatty() else Console(width=160)  # pipes: no wrapping
    if not watch:
        console.print(render(collect(), reports))
        return
    with Live(render(collect(), reports), console=console, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(interval)
                live.update(render(collect(), reports), refresh=True)
        except KeyboardInterrupt:
            pass


def _collector(client: Any, keys: Any, stale_after: float) -> tuple[Any, dict[str, Any]]:
    """A function returning the run's status, with what its algorithm's builder adds, and
    what its roles report (by role name: what to show of each process)."""
    from redis import ResponseError

    from qrl.algos import ALGOS
    from qrl.runtime.runs import RunNotFound, load_run
    from qrl.runtime.status import collect
    from qrl.wire.codec import CodecError

    unreadable = []  # the config of the wrong type or unreadable: shown as unknown
    try:
        name, config = load_run(client, keys)
    except RunNotFound:
        name, config = None, {}
    except (CodecError, ResponseError):
        name, config, unreadable = None, {}, ["config"]
    algo = ALGOS.get(name) if name else None
    reports = algo.reports if algo else {}

    def status() -> dict[str, Any]:
        return collect(
            client,
            keys,
            stale_after,
            algo=name,
            env=config.get("env"),
            weights_key=algo.weights_key(keys) if algo else None,
            streams=algo.streams(keys, config) if algo else None,
            extra=(lambda: algo.status(client, keys, config)) if algo else None,
            unreadable=unreadable,
            reports=reports,
        )

    return status, reports


def _serve(
    client: Any, run: str, collect: Any, reports: dict[str, Any], bind: str, port: int
) -> None:
    """Answer Prometheus scrapes of ``run`` on ``bind:port`` until Ctrl-C or SIGTERM."""
    import signal
    import threading

    from prometheus_client import CollectorRegistry, start_http_server

    from qrl.runtime.prometheus import StatusCollector

    registry = CollectorRegistry(auto_describe=False)  # described by a scrape, not at start
    registry.register(StatusCollector(run, collect, reports, client))
    try:
        server, _ = start_http_server(port, addr=bind, registry=registry)
    except OSError as e:
        raise click.ClickException(f"cannot serve on {bind}:{port}: {e}") from e
    host, bound = server.server_address[:2]
    click.echo(f"serving run {run}'s status on http://{host}:{bound}/metrics (Ctrl-C stops)")
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    with contextlib.suppress(KeyboardInterrupt):
        stopped.wait()
    server.shutdown()


def register(main: click.Group) -> None:
    main.add_command(status_cmd)
