"""The algorithms qrl runs, and what the CLI needs to know about each: its config, its actor
and learner classes, its evaluation policy, and the processes ``qrl train`` starts."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qrl.configs import ApexConfig, ESConfig, ImpalaConfig

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


def net_policy(
    build: Callable[[Any], torch.nn.Module],
) -> Callable[[Any, dict[str, np.ndarray]], Callable[[np.ndarray], np.ndarray]]:
    """Evaluation policy for a torch network: load the parameters, act greedily."""

    def make(cfg: Any, params: dict[str, np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
        from qrl.weights import load_arrays

        net = build(cfg)
        load_arrays(net, params)
        return greedy_action(net)

    return make


def es_policy(cfg: ESConfig, params: dict[str, np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    from qrl.learners.es import policy_from_params

    return policy_from_params(cfg, params)


@dataclass(frozen=True)
class Algo:
    name: str
    config: type
    actor: str  # "module:Class"
    learner: str
    # (config, parameters) -> the policy evaluation plays: greedy, no exploration noise
    policy: Callable[[Any, dict[str, np.ndarray]], Callable[[np.ndarray], np.ndarray]]
    stream_role: str | None = None  # an extra role that drains the actors' stream
    actor_cmd: tuple[str, str] = ("actor", "")  # CLI group and command ("" = the algo's name)
    learner_cmd: tuple[str, str] = ("learner", "")
    count_field: str = "actors"  # config field holding the number of actor processes
    weights_key: str = "weights"  # RunKeys attribute where the learner publishes
    torch_learner: bool = True  # takes --device/--threads

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
        learner = [*self.learner_cmd, "--checkpoint", str(run_dir / "checkpoint.pt")]
        if self.torch_learner:
            learner += ["--device", device]
        roles.append(Role("learner", learner))
        n = getattr(cfg, self.count_field)
        roles += [Role(f"actor{i}", [*self.actor_cmd, "--id", str(i)]) for i in range(n)]
        return roles

    def __post_init__(self) -> None:
        for attr in ("actor_cmd", "learner_cmd"):
            group, cmd = getattr(self, attr)
            object.__setattr__(self, attr, (group, cmd or self.name))


ALGOS = {
    "apex": Algo(
        "apex",
        ApexConfig,
        "qrl.actors.apex:ApexActor",
        "qrl.learners.apex:ApexLearner",
        net_policy(q_policy),
        stream_role="replay",
    ),
    "impala": Algo(
        "impala",
        ImpalaConfig,
        "qrl.actors.impala:ImpalaActor",
        "qrl.learners.impala:ImpalaLearner",
        net_policy(pv_policy),
    ),
    "es": Algo(
        "es",
        ESConfig,
        "qrl.actors.es:ESWorker",
        "qrl.learners.es:ESMaster",
        es_policy,
        actor_cmd=("es", "worker"),
        learner_cmd=("es", "master"),
        count_field="workers",
        weights_key="es_params",
        torch_learner=False,
    ),
}
