"""Networks, chosen from the observation: an MLP for vectors, a conv stack for images
(MinAtar's for small ones, the Nature DQN's for 84x84 frames)."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from torch import nn

from qrl.rl.envspec import EnvSpec, is_image

Bounds = tuple[np.ndarray, np.ndarray]  # an observation space's (low, high)


CONVS = ("auto", "minatar", "nature")
ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh}


def torso(
    obs_shape: tuple[int, ...],
    hidden: tuple[int, ...],
    bounds: Bounds | None = None,
    conv: str = "auto",
    activation: str = "relu",
) -> tuple[nn.Module, int]:
    """A feature extractor for ``obs_shape`` and its output width: for ``(C, H, W)`` images a
    conv stack (:func:`conv_torso`), for vectors an MLP of ``hidden`` layers, each followed
    by ``activation`` (a name of :data:`ACTIVATIONS`); with
    ``bounds``, vector observations are first scaled by them (:class:`ObsScale`) and images
    divided by their largest value (Atari's 255, MinAtar's 1)."""
    if is_image(obs_shape):
        return conv_torso(obs_shape, conv, _image_scale(bounds))
    if len(obs_shape) != 1:
        raise ValueError(f"observations of shape {obs_shape} are not supported (vector or CxHxW)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r}: one of {', '.join(ACTIVATIONS)}")
    layers: list[nn.Module] = []
    width = obs_shape[0]
    for h in hidden:
        layers += [nn.Linear(width, h), ACTIVATIONS[activation]()]
        width = h
    first = _Scale(1.0) if bounds is None else ObsScale(*bounds)
    return nn.Sequential(first, *layers), width


def conv_torso(obs_shape: tuple[int, ...], conv: str, scale: float) -> tuple[nn.Module, int]:
    """``conv`` ``minatar``: MinAtar's network (Young & Tian 2019: one 3x3 conv of 16
    channels, 128 units), for small images; ``nature``: the Nature DQN's (Mnih et al. 2015:
    three convs, 512 units), for 84x84 frames; ``auto``: MinAtar's below 36 pixels a side
    (the least the Nature stack takes)."""
    c, h, w = obs_shape
    if conv not in CONVS:
        raise ValueError(f"conv {conv!r}: one of {', '.join(CONVS)}")
    if conv == "minatar" or (conv == "auto" and min(h, w) < 36):
        stack, width = [nn.Conv2d(c, 16, 3, stride=1), nn.ReLU()], 128
    else:
        stack = [
            nn.Conv2d(c, 32, 8, stride=4),
            nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1),
            nn.ReLU(),
        ]
        width = 512
        if min(h, w) < 36:
            raise ValueError(f"images of {h}x{w} are too small for the Nature CNN (36x36 or more)")
    convs = nn.Sequential(*stack, nn.Flatten())
    with torch.no_grad():
        n = convs(torch.zeros(1, c, h, w)).shape[1]
    return nn.Sequential(_Scale(scale), convs, nn.Linear(n, width), nn.ReLU()), width


def _image_scale(bounds: Bounds | None) -> float:
    """1 / the largest value of an image's space (1/255 without bounds or a finite one)."""
    top = float(np.max(bounds[1])) if bounds is not None else 255.0
    return 1.0 / top if np.isfinite(top) and top > 0 else 1.0 / 255


