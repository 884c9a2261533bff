"""Generalized advantage estimation (Schulman et al. 2016), time-major, over a batch of unrolls.

With ``d_t`` the discount after step t (``gamma``, 0 where an episode ends) and
``delta_t = r_t + d_t V(x_{t+1}) - V(x_t)``:

    A_t = delta_t + lambda d_t A_{t+1},    returns R_t = A_t + V(x_t)

A step where a time limit cut the episode ends it (``d_t = 0``) and its reward carries the
bootstrap ``gamma V(final observation)`` instead (the learner adds it), so no advantage
crosses from one episode into the next.
"""

from __future__ import annotations

import torch


def gae(
    rewards: torch.Tensor,
    discounts: torch.Tensor,
    values: torch.Tensor,
    bootstrap: torch.Tensor,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(advantages, returns)``, both ``[T, B]``; inputs are ``[T, B]`` except
    ``bootstrap`` (``[B]``, the value of the observation after the last step)."""
    with torch.no_grad():
        values_tp1 = torch.cat([values[1:], bootstrap[None]], dim=0)
        deltas = rewards + discounts * values_tp1 - values
        acc = torch.zeros_like(bootstrap)
        out = []
        for t in range(values.shape[0] - 1, -1, -1):
            acc = deltas[t] + lam * discounts[t] * acc
            out.append(acc)
        adv = torch.stack(out[::-1])
    return adv, adv + values
