"""A second throwaway algorithm, of another kind than qrl's own: REINFORCE on whole episodes,
built of qrl's generic parts and two of its own, all in this module (no module of ``qrl``
names it):

* its actor is the generic :class:`qrl.actors.actor.Actor` with the generic
  :class:`~qrl.actors.envs.EnvRunner` and :class:`~qrl.actors.weights.Weights`, a
  :class:`SoftmaxPolicy` of its own and its own sink, :class:`EpisodeSink`: each finished
  episode (observations, actions, returns-to-go) goes to a stream of its own as a message of
  its own kind (:func:`episode_schema`), through a bounded
  :class:`~qrl.wire.streams.StreamProducer`;
* its learner is the generic :class:`qrl.learners.base.Learner` with its own batch source,
  :class:`EpisodeSource`: a :class:`~qrl.wire.streams.StreamConsumer` in the learner's own
  process (no feed process), whose entries are acknowledged after the update that used them;
  and its own rule, :class:`ReinforceRule`: REINFORCE with the batch's mean return-to-go as
  baseline (returns-to-go normalized), publishing the weights the actors load.

``python -m tests._episode_algo ARGS`` is the ``qrl`` command line with this algorithm in the
registry; :mod:`tests.test_episode_algo` trains it."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from qrl.actors.actor import Actor, Policy, WeightsClient
from qrl.actors.envs import EnvRunner, Step
from qrl.actors.weights import Weights, local_net
from qrl.learners.base import Learner, adam, prepare
from qrl.learners.rule import Rule, Update
from qrl.rl.envspec import EnvSpec
from qrl.rl.fields import BATCH_ID, NATURAL, RETURN_BOUND, floats, obs_bytes, obs_field
from qrl.runtime.algorithm import Algorithm, RoleContext, actor_role, learner_role, torch_policy
from qrl.runtime.config import (
    ClaimIdle,
    Config,
    GradientClip,
    LearningRate,
    grad_clip_field,
    lr_field,
)
from qrl.runtime.loop import StopCheck
from qrl.runtime.roles import (
    CONSUMER_SCRIPTS,
    POLICY_LAG,
    PRODUCER_SCRIPTS,
    PUBLISHER_SCRIPTS,
    Feed,
)
from qrl.wire import schema as wire
from qrl.wire.codec import encode
from qrl.wire.keys import RunKeys
from qrl.wire.streams import Entry, StreamConsumer, StreamProducer

NAME = "episode-test"
KIND = f"{NAME}.episodes"


class EpisodeConfig(LearningRate, GradientClip, ClaimIdle, Config):
    """REINFORCE: actors push whole episodes, one learner takes ``batch_episodes`` of them
    per update."""

    actors: int = Field(2, ge=1, le=64, description="Actor processes.")
    envs_per_actor: int = Field(4, ge=1, le=64, description="Environments per actor.")
    hidden: int = Field(64, ge=1, le=4096, description="Hidden units of the policy network.")
    gamma: float = Field(0.99, gt=0, le=1, description="Discount of the returns-to-go.")
    lr: float = lr_field(1e-2)
    grad_clip: float = grad_clip_field(1.0)
    batch_episodes: int = Field(8, ge=1, le=1024, description="Episodes per update.")
    max_episode: int = Field(
        1000,
        ge=1,
        le=100_000,
        description="Steps an episode is cut at (and sent as it stands) if the env sets no "
        "time limit of its own.",
    )
    stream_maxlen: int = Field(16, ge=1, description="Messages waiting before actors back off.")
    weight_poll: int = Field(1, ge=1, description="Messages pushed between weight checks.")


def episodes_key(keys: RunKeys) -> str:
    """The actors' episode stream."""
    return keys.key("episodes")


def episode_limit(cfg: EpisodeConfig, env: EnvSpec) -> int:
    """The most steps an episode message holds: the env's time limit, else ``max_episode``."""
    return env.max_steps or cfg.max_episode


# --------------------------------------------------------------------------- the message


