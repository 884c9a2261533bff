"""What the Ape-X family (Ape-X, Ape-X DPG, R2D2) configures alike: n-step returns, the
prioritized replay and its fillers, the actors and their rate limit."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from qrl.runtime.config import LIVE, ClaimIdle, Config, GradientClip, Torso
from qrl.wire.keys import MAX_SHARDS


class ReplayConfig(ClaimIdle, Config):
    """What the Ape-X family shares: n-step returns, the prioritized replay and its fillers,
    the actors and their rate limit (Ape-X DQN and Ape-X DPG extend it)."""

    gamma: float = Field(0.99, gt=0, le=1, description="Discount factor.")
    n_step: int = Field(3, ge=1, le=100, description="Steps of the n-step return.")
    batch_size: int = Field(64, ge=1, le=65_536, description="Transitions per learner update.")
    learning_starts: int = Field(
        1000, ge=0, description="Transitions in the replay before the first update."
    )
    samplers: int = Field(
        1,
        ge=1,
        le=16,
        description="Sampler processes drawing batches for the learner (docs/benchmarks.md, "
        "'Learner feed').",
    )
    prefetch: int = Field(
        8,
        ge=2,
        le=256,
        description="Batches sampled ahead of the learner (its ring's slots, in shared "
        "memory). A sampler fills every slot given back in one round trip, so this bounds how "
        "many batches one round trip to Redis brings: 8 kept an Ape-X learner 5 ms from Redis "
        "at its loopback rate where 4 held it to 0.8x (docs/benchmarks.md, 'Many machines').",
    )
    publish_every: int = Field(10, ge=1, description="Updates between weight publications.")
    replay_capacity: int = Field(100_000, ge=1, description="Transitions the replay keeps.")
    replay_mode: Literal["rank", "proportional"] = Field(
        "rank", description="Prioritized sampling: rank-based or proportional."
    )
    alpha: float = Field(0.6, ge=0, le=1, description="Priority exponent.")
    beta: float = Field(0.4, ge=0, le=1, description="Importance-sampling exponent.")
    replay_shards: int = Field(
        1,
        ge=1,
        le=MAX_SHARDS,
        description="Replay shards, each with its own hash tag, stream, filler and "
        "capacity/shards (1: one unsharded replay); see docs/many-machines.md, 'Sharded replay'.",
    )
    replays: int = Field(
        1,
        ge=1,
        le=64,
        description="Replay-filling processes `qrl train` runs (at least one per shard; "
        "filler i drains shard i mod replay_shards).",
    )
    actors: int = Field(
        2, ge=1, le=4096, description="Actor processes (also sets the per-actor exploration)."
    )
    envs_per_actor: int = Field(8, ge=1, le=4096, description="Environments per actor process.")
    actor_batch: int = Field(
        256, ge=1, le=1_000_000, description="Transitions per experience-stream entry."
    )
    weight_poll: int = Field(10, ge=1, description="Vector steps between weight-version checks.")
    stream_maxlen: int = Field(
        64, ge=1, description="Experience-stream entries waiting before actors back off."
    )
    steps_per_update: float = Field(
        4.0,
        ge=0,
        description="Rate limit: actors together take at most learning_starts + this x "
        "(learner updates) env steps (0: no limit).",
    )


class QLearning(Torso, GradientClip):
    """Mixin of the Ape-X family's Q-learners (Ape-X, R2D2): the Q-network's head and input
    scaling, Adam's epsilon, the target network, the actors' per-slot epsilons."""

    dueling: bool = Field(True, description="Dueling head (value + advantage).")
    obs_scale: bool = Field(
        True,
        description="Scale vector observations to [-1, 1] by their space's finite bounds.",
    )
    adam_eps: float = Field(1e-5, gt=0, description="Adam epsilon.")
    target_update: int = Field(
        250, ge=1, description="Updates between target-network syncs.", json_schema_extra=LIVE
    )
    # live: an actor's policy sets its epsilons again (qrl.actors.dqn.EpsilonGreedy.reconfigure)
    eps_base: float = Field(
        0.4, gt=0, lt=1, description="Ape-X epsilon base.", json_schema_extra=LIVE
    )
    eps_alpha: float = Field(
        7.0, ge=0, description="Ape-X epsilon exponent spread.", json_schema_extra=LIVE
    )
