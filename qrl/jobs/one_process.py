"""What ``qrl train --one-process`` adds to a job (:func:`qrl.jobs.train.run_training`): which
runs can take turns in one process (:func:`refusal`), the job's seat and its roles' seats
(:func:`seated`; the turns are :mod:`qrl.runtime.turns`'), and the roles' logs, each in its
file as a role process's would be (:class:`RoleLogs`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from qrl.algos import ALGOS
from qrl.jobs.launch import LOG_DATES, RoleSpec, start_seat
from qrl.runtime.algorithm import Algorithm
from qrl.runtime.config import Config
from qrl.runtime.files import open_appending
from qrl.runtime.turns import Seat, Table


def refusal(algo: Algorithm, cfg: Config) -> str | None:
    """Why ``cfg``'s run of ``algo`` cannot run in one process (``None``: it can): a role
    that cannot take turns (:attr:`~qrl.runtime.algorithm.RoleDef.turns`), or a learner
    pool, whose learners meet in torch.distributed, a process each. The message names the
    algorithms that do run (whose roles take turns, those a config may leave out aside)."""
    procs = algo.processes(cfg)
    blocked = list(dict.fromkeys(r.name for r, _ in procs if not r.turns))
    runs = ", ".join(a.name for a in ALGOS.values() if all(r.turns or r.when for r in a.roles))
    if blocked:
        return (
            f"--one-process runs roles that take turns ({runs}, with one learner): "
            f"{algo.name}'s {' and '.join(blocked)} role{'s' if len(blocked) > 1 else ''} "
            "cannot take turns in one process"
        )
    for r in dict.fromkeys(r for r, _ in procs if r.group):
        n = sum(1 for p, _ in procs if p is r)
        if n > 1:
            return f"--one-process runs one {r.name}: {r.count}={n} makes a pool of processes"
    return None


@contextmanager
def seated() -> Iterator[Callable[[RoleSpec, Path, str], Seat]]:
    """For a ``with`` block: the calling thread (the job) seated first at a new table, the
    roles' logs taken into their files, and how to start a role as a seat logging to a
    file (what :func:`qrl.jobs.launch.start_process` is for a process)."""
    table = Table()
    with table.sit("job"), RoleLogs(table).installed() as logs:

        def start(spec: RoleSpec, log_path: Path, name: str) -> Seat:
            seat = start_seat(table, spec, name)
            logs.add(seat, log_path)
            return seat

        yield start


class RoleLogs(logging.Handler):
    """A one-process run's log records, each role's (and its helpers') into the role's own
    file, as a role process's output goes to ``logs/NAME.log``; the handlers the job had
    keep the other records, at their level as before."""

    def __init__(self, table: Table) -> None:
        super().__init__(logging.INFO)
        self.table = table
        self.files: dict[Seat, IO[str]] = {}
        self.setFormatter(
            logging.Formatter(
                "%(asctime)s %(levelname)s %(name)s[%(threadName)s]: %(message)s", LOG_DATES
            )
        )

    def add(self, seat: Seat, path: Path) -> None:
        """Write ``seat``'s records (and its helpers') to ``path``."""
        self.files[seat] = os.fdopen(open_appending(path, 0o644), "a")

    def file_of(self, record: logging.LogRecord) -> IO[str] | None:
        seat = self.table.seat_of(record.thread)
        while seat is not None and seat not in self.files:
            seat = seat.parent
        return None if seat is None else self.files[seat]

    def emit(self, record: logging.LogRecord) -> None:
        if (f := self.file_of(record)) is not None:
            f.write(self.format(record) + "\n")
            f.flush()

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        super().close()

    @contextmanager
    def installed(self) -> Iterator[RoleLogs]:
        """Take the roles' records (from INFO up) for the ``with`` block."""
        root = logging.getLogger()
        level, others = root.level, list(root.handlers)

        def theirs(record: logging.LogRecord) -> bool:
            return record.levelno >= level and self.file_of(record) is None

        for h in others:
            h.addFilter(theirs)
        root.addHandler(self)
        root.setLevel(min(level, logging.INFO))
        try:
            yield self
        finally:
            root.setLevel(level)
            root.removeHandler(self)
            for h in others:
                h.removeFilter(theirs)
            self.close()