def episode_schema(cfg: EpisodeConfig, env: EnvSpec) -> wire.Schema:
    """Up to ``envs_per_actor`` whole episodes (one vector step can end each env's), their
    steps concatenated: observations, actions and returns-to-go ``[N]``, the length of each
    ``[E]`` (summing to N, each at most the episode limit), the oldest weights version that
    acted in them, the actor and a batch id."""
    limit, envs, n_actions = episode_limit(cfg, env), cfg.envs_per_actor, env.discrete_actions()

    def check(msg: dict[str, Any]) -> None:
        lengths, n = msg["lengths"], len(msg["obs"])
        if not 0 < len(lengths) <= envs:
            raise wire.CodecError(f"{len(lengths)} episodes, expected 1-{envs}")
        if tuple(msg["obs"].shape[1:]) != tuple(env.obs_shape):
            raise wire.CodecError(f"observations of shape {msg['obs'].shape[1:]}")
        if int(lengths.sum()) != n:
            raise wire.CodecError("the lengths do not add up to the observations")
        if len(msg["action"]) != n or len(msg["rtg"]) != n:
            raise wire.CodecError("obs, action and rtg disagree in length")

    step = obs_bytes(env.obs_shape, env.obs_dtype) + 8
    fields = {
        "obs": obs_field(env.obs_shape, env.obs_dtype, 1),
        "action": wire.Field(np.ndarray, dtypes=("int32",), ndim=1, bounds=(0, n_actions - 1)),
        "rtg": floats(1, RETURN_BOUND),
        "lengths": wire.Field(np.ndarray, dtypes=("int32",), ndim=1, bounds=(1, limit)),
        "version": NATURAL,
        "actor": NATURAL,
        "batch": BATCH_ID,
    }
    return wire.Schema(KIND, fields, check=check, max_bytes=wire.size_cap(envs * limit * step))


def returns_to_go(rewards: np.ndarray, gamma: float) -> np.ndarray:
    """``G_t = r_t + gamma G_{t+1}`` of one episode (nothing after its last step)."""
    out, g = np.empty(len(rewards), np.float32), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        g = float(rewards[t]) + gamma * g
        out[t] = g
    return out


# --------------------------------------------------------------------------- the actor's parts


def policy_net(cfg: EpisodeConfig, env: EnvSpec) -> nn.Module:
    """The policy: logits of an MLP of one hidden layer (vector observations)."""
    (width,) = env.obs_shape
    return nn.Sequential(
        nn.Linear(width, cfg.hidden), nn.Tanh(), nn.Linear(cfg.hidden, env.discrete_actions())
    )


class SoftmaxPolicy(Policy):
    """Actions sampled from the softmax of ``net``'s logits, with the actor's own generator
    (seeded by ``cfg.seed`` and its number); the sink needs nothing else of them."""

    def __init__(self, net: nn.Module, cfg: EpisodeConfig, actor_id: int) -> None:
        self.net = net
        self.gen = torch.Generator().manual_seed(cfg.seed * 10_000 + actor_id)

    @torch.no_grad()
    def act(self, obs: np.ndarray, should_stop: StopCheck) -> tuple[np.ndarray, None]:
        probs = torch.softmax(self.net(torch.from_numpy(np.asarray(obs))), dim=1)
        return torch.multinomial(probs, 1, generator=self.gen)[:, 0].numpy(), None


