"""ACL users for a population (``qrl pbt ALGO --acl DIR``): one for its controller and one per
trial, so that a worker machine holds only the passwords of the trials it trains and can
write nothing else.

- ``NAME.controller`` writes the population's keys (its config, the solve, its control flag)
  and reads every trial's;
- ``NAME-tI.worker`` writes trial ``I``'s keys (its run's: the segment's roles run as this
  user too; its lease, score, lineage, claim: :mod:`qrl.pbt.population`) and reads the
  population's and the other trials' (to rank them and copy the better ones' state).

The reads are read-only per key (Redis 7's ``%R~``): on Redis 6 they would be writable, so
there ``--acl`` is refused. The rules are :mod:`qrl.jobs.acl`'s (:func:`setuser_args`), the
passwords its files (:func:`role_passwords`): ``DIR/controller``, ``DIR/NAME-tI``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qrl.algos import ALGOS
from qrl.jobs.acl import (
    has_selectors,
    job_scripts,
    role_passwords,
    set_user,
    setuser_args,
    user_name,
)
from qrl.pbt.config import PBTConfig
from qrl.runtime.roles import Access
from qrl.wire.connection import read_password_file, with_user
from qrl.wire.keys import RunKeys
from qrl.wire.scripts import load_scripts

CONTROLLER = "controller"
WORKER = "worker"
# the scripts of qrl's each user runs besides: a worker its trial's whole job (every role of
# its segments, qrl train's own: qrl.jobs.acl.job_scripts), its lease and the exploit (the
# better trial's weights, the explored values: qrl.pbt.exploit); the controller reads the
# trials' live config and evaluates their weights (dead-lettering a blob that fails)
WORKER_SCRIPTS = ("pbt.take", "pbt.hold", "weights.publish", "live.set")
CONTROLLER_SCRIPTS = ("live.read", "streams.dead_letter")


class AccessRefused(ValueError):
    """``--acl`` cannot be had here (one line: what to run instead)."""


def trial_user(trial: str) -> str:
    return user_name(trial, WORKER)


def create_users(client: Any, pcfg: PBTConfig, folder: Path) -> dict[str, tuple[str, Path]]:
    """Create (or reset) the controller's user and each trial's worker user, passwords in
    ``folder`` (made where missing); ``controller`` and each trial -> (user, password file).
    AccessRefused on a Redis without read-only key patterns."""
    if not has_selectors(client):
        raise AccessRefused(
            "--acl needs Redis 7 or later (read-only key patterns): on Redis 6 a worker's user "
            "could write every trial's keys; pass --redis URL of a Redis 7 server, or set "
            "QRL_REDIS_SERVER to a Redis 7 redis-server for the embedded one"
        )
    trials = pcfg.trials()
    files = role_passwords(folder, [CONTROLLER, *trials])
    population = RunKeys(pcfg.name)
    users = {CONTROLLER: (user_name(pcfg.name, CONTROLLER), files[CONTROLLER])}
    users |= {t: (trial_user(t), files[t]) for t in trials}
    worker = (*job_scripts(ALGOS[pcfg.algo]), *WORKER_SCRIPTS)
    for who, (user, path) in users.items():
        own = population if who == CONTROLLER else RunKeys(who)
        others = [k for k in (population, *map(RunKeys, trials)) if k != own]
        scripts = CONTROLLER_SCRIPTS if who == CONTROLLER else worker
        access = Access(writes=("*",), scripts=scripts)
        args = setuser_args(own, access, user, read_password_file(path), True)
        set_user(client, [*args, *(f"%R~{p}" for k in others for p in k.acl_patterns())])
    load_scripts(client)  # its users may run their scripts, not load them
    return users


def as_user(url: str, user: str, password_file: Path) -> str:
    """``url`` with ``user`` and the password in ``password_file`` instead of its own."""
    return with_user(url, user, read_password_file(password_file))


def trial_urls(url: str, name: str, folder: Path) -> dict[str, str]:
    """The trials of population ``name`` whose password files are in ``folder``, each with
    the URL that runs it as its worker's user."""
    found = sorted(p for p in folder.glob(f"{name}-t*") if p.name[len(name) + 2 :].isdigit())
    return {p.name: as_user(url, trial_user(p.name), p) for p in found}
