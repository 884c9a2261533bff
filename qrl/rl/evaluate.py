"""Evaluation: play whole episodes with a fixed policy and report their returns."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path

import gymnasium as gym
import numpy as np

from qrl.rl.envs import make_env, spaces


def evaluate(
    env_id: str,
    policy: Callable[[np.ndarray], np.ndarray],
    episodes: int = 10,
    seed: int = 10_000,
    max_steps: int = 100_000,
    video_dir: Path | None = None,
) -> list[float]:
    """Run ``episodes`` episodes in parallel (one env each, seeds ``seed + i``) with
    ``policy`` (a batch of observations -> a batch of actions); returns their returns.
    With ``video_dir``, each episode is recorded there as ``episode-I-episode-0.mp4``
    (gymnasium's ``RecordVideo``, which needs moviepy)."""

    def make(i: int) -> gym.Env:
        if video_dir is None:
            return make_env(env_id)
        with warnings.catch_warnings():
            if i > 0:  # the folder exists because episode 0 made it
                warnings.filterwarnings("ignore", message=".*Overwriting existing videos")
            return gym.wrappers.RecordVideo(
                make_env(env_id, render_mode="rgb_array"),
                str(video_dir),
                episode_trigger=lambda n: n == 0,  # the env's first episode, the one that counts
                name_prefix=f"episode-{i}",
            )

    if video_dir is not None:
        os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # frames as arrays: no display

    envs = gym.vector.SyncVectorEnv(
        [lambda i=i: make(i) for i in range(episodes)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    try:
        obs, _ = envs.reset(seed=[seed + i for i in range(episodes)])
        returns = np.zeros(episodes)
        done = np.zeros(episodes, dtype=bool)
        for _ in range(max_steps):
            obs, reward, term, trunc, _ = envs.step(policy(obs))
            returns += np.where(done, 0.0, reward)
            done |= term | trunc
            if done.all():
                break
        return returns.tolist()
    finally:
        envs.close()


def _signature(space: gym.Space) -> str:
    """What a policy depends on: the kind, shape and dtype (and the number of actions)."""
    if isinstance(space, gym.spaces.Discrete):
        return f"Discrete({space.n})"
    return f"{type(space).__name__} of shape {space.shape}, {space.dtype}"


def check_same_spaces(trained_on: str, env_id: str) -> None:
    """Raise ``ValueError`` (one line) unless ``env_id`` has the observation and action
    spaces (kind, shape, dtype, number of actions) of ``trained_on``."""
    ours, theirs = spaces(trained_on), spaces(env_id)
    for what, a, b in zip(("observation", "action"), ours, theirs, strict=True):
        if _signature(a) != _signature(b):
            raise ValueError(
                f"{env_id} does not fit a policy trained on {trained_on}: its "
                f"{what} space is {_signature(b)}, the policy's {_signature(a)}"
            )
