"""The A3C actor-learner's parts (Mnih et al. 2016): it steps its vector envs ``unroll``
steps with the parameters it last pulled (:class:`A3CPolicy`), computes the n-step advantage
actor-critic gradient (entropy bonus, clipped norm) and pushes it to the parameter-server
shards (:class:`GradientSink`), then pulls the blocks they published since, every
``pull_every`` gradients (:class:`PSWeights`). Where a time limit cut an episode that had not
terminated, its last reward gets ``gamma V(final observation)``, as IMPALA's and PPO's do."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from qrl.actors.actor import Policy, WeightsClient
from qrl.actors.envs import Step
from qrl.algos.a3c.config import A3CConfig
from qrl.ps.client import Fetched, PSClient
from qrl.runtime.background import Background
from qrl.runtime.loop import StopCheck
from qrl.wire.weights import wait_for_weights

log = logging.getLogger(__name__)

# what the gradient needs of an action: log-softmax of its logits, the value, the action
Acted = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class A3CPolicy(Policy):
    """Actions sampled from ``net``'s softmax (the worker's own generator, seeded by
    ``cfg.seed`` and ``worker_id``), with the graph the gradient is taken through."""

    def __init__(self, net: torch.nn.Module, cfg: A3CConfig, worker_id: int) -> None:
        self.net = net
        self.gen = torch.Generator().manual_seed(cfg.seed * 10_000 + worker_id)

    def act(self, obs: np.ndarray, should_stop: StopCheck) -> tuple[np.ndarray, Acted]:
        logits, v = self.net(torch.as_tensor(obs))
        logp_all = F.log_softmax(logits, -1)
        action = torch.multinomial(logp_all.exp().detach(), 1, generator=self.gen)[:, 0]
        return action.numpy(), (logp_all, v, action)


class PSWeights:
    """The parameters from the parameter-server shards (:class:`qrl.ps.client.PSClient`),
    pulled every ``pull_every`` gradients (sent or skipped). Far from Redis a pull fetches
    on a thread of its own while the worker acts on (:class:`Background`), and what it
    brought is loaded between the next two steps after it is back; near Redis in line."""

    def __init__(self, ps: PSClient, pull_every: int) -> None:
        self.ps, self.pull_every = ps, pull_every
        self.units = 0
        self.looking = Background("pull")
        self.looked: Fetched | None = None

    @property
    def version(self) -> int:
        return self.ps.version

    def wait(self, should_stop: StopCheck) -> bool:
        return wait_for_weights(self.ps.pull, should_stop)

    def refresh(self) -> bool:
        return self.ps.pull()

    def ready(self, should_stop: StopCheck) -> bool:
        return True

    def done(self) -> None:
        self.units += 1
        self.fresh()
        if self.units % self.pull_every == 0 and not self.looking.busy:
            # in line a pull loads at once, into the vector held; off it, into a copy (no
            # job is under way, so the job runs where in_line says now)
            self.looking.submit(self.ps.pull if self.looking.in_line else self._look)

    def _look(self) -> None:
        self.looked = self.ps.fetch()

    def fresh(self) -> None:
        """Between two steps: load what a pull brought, if it is back."""
        looked, self.looked = self.looked, None
        self.ps.load(looked)

    def close(self) -> None:
        self.looking.close()

    def metrics(self) -> dict[str, Any]:
        return {"version": self.ps.version}


class GradientSink:
    """The advantage actor-critic gradient of ``cfg.unroll`` steps, pushed to the
    parameter-server shards through ``ps``: a unit is one unroll, one gradient."""

    def __init__(self, net: torch.nn.Module, ps: PSClient, cfg: A3CConfig) -> None:
        self.net, self.ps, self.cfg = net, ps, cfg
        self.gradients = self.skipped = 0
        self._begin()

    def _begin(self) -> None:
        self.logps: list[torch.Tensor] = []
        self.entropies: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.rewards: list[torch.Tensor] = []
        self.discounts: list[torch.Tensor] = []

    def reconfigure(self, cfg: A3CConfig) -> None:
        self.cfg = cfg  # its loss weights and clip are live

    def add(
        self, obs: np.ndarray, actions: np.ndarray, extra: Acted, step: Step, version: int
    ) -> bool:
        cfg, (logp_all, v, action) = self.cfg, extra
        reward = torch.as_tensor(step.rewards * cfg.reward_scale, dtype=torch.float32)
        # the value of where a time limit stopped an episode that would have gone on; one
        # that also terminated there (gymnasium's TimeLimit sets both on its last step)
        # ended: termination wins, nothing is bootstrapped
        cut = step.truncated & ~step.terminated
        if cut.any():
            with torch.no_grad():
                _, v_next = self.net(torch.as_tensor(step.true_next[cut]))
            reward[torch.from_numpy(cut)] += cfg.gamma * v_next
        self.logps.append(logp_all.gather(1, action[:, None])[:, 0])
        self.entropies.append(-(logp_all.exp() * logp_all).sum(-1))
        self.values.append(v)
        self.rewards.append(reward)
        self.discounts.append(
            cfg.gamma * torch.as_tensor(~(step.terminated | step.truncated)).float()
        )
        self.last_obs = step.next_obs
        return len(self.rewards) == cfg.unroll

    def flush(self, steps: int, weights: WeightsClient, should_stop: StopCheck) -> bool:
        """The unroll's gradient, pushed (skipped if not finite); False if stopped while a
        shard's stream was full."""
        cfg = self.cfg
        with torch.no_grad():
            ret = self.net(torch.as_tensor(self.last_obs))[1]
        returns = []
        for r, d in zip(reversed(self.rewards), reversed(self.discounts), strict=True):
            ret = r + d * ret
            returns.append(ret)
        ret_t = torch.stack(returns[::-1])
        v_t = torch.stack(self.values)
        adv = ret_t - v_t.detach()
        loss = (
            -(torch.stack(self.logps) * adv).mean()
            + cfg.value_cost * F.mse_loss(v_t, ret_t)
            - cfg.entropy_cost * torch.stack(self.entropies).mean()
        )
        self._begin()
        self.net.zero_grad(set_to_none=False)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.net.parameters(), cfg.grad_clip)
        if not (torch.isfinite(norm) and torch.isfinite(loss)):
            self.skipped += 1
            log.warning("non-finite gradient: not sent")
        elif not self.ps.push(loss.item(), should_stop):
            return False
        else:
            self.gradients += 1
        return True

    def close(self, steps: int, weights: WeightsClient, should_stop: StopCheck) -> None:
        self.ps.close()  # the push under way; an unroll not complete makes no gradient

    def metrics(self) -> dict[str, Any]:
        return {
            "gradients": self.gradients,
            "skipped": self.skipped,
            "backpressure_s": self.ps.waited_s(),
        }
