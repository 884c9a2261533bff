"""ACL users for a population (``qrl pbt ALGO --acl DIR``), every one made by the controller as
it sets the population up (with the admin's connection) and deleted as the population ends:

- ``NAME.controller`` writes the population's keys (its config, the solve, its control flag)
  and reads every trial's;
- ``NAME-tI.worker``, trial ``I``'s user, what a slot training the trial runs as: it writes
  the trial's keys (its run's; its lease, score, lineage, claim, snapshot:
  :mod:`qrl.pbt.population`) and reads the population's and the other trials' (to rank them
  and copy the better ones' state);
- the users of trial ``I``'s segment's processes, as ``qrl train --acl`` has them
  (:func:`qrl.jobs.acl.process_user`: ``NAME-tI.actor.N`` for each actor, ...): each reaches
  its role's keys of trial ``I`` only, so a taken actor can neither post the trial's score,
  lineage, claim or snapshot (only the slot writes those) nor touch another trial.

Why the controller makes the role users rather than the slot: Redis cannot limit ``ACL
SETUSER`` to some user names, and a user that may run it may give itself (or anyone) every
right; so no slot has any ACL right. A role user's password is derived from its trial's
(:func:`role_password`): a slot on another machine, given only its trial's password file,
runs each role as its own user (:func:`role_urls`), and a role, given only its own password,
learns neither its trial's nor another role's.

The reads are read-only per key (Redis 7's ``%R~``): on Redis 6 they would be writable, so
there ``--acl`` is refused. The rules are :mod:`qrl.jobs.acl`'s (:func:`setuser_args`), the
passwords its files (:func:`role_passwords`): ``DIR/controller``, ``DIR/NAME-tI``.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from typing import Any

from redis.connection import parse_url

from qrl.algos import ALGOS, Algorithm
from qrl.jobs.acl import (
    delete_users,
    job_scripts,
    process_user,
    require_selectors,
    role_passwords,
    set_user,
    setuser_args,
    user_name,
)
from qrl.pbt.config import PBTConfig
from qrl.pbt.exploit import initial_config
from qrl.runtime.config import Config
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
WORKER_SCRIPTS = ("pbt.take", "pbt.hold", "chunks.publish", "live.set")
CONTROLLER_SCRIPTS = ("live.read", "streams.dead_letter")


def trial_user(trial: str) -> str:
    return user_name(trial, WORKER)


def role_password(trial_password: str, user: str) -> str:
    """The password of ``user``, a process of a trial whose user's password is
    ``trial_password``: an HMAC of the name, which tells nothing of the key it was made with."""
    return hmac.new(trial_password.encode(), user.encode(), hashlib.sha256).hexdigest()


def _processes(
    trial: str, algo: Algorithm, cfg: Config
) -> dict[tuple[str, int], tuple[str, Access]]:
    """Each process of a segment of ``trial`` run with ``cfg``: (role, number) -> its user
    and what it may do."""
    return {(r.name, i): process_user(trial, r, i) for r, i in algo.processes(cfg)}


def create_users(client: Any, pcfg: PBTConfig, folder: Path) -> dict[str, tuple[str, Path]]:
    """Create (or reset) the controller's user, each trial's user and the users of each
    trial's processes, passwords in ``folder`` (made where missing); ``controller`` and each
    trial -> (user, password file). AclRefused on a Redis without read-only key patterns."""
    require_selectors(client)
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
    algo = ALGOS[pcfg.algo]
    for i, trial in enumerate(trials):
        secret = read_password_file(files[trial])
        for user, access in _processes(trial, algo, initial_config(pcfg, i)).values():
            password = role_password(secret, user)
            set_user(client, setuser_args(RunKeys(trial), access, user, password, True))
    load_scripts(client)  # its users may run their scripts, not load them
    return users


def delete_population_users(client: Any, pcfg: PBTConfig) -> None:
    """Delete every user :func:`create_users` made for ``pcfg`` (on every node)."""
    algo = ALGOS[pcfg.algo]
    names = [user_name(pcfg.name, CONTROLLER)]
    for i, trial in enumerate(pcfg.trials()):
        processes = _processes(trial, algo, initial_config(pcfg, i))
        names += [trial_user(trial), *(user for user, _ in processes.values())]
    delete_users(client, names)


def role_urls(
    trial_url: str, trial: str, algo: Algorithm, cfg: Config
) -> dict[tuple[str, int], str]:
    """Each process of a segment of ``trial`` with ``cfg`` -> the URL that runs it as its own
    user, from ``trial_url`` (the trial's user's, with its password: :func:`as_user`)."""
    secret = parse_url(trial_url)["password"]
    return {
        process: with_user(trial_url, user, role_password(secret, user))
        for process, (user, _) in _processes(trial, algo, cfg).items()
    }


def as_user(url: str, user: str, password_file: Path) -> str:
    """``url`` with ``user`` and the password in ``password_file`` instead of its own."""
    return with_user(url, user, read_password_file(password_file))


def trial_urls(url: str, name: str, folder: Path) -> dict[str, str]:
    """The trials of population ``name`` whose password files are in ``folder``, each with
    the URL that runs it as its worker's user."""
    found = sorted(p for p in folder.glob(f"{name}-t*") if p.name[len(name) + 2 :].isdigit())
    return {p.name: as_user(url, trial_user(p.name), p) for p in found}
