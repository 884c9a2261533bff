"""The environment factory: gymnasium envs by id, Atari with the standard preprocessing, and
qrl's own tasks, registered when qrl is imported:

* ``qrl/CartPoleNoVel-v1``: CartPole-v1 with the velocities hidden (the observation is the
  cart position and the pole angle), the RL zoo's ``CartPoleNoVel-v1``. A feed-forward policy
  cannot tell which way the pole moves; a recurrent one (R2D2, ``qrl train r2d2``) can.
* ``qrl/SlowCartPole-v1``: CartPole-v1 that sleeps 1 ms in every step, a slow simulator
  (``benchmarks/slow_env.py``; evaluate on ``CartPole-v1`` with ``--eval-env``).

MinAtar's games (``MinAtar/Breakout-v1``... with ``pip install 'qrl-rl[minatar]'``) are
registered on first use, with their minimal action sets (``-v1``) and observations channels
first, ``(C, 10, 10)`` bool, as the conv nets take them. Only Freeway ends by itself (after
2500 steps); every game is cut at :data:`MINATAR_STEPS` (a truncation, not a terminal)."""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterable

import gymnasium as gym
import numpy as np

NO_VEL_ID = "qrl/CartPoleNoVel-v1"


class NoVelocity(gym.ObservationWrapper):
    """CartPole's observation without the velocities: ``[x, theta]`` of ``[x, x', theta,
    theta']``."""

    KEEP = np.array([0, 2])

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        box = env.observation_space
        assert isinstance(box, gym.spaces.Box)
        self.observation_space = gym.spaces.Box(
            box.low[self.KEEP], box.high[self.KEEP], dtype=box.dtype
        )

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return observation[self.KEEP]


def cartpole_no_vel(**kwargs: object) -> gym.Env:
    """The entry point of ``qrl/CartPoleNoVel-v1`` (``gym.make`` adds the 500-step limit)."""
    from gymnasium.envs.classic_control.cartpole import CartPoleEnv

    return NoVelocity(CartPoleEnv(**kwargs))  # type: ignore[arg-type]


class SlowStep(gym.Wrapper):
    """Sleeps ``sleep_s`` seconds in every step before stepping the env: a slow simulator."""

    def __init__(self, env: gym.Env, sleep_s: float) -> None:
        super().__init__(env)
        self.sleep_s = sleep_s

    def step(self, action: object) -> tuple:
        time.sleep(self.sleep_s)
        return self.env.step(action)


def slow_cartpole(sleep_s: float = 0.001, **kwargs: object) -> gym.Env:
    """The entry point of ``qrl/SlowCartPole-v1`` (``gym.make`` adds the 500-step limit)."""
    from gymnasium.envs.classic_control.cartpole import CartPoleEnv

    return SlowStep(CartPoleEnv(**kwargs), sleep_s)  # type: ignore[arg-type]


SLOW_ID = "qrl/SlowCartPole-v1"
for _id, _entry in ((NO_VEL_ID, "cartpole_no_vel"), (SLOW_ID, "slow_cartpole")):
    if _id not in gym.registry:
        gym.register(
            _id, entry_point=f"qrl.rl.envs:{_entry}", max_episode_steps=500, reward_threshold=475.0
        )


MINATAR = "MinAtar/"
MINATAR_STEPS = 10_000  # at MinAtar's pace a trained policy's episodes end well before it


