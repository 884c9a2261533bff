"""R2D2's configuration (Kapturowski et al. 2019): the Ape-X replay, fillers and actors
(:class:`ReplayConfig`) around an LSTM Q-network trained on stored sequences with their
starting recurrent state, a burn-in prefix, n-step double-Q targets under the value
rescaling h, and sequence priorities. The defaults solve ``qrl/CartPoleNoVel-v1`` on a
2-core machine (docs/benchmarks.md, "R2D2 on the velocity-hidden CartPole")."""

from __future__ import annotations

from pydantic import Field, model_validator

from qrl.algos.apex_family.config import QLearning, ReplayConfig
from qrl.runtime.config import CentralInference, Layers, LearningRate, lr_field


class R2D2Config(LearningRate, QLearning, CentralInference, ReplayConfig):
    """R2D2: actors -> sequences -> replay fillers -> prioritized replay -> learner.

    Replay items are sequences: ``replay_capacity`` and ``batch_size`` count sequences,
    ``actor_batch`` the sequences per experience-stream entry; ``learning_starts`` and
    ``steps_per_update`` count env steps, as for Ape-X."""

    env: str = Field("qrl/CartPoleNoVel-v1", min_length=1, description="Gymnasium environment id.")
    # the network
    hidden: Layers = Field((64,), description="MLP layer sizes before the LSTM.")
    lstm: int = Field(64, ge=1, le=4096, description="LSTM cell size.")
    # sequences
    sequence_length: int = Field(
        20, ge=2, le=1000, description="Steps per stored sequence (burn-in included)."
    )
    burn_in: int = Field(
        4,
        ge=0,
        le=999,
        description="Leading steps of a sequence that only warm up the stored LSTM state (no "
        "loss or gradient there, unless the sequence starts an episode: its state is exact); "
        "at most overlap, so every step is in some sequence's loss.",
    )
    overlap: int = Field(
        10, ge=0, le=999, description="Steps a sequence shares with the next one of its episode."
    )
    # learning
    lr: float = lr_field(5e-3)
    rescale_eps: float = Field(
        1e-3,
        ge=0,
        le=1,
        description="eps of the value rescaling h(x) = sign(x)(sqrt(|x|+1)-1)+eps x.",
    )
    eta: float = Field(
        0.9, ge=0, le=1, description="Sequence priority: eta max|delta| + (1 - eta) mean|delta|."
    )
    # overrides of the shared defaults
    n_step: int = Field(3, ge=1, le=100, description="Steps of the n-step return.")
    batch_size: int = Field(64, ge=1, le=65_536, description="Sequences per learner update.")
    replay_capacity: int = Field(20_000, ge=1, description="Sequences the replay keeps.")
    actor_batch: int = Field(
        16, ge=1, le=4096, description="Sequences per experience-stream entry."
    )
    learning_starts: int = Field(
        2000,
        ge=0,
        description="Env steps before the first update (the replay then holds at least "
        "(learning_starts - actors x envs_per_actor x (sequence_length - 1)) / "
        "sequence_length sequences).",
    )
    steps_per_update: float = Field(
        16.0,
        ge=0,
        description="Rate limit: actors together take at most learning_starts + this x "
        "(learner updates) env steps (0: no limit).",
    )

    @model_validator(mode="after")
    def _sequence_fits(self) -> R2D2Config:
        if self.burn_in >= self.sequence_length:
            raise ValueError(
                f"burn_in={self.burn_in} must be below sequence_length={self.sequence_length}"
            )
        if self.overlap >= self.sequence_length:
            raise ValueError(
                f"overlap={self.overlap} must be below sequence_length={self.sequence_length}"
            )
        if self.burn_in > self.overlap:  # a sequence's burn-in steps are the previous one's
            raise ValueError(  # last ones: longer, and the steps between are in no loss
                f"burn_in={self.burn_in} must be at most overlap={self.overlap}: the steps a "
                "sequence burns in must be in the previous sequence's loss, or no loss trains on "
                "them"
            )
        return self

    @property
    def period(self) -> int:
        """Steps between the starts of consecutive sequences of one episode."""
        return self.sequence_length - self.overlap

    @property
    def start_sequences(self) -> int:
        """Sequences in the replay before the first update: as many as ``learning_starts``
        env steps surely make while the actors wait for the learner (the rate limit lets
        them take that many; each env slot may hold up to ``sequence_length - 1`` of them in
        a sequence not yet sent, and a sequence holds at most ``sequence_length``)."""
        held = self.actors * self.envs_per_actor * (self.sequence_length - 1)
        return max(1, -(-(self.learning_starts - held) // self.sequence_length))
