"""The algorithms qrl runs, and what the CLI needs to know about each: its config, its actor
and learner classes, its evaluation policy, and the processes ``qrl train`` starts."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qrl.configs import ApexConfig, ImpalaConfig

if TYPE_CHECKING:  # torch and gymnasium load only when a command runs, not for --help
    import numpy as np
    import torch


def _load(path: str) -> Any:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def q_policy(cfg: ApexConfig) -> torch.nn.Module:
    from qrl.envs import env_spec
    from qrl.models import QNetwork

    obs_shape, _, n_actions = env_spec(cfg.env)
    return QNetwork(obs_shape, n_actions, cfg.hidden, cfg.dueling)


def pv_policy(cfg: ImpalaConfig) -> torch.nn.Module:
    from qrl.envs import env_spec
    from qrl.models import PolicyValueNet

    obs_shape, _, n_actions = env_spec(cfg.env)
    return PolicyValueNet(obs_shape, n_actions, cfg.hidden)


def greedy_action(net: torch.nn.Module) -> Callable[[np.ndarray], np.ndarray]:
    """The greedy policy of a network whose (first) output ranks the actions: argmax of
    Q-values or of policy logits."""
    import numpy as np
    import torch

    @torch.no_grad()
    def act(obs: np.ndarray) -> np.ndarray:
        out = net(torch.as_tensor(np.asarray(obs)))
        return (out[0] if isinstance(out, tuple) else out).argmax(dim=1).numpy()

    return act


@dataclass(frozen=True)
class Algo:
    name: str
    config: type
    actor: str  # "module:Class"
    learner: str
    policy: Callable[[Any], torch.nn.Module]
    stream_role: str | None = None  # an extra role that drains the actors' stream

    def actor_cls(self) -> Any:
        return _load(self.actor)

    def learner_cls(self) -> Any:
        return _load(self.learner)

    def roles(self, cfg: Any, device: str, run_dir: Path, replays: int = 1) -> list[Any]:
        from qrl.train import Role

        roles = []
        if self.stream_role:
            roles += [
                Role(f"replay{i}", [self.stream_role, "--id", str(i)]) for i in range(replays)
            ]
        ckpt = str(run_dir / "checkpoint.pt")
        roles.append(
            Role("learner", ["learner", self.name, "--device", device, "--checkpoint", ckpt])
        )
        roles += [
            Role(f"actor{i}", ["actor", self.name, "--id", str(i)]) for i in range(cfg.actors)
        ]
        return roles


ALGOS = {
    "apex": Algo("apex", ApexConfig, "qrl.actors.apex:ApexActor", "qrl.learners.apex:ApexLearner",
                 q_policy, stream_role="replay"),
    "impala": Algo("impala", ImpalaConfig, "qrl.actors.impala:ImpalaActor",
                   "qrl.learners.impala:ImpalaLearner", pv_policy),
}  # fmt: skip