class ChannelsFirst(gym.ObservationWrapper):
    """``(H, W, C)`` images as ``(C, H, W)``, the dtype kept."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        box = env.observation_space
        assert isinstance(box, gym.spaces.Box) and len(box.shape) == 3
        low, high = (np.moveaxis(b, -1, 0) for b in (box.low, box.high))
        self.observation_space = gym.spaces.Box(low, high, dtype=box.dtype)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(np.moveaxis(observation, -1, 0))


def _register_minatar() -> None:
    if any(name.startswith(MINATAR) for name in gym.registry):
        return
    try:
        from minatar import gym as minatar_gym
    except ImportError as e:
        raise RuntimeError("MinAtar needs `pip install 'qrl-rl[minatar]'`") from e
    minatar_gym.register_envs()


ENV_MODULES_VAR = "QRL_ENV_MODULES"
# modules this process was told to import for env ids; qrl's own simulated env (its import
# only registers qrl/Sleep-v0) is allowed as part of qrl
_allowed: set[str] = {"qrl.rl.simenv"}


class EnvModuleRefused(ValueError):
    """An env id ``module:EnvId`` whose module this process was not told to import."""


def allow_env_modules(modules: Iterable[str]) -> None:
    """Let env ids ``module:EnvId`` name these modules in this process (and in the role
    processes it starts). Only the person starting the process says which: an env id read
    from Redis, a checkpoint or a run directory is data, and data never picks code to run."""
    for module in modules:
        if not all(part.isidentifier() for part in module.split(".")):
            raise ValueError(f"{module!r} is not a module name")
        _allowed.add(module)


def allowed_env_modules() -> tuple[str, ...]:
    return tuple(sorted(_allowed))


def check_env_id(env_id: str) -> None:
    """Raise :class:`EnvModuleRefused` (one line saying how to allow it) if ``env_id`` names
    a module (``module:EnvId``) this process was not told to import; imports nothing."""
    module, sep, name = env_id.partition(":")
    if sep and ":" in name:
        raise EnvModuleRefused(f"environment {env_id!r}: one module:EnvId at most")
    if sep and module not in _allowed:
        raise EnvModuleRefused(
            f"environment {env_id!r}: qrl imports the module {module!r} only when told to by "
            f"whoever starts it: --env-module {module} (or {ENV_MODULES_VAR}={module}; in "
            f"Python, load_policy(..., env_modules=[{module!r}]))"
        )


def registered_id(env_id: str) -> str:
    """The id to look up in gymnasium's registry: ``env_id`` itself, or for ``module:EnvId``
    ``EnvId`` after importing the module, which must be allowed (:func:`check_env_id`).
    gymnasium would import any module an id names, so it only ever gets the bare id."""
    check_env_id(env_id)
    module, sep, name = env_id.partition(":")
    if not sep:
        if env_id.startswith(MINATAR):
            _register_minatar()
        return env_id
    importlib.import_module(module)
    return name


def find_spec(env_id: str) -> gym.envs.registration.EnvSpec:
    """The registration of ``env_id``, including the ``module:EnvId`` form of an allowed
    module (:func:`registered_id`); raises ``gymnasium.error.Error`` or ``ValueError``."""
    return gym.spec(registered_id(env_id))


def is_atari(env_id: str) -> bool:
    return env_id.startswith("ALE/") or "NoFrameskip" in env_id


def make_env(env_id: str, seed: int | None = None, render_mode: str | None = None) -> gym.Env:
    """One environment. Atari ids (``ALE/...``) get the standard DQN preprocessing: no-op
    starts, frame skip 4 with max-pooling, 84x84 grayscale uint8, a stack of 4 frames.
    ``render_mode`` is gymnasium's (``"rgb_array"`` to record video); it is passed only when
    given, so envs that take no ``render_mode`` argument still work."""
    extra = {} if render_mode is None else {"render_mode": render_mode}
    name = registered_id(env_id)
    if is_atari(name):
        try:
            import ale_py
        except ImportError as e:  # pragma: no cover - depends on the install
            raise RuntimeError("Atari needs `pip install 'qrl-rl[atari]'` (ale-py, opencv)") from e
        gym.register_envs(ale_py)
        env = gym.make(name, frameskip=1, repeat_action_probability=0.0, **extra)
        env = gym.wrappers.AtariPreprocessing(
            env, frame_skip=4, screen_size=84, grayscale_obs=True, noop_max=30
        )
        env = gym.wrappers.FrameStackObservation(env, 4)
    elif name.startswith(MINATAR):
        env = ChannelsFirst(gym.make(name, max_episode_steps=MINATAR_STEPS, **extra))
    else:
        try:
            env = gym.make(name, **extra)
        except gym.error.Error as e:
            raise ValueError(f"cannot make environment {env_id!r}: {e}") from e
    if seed is not None:
        env.reset(seed=seed)
        env.action_space.seed(seed)
    return env


def make_vector_env(env_id: str, num_envs: int, seed: int) -> gym.vector.VectorEnv:
    """``num_envs`` copies stepped together in this process (seeds ``seed .. seed+n-1``).
    Episodes reset in the same step they end; the last observation of an ended episode is in
    ``info["final_obs"]``."""
    envs = gym.vector.SyncVectorEnv(
        [lambda i=i: make_env(env_id) for i in range(num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    envs.reset(seed=seed)
    envs.action_space.seed(seed)
    return envs


def spaces(env_id: str) -> tuple[gym.Space, gym.Space]:
    """The env's ``(observation space, action space)`` (the env made, read and closed; roles
    get them read once, as a :class:`qrl.rl.envspec.EnvSpec`)."""
    return read_env(env_id)[:2]


def read_env(env_id: str) -> tuple[gym.Space, gym.Space, int | None]:
    """:func:`spaces` and the env's episode limit (its ``max_episode_steps``; None: none)."""
    env = make_env(env_id)
    try:
        limit = getattr(env.spec, "max_episode_steps", None)
        return env.observation_space, env.action_space, limit if isinstance(limit, int) else None
    finally:
        env.close()
