"""The DQN actor of Ape-X and Gorila: batched epsilon-greedy inference with Ape-X's
per-slot epsilons (:class:`EpsilonGreedy`), and initial priorities from the actor's own
|TD error| under its copy of the Q-network (:func:`td_priorities`), on n-step transitions
to the replay shards (:mod:`qrl.actors.replay`). :func:`dqn_actor` puts the parts
together, for both algorithms' builders."""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from qrl.actors.actor import Actor, Policy
from qrl.actors.envs import EnvRunner
from qrl.actors.replay import ReplaySink, Transitions, epsilon_greedy, spread
from qrl.actors.weights import Weights, local_net
from qrl.algos.apex_family.config import ReplayConfig
from qrl.rl.models import q_network
from qrl.runtime.algorithm import RoleContext
from qrl.runtime.loop import StopCheck


def epsilons(cfg: ReplayConfig, actor_id: int) -> np.ndarray:
    """Ape-X exploration: eps_i = eps^(1 + i * alpha / (N - 1)) (:func:`spread`), from a
    config's ``eps_base`` and ``eps_alpha`` (its ``QLearning`` part: Ape-X's, Gorila's)."""
    return spread(cfg.eps_base, cfg.eps_alpha, cfg, actor_id)


class EpsilonGreedy(Policy):
    """Greedy actions of ``net``'s Q-values, each env slot's replaced by a random one with
    its epsilon (drawn from the actor's own generator, seeded by ``cfg.seed`` and
    ``actor_id``)."""

    def __init__(
        self, net: torch.nn.Module, cfg: ReplayConfig, actor_id: int, n_actions: int
    ) -> None:
        self.net, self.actor_id, self.n_actions = net, actor_id, n_actions
        self.rng = np.random.default_rng(cfg.seed * 10_000 + actor_id)
        self.reconfigure(cfg)

    def reconfigure(self, cfg: ReplayConfig) -> None:
        self.eps = epsilons(cfg, self.actor_id)

    @torch.no_grad()
    def act(self, obs: np.ndarray, should_stop: StopCheck) -> tuple[np.ndarray, None]:
        q = self.net(torch.from_numpy(np.asarray(obs)))
        return epsilon_greedy(q.argmax(dim=1).numpy(), self.eps, self.rng, self.n_actions), None


@torch.no_grad()
def td_priorities(
    net: torch.nn.Module,
    obs: np.ndarray,
    act: np.ndarray,
    ret: np.ndarray,
    disc: np.ndarray,
    nxt: np.ndarray,
) -> np.ndarray:
    """|TD error| of the n-step double-Q target under the actor's own network."""
    q = net(torch.from_numpy(obs))
    q_next = net(torch.from_numpy(nxt))
    best = q_next.max(dim=1).values.numpy()
    q_sa = q.gather(1, torch.from_numpy(act.astype(np.int64))[:, None])[:, 0].numpy()
    return np.abs(ret + disc * best - q_sa).astype(np.float32)


def dqn_actor(ctx: RoleContext) -> Actor:
    """The actor of Ape-X's and Gorila's builders: epsilon-greedy on a local Q-network,
    n-step transitions with their |TD error| to the replay shards."""
    cfg, client, keys = ctx.cfg, ctx.client, ctx.keys
    runner = EnvRunner(cfg, ctx.ident, ctx.env)
    net = local_net(q_network(cfg, runner.env))
    transitions = Transitions(cfg, runner.env, np.int32, partial(td_priorities, net))
    return Actor(
        cfg,
        runner,
        EpsilonGreedy(net, cfg, ctx.ident, runner.env.discrete_actions()),
        Weights(client, keys, net, cfg.weight_poll),
        ReplaySink(client, keys, cfg, ctx.ident, transitions),
    )
