"""The one actor role, composed of parts with one job each that the algorithm's builder
(``qrl/algos/NAME/builder.py``, its ``_actor``) passes in:

* the **env runner** (:class:`qrl.actors.envs.EnvRunner`): the vector envs and the episode
  statistics;
* the **policy** (:class:`Policy`): actions for the observations, from a local network
  (``qrl/actors/NAME.py``) or an inference server (:mod:`qrl.inference.stepper`);
* the **weights client** (:class:`WeightsClient`): the version the policy acts with, kept
  fresh (:class:`qrl.actors.weights.Weights`; A3C's pulls from the parameter server);
* the **sink** (:class:`Sink`): what the steps gave, on its way out (replay items to the
  replay shards, :mod:`qrl.actors.replay`; unrolls to a stream, :mod:`qrl.actors.unrolls`;
  A3C's gradients to the parameter server).

A step of the role is one *unit* of the sink's: the policy acts, the runner steps, the sink
takes what happened until it says the unit is complete (a vector step for replay items, T
steps for an unroll); it then pushes what is ready and the weights client counts the unit
(checking for new weights every ``weight_poll`` units). This module imports no torch: the
steppers of central inference run it without."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from qrl.actors.envs import EnvRunner, Step
from qrl.runtime.config import Config
from qrl.runtime.loop import Role, StopCheck


class Policy(Protocol):
    """A policy subclasses this for its no-op defaults, or just has the methods."""

    def act(self, obs: np.ndarray, should_stop: StopCheck) -> tuple[np.ndarray, Any] | None:
        """The actions for ``obs`` and what the sink needs of how they were chosen (logits,
        values, the recurrent state; ``None`` if nothing); ``None`` if stopped first."""
        ...

    def observe(self, step: Step) -> None:
        """What the actions gave (a recurrent policy's state starts again where an episode
        ended; a stepper's next request carries it). Nothing by default."""

    def reconfigure(self, cfg: Config) -> None:
        """A live config change came: set the exploration (epsilons, noise) again. Nothing
        by default."""

    def metrics(self) -> dict[str, Any]:
        """Its values in the role's report (none by default)."""
        return {}


class WeightsClient(Protocol):
    version: int  # of the weights the policy acts with

    def wait(self, should_stop: StopCheck) -> bool:
        """Block until the first weights came; False if stopped first."""

    def refresh(self) -> bool:
        """Load newer weights if there are any; whether it did."""

    def ready(self, should_stop: StopCheck) -> bool:
        """Before each unit: wait until the actor may act on (PPO's pacing); False if
        stopped first."""

    def done(self) -> None:
        """A unit was pushed: refresh when one is due."""

    def fresh(self) -> None:
        """Between two steps: load weights fetched meanwhile, if any (at once: the next
        step acts with them)."""

    def close(self) -> None:
        """The actor ends: stop what it started (a look for weights under way)."""

    def metrics(self) -> dict[str, Any]:
        """Its values in the role's report (the version)."""


class Sink(Protocol):
    def add(
        self, obs: np.ndarray, actions: np.ndarray, extra: Any, step: Step, version: int
    ) -> bool:
        """Take one vector step: ``actions`` taken in ``obs`` with weights ``version`` gave
        ``step``; ``extra``, what the policy said of them. True when a unit is complete."""

    def flush(self, steps: int, weights: WeightsClient, should_stop: StopCheck) -> bool:
        """After a unit: push what is ready (the actor's env ``steps`` so far); False if
        stopped while waiting."""

    def close(self, steps: int, weights: WeightsClient, should_stop: StopCheck) -> None:
        """Push what is left before the actor ends."""

    def reconfigure(self, cfg: Config) -> None:
        """A live config change came (A3C's loss weights)."""

    def metrics(self) -> dict[str, Any]:
        """Its values in the role's report (backpressure, throttling)."""


class NoWeights:
    """A policy that needs no weights of its own (a stepper's server holds them)."""

    version = -1

    def wait(self, should_stop: StopCheck) -> bool:
        return True

    def refresh(self) -> bool:
        return False

    def ready(self, should_stop: StopCheck) -> bool:
        return True

    def done(self) -> None:
        pass

    def fresh(self) -> None:
        pass

    def close(self) -> None:
        pass

    def metrics(self) -> dict[str, Any]:
        return {}


class NoSink:
    """Steps that go nowhere from the actor (a stepper's server assembles them); a unit is
    one vector step."""

    def add(
        self, obs: np.ndarray, actions: np.ndarray, extra: Any, step: Step, version: int
    ) -> bool:
        return True

    def flush(self, steps: int, weights: WeightsClient, should_stop: StopCheck) -> bool:
        return True

    def close(self, steps: int, weights: WeightsClient, should_stop: StopCheck) -> None:
        pass

    def reconfigure(self, cfg: Config) -> None:
        pass

    def metrics(self) -> dict[str, Any]:
        return {}


class Actor(Role):
    """An actor of ``cfg`` made of its parts (module docstring); ``name``: its role's name
    in metrics and heartbeats (``actor``, ``stepper``, A3C's ``worker``). No weights client
    or no sink: :class:`NoWeights`, :class:`NoSink`."""

    counter = "steps"

    def __init__(
        self,
        cfg: Config,
        runner: EnvRunner,
        policy: Policy,
        weights: WeightsClient | None = None,
        sink: Sink | None = None,
        name: str = "actor",
    ) -> None:
        self.cfg, self.name = cfg, name
        self.runner, self.policy = runner, policy
        self.weights: WeightsClient = NoWeights() if weights is None else weights
        self.sink: Sink = NoSink() if sink is None else sink

    @property
    def steps(self) -> int:
        return self.runner.steps

    def start(self, should_stop: StopCheck) -> bool:
        if not self.weights.wait(should_stop):
            return False
        self.runner.reset()
        return True

    def step(self, should_stop: StopCheck) -> bool:
        """One unit of the sink's (a vector step, an unroll), pushed."""
        if not (self.weights.ready(should_stop) and self.unit(should_stop)):
            return False
        if not self.sink.flush(self.runner.steps, self.weights, should_stop):
            return False
        self.weights.done()
        return True

    def unit(self, should_stop: StopCheck) -> bool:
        """Act and step until the sink holds a complete unit; False if stopped first."""
        runner, policy, sink, weights = self.runner, self.policy, self.sink, self.weights
        while True:
            weights.fresh()
            obs = runner.obs
            acted = policy.act(obs, should_stop)
            if acted is None:
                return False
            actions, extra = acted
            step = runner.step(actions)
            policy.observe(step)
            if sink.add(obs, actions, extra, step, weights.version):
                return True

    def reconfigure(self, cfg: Config) -> None:
        super().reconfigure(cfg)
        self.policy.reconfigure(cfg)
        self.sink.reconfigure(cfg)

    def close(self, should_stop: StopCheck) -> None:
        try:
            self.sink.close(self.runner.steps, self.weights, should_stop)
        finally:
            self.weights.close()

    def metrics(self) -> dict[str, Any]:
        """Env steps, the episodes finished since the last report, and each part's values."""
        return {
            **self.runner.episodes(),
            **self.weights.metrics(),
            **self.policy.metrics(),
            **self.sink.metrics(),
        }
