"""A3C's gradient sink: what a step's rewards become before the n-step returns (issue 70)."""

from __future__ import annotations

import numpy as np
import torch

from qrl.actors.a3c import GradientSink
from qrl.actors.envs import Step
from qrl.algos.a3c.config import A3CConfig
from qrl.rl.envspec import EnvSpec
from qrl.rl.models import policy_value_net


def test_termination_wins_over_truncation():
    """A step that both terminated and was truncated (gymnasium's TimeLimit sets both when an
    episode ends on its limit step) ended: no ``gamma V(final)`` is added to its reward, as
    it is to a step only truncated, and its discount is 0 like every ended step's."""
    cfg = A3CConfig(env="CartPole-v1", reward_scale=1.0)
    net = policy_value_net(cfg, EnvSpec.of(cfg.env))
    sink = GradientSink(net, None, cfg)  # the parameter server is only pushed to on flush
    obs = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    step = Step(
        next_obs=obs,
        true_next=obs + 1,
        rewards=np.ones(3, np.float32),
        terminated=np.array([False, True, True]),
        truncated=np.array([True, True, False]),
    )
    with torch.no_grad():
        logits, v = net(torch.as_tensor(obs))
    acted = (torch.log_softmax(logits, -1), v, torch.zeros(3, dtype=torch.long))
    sink.add(obs, np.zeros(3, np.int64), acted, step, version=0)
    with torch.no_grad():
        v_final = net(torch.as_tensor(obs[:1] + 1))[1]
    reward = sink.rewards[-1]
    assert torch.allclose(reward[0], 1 + cfg.gamma * v_final[0])  # only truncated: bootstrapped
    assert reward[1] == 1 and reward[2] == 1  # terminated (also truncated, or not): not
    assert sink.discounts[-1].tolist() == [0.0, 0.0, 0.0]
