"""The ``qrl`` command line: one click group, a subcommand for every role."""

from __future__ import annotations

import logging
import signal
import sys
import threading

import click

from qrl import __version__

log = logging.getLogger("qrl")

REDIS_OPTION_HELP = (
    "Redis URL (redis://, rediss://, unix://; user:password@ allowed). Default: $QRL_REDIS_URL."
)


def setup_logging(verbose: int) -> None:
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(
        level=max(level, logging.DEBUG),
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
        datefmt="%H:%M:%S",
    )


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="qrl")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def main(verbose: int) -> None:
    """qrl: distributed reinforcement learning coordinated through Redis.

    \b
    One machine, everything in one command (embedded Redis):
      qrl train apex --env CartPole-v1
    A cluster: run `qrl redis` (or your own Redis), then start roles anywhere with
    --redis URL --run NAME.
    """
    setup_logging(verbose)


@main.command("redis")
@click.option("--port", type=int, default=0, help="Port to listen on (default: a free one).")
@click.option("--bind", "host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--password", default=None, help="Require this password (requirepass).")
@click.option("--appendonly", is_flag=True, help="Persist with an append-only file in --dir.")
@click.option("--dir", "data_dir", type=click.Path(file_okay=False), default=None,
              help="Data directory (default: a temporary one, removed on exit).")  # fmt: skip
def redis_cmd(
    port: int, host: str, password: str | None, appendonly: bool, data_dir: str | None
) -> None:
    """Run a private redis-server in the foreground and print its URL; Ctrl-C stops it."""
    from qrl.embedded import EmbeddedRedis

    server = EmbeddedRedis(port, host, data_dir=data_dir, appendonly=appendonly, password=password)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start()
    except (OSError, RuntimeError) as e:
        raise click.ClickException(str(e)) from e
    try:
        click.echo(server.url)
        click.echo(
            f"redis-server {server.binary} (pid {server.proc.pid}); Ctrl-C to stop", err=True
        )
        sys.stdout.flush()
        while not stop.is_set() and server.proc.poll() is None:
            stop.wait(0.5)
        if not stop.is_set():
            raise click.ClickException(f"redis-server exited with {server.proc.returncode}")
    finally:
        server.stop()
    click.echo("redis-server stopped", err=True)


@main.group()
def train() -> None:
    """Run a whole training job: run config, roles and progress, in one command."""


@main.group()
def actor() -> None:
    """Start an actor that joins a run (needs --redis and --run)."""


@main.group()
def learner() -> None:
    """Start a learner for a run (needs --redis and --run)."""


@main.group()
def es() -> None:
    """Evolution Strategies roles: master and workers."""


if __name__ == "__main__":
    main()
