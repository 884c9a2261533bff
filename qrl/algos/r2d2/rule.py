"""R2D2's learning rule (Kapturowski et al. 2019), shared by its learner and its actors
(which compute their sequences' initial priorities with it).

* The value rescaling ``h(x) = sign(x)(sqrt(|x| + 1) - 1) + eps x`` and its inverse: the
  network learns ``h(Q)``, so returns of any scale become numbers of order 1-10.
* n-step double-Q targets over a stored sequence: for each real step t of a sequence of
  ``steps`` real steps, ``m = min(n, steps - t)`` rewards, then (unless the episode
  terminated at the sequence's last real step and t + m reaches it) ``gamma^m`` times the
  target network's value of the online network's greedy action at step t + m, taken
  through ``h^-1``; the target is ``h`` of that.
* The loss covers the real steps after the burn-in (all real steps of a sequence that
  starts an episode: its stored state, zeros, is exact); the LSTM unrolls over the whole
  sequence from its stored state, for the online and the target network alike, with no
  gradient through the burn-in of a sequence that starts mid-episode.
* Sequence priority ``eta max|delta| + (1 - eta) mean|delta|`` over the loss's steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from qrl.algos.r2d2.config import R2D2Config
from qrl.rl.models import RecurrentQNetwork


def value_rescale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``h(x) = sign(x)(sqrt(|x| + 1) - 1) + eps x``."""
    return torch.sign(x) * (torch.sqrt(torch.abs(x) + 1) - 1) + eps * x


