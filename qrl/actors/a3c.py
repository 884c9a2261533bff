"""The A3C actor-learner (Mnih et al. 2016): steps its vector envs ``unroll`` steps with the
parameters it last pulled, computes the n-step advantage actor-critic gradient (entropy
bonus, clipped norm) and pushes it to the parameter-server shards, then pulls the blocks
they published since (every ``pull_every`` gradients). Where a time limit cut an episode its
last reward gets ``gamma V(final observation)``, as IMPALA's and PPO's do."""

from __future__ import annotations

import logging
from typing import Any

import redis
import torch
import torch.nn.functional as F

from qrl.actors.envs import EnvActor
from qrl.algos.a3c.config import A3CConfig
from qrl.ps.client import PSClient
from qrl.rl.envspec import EnvSpec
from qrl.rl.models import policy_value_net
from qrl.runtime.loop import StopCheck
from qrl.wire.keys import RunKeys
from qrl.wire.weights import wait_for_weights

log = logging.getLogger(__name__)


class A3CWorker(EnvActor):
    name = "worker"

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        cfg: A3CConfig,
        worker_id: int = 0,
        env: EnvSpec | None = None,
    ) -> None:
        torch.set_num_threads(1)
        super().__init__(cfg, worker_id, env, cfg.envs_per_worker)
        self.net = policy_value_net(cfg, self.env)
        self.ps = PSClient(client, keys, cfg, self.net, worker_id, cfg.workers)
        self.gen = torch.Generator().manual_seed(cfg.seed * 10_000 + worker_id)
        self.gradients = self.skipped = 0

    def start(self, should_stop: StopCheck) -> bool:
        if not wait_for_weights(self.ps.pull, should_stop):
            return False
        self.obs, _ = self.envs.reset()
        return True

    def step(self, should_stop: StopCheck) -> bool:
        cfg = self.cfg
        logps, entropies, values, rewards, discounts = [], [], [], [], []
        for _ in range(cfg.unroll):
            logits, v = self.net(torch.as_tensor(self.obs))
            logp_all = F.log_softmax(logits, -1)
            action = torch.multinomial(logp_all.exp().detach(), 1, generator=self.gen)[:, 0]
            s = self.step_envs(action.numpy())
            reward = torch.as_tensor(s.rewards * cfg.reward_scale, dtype=torch.float32)
            if s.truncated.any():  # the value of where a time limit stopped the episode
                with torch.no_grad():
                    _, v_next = self.net(torch.as_tensor(s.true_next[s.truncated]))
                reward[torch.from_numpy(s.truncated)] += cfg.gamma * v_next
            logps.append(logp_all.gather(1, action[:, None])[:, 0])
            entropies.append(-(logp_all.exp() * logp_all).sum(-1))
            values.append(v)
            rewards.append(reward)
            discounts.append(cfg.gamma * torch.as_tensor(~(s.terminated | s.truncated)).float())
            self.obs = s.next_obs
        with torch.no_grad():
            ret = self.net(torch.as_tensor(self.obs))[1]
        returns = []
        for r, d in zip(reversed(rewards), reversed(discounts), strict=True):
            ret = r + d * ret
            returns.append(ret)
        ret_t = torch.stack(returns[::-1])
        v_t = torch.stack(values)
        adv = ret_t - v_t.detach()
        loss = (
            -(torch.stack(logps) * adv).mean()
            + cfg.value_cost * F.mse_loss(v_t, ret_t)
            - cfg.entropy_cost * torch.stack(entropies).mean()
        )
        self.net.zero_grad(set_to_none=False)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.net.parameters(), cfg.grad_clip)
        if not (torch.isfinite(norm) and torch.isfinite(loss)):
            self.skipped += 1
            log.warning("non-finite gradient: not sent")
        elif not self.ps.push(float(loss), should_stop):
            return False
        else:
            self.gradients += 1
        if (self.gradients + self.skipped) % cfg.pull_every == 0:
            self.ps.pull()
        return True

    def metrics(self) -> dict[str, Any]:
        return {
            **self.episodes(),
            "version": self.ps.version,
            "gradients": self.gradients,
            "skipped": self.skipped,
            "backpressure_s": self.ps.waited_s(),
        }
