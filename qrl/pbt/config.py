"""A population's settings (``qrl pbt``): which algorithm on which env, how many trials, which
hyperparameters are explored over which ranges, and when a trial is ready to exploit.

An explored field is written ``FIELD=LOW..HIGH`` (uniform), ``FIELD=LOW..HIGH:log``
(log-uniform) or ``FIELD=A,B,C`` (choices). Only fields the algorithm declares live (those
``qrl run set`` may change) can be explored: a trial takes new values while it runs.
"""

from __future__ import annotations

import math
import random
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from qrl.algos import ALGOS


def pbt_algos() -> list[str]:
    """The algorithms that declare where a trial's whole state lives
    (:attr:`qrl.runtime.algorithm.Algorithm.pbt`), in the registry's order."""
    return [name for name, algo in ALGOS.items() if algo.pbt is not None]


_SPEC = re.compile(r"([a-z_][a-z0-9_]{0,63})=(.+)")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class Explore(BaseModel):
    """One explored hyperparameter."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    field: str = Field(pattern=r"^[a-z_][a-z0-9_]{0,63}$")
    kind: Literal["linear", "log", "choice"]
    low: float | None = None
    high: float | None = None
    choices: list[float] | None = Field(default=None, max_length=64)

    @model_validator(mode="after")
    def _bounds(self) -> Explore:
        if self.kind == "choice":
            if not self.choices or not all(math.isfinite(c) for c in self.choices):
                raise ValueError(f"{self.field}: choices must be finite numbers")
        elif (
            self.low is None
            or self.high is None
            or not (math.isfinite(self.low) and math.isfinite(self.high) and self.low < self.high)
        ):
            raise ValueError(f"{self.field}: a range LOW..HIGH with LOW < HIGH, both finite")
        elif self.kind == "log" and self.low <= 0:
            raise ValueError(f"{self.field}: a log range must be above 0")
        return self

    @classmethod
    def parse(cls, text: str) -> Explore:
        """``FIELD=LOW..HIGH[:log]`` or ``FIELD=A,B,...``; ValueError says what is wrong."""
        m = _SPEC.fullmatch(text.strip())
        if m is None:
            raise ValueError(f"{text!r}: expected FIELD=LOW..HIGH[:log] or FIELD=A,B,...")
        name, rest = m.groups()
        try:
            if ".." in rest:
                span, _, scale = rest.partition(":")
                low, _, high = span.partition("..")
                kind = scale or "linear"
                return cls(field=name, kind=kind, low=float(low), high=float(high))
            return cls(field=name, kind="choice", choices=[float(c) for c in rest.split(",")])
        except ValueError as e:
            raise ValueError(f"{text!r}: {e}") from None

    def warning(self) -> str | None:
        """What to tell a user whose uniform range spans more than two decades (its draws
        fall almost all in the top one: ``lr=1e-5..1e-1`` puts 99% of them above 1e-3)."""
        if self.kind != "linear" or self.low is None or self.high is None or self.low <= 0:
            return None
        if self.high / self.low <= 100:
            return None
        top = self.high / 100  # the range's top two decades begin here
        share = (self.high - top) / (self.high - self.low)
        return (
            f"{self.field}={self.low:g}..{self.high:g} draws uniformly: {share:.0%} of its "
            f"values fall above {top:g}; for every decade alike write "
            f"{self.field}={self.low:g}..{self.high:g}:log"
        )

    def sample(self, rng: random.Random) -> float:
        if self.kind == "choice":
            return rng.choice(self.choices)  # type: ignore[arg-type]
        assert self.low is not None and self.high is not None
        if self.kind == "log":
            return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        return rng.uniform(self.low, self.high)

    def perturb(self, value: float, rng: random.Random, factors: tuple[float, float]) -> float:
        """``value`` times one of ``factors``, kept in the range; a choice moves to a
        neighbouring choice."""
        if self.kind == "choice":
            assert self.choices is not None
            near = min(range(len(self.choices)), key=lambda i: abs(self.choices[i] - value))
            step = rng.choice((-1, 1))
            return self.choices[min(max(near + step, 0), len(self.choices) - 1)]
        assert self.low is not None and self.high is not None
        return min(max(value * rng.choice(factors), self.low), self.high)


Score = Literal["train", "eval"]  # what ranks trials


class PBTConfig(BaseModel):
    """A population (stored in Redis as JSON; a worker validates it before it uses it)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="The population's name: its trials are runs NAME-tI.")
    algo: str
    env: str = Field(max_length=128)
    seed: int = Field(0, ge=0, le=2**31 - 1)
    population: int = Field(4, ge=2, le=64, description="Trials.")
    explore: list[Explore] = Field(min_length=1, max_length=32)
    overrides: dict[str, Any] = Field(default_factory=dict, description="Base config (--set).")
    ready_s: float = Field(
        30.0,
        gt=0,
        le=86_400,
        description="Seconds a trial trains between two exploit/explore points (its segment).",
    )
    ready_steps: int | None = Field(
        None,
        ge=1,
        le=10**12,
        description="Env steps a segment trains (the paper's ready rule; the same on any "
        "machine); ready_s is then the most it may take.",
    )
    quantile: float = Field(
        0.25,
        gt=0,
        lt=1,
        description="Truncation selection: the bottom quantile copies the top one (past 0.5, "
        "the top 1 - quantile).",
    )
    burn_in: int = Field(
        0,
        ge=0,
        le=10_000,
        description="Segments a trial trains on its own before it may copy or be copied (Ray "
        "Tune's burn-in): a first ranking can put a policy that collapsed at once above one "
        "still learning.",
    )
    resample: float = Field(0.25, ge=0, le=1, description="Chance an explored value is redrawn.")
    perturb: tuple[float, float] = (0.8, 1.2)
    target_return: float | None = None
    score: Score = Field(
        "train",
        description="What ranks trials: their training episodes' recent mean return (the "
        "paper's choice for RL), or the greedy evaluation (eval_episodes each).",
    )
    eval_episodes: int = Field(10, ge=1, le=1000)
    confirm_episodes: int = Field(100, ge=0, le=10_000)
    lease_s: float = Field(60.0, ge=5, le=86_400, description="Past a segment: a dead worker's.")
    exploit: bool = Field(True, description="False: random search (the same trials, no copies).")

    @field_validator("algo")
    @classmethod
    def _algo(cls, v: str) -> str:
        if v not in pbt_algos():
            raise ValueError(f"{v!r}: population-based training runs {', '.join(pbt_algos())}")
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.fullmatch(v):
            raise ValueError(f"{v!r}: letters, digits, '_', '.', '-' (64 at most)")
        return v

    @model_validator(mode="after")
    def _distinct(self) -> PBTConfig:
        names = [e.field for e in self.explore]
        if len(set(names)) != len(names):
            raise ValueError(f"a field explored twice: {names}")
        if not all(math.isfinite(f) and f > 0 for f in self.perturb):
            raise ValueError(f"perturb factors {self.perturb} must be finite and > 0")
        return self

    def trials(self) -> list[str]:
        return [f"{self.name}-t{i}" for i in range(self.population)]
