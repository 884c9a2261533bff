"""The ``qrl`` command line: a thin click package. Commands parse their options and call
the library; the commands that start roles and jobs are generated from the algorithm
registry (:mod:`qrl.algos`), so no command here names an algorithm."""

from __future__ import annotations

import atexit
import gc
import logging
from typing import Any

import click

from qrl import __version__
from qrl.cli.options import VERBOSE, Settings


class QrlGroup(click.Group):
    """The root group: Redis going away for longer than the deadline ends any command with
    one clear line and exit code 3, an ACL refusal with one line and exit code 1, not a
    traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        from qrl.wire.connection import failure_exit

        try:
            return super().invoke(ctx)
        except Exception as e:
            failure = failure_exit(e)
            if failure is None:
                raise
            click.echo(failure[1], err=True)
            ctx.exit(failure[0])


@click.group(cls=QrlGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="qrl")
@VERBOSE
@click.option(
    "--redis-deadline",
    type=float,
    envvar="QRL_REDIS_DEADLINE",
    default=60.0,
    show_default=True,
    help="Seconds to keep retrying a lost Redis before exiting with code 3 "
    "(env QRL_REDIS_DEADLINE).",
)
@click.pass_context
def main(ctx: click.Context, redis_deadline: float) -> None:
    """qrl: distributed reinforcement learning coordinated through Redis.

    \b
    One machine, everything in one command (embedded Redis):
      qrl train apex --env CartPole-v1
    A cluster: run `qrl redis` (or your own Redis), then start roles anywhere with
    --redis URL --run NAME.
    """
    from qrl.jobs.launch import setup_logging

    setup_logging(logging.WARNING, force=False)  # unless -v came first
    ctx.obj = Settings(redis_deadline=redis_deadline)
    # the last thing before the interpreter's teardown (handlers run last-registered first):
    # its final garbage collections then skip torch's million objects, a quarter second off
    # every command's exit (files and connections are closed by then, by their owners)
    atexit.register(gc.freeze)


from qrl.cli import config, pbt, results, roles, runs, server, status, train  # noqa: E402

for _module in (config, pbt, results, roles, runs, server, status, train):  # their commands
    _module.register(main)


def _verbose_everywhere(cmd: click.Command) -> None:
    """-v/--verbose on every command, so it works before or after the subcommand."""
    if not any(p.name == "verbose" for p in cmd.params):
        VERBOSE(cmd)
    for sub in getattr(cmd, "commands", {}).values():
        _verbose_everywhere(sub)


_verbose_everywhere(main)