class EpisodeSink:
    """Records each env slot's episode; a unit is complete when one ended (or reached the
    episode limit: it is sent as it stands and the rest goes as the next episode), and
    :meth:`flush` pushes the episodes that ended as one message, with their returns-to-go,
    to the episode stream."""

    def __init__(
        self, client: redis.Redis, keys: RunKeys, cfg: EpisodeConfig, actor_id: int, env: EnvSpec
    ) -> None:
        self.cfg, self.actor_id = cfg, actor_id
        self.limit = episode_limit(cfg, env)
        self.producer = StreamProducer(
            client, episodes_key(keys), maxlen=cfg.stream_maxlen, keys=keys
        )
        # each env slot's episode so far: (observation, action, reward, weights version)
        self.steps: list[list[tuple[np.ndarray, int, float, int]]]
        self.steps = [[] for _ in range(cfg.envs_per_actor)]
        self.ended: list[list[tuple[np.ndarray, int, float, int]]] = []  # to push
        self.sent = 0

    def add(
        self, obs: np.ndarray, actions: np.ndarray, extra: None, step: Step, version: int
    ) -> bool:
        ended = step.terminated | step.truncated
        for j, steps in enumerate(self.steps):
            steps.append((obs[j], int(actions[j]), float(step.rewards[j]), version))
            if ended[j] or len(steps) == self.limit:
                self.ended.append(steps)
                self.steps[j] = []
        return bool(self.ended)

    def message(self) -> dict[str, Any]:
        """The fields of the message of the episodes that ended; its version is the oldest
        that acted in them (an episode's first step's)."""
        obs, action, rtg, lengths = [], [], [], []
        for steps in self.ended:
            o, a, r, _ = zip(*steps, strict=True)
            obs += o
            action += a
            rtg.append(returns_to_go(np.array(r), self.cfg.gamma))
            lengths.append(len(steps))
        return {
            "obs": np.stack(obs),
            "action": np.array(action, np.int32),
            "rtg": np.concatenate(rtg),
            "lengths": np.array(lengths, np.int32),
            "version": min(steps[0][3] for steps in self.ended),
            "actor": self.actor_id,
            "batch": uuid.uuid4().hex,
        }

    def flush(self, steps: int, weights: WeightsClient, should_stop: StopCheck) -> bool:
        payload = encode(KIND, self.message())
        self.ended = []
        if self.producer.add(payload, should_stop) is None:
            return False  # stopped while the stream was full
        self.sent += 1
        return True

    def close(self, steps: int, weights: WeightsClient, should_stop: StopCheck) -> None:
        """Episodes still running are not whole: nothing to push."""

    def reconfigure(self, cfg: Config) -> None:
        pass

    def metrics(self) -> dict[str, Any]:
        return {"sent": self.sent, "waited_s": self.producer.waited_s}


# --------------------------------------------------------------------------- the learner's parts


@dataclass
class EpisodeBatch:
    """The steps of the episodes of some entries, as tensors, and the entries (to
    acknowledge once the update used them)."""

    obs: torch.Tensor  # [N, ...]
    action: torch.Tensor  # [N]
    rtg: torch.Tensor  # [N]
    entries: list[Entry]


class EpisodeSource:
    """Batches of ``batch_episodes`` (or a few more: messages are not split) episodes read
    from the episode stream by a :class:`~qrl.wire.streams.StreamConsumer` in the learner's
    own process; a batch's entries are acknowledged once its update is done."""

    def __init__(
        self, ctx: RoleContext, cfg: EpisodeConfig, env: EnvSpec, device: torch.device
    ) -> None:
        self.connect, self.keys, self.cfg, self.device = ctx.connect, ctx.keys, cfg, device
        self.schema = episode_schema(cfg, env)
        self.consumer: StreamConsumer  # made as it starts
        self.held: list[Entry] = []  # read, not yet a batch
        self.transfer_s = 0.0
        self.lag: list[float] = []

    def start(self, fail: Callable[[str], None]) -> None:
        # made here, in the thread that runs the role (its name in the group is that thread's)
        self.consumer = StreamConsumer(
            self.connect(),
            self.keys,
            episodes_key(self.keys),
            self.schema,
            claim_idle_ms=self.cfg.claim_idle_ms,
        )

    def stop(self) -> None:
        self.consumer.close()

    def next(self, timeout: float, updates: int) -> EpisodeBatch | None:
        self.held += self.consumer.read(block_ms=int(timeout * 1000))
        if sum(len(e.data["lengths"]) for e in self.held) < self.cfg.batch_episodes:
            return None
        entries, self.held = self.held, []
        return self.batch(entries, updates)

    def batch(self, entries: list[Entry], updates: int) -> EpisodeBatch:
        t0 = time.monotonic()
        self.lag += [updates - e.data["version"] for e in entries]

        def cat(name: str) -> torch.Tensor:
            return torch.from_numpy(np.concatenate([e.data[name] for e in entries])).to(self.device)

        b = EpisodeBatch(cat("obs"), cat("action").long(), cat("rtg"), entries)
        self.transfer_s += time.monotonic() - t0
        return b

    def done(self, batch: EpisodeBatch, update: Update | None) -> None:
        """Used, whether or not a step was taken (the same episodes would give the same
        loss again)."""
        self.consumer.ack(batch.entries)

    def metrics(self) -> dict[str, float]:
        lag, self.lag = self.lag, []
        return {"policy_lag": float(np.mean(lag)) if lag else 0.0}