def value_rescale_inv(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``h^-1``: ``sign(x)(((sqrt(1 + 4 eps (|x| + 1 + eps)) - 1) / (2 eps))^2 - 1)``
    (``sign(x)((|x| + 1)^2 - 1)`` for ``eps = 0``)."""
    a = torch.abs(x)
    if eps == 0:
        return torch.sign(x) * ((a + 1) ** 2 - 1)
    root = (torch.sqrt(1 + 4 * eps * (a + 1 + eps)) - 1) / (2 * eps)
    return torch.sign(x) * (root**2 - 1)


def n_step_targets(
    reward: torch.Tensor,
    steps: torch.Tensor,
    terminal: torch.Tensor,
    boot: torch.Tensor,
    n: int,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """n-step returns plus bootstrap for every step of a batch of sequences, in value space
    (before ``h``): ``reward [B, T]``, ``steps [B]`` real steps, ``terminal [B]``, ``boot
    [B, T + 1]`` the value to bootstrap from at each observation. Returns ``(targets [B, T],
    valid [B, T])``; targets of padded steps are 0."""
    b, t = reward.shape
    idx = torch.arange(t, device=reward.device)
    valid = idx[None] < steps[:, None]
    r = torch.where(valid, reward, torch.zeros_like(reward))
    ret = torch.zeros_like(r)
    for i in range(min(n, t)):  # sum_{i < m} gamma^i r[t + i]: padded rewards are zero
        ret[:, : t - i] += gamma**i * r[:, i:]
    m = torch.minimum(torch.full_like(idx[None], n), steps[:, None] - idx[None]).clamp(min=0)
    k = idx[None] + m  # the bootstrap observation, at most steps
    ends = terminal[:, None] & (k == steps[:, None])
    disc = torch.where(ends, torch.zeros_like(r), gamma ** m.to(r.dtype))
    target = ret + disc * boot.gather(1, k)
    return torch.where(valid, target, torch.zeros_like(target)), valid


def sequence_priority(delta: torch.Tensor, mask: torch.Tensor, eta: float) -> torch.Tensor:
    """``eta max|delta| + (1 - eta) mean|delta|`` per sequence over the steps in ``mask``
    (0 for a sequence with none)."""
    d = torch.where(mask, delta.abs(), torch.zeros_like(delta))
    count = mask.sum(dim=1).clamp(min=1)
    return eta * d.max(dim=1).values + (1 - eta) * d.sum(dim=1) / count


@dataclass
class Sequences:
    """A batch of stored sequences as tensors (batch-first)."""

    obs: torch.Tensor  # [B, T + 1, *obs_shape]
    action: torch.Tensor  # [B, T] int64
    reward: torch.Tensor  # [B, T]
    steps: torch.Tensor  # [B] int64, 1..T
    terminal: torch.Tensor  # [B] bool
    first: torch.Tensor  # [B] bool
    h0: torch.Tensor  # [B, lstm]
    c0: torch.Tensor  # [B, lstm]

    @classmethod
    def of(cls, rec: np.ndarray, device: torch.device | str = "cpu") -> Sequences:
        """From the records (or an actor's batch) as a structured array or a dict of arrays;
        ``steps`` is clipped into ``1..T``."""

        def t(x: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(x)).to(device, dtype)

        length = rec["action"].shape[1]
        return cls(
            obs=t(rec["obs"]),
            action=t(rec["action"], torch.int64),
            reward=t(rec["reward"], torch.float32),
            steps=t(np.clip(rec["steps"], 1, length), torch.int64),
            terminal=t(rec["terminal"], torch.bool),
            first=t(rec["first"], torch.bool),
            h0=t(rec["h0"], torch.float32),
            c0=t(rec["c0"], torch.float32),
        )


@dataclass(frozen=True)
class Rule:
    """The settings of the learning rule."""

    n: int
    gamma: float
    burn_in: int
    rescale_eps: float
    eta: float


def online_q(net: RecurrentQNetwork, s: Sequences, burn_in: int) -> torch.Tensor:
    """Q ``[B, T + 1, A]`` over the sequences from their stored state. The burn-in of a
    sequence that starts mid-episode only warms its state up: no gradient flows through it
    (its state is detached after it, as in the paper); a sequence that starts an episode
    trains on its burn-in steps too (its stored state, zeros, is exact)."""
    if burn_in == 0:
        return net(s.obs, (s.h0, s.c0))[0]

    def unless_first(x: torch.Tensor) -> torch.Tensor:
        return torch.where(s.first.view(-1, *[1] * (x.ndim - 1)), x, x.detach())

    q_burn, (h, c) = net(s.obs[:, :burn_in], (s.h0, s.c0))
    q_rest, _ = net(s.obs[:, burn_in:], (unless_first(h), unless_first(c)))
    return torch.cat([unless_first(q_burn), q_rest], dim=1)


def sequence_td(
    net: RecurrentQNetwork, target: RecurrentQNetwork, s: Sequences, rule: Rule
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(Q of the actions taken [B, T], rescaled targets [B, T], loss mask [B, T])``: the
    online network with gradients (none through the burn-in of a sequence that starts
    mid-episode), the target without."""
    state = (s.h0, s.c0)
    q = online_q(net, s, rule.burn_in)
    with torch.no_grad():
        q_target, _ = target(s.obs, state) if target is not net else (q, None)
        best = q.detach().argmax(dim=-1, keepdim=True)  # double Q: the online argmax
        boot = value_rescale_inv(q_target.gather(-1, best)[..., 0], rule.rescale_eps)
        ret, valid = n_step_targets(s.reward, s.steps, s.terminal, boot, rule.n, rule.gamma)
        y = value_rescale(ret, rule.rescale_eps)
    q_taken = q[:, :-1].gather(-1, s.action[..., None])[..., 0]
    t = torch.arange(q_taken.shape[1], device=q.device)
    mask = valid & ((t[None] >= rule.burn_in) | s.first[:, None])
    return q_taken, y, mask


def sequence_loss(
    q: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """The IS-weighted mean over sequences of the Huber loss averaged over its masked steps."""
    per_step = F.smooth_l1_loss(q, y, reduction="none") * mask
    per_seq = per_step.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return (weight * per_seq).mean()


def rule_of(cfg: R2D2Config) -> Rule:
    """The rule of an R2D2 config."""
    return Rule(cfg.n_step, cfg.gamma, cfg.burn_in, cfg.rescale_eps, cfg.eta)


def priorities(
    net: RecurrentQNetwork, target: RecurrentQNetwork, s: Sequences, rule: Rule
) -> torch.Tensor:
    """Each sequence's priority (no gradients)."""
    with torch.no_grad():
        q, y, mask = sequence_td(net, target, s, rule)
        return sequence_priority(y - q, mask, rule.eta)


class RecurrentPolicy:
    """The greedy policy of a recurrent Q-network: a batch of observations -> actions, the
    LSTM state carried between calls. The state starts at zeros, and again after
    :meth:`reset` or when the batch size changes (a new set of episodes)."""

    def __init__(self, net: RecurrentQNetwork) -> None:
        self.net = net
        self.state: tuple[torch.Tensor, torch.Tensor] | None = None

    def reset(self) -> None:
        self.state = None

    @torch.no_grad()
    def __call__(self, obs: np.ndarray) -> np.ndarray:
        x = torch.as_tensor(np.asarray(obs))
        if self.state is not None and self.state[0].shape[0] != x.shape[0]:
            self.state = None
        q, self.state = self.net(x[:, None], self.state)
        return q[:, 0].argmax(dim=1).numpy()