class _Scale(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() * self.scale


class ObsScale(nn.Module):
    """Vector observations mapped to [-1, 1] by the finite bounds of their space, dimension
    by dimension; a dimension without them (or with a half-range over ``MAX_HALF_RANGE``)
    passes as it is. The scale is fixed by the env (it does not drift as the policy's
    states do) and sets the features' relative weights: CartPole's pole angle (+-0.42 rad)
    and cart position (+-4.8) differ ten-fold, and scaled, Ape-X solves CartPole-v1 in a
    fraction of the updates (docs/benchmarks.md, "The defaults: Ape-X"). The buffers
    travel with the weights."""

    MAX_HALF_RANGE = 1e4

    def __init__(self, low: np.ndarray, high: np.ndarray) -> None:
        super().__init__()
        with np.errstate(invalid="ignore", over="ignore"):  # infinite bounds
            half, mid = (high - low) / 2, (high + low) / 2
        ok = np.isfinite(half) & np.isfinite(mid) & (half > 0) & (half <= self.MAX_HALF_RANGE)
        center = np.where(ok, mid, 0.0)
        scale = 1 / np.where(ok, half, 1.0)
        self.register_buffer("center", torch.as_tensor(center, dtype=torch.float32))
        self.register_buffer("scale", torch.as_tensor(scale, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() - self.center) * self.scale


class QNetwork(nn.Module):
    """Q-values for discrete actions, with a dueling head (Wang et al. 2016) by default."""

    def __init__(
        self,
        obs_shape: tuple[int, ...],
        n_actions: int,
        hidden: tuple[int, ...] = (256, 256),
        dueling: bool = True,
        bounds: Bounds | None = None,
        conv: str = "auto",
        activation: str = "relu",
    ) -> None:
        super().__init__()
        self.features, width = torso(obs_shape, hidden, bounds, conv, activation)
        self.dueling = dueling
        self.advantage = nn.Linear(width, n_actions)
        self.value = nn.Linear(width, 1) if dueling else None

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = self.features(obs)
        a = self.advantage(x)
        if self.value is None:
            return a
        return self.value(x) + a - a.mean(dim=1, keepdim=True)


class PolicyValueNet(nn.Module):
    """Policy logits and a state value from one shared torso (IMPALA, ES)."""

    def __init__(
        self,
        obs_shape: tuple[int, ...],
        n_actions: int,
        hidden: tuple[int, ...] = (64, 64),
        bounds: Bounds | None = None,
        conv: str = "auto",
        activation: str = "relu",
    ) -> None:
        super().__init__()
        self.features, width = torso(obs_shape, hidden, bounds, conv, activation)
        self.policy = nn.Linear(width, n_actions)
        self.value = nn.Linear(width, 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.features(obs)
        return self.policy(x), self.value(x)[..., 0]


class RecurrentQNetwork(nn.Module):
    """R2D2's network: the torso, an LSTM, then Q-values with a dueling head. Inputs are
    batch-first sequences ``[B, T, *obs_shape]`` and the LSTM state ``(h, c)``, each
    ``[B, lstm]`` (zeros if ``None``); returns Q ``[B, T, A]`` and the state after the last
    step."""

    def __init__(
        self,
        obs_shape: tuple[int, ...],
        n_actions: int,
        hidden: tuple[int, ...] = (64,),
        lstm: int = 64,
        dueling: bool = True,
        bounds: Bounds | None = None,
        conv: str = "auto",
        activation: str = "relu",
    ) -> None:
        super().__init__()
        self.features, width = torso(obs_shape, hidden, bounds, conv, activation)
        self.lstm_size = lstm
        self.lstm = nn.LSTM(width, lstm, batch_first=True)
        self.advantage = nn.Linear(lstm, n_actions)
        self.value = nn.Linear(lstm, 1) if dueling else None

    def initial_state(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        zeros = torch.zeros(batch, self.lstm_size)
        return zeros, zeros.clone()

    def forward(
        self, obs: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, t = obs.shape[:2]
        x = self.features(obs.reshape(b * t, *obs.shape[2:])).reshape(b, t, -1)
        h, c = state if state is not None else self.initial_state(b)
        out, (h, c) = self.lstm(x, (h[None].to(x), c[None].to(x)))
        a = self.advantage(out)
        q = a if self.value is None else self.value(out) + a - a.mean(dim=-1, keepdim=True)
        return q, (h[0], c[0])


class NetConfig(Protocol):
    """What the builders below read of a config: its hidden layers, its conv stack and its
    activation (:class:`qrl.runtime.config.Torso`)."""

    hidden: tuple[int, ...]
    conv: str
    activation: str


class QNetConfig(NetConfig, Protocol):
    """A Q-network's config (the Ape-X family's ``QLearning``)."""

    dueling: bool
    obs_scale: bool  # vector observations scaled by the space's bounds


class RecurrentQNetConfig(QNetConfig, Protocol):
    lstm: int


def _bounds(cfg: QNetConfig, env: EnvSpec) -> Bounds | None:
    if len(env.obs_shape) != 1:
        return env.obs_bounds  # images: divided by their largest value
    return env.obs_bounds if cfg.obs_scale else None


def q_network(cfg: QNetConfig, env: EnvSpec) -> QNetwork:
    """Ape-X's Q-network for ``cfg`` on ``env`` (its learner, actors and greedy policy build
    it here)."""
    n_actions, bounds = env.discrete_actions(), _bounds(cfg, env)
    return QNetwork(
        env.obs_shape, n_actions, cfg.hidden, cfg.dueling, bounds, cfg.conv, cfg.activation
    )


def recurrent_q_network(cfg: RecurrentQNetConfig, env: EnvSpec) -> RecurrentQNetwork:
    """R2D2's LSTM Q-network for ``cfg`` on ``env`` (its learner, actors and greedy policy
    build it here)."""
    n_actions, bounds = env.discrete_actions(), _bounds(cfg, env)
    return RecurrentQNetwork(
        env.obs_shape,
        n_actions,
        cfg.hidden,
        cfg.lstm,
        cfg.dueling,
        bounds,
        cfg.conv,
        cfg.activation,
    )


def policy_value_net(cfg: NetConfig, env: EnvSpec) -> PolicyValueNet:
    """IMPALA's and PPO's policy-value network for ``cfg`` on ``env`` (their learners, actors
    and greedy policies build it here)."""
    bounds = env.obs_bounds if len(env.obs_shape) != 1 else None  # vectors unscaled: tuned so
    return PolicyValueNet(
        env.obs_shape, env.discrete_actions(), cfg.hidden, bounds, cfg.conv, cfg.activation
    )
