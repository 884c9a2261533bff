"""What an algorithm is to qrl (the builder idea of Acme, in qrl's plain style): its config
class, the roles a job runs and how to make each, its evaluation policy, its weights key and
what ``qrl status`` shows for it. Everything else (the CLI, ``qrl train``, the role loop,
``qrl status``) is generic and asks an :class:`Algorithm`.

A builder module imports its actor and learner classes inside its ``make`` functions, so
``qrl --help`` does not load torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import redis

from qrl.runtime.config import Config
from qrl.wire.keys import RunKeys

if TYPE_CHECKING:
    import numpy as np

    from qrl.runtime.loop import Role

Policy = Callable[["np.ndarray"], "np.ndarray"]  # a batch of observations -> actions


@dataclass(frozen=True)
class RoleContext:
    """What making a role needs: a connection, a way to open more (picklable, for child
    processes), the run's keys and config, the process number, the learner options and the
    spec of the run's env (a :class:`qrl.rl.envspec.EnvSpec`, read once by the launcher;
    ``None``: each role reads its own)."""

    client: redis.Redis
    connect: Callable[[], redis.Redis]
    keys: RunKeys
    cfg: Any
    ident: int
    device: str = "auto"
    threads: int = 1
    checkpoint: Path | None = None
    env: Any = None


@dataclass(frozen=True)
class RoleDef:
    """One role of an algorithm.

    ``kind`` decides the role's command-line options: an ``actor`` takes ``--id`` and
    ``--max-steps``; a ``service`` takes ``--id``; a ``learner`` (one per run) takes the
    checkpoint options and ``--max-updates``, and ``--device``/``--threads`` if ``torch``.
    ``count`` names the config field that says how many processes ``qrl train`` starts
    (``None``: one), ``least`` the fewest it starts whatever that field says."""

    name: str  # in metrics, heartbeats and logs
    command: tuple[str, ...]  # the CLI command that starts it, e.g. ("actor", NAME)
    kind: Literal["actor", "learner", "service"]
    make: Callable[[RoleContext], Role]
    help: str
    count: str | None = None
    torch: bool = False
    least: Callable[[Any], int] | None = None


def no_status(client: redis.Redis, keys: RunKeys, config: dict[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Algorithm:
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

    def role(self, name: str) -> RoleDef:
        for r in self.roles:
            if r.name == name:
                return r
        raise KeyError(f"{self.name} has no role {name!r} ({', '.join(self.role_names)})")

    @property
    def role_names(self) -> list[str]:
        return [r.name for r in self.roles]

    def processes(self, cfg: Any) -> list[tuple[RoleDef, int]]:
        """The ``(role, number)`` of every process of a whole job, services first."""
        order = {"service": 0, "learner": 1, "actor": 2}
        out = []
        for r in sorted(self.roles, key=lambda r: order[r.kind]):
            n = getattr(cfg, r.count) if r.count else 1
            n = max(n, r.least(cfg)) if r.least else n
            out += [(r, i) for i in range(n)]
        return out


def torch_policy(
    build: Callable[[Any, Any], Any],
) -> Callable[[Any, Any, dict[str, np.ndarray]], Policy]:
    """The evaluation policy of a torch network built by ``build(cfg, env)``: load the
    published parameters and act greedily (argmax of the network's first output: Q-values or
    logits)."""

    def make(cfg: Any, env: Any, params: dict[str, np.ndarray]) -> Policy:
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
