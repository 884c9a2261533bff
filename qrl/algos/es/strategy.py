"""Evolution Strategies (Salimans et al. 2017): the shared noise table, the policy as a flat
parameter vector, fitness shaping (pair differences by default, or centered ranks) and the
gradient estimate.

The policy is a small tanh MLP evaluated in numpy for many parameter vectors at once (one
per environment slot), which is what makes ES workers cheap: no torch on the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from qrl.rl.envspec import EnvSpec


class NoiseTable:
    """``size`` float32 N(0, 1) values from ``seed``: identical in every process, so a noise
    vector travels as its start index. ``get(i, dim)`` is ``table[i:i+dim]``."""

    def __init__(self, seed: int, size: int) -> None:
        self.noise = np.random.default_rng(seed).standard_normal(size, dtype=np.float32)

    def sample_index(self, rng: np.random.Generator, dim: int) -> int:
        return int(rng.integers(0, len(self.noise) - dim + 1))

    def get(self, i: int, dim: int) -> np.ndarray:
        return self.noise[i : i + dim]


def centered_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks of ``x`` (any shape) scaled to [-0.5, 0.5]; ties get distinct ranks."""
    ranks = np.empty(x.size, dtype=np.float32)
    ranks[x.ravel().argsort(kind="stable")] = np.arange(x.size, dtype=np.float32)
    if x.size > 1:
        ranks = ranks / (x.size - 1) - 0.5
    else:
        ranks[:] = 0.0
    return ranks.reshape(x.shape)


def pair_ranks(returns_pos: np.ndarray, returns_neg: np.ndarray) -> np.ndarray:
    """Each pair's weight from its own difference: ``sign(r+ - r-)`` times the rank of
    ``|r+ - r-|`` among the pairs, scaled to (0, 1]. Both halves of a pair played the same
    episode start (common random numbers), so the difference is the perturbation's effect;
    ranks over all 2n returns would mostly rank the starts where the start decides most of
    the return (Pendulum-v1: docs/benchmarks.md, "The defaults: ES") and give a
    pair of two hard starts a weight near 0."""
    diff = returns_pos - returns_neg
    ranks = np.empty(diff.size, dtype=np.float32)
    ranks[np.abs(diff).argsort(kind="stable")] = np.arange(1, diff.size + 1, dtype=np.float32)
    return np.sign(diff).astype(np.float32) * ranks / diff.size


def es_gradient(
    noise: np.ndarray,
    returns_pos: np.ndarray,
    returns_neg: np.ndarray,
    sigma: float,
    shaping: str,
) -> np.ndarray:
    """The antithetic estimate of the gradient of E[F(theta + sigma eps)],
    ``sum_i w_i eps_i / (2 n sigma)``, with ``w_i`` from centered ranks over all 2n returns
    (``ranks``: ``rank(r+_i) - rank(r-_i)``) or from the pairs' differences
    (``pair_ranks``, :func:`pair_ranks`)."""
    if shaping == "pair_ranks":
        weights = pair_ranks(returns_pos, returns_neg)
    elif shaping == "ranks":
        ranks = centered_ranks(np.stack([returns_pos, returns_neg]))
        weights = ranks[0] - ranks[1]
    else:
        raise ValueError(f"unknown fitness shaping {shaping!r}: ranks or pair_ranks")
    return (weights @ noise) / (2 * len(weights) * sigma)


@dataclass
class PolicySpec:
    """Shapes of the tanh MLP ``obs -> hidden... -> action``; discrete actions take the
    argmax, continuous ones ``tanh(out)`` scaled to the action bounds."""

    obs_dim: int
    hidden: tuple[int, ...]
    act_dim: int
    discrete: bool
    low: np.ndarray | None = None
    high: np.ndarray | None = None

    @classmethod
    def for_env(cls, env: EnvSpec, hidden: tuple[int, ...]) -> PolicySpec:
        if len(env.obs_shape) != 1:
            raise ValueError("ES supports vector observations")
        if env.action_kind == "discrete":
            return cls(env.obs_shape[0], tuple(hidden), env.n_actions, True)
        if env.action_bounds is not None and len(env.action_shape) == 1:
            low, high = env.action_bounds
            return cls(env.obs_shape[0], tuple(hidden), env.action_shape[0], False, low, high)
        raise ValueError(f"unsupported action space {env.action_space}")

    @property
    def layers(self) -> list[tuple[int, int]]:
        sizes = [self.obs_dim, *self.hidden, self.act_dim]
        return list(zip(sizes[:-1], sizes[1:], strict=True))

    @property
    def dim(self) -> int:
        return sum(i * o + o for i, o in self.layers)

    def init(self, rng: np.random.Generator) -> np.ndarray:
        """Initial parameters: scaled normal weights (1/sqrt(fan-in)), zero biases."""
        parts = []
        for i, o in self.layers:
            parts += [rng.standard_normal(i * o) / np.sqrt(i), np.zeros(o)]
        return np.concatenate(parts).astype(np.float32)

    def act(self, params: np.ndarray, obs: np.ndarray) -> np.ndarray:
        """Actions for a batch: ``params`` is ``[K, dim]`` (one vector per row of ``obs``,
        ``[K, obs_dim]``, already normalized) or ``[dim]`` shared by all rows."""
        if params.ndim == 1:
            params = np.broadcast_to(params, (len(obs), params.size))
        x = obs.astype(np.float32)
        pos = 0
        for n, (i, o) in enumerate(self.layers):
            w = params[:, pos : pos + i * o].reshape(-1, i, o)
            b = params[:, pos + i * o : pos + i * o + o]
            pos += i * o + o
            x = np.einsum("ki,kio->ko", x, w) + b
            if n < len(self.layers) - 1:
                x = np.tanh(x)
        if self.discrete:
            return x.argmax(axis=1)
        assert self.low is not None and self.high is not None
        return self.low + (np.tanh(x) + 1) * 0.5 * (self.high - self.low)


def normalize(obs: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    return np.clip((obs - mean) / std, -5.0, 5.0)


class Adam:
    """Adam on a flat vector (ascent: ``step`` adds the update)."""

    def __init__(self, dim: int, lr: float, beta1: float = 0.9, beta2: float = 0.999) -> None:
        self.lr, self.beta1, self.beta2 = lr, beta1, beta2
        self.m = np.zeros(dim, np.float32)
        self.v = np.zeros(dim, np.float32)
        self.t = 0

    def step(self, grad: np.ndarray) -> np.ndarray:
        self.t += 1
        self.m = self.beta1 * self.m + (1 - self.beta1) * grad
        self.v = self.beta2 * self.v + (1 - self.beta2) * grad * grad
        a = self.lr * np.sqrt(1 - self.beta2**self.t) / (1 - self.beta1**self.t)
        return (a * self.m / (np.sqrt(self.v) + 1e-8)).astype(np.float32)
