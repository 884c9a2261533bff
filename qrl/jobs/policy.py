"""Trained policies from checkpoints: the greedy policy a run's checkpoint holds, whatever
the algorithm (its builder says how to act with its parameters).

    import qrl
    policy = qrl.load_policy("runs/my-run")        # a run directory or a checkpoint.pt
    action = policy.predict(obs)                   # one observation -> one action
    actions = policy.predict(batch_of_obs)         # a batch -> a batch
    policy.reset()                                 # new episodes (R2D2 keeps an LSTM state)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qrl.algos import ALGOS, Algorithm
from qrl.rl.envspec import EnvSpec
from qrl.runtime.algorithm import Policy
from qrl.runtime.checkpoint import CheckpointError, load_checkpoint
from qrl.runtime.config import parse_config


@dataclass
class LoadedPolicy:
    """A trained policy: ``predict`` acts greedily; ``algo``, ``config``, ``env_id`` and
    ``env`` (its spaces) say what it is; ``step`` is the learner's update (or generation)
    it was saved at."""

    algorithm: Algorithm
    config: Any
    act: Policy  # a batch of observations -> a batch of greedy actions
    step: int
    env: EnvSpec

    @property
    def algo(self) -> str:
        return self.algorithm.name

    @property
    def env_id(self) -> str:
        return str(self.config.env)

    @property
    def observation_shape(self) -> tuple[int, ...]:
        return self.env.obs_shape

    def reset(self) -> None:
        """Start new episodes: a recurrent policy (R2D2) forgets its state; others have none."""
        reset = getattr(self.act, "reset", None)
        if reset is not None:
            reset()

    def predict(self, obs: Any, deterministic: bool = True) -> np.ndarray:
        """The action for one observation, or the actions for a batch of them (an array whose
        first axis is the batch). qrl's policies are greedy: ``deterministic=False`` is
        refused rather than silently ignored."""
        if not deterministic:
            raise ValueError("qrl policies act greedily: predict(obs, deterministic=True)")
        obs = np.asarray(obs)
        shape = self.observation_shape
        if obs.shape == shape:
            return self.act(obs[None])[0]
        if obs.shape[1:] != shape:
            raise ValueError(
                f"observation shape {obs.shape}: {self.env_id} observations are {shape} "
                f"(or a batch of them, {('N', *shape)})"
            )
        return self.act(obs)


def load_policy(path: str | Path, env_modules: Iterable[str] = ()) -> LoadedPolicy:
    """The greedy policy in a checkpoint file or a run directory (its ``checkpoint.pt``);
    raises ``CheckpointError`` (a ``ValueError``) if it cannot be used. The checkpoint's env
    id may name a module (``module:EnvId``) only if it is in ``env_modules``: what a file
    names is never imported (nor anything from the run directory) unless the caller says so."""
    from qrl.rl.envs import allow_env_modules, check_env_id

    allow_env_modules(env_modules)
    path = Path(path)
    if path.is_dir():
        path = path / "checkpoint.pt"
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    state = load_checkpoint(path)
    algo = ALGOS.get(state["algo"])
    if algo is None:
        raise CheckpointError(f"unknown algorithm {state['algo']!r} in {path}")
    cfg = parse_config(algo.config, state["config"])
    try:
        check_env_id(cfg.env)
        env = EnvSpec.of(cfg.env)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    act = algo.policy(cfg, env, {k: v.numpy() for k, v in state["model"].items()})
    return LoadedPolicy(algo, cfg, act, int(state["step"]), env)
