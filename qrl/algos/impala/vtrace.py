"""V-trace targets (Espeholt et al. 2018, section 4.1), time-major, vectorized over the batch.

With ``rho_t = pi(a_t|x_t) / mu(a_t|x_t)``, ``c_t = min(c_bar, rho_t)``, clipped
``rho'_t = min(rho_bar, rho_t)`` and ``delta_t V = rho'_t (r_t + d_t V(x_{t+1}) - V(x_t))``
where ``d_t`` is the discount (``gamma``, 0 where an episode ends at step t):

    v_s = V(x_s) + sum_{t>=s} (prod_{i=s}^{t-1} d_i c_i) delta_t V

computed backwards as ``v_s - V(x_s) = delta_s V + d_s c_s (v_{s+1} - V(x_{s+1}))``. The
policy-gradient advantage is ``rho'_s (r_s + d_s v_{s+1} - V(x_s))``.
"""

from __future__ import annotations

import torch


def vtrace(
    behaviour_logp: torch.Tensor,
    target_logp: torch.Tensor,
    rewards: torch.Tensor,
    discounts: torch.Tensor,
    values: torch.Tensor,
    bootstrap: torch.Tensor,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(vs, pg_advantages)``, both ``[T, B]``; inputs are ``[T, B]`` except
    ``bootstrap`` (``[B]``, the value of the state after the last step). No gradient flows."""
    with torch.no_grad():
        rho = torch.exp(target_logp - behaviour_logp)
        rho_c = torch.clamp(rho, max=rho_bar)
        cs = torch.clamp(rho, max=c_bar)
        values_tp1 = torch.cat([values[1:], bootstrap[None]], dim=0)
        deltas = rho_c * (rewards + discounts * values_tp1 - values)
        acc = torch.zeros_like(bootstrap)
        out = []
        for t in range(values.shape[0] - 1, -1, -1):
            acc = deltas[t] + discounts[t] * cs[t] * acc
            out.append(acc)
        vs = torch.stack(out[::-1]) + values
        vs_tp1 = torch.cat([vs[1:], bootstrap[None]], dim=0)
        pg_adv = rho_c * (rewards + discounts * vs_tp1 - values)
    return vs, pg_adv