class ReinforceRule(Rule):
    """REINFORCE (Williams 1992): the log-probability of each action taken, weighted by its
    return-to-go normalized over the batch (its mean the baseline)."""

    def __init__(self, cfg: EpisodeConfig, env: EnvSpec, device: torch.device) -> None:
        self.cfg, self.net = cfg, policy_net(cfg, env).to(device)

    def optimizer(self) -> torch.optim.Optimizer:
        return adam(self.net.parameters(), lr=self.cfg.lr)

    def loss(self, part: EpisodeBatch, updates: int) -> Update:
        rtg = part.rtg
        advantage = (rtg - rtg.mean()) / (rtg.std(correction=0) + 1e-8)
        logp = F.log_softmax(self.net(part.obs), -1).gather(1, part.action[:, None])[:, 0]
        return Update(-(logp * advantage).mean())


# --------------------------------------------------------------------------- the builder


def _actor(ctx: RoleContext) -> Actor:
    cfg = ctx.cfg
    runner = EnvRunner(cfg, ctx.ident, ctx.env)
    net = local_net(policy_net(cfg, runner.env))
    return Actor(
        cfg,
        runner,
        SoftmaxPolicy(net, cfg, ctx.ident),
        Weights(ctx.client, ctx.keys, net, cfg.weight_poll),
        EpisodeSink(ctx.client, ctx.keys, cfg, ctx.ident, runner.env),
    )


def _learner(ctx: RoleContext) -> Learner:
    device, env = prepare(ctx)
    rule = ReinforceRule(ctx.cfg, env, device)
    source = EpisodeSource(ctx, ctx.cfg, env, device)
    return Learner.publishing(ctx, device, rule, source, NAME)


ALGORITHM = Algorithm(
    name=NAME,
    config=EpisodeConfig,
    summary="REINFORCE on whole episodes (a test of a sink and a batch source of new kinds).",
    roles=(
        learner_role(
            "learner",
            ("learner", NAME),
            _learner,
            "A REINFORCE learner: reads whole episodes, publishes weights.",
            writes=("episodes", "weights"),  # (it acknowledges and deletes the entries)
            scripts=(*CONSUMER_SCRIPTS, *PUBLISHER_SCRIPTS),
            progress=(Feed(POLICY_LAG, "policy_lag"),),
        ),
        actor_role(
            "actor",
            ("actor", NAME),
            _actor,
            "A REINFORCE actor: samples from the policy, pushes whole episodes.",
            reads=("weights",),
            writes=("episodes",),
            scripts=PRODUCER_SCRIPTS,
            count="actors",
            shown=("version", "sent"),
        ),
    ),
    policy=torch_policy(policy_net),
    weights_key=lambda keys: keys.weights,
    streams=lambda keys, config: {"episodes": episodes_key(keys)},
)


if __name__ == "__main__":
    from qrl.algos import ALGOS

    ALGOS[NAME] = ALGORITHM  # before the CLI reads the registry to make its commands
    from qrl.cli import main

    main()
