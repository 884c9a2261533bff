"""A throwaway algorithm whose roles are of kinds qrl's own algorithms lack, declared only
through :class:`qrl.runtime.algorithm.RoleDef`: random ``player`` processes (an actor that
needs no weights) and one ``oracle``, a torch service with ``--device`` that is not a
learner (a stand-in for an inference server: it answers batches of requests on its device
and reports how many). ``python -m tests._random_algo ARGS`` is the ``qrl`` command line
with this algorithm in the registry; :mod:`tests.test_roles` shows that the generic code
serves it without an edit."""

from __future__ import annotations

import time
from typing import Any

from pydantic import Field

from qrl.runtime.algorithm import Algorithm, RoleDef, actor_role
from qrl.runtime.config import Config
from qrl.runtime.loop import Role, StopCheck
from qrl.runtime.roles import Access, Column, Feed, Reports

NAME = "rnd-test"
REQUESTS = Column("requests", "charts/requests", digits=None, start=0)


class RandomConfig(Config):
    players: int = Field(2, ge=1, le=64, description="Random player processes.")
    oracle_batch: int = Field(8, ge=1, le=4096, description="Requests the oracle answers at once.")


class RandomPlayer(Role):
    """Plays uniformly random actions; reports env steps and episode returns."""

    name = "player"
    counter = "steps"

    def __init__(self, cfg: RandomConfig, ident: int) -> None:
        from qrl.rl.envs import make_env

        self.env = make_env(cfg.env, seed=cfg.seed * 1000 + ident)
        self.steps, self.ret, self.returns = 0, 0.0, []

    def step(self, should_stop: StopCheck) -> bool:
        _, reward, terminated, truncated, _ = self.env.step(self.env.action_space.sample())
        self.steps += 1
        self.ret += float(reward)
        if terminated or truncated:
            self.returns.append(self.ret)
            self.ret = 0.0
            self.env.reset()
        return True

    def metrics(self) -> dict[str, Any]:
        returns, self.returns = self.returns, []
        return {"steps": self.steps, "episode_returns": returns}


class Oracle(Role):
    """A torch service on the device it is given: answers batches of requests with a tiny
    network and reports how many it answered, and whether on CUDA."""

    name = "oracle"
    counter = "requests"

    def __init__(self, cfg: RandomConfig, device: str, threads: int) -> None:
        import torch

        from qrl.learners.base import pick_device

        torch.set_num_threads(threads)
        self.device = pick_device(device)
        self.net = torch.nn.Linear(4, 2).to(self.device)
        self.batch = cfg.oracle_batch
        self.requests = 0

    def step(self, should_stop: StopCheck) -> bool:
        import torch

        with torch.no_grad():
            self.net(torch.zeros(self.batch, 4, device=self.device))
        self.requests += self.batch
        time.sleep(0.01)  # requests arrive now and then
        return True

    def metrics(self) -> dict[str, Any]:
        return {"requests": self.requests, "on_cuda": int(self.device.type == "cuda")}


def _random_policy(cfg: RandomConfig, params: dict[str, Any]) -> Any:
    raise ValueError("a random algorithm publishes no weights to evaluate")


ALGORITHM = Algorithm(
    name=NAME,
    config=RandomConfig,
    summary="Random players and an oracle (a test of roles of new kinds).",
    roles=(
        RoleDef(
            "oracle",
            ("oracle",),
            lambda ctx: Oracle(ctx.cfg, ctx.device, ctx.threads),
            "A torch service that answers requests on its device.",
            access=Access(reads=("oracle:requests",), writes=("oracle:answers",)),
            reports=Reports("requests", ("on_cuda",), (Feed(REQUESTS, "requests", "sum"),)),
            device=True,
        ),
        actor_role(
            "player",
            ("actor", NAME),
            lambda ctx: RandomPlayer(ctx.cfg, ctx.ident),
            "A player of random actions.",
            reads=(),
            writes=("oracle:requests",),
            scripts=(),
            count="players",
            shown=(),
            acts_on=None,
        ),
    ),
    policy=_random_policy,
    weights_key=lambda keys: keys.weights,  # never published
    streams=lambda keys, config: {},
    actions=frozenset({"discrete", "continuous"}),
)


if __name__ == "__main__":
    from qrl.algos import ALGOS

    ALGOS[NAME] = ALGORITHM  # before the CLI reads the registry to make its commands
    from qrl.cli import main

    main()
