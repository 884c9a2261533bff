"""Ape-X DPG's networks and math (TD3-style, Fujimoto et al. 2018): a deterministic actor
with a tanh head, twin critics, the n-step critic target with target policy smoothing,
Polyak averaging, and the map between the actor's [-1, 1] actions and a Box's bounds.

Networks work in normalized actions ([-1, 1] per dimension); only the env boundary sees
the Box's scale: actors and the evaluation policy :func:`scale_action` (clipped to the
bounds), the learner :func:`unscale_action` the replay's env-scale actions.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from qrl.rl.models import torso


class Actor(nn.Module):
    """Observation -> action in [-1, 1]^d."""

    def __init__(self, obs_shape: tuple[int, ...], action_dim: int, hidden: tuple[int, ...]):
        super().__init__()
        self.features, width = torso(obs_shape, hidden)
        self.mu = nn.Linear(width, action_dim)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mu(self.features(obs)))


def _q(obs_dim: int, action_dim: int, hidden: tuple[int, ...]) -> nn.Module:
    features, width = torso((obs_dim + action_dim,), hidden)
    return nn.Sequential(features, nn.Linear(width, 1))


class TwinCritic(nn.Module):
    """Two independent Q(s, a) networks (a in [-1, 1]^d)."""

    def __init__(self, obs_dim: int, action_dim: int, hidden: tuple[int, ...]):
        super().__init__()
        self.q1, self.q2 = _q(obs_dim, action_dim, hidden), _q(obs_dim, action_dim, hidden)

    def forward(self, obs: torch.Tensor, act: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([obs.float(), act], dim=1)
        return self.q1(x)[:, 0], self.q2(x)[:, 0]

    def q1_frozen(self, obs: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        """Q1 with its parameters detached: the actor's loss moves the actor only."""
        frozen = {k: v.detach() for k, v in self.q1.named_parameters()}
        x = torch.cat([obs.float(), act], dim=1)
        return functional_call(self.q1, frozen, (x,))[:, 0]


class ActorCritic(nn.Module):
    """The learner's network: ``actor`` (published to actors) and ``critic``."""

    def __init__(self, obs_shape: tuple[int, ...], action_dim: int, hidden: tuple[int, ...]):
        super().__init__()
        self.actor = Actor(obs_shape, action_dim, hidden)
        self.critic = TwinCritic(obs_shape[0], action_dim, hidden)


def policy_net(obs_shape: tuple[int, ...], action_dim: int, hidden: tuple[int, ...]) -> nn.Module:
    """What actors and evaluation hold: the actor under the name it has in
    :class:`ActorCritic` (``actor.*``), so published weights load as they are."""
    return nn.ModuleDict({"actor": Actor(obs_shape, action_dim, hidden)})


def scale_action(a: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Actions in [-1, 1] to the Box ``low..high``, clipped there (float32)."""
    out = low + (np.asarray(a, np.float32) + 1.0) * 0.5 * (high - low)
    return np.clip(out, low, high).astype(np.float32)


def unscale_action(a: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Box actions back to [-1, 1] (the inverse of :func:`scale_action` inside the bounds)."""
    return (2.0 * (a - low) / (high - low) - 1.0).clamp(-1.0, 1.0)


def explore(a: np.ndarray, sigma: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Gaussian exploration: row i of the [-1, 1] actions ``a`` plus N(0, sigma_i^2) noise,
    clipped back to [-1, 1]."""
    noise = rng.standard_normal(a.shape) * np.asarray(sigma)[:, None]
    return np.clip(a + noise, -1.0, 1.0)


@torch.no_grad()
def critic_target(
    target: ActorCritic,
    ret: torch.Tensor,
    disc: torch.Tensor,
    next_obs: torch.Tensor,
    noise: float,
    noise_clip: float,
) -> torch.Tensor:
    """The n-step TD3 target ``ret + disc * min(Q1', Q2')(s', clip(pi'(s') + eps))`` with
    ``eps ~ clip(N(0, noise^2), +-noise_clip)`` (target policy smoothing). ``disc`` is
    gamma^k, or 0 after a terminal state: a truncated episode still bootstraps."""
    a = target.actor(next_obs)
    if noise > 0:
        a = (a + (torch.randn_like(a) * noise).clamp(-noise_clip, noise_clip)).clamp(-1.0, 1.0)
    q1, q2 = target.critic(next_obs, a)
    return ret + disc * torch.min(q1, q2)


@torch.no_grad()
def polyak(target: nn.Module, source: nn.Module, tau: float) -> None:
    """``target <- (1 - tau) target + tau source``, parameter by parameter."""
    for t, s in zip(target.parameters(), source.parameters(), strict=True):
        t.lerp_(s, tau)
