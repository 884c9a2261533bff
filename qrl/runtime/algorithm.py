"""What an algorithm is to qrl (the builder idea of Acme, in qrl's plain style): its config
class, the roles a job runs (how to make each and what each needs and reports), its
evaluation policy, its weights key and what ``qrl status`` shows for it. Everything else
(the CLI, ``qrl train``, the role loop, ``qrl status``, the run log, the ACL users) is
generic and asks an :class:`Algorithm`: it reads the roles' declarations, never a role's
name or kind.

A builder module imports its actor and learner classes inside its ``make`` functions, so
``qrl --help`` does not load torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import redis

from qrl.runtime.config import Config
from qrl.runtime.ids import id_limit
from qrl.runtime.roles import (
    ACTOR_COMMANDS,
    ACTOR_PROGRESS,
    LEARNER_PROGRESS,
    Access,
    Feed,
    Reports,
)
from qrl.wire.keys import RunKeys

if TYPE_CHECKING:
    import numpy as np

    from qrl.runtime.loop import Role

Policy = Callable[["np.ndarray"], "np.ndarray"]  # a batch of observations -> actions

# where a run's whole state lives, for population-based training to copy from trial to trial:
# its learner's snapshot in Redis (:mod:`qrl.runtime.snapshot`: the learner saves it with
# RoleContext.snapshot), or the published weights, whose blob carries the rest (ES: the
# master's Adam moments and statistics)
TrialState = Literal["snapshot", "weights"]


@dataclass(frozen=True)
class RoleContext:
    """What making a role needs: a connection, a way to open more (picklable, for child
    processes), the run's keys and config, the process number, the learner options and the
    spec of the run's env (a :class:`qrl.rl.envspec.EnvSpec`, read once by the launcher;
    ``None``: each role reads its own); ``snapshot``: the file of the run's snapshot, which
    the learner resumes from and saves to (:mod:`qrl.runtime.snapshot`; population-based
    training: the slot hands it in and takes it back)."""

    client: redis.Redis
    connect: Callable[[], redis.Redis]
    keys: RunKeys
    cfg: Config
    ident: int
    device: str = "auto"
    threads: int = 1
    checkpoint: Path | None = None
    env: Any = None
    snapshot: Path | None = None  # a learner keeps its whole state in this snapshot file too


# role names go in key patterns (leases, heartbeats, ACL rules) unescaped
_ROLE = re.compile(r"[a-z][a-z0-9-]*")


@dataclass(frozen=True)
class RoleDef:
    """One role of an algorithm: how to make it, and what it needs and offers. The generic
    code (the CLI, ``qrl train``, :func:`qrl.jobs.launch.run_role`, ``qrl status``, the run
    log, the ACL users) reads these fields and nothing else; :func:`actor_role` and
    :func:`learner_role` fill them for the usual two kinds of role.

    Command-line options follow from the needs: ``--id`` where ``count`` allows several
    processes, ``--max-COUNTER`` with a ``limit``, ``--checkpoint``/``--checkpoint-every``
    with ``checkpoints``, ``--run-dir`` with ``checkpoints`` or ``logs_run`` (and ``--track``
    with ``logs_run``), ``--device``/``--threads`` with ``device``."""

    name: str  # in metrics, heartbeats, leases, logs and its ACL user's name
    command: tuple[str, ...]  # the CLI command that starts it, e.g. ("actor", NAME)
    make: Callable[[RoleContext], Role]
    help: str
    access: Access  # the Redis keys it reads and writes, its commands and qrl's Lua scripts
    reports: Reports = Reports()  # what its processes report, and where that shows
    order: int = 0  # qrl train starts the roles of lower order first (ties: as listed)
    # the config field that says how many processes qrl train starts (None: one); ``least``:
    # the fewest it starts whatever that field says
    count: str | None = None
    least: Callable[[Any], int] | None = None
    # whether a config runs this role at all (None: always), e.g. only with central inference
    when: Callable[[Any], bool] | None = None
    limit: str | None = None  # what its counter counts ("env steps"): --max-COUNTER stops it
    checkpoints: bool = False  # keeps its state in a checkpoint file (one process at most)
    device: bool = False  # runs torch on a device of its choice (--device, --threads)
    nice: bool = False  # qrl train lowers its CPU priority (--actor-nice) for the others
    logs_run: bool = False  # with --run-dir, follows the run's metrics into the run dir
    # its processes form one pool (a torch.distributed group): the pool's leader writes the
    # checkpoint, and process 0 alone follows the metrics into the run dir
    group: bool = False
    # its processes can take turns as threads of one process (qrl train --one-process,
    # qrl.runtime.turns): every wait of theirs reads qrl.wire.clock, none blocks otherwise,
    # and nothing they compute depends on wall-clock time
    turns: bool = False

    def __post_init__(self) -> None:
        if not _ROLE.fullmatch(self.name):
            raise ValueError(f"role name {self.name!r} cannot go in a key pattern")
        if self.checkpoints and (self.count or self.least) and not self.group:
            raise ValueError(
                f"role {self.name!r}: a role that checkpoints runs one process, or a pool"
            )


def actor_role(
    name: str,
    command: tuple[str, ...],
    make: Callable[[RoleContext], Role],
    help: str,
    *,
    reads: tuple[str, ...],
    writes: tuple[str, ...],
    scripts: tuple[str, ...],
    count: str,
    shown: tuple[str, ...] = ("version",),
    acts_on: str | None = "version",
    mine: tuple[str, ...] = (),
    **more: Any,
) -> RoleDef:
    """A role that plays the env with the published weights (keys ``reads``) and feeds the
    learner (keys ``writes``, and ``mine``: each process its own, see
    :class:`qrl.runtime.roles.Access`; with :data:`ACTOR_COMMANDS` only, and qrl's Lua
    ``scripts``): ``count`` processes, started last, niced in ``qrl train``, stopped by
    ``--max-steps``, able to take turns in one process; it reports env steps, episode
    returns, ``shown`` and (``acts_on``) the weights version it acts with. ``more``
    overrides other fields."""
    fields: dict[str, Any] = {
        "access": Access(reads, writes, ACTOR_COMMANDS, mine, scripts),
        "reports": Reports("steps", shown, ACTOR_PROGRESS, acts_on),
        "order": 2,
        "count": count,
        "limit": "env steps",
        "nice": True,
        "turns": True,
    }
    return RoleDef(name, command, make, help, **{**fields, **more})


def learner_role(
    name: str,
    command: tuple[str, ...],
    make: Callable[[RoleContext], Role],
    help: str,
    *,
    writes: tuple[str, ...],
    scripts: tuple[str, ...],
    progress: tuple[Feed, ...] = (),
    shown: tuple[str, ...] = ("skipped",),
    **more: Any,
) -> RoleDef:
    """The one process that trains and publishes (keys ``writes``, qrl's Lua ``scripts``):
    started after the services, a torch device, a checkpoint, the run dir's metrics,
    ``--max-updates``, able to take turns in one process; it reports its updates, their rate
    and loss, ``shown`` and
    ``progress`` besides. ``more`` overrides other fields."""
    fields: dict[str, Any] = {
        "access": Access(writes=writes, scripts=scripts),
        "reports": Reports("updates", shown, LEARNER_PROGRESS + progress),
        "order": 1,
        "limit": "updates",
        "checkpoints": True,
        "device": True,
        "logs_run": True,
        "turns": True,
    }
    return RoleDef(name, command, make, help, **{**fields, **more})


def no_status(client: redis.Redis, keys: RunKeys, config: dict[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Algorithm:
    """One algorithm as the generic code sees it: its name (``qrl train NAME``), its config
    class, its roles, how evaluation acts with published parameters, where the learner
    publishes them and what ``qrl status`` shows. Its builder module defines one, and the
    registry (:data:`qrl.algos.ALGOS`) lists it."""

    name: str
    config: type[Config]
    summary: str  # the help of `qrl train NAME`
    roles: tuple[RoleDef, ...]
    # (config, env spec, published parameters) -> the greedy policy evaluation plays
    policy: Callable[[Any, Any, dict[str, np.ndarray]], Policy]
    weights_key: Callable[[RunKeys], str]  # where the learner publishes
    # what `qrl status` reports as streams, and more values it shows, from the run's keys
    # and its stored config (a dict as written: fields may be missing or wrong)
    streams: Callable[[RunKeys, dict[str, Any]], dict[str, str]]
    status: Callable[[redis.Redis, RunKeys, dict[str, Any]], dict[str, Any]] = no_status
    actions: frozenset[str] = frozenset({"discrete"})  # action spaces it handles
    pbt: TrialState | None = None  # what `qrl pbt` copies (None: it trains no population)

    def __post_init__(self) -> None:
        if len(set(self.role_names)) < len(self.roles):
            raise ValueError(f"{self.name}: two roles of one name")
        if sum(r.checkpoints for r in self.roles) > 1:
            raise ValueError(f"{self.name}: one role may checkpoint (a run dir has one file)")

    def role(self, name: str) -> RoleDef:
        for r in self.roles:
            if r.name == name:
                return r
        raise KeyError(f"{self.name} has no role {name!r} ({', '.join(self.role_names)})")

    @property
    def role_names(self) -> list[str]:
        return [r.name for r in self.roles]

    @property
    def reports(self) -> dict[str, Reports]:
        """What each role (by name) reports: what ``qrl status`` and the run log read."""
        return {r.name: r.reports for r in self.roles}

    def processes(self, cfg: Config) -> list[tuple[RoleDef, int]]:
        """The ``(role, number)`` of every process of a whole job, in start order."""
        out = []
        for r in sorted(self.roles, key=lambda r: r.order):
            if r.when is not None and not r.when(cfg):
                continue
            n = getattr(cfg, r.count) if r.count else 1
            n = max(n, r.least(cfg)) if r.least else n
            out += [(r, i) for i in range(n)]
        return out

    def count(self, role: RoleDef, cfg: Config) -> int:
        """How many processes of ``role`` a whole job of ``cfg`` runs (0: none)."""
        return sum(1 for r, _ in self.processes(cfg) if r is role)

    def numbers(self, role: RoleDef, cfg: Config) -> range:
        """The numbers a process of ``role`` may hold in a run of ``cfg``: below
        :func:`qrl.runtime.ids.id_limit` of its count, whether it claims one (``--id auto``),
        is given one (``--id N``) or joins with a user of its own (``qrl run join``)."""
        return range(id_limit(self.count(role, cfg)))

    def reporters(self, cfg: Config) -> list[tuple[str, int]]:
        """Every (role name, number) that may report in a run of ``cfg`` (:meth:`numbers`
        of each role it runs): whose metrics streams the run's readers follow."""
        return [(r.name, i) for r in self.roles if self.count(r, cfg) for i in self.numbers(r, cfg)]


def torch_policy(
    build: Callable[[Any, Any], Any],
) -> Callable[[Any, Any, dict[str, np.ndarray]], Policy]:
    """The evaluation policy of a torch network built by ``build(cfg, env)``: load the
    published parameters and act greedily (argmax of the network's first output: Q-values or
    logits)."""

    def make(cfg: Config, env: Any, params: dict[str, np.ndarray]) -> Policy:
        import numpy as np
        import torch

        from qrl.wire.weights import load_arrays

        net = build(cfg, env)
        load_arrays(net, params)

        @torch.no_grad()
        def act(obs: np.ndarray) -> np.ndarray:
            out = net(torch.as_tensor(np.asarray(obs)))
            return (out[0] if isinstance(out, tuple) else out).argmax(dim=1).numpy()

        return act

    return make
