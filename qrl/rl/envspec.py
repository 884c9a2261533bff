"""What roles read from an environment, read once: :class:`EnvSpec`.

The code that makes roles (``qrl.jobs.launch``, evaluation, ``load_policy``) makes the env
once, reads its spaces into an :class:`EnvSpec` and hands that to every role, network and
replay it builds; nothing else makes an env only to read its spaces. An env is code (any
installed package may register one), so what its spaces say is checked here, and an odd
space gives one clear line rather than a failure deep in a role.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import gymnasium as gym
import numpy as np

from qrl.rl.envs import read_env


def is_image(obs_shape: tuple[int, ...]) -> bool:
    """Whether observations of ``obs_shape`` are images (``C x H x W``): they get a conv
    network and, where an algorithm has them, its image defaults."""
    return len(obs_shape) == 3


def action_kind(space: object) -> str:
    """``discrete``, ``continuous`` (a Box) or the space's class name."""
    if isinstance(space, gym.spaces.Discrete):
        return "discrete"
    if isinstance(space, gym.spaces.Box):
        return "continuous"
    return type(space).__name__


@dataclass(frozen=True, eq=False)
class EnvSpec:
    """An env's observations and actions as plain data (no gymnasium objects): cheap to
    keep, pass and pickle. Bounds are read-only arrays."""

    id: str  # the env id it was read from
    obs_shape: tuple[int, ...]
    obs_dtype: str  # a numpy dtype name
    obs_bounds: tuple[np.ndarray, np.ndarray] | None  # (low, high) float64 of a Box, else None
    action_kind: str  # discrete, continuous (a Box) or the space's class name
    action_space: str  # gymnasium's description of the action space, for messages
    n_actions: int = 0  # discrete: actions 0 .. n_actions - 1
    action_shape: tuple[int, ...] = ()
    action_bounds: tuple[np.ndarray, np.ndarray] | None = None  # (low, high) float32 of a Box
    max_steps: int | None = None  # the episode limit (gymnasium's max_episode_steps), if any

    @classmethod
    def of(cls, env_id: str) -> EnvSpec:
        """Make ``env_id`` once (not stepped), read its spaces and close it; raises
        ``ValueError`` (one line) if it cannot be made or its spaces are not arrays."""
        try:
            obs, act, max_steps = read_env(env_id)
        except (gym.error.Error, ImportError, RuntimeError, ValueError) as e:
            msg = str(e).removeprefix(f"cannot make environment {env_id!r}: ")
            msg = msg.removeprefix(f"environment {env_id!r}: ")
            raise ValueError(f"environment {env_id!r}: {msg}") from None
        return cls.read(env_id, obs, act, max_steps)

    @classmethod
    def read(cls, env_id: str, obs: object, act: object, max_steps: int | None = None) -> EnvSpec:
        """The spec of an env with observation space ``obs``, action space ``act`` and
        episode limit ``max_steps``."""

        def bad(what: str, space: object, need: str) -> ValueError:
            return ValueError(f"environment {env_id!r} has {what} {space!r}: qrl needs {need}")

        obs_shape, obs_dtype = _shape(obs), _dtype(obs)
        if obs_shape is None or obs_dtype is None:
            raise bad("observations", obs, "arrays (a Box, Discrete... space)")
        obs_bounds = None
        if isinstance(obs, gym.spaces.Box) and (obs_bounds := _bounds(obs, np.float64)) is None:
            raise bad("observations", obs, "bounds of the space's shape")
        n_actions, action_bounds = 0, None
        if isinstance(act, gym.spaces.Discrete):
            n_actions = int(act.n)
            if int(act.start) != 0 or n_actions < 1:
                raise bad("actions", act, "discrete actions 0 .. n - 1")
        if isinstance(act, gym.spaces.Box) and (action_bounds := _bounds(act, np.float32)) is None:
            raise bad("actions", act, "bounds of the space's shape")
        return cls(
            id=env_id,
            obs_shape=obs_shape,
            obs_dtype=obs_dtype,
            obs_bounds=obs_bounds,
            action_kind=action_kind(act),
            action_space=str(act),
            n_actions=n_actions,
            action_shape=_shape(act) or (),
            action_bounds=action_bounds,
            max_steps=max_steps if max_steps and max_steps > 0 else None,
        )

    def discrete_actions(self) -> int:
        """The number of actions; ``ValueError`` unless they are discrete."""
        if self.action_kind != "discrete":
            raise ValueError(
                f"{self.id} has {self.action_space}, this algorithm needs discrete actions"
            )
        return self.n_actions

    def box_actions(self) -> tuple[np.ndarray, np.ndarray]:
        """The ``(low, high)`` bounds of a Box action vector with finite bounds (float32), of
        an env with vector observations; ``ValueError`` otherwise."""
        if self.action_bounds is None or len(self.action_shape) != 1:
            raise ValueError(
                f"{self.id} has {self.action_space}, this algorithm needs a Box action vector"
            )
        low, high = self.action_bounds
        if not (np.isfinite(low).all() and np.isfinite(high).all() and (low < high).all()):
            raise ValueError(f"{self.id} has action bounds {low}..{high}: need finite ones")
        if len(self.obs_shape) != 1:
            raise ValueError(f"{self.id} has observations of shape {self.obs_shape}: need a vector")
        return low, high


def _shape(space: object) -> tuple[int, ...] | None:
    """A space's shape, or ``None`` if it has none that is a tuple of sizes."""
    shape = getattr(space, "shape", None)
    if not isinstance(shape, tuple):
        return None
    if not all(isinstance(n, int | np.integer) and n >= 0 for n in shape):
        return None
    return tuple(int(n) for n in shape)


def _dtype(space: object) -> str | None:
    """A space's numpy dtype name, or ``None`` if it has none."""
    dtype = getattr(space, "dtype", None)
    if dtype is None:  # np.dtype(None) would say float64
        return None
    try:
        return np.dtype(dtype).name
    except TypeError:
        return None


def _bounds(box: gym.spaces.Box, dtype: type) -> tuple[np.ndarray, np.ndarray] | None:
    """A Box's ``(low, high)`` as read-only arrays of ``dtype``, or ``None`` if they are
    not numbers of the Box's shape."""
    try:
        low, high = np.array(box.low, dtype), np.array(box.high, dtype)
    except (TypeError, ValueError):
        return None
    if low.shape != box.shape or high.shape != box.shape:
        return None
    low.setflags(write=False)
    high.setflags(write=False)
    return low, high


def check_env(env_id: str, algo: str, actions: Iterable[str]) -> EnvSpec:
    """The spec of ``env_id`` (:meth:`EnvSpec.of`); ``ValueError`` (one line) if its actions
    are not of a kind in ``actions``."""
    env = EnvSpec.of(env_id)
    if env.action_kind not in actions:
        raise ValueError(
            f"{env_id} has {env.action_kind} actions ({env.action_space}); {algo} needs "
            f"{' or '.join(sorted(actions))} actions"
        )
    return env
