"""A simulated environment whose step costs wall time but (almost) no CPU, for scaling
measurements. With a real simulator a step's cost is the simulator's, which a cluster pays
for with more machines; what qrl must show is that its own work around the step
(inference, n-step returns, encoding, Redis) stays small enough that adding actor processes
adds throughput.

``qrl/Sleep-v0`` is registered when this module is imported, which is only when an env id
names it: every role takes ``--env qrl.rl.simenv:qrl/Sleep-v0`` (:data:`SLEEP_ENV`) and qrl
imports the module first (it is on qrl's own list of env modules, :mod:`qrl.rl.envs`); nothing
in qrl's own import path registers it. Every
step costs 1 ms of wall time, with CartPole's spaces (a ``Box(4,)``
float32 observation, ``Discrete(2)`` actions). Observations are uniform in [-1, 1]; the
reward is 1 when the action equals ``obs[0] > 0``, else 0; episodes are truncated after 200
steps. Random play scores about 100, the best policy 200.

**How the 1 ms is spent.** Each step adds 1 ms to this process's sleep debt; once the debt
reaches the *quantum* (100 ms by default) the step sleeps it off, and the time actually
slept is subtracted (oversleeping is paid back). So N steps take N ms of sleep, in one
``time.sleep`` per 100 steps. The quantum is ``$QRL_SLEEP_QUANTUM_MS`` when set (read when an
env is made, so role processes inherit it); ``QRL_SLEEP_QUANTUM_MS=0`` sleeps 1 ms in every
step.

Why not a sleep in every step: waking a process is not free, least of all on a virtual
machine, and an actor's working set is cold after every sleep. With a 1 ms sleep per step
an actor burns more CPU on waking than on acting, and 32 of them saturate both cores of the
machine qrl is developed on: a scaling measurement would measure the hypervisor. Longer
quanta cost less CPU per env step (docs/benchmarks.md, "Scaling by adding actor processes",
has the cost of a wake-up and of each quantum).

From Python: ``gymnasium.make("qrl/Sleep-v0", delay=0.01, quantum=0.0)``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import gymnasium as gym
import numpy as np

SLEEP_ENV_ID = "qrl/Sleep-v0"
SLEEP_ENV = f"qrl.rl.simenv:{SLEEP_ENV_ID}"  # the id to pass: gymnasium imports this module first
EPISODE_STEPS = 200
DEFAULT_QUANTUM = 0.1  # seconds
QUANTUM_ENV_VAR = "QRL_SLEEP_QUANTUM_MS"


class _SleepDebt:
    """The wall time this process's simulated steps still owe, paid in sleeps of at least
    ``quantum`` seconds. One per process: envs stepped one after the other share it, as they
    would share the wall clock if each slept on its own."""

    def __init__(self) -> None:
        self.owed = 0.0

    def charge(self, seconds: float, quantum: float) -> None:
        self.owed += seconds
        if self.owed >= quantum:
            t0 = time.perf_counter()
            time.sleep(self.owed)
            self.owed -= time.perf_counter() - t0  # negative after oversleeping: paid back


_DEBT = _SleepDebt()


def default_quantum() -> float:
    """``$QRL_SLEEP_QUANTUM_MS`` in seconds, else 0.1."""
    raw = os.environ.get(QUANTUM_ENV_VAR)
    if not raw:
        return DEFAULT_QUANTUM
    try:
        return float(raw) / 1000
    except ValueError as e:
        raise ValueError(f"{QUANTUM_ENV_VAR}={raw!r} is not a number of milliseconds") from e


class SleepEnv(gym.Env[np.ndarray, np.int64]):
    """A step costs ``delay`` seconds of wall time, slept off in sleeps of at least
    ``quantum`` seconds (0: a sleep in every step; default: :func:`default_quantum`), and a
    few microseconds of numpy."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, delay: float = 0.001, quantum: float | None = None) -> None:
        quantum = default_quantum() if quantum is None else quantum
        if delay < 0 or quantum < 0:
            raise ValueError(f"delay and quantum must be >= 0, not {delay}, {quantum}")
        self.delay, self.quantum = float(delay), float(quantum)
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self._obs = np.zeros(4, np.float32)

    def _draw(self) -> np.ndarray:
        self._obs = self.np_random.uniform(-1.0, 1.0, 4).astype(np.float32)
        return self._obs

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        return self._draw(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self.quantum > 0:
            _DEBT.charge(self.delay, self.quantum)
        elif self.delay > 0:
            time.sleep(self.delay)
        reward = 1.0 if int(action) == int(self._obs[0] > 0) else 0.0
        return self._draw(), reward, False, False, {}


def register_envs() -> None:
    """Register ``qrl/Sleep-v0`` with gymnasium (once; later calls do nothing)."""
    if SLEEP_ENV_ID not in gym.registry:
        gym.register(
            SLEEP_ENV_ID,
            entry_point=SleepEnv,
            kwargs={"delay": 0.001},
            max_episode_steps=EPISODE_STEPS,
            reward_threshold=195.0,
            disable_env_checker=True,
        )


register_envs()
