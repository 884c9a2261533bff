"""Evolution Strategies' configuration (Salimans et al. 2017), Redis the only coordinator."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from qrl.runtime.config import LIVE, ClaimIdle, Config, Layers, LearningRate, lr_field


class ESConfig(LearningRate, ClaimIdle, Config):
    """ES: workers evaluate antithetic perturbations -> results stream -> master."""

    hidden: Layers = Field((16,), description="Hidden layer sizes of the policy.")
    population: int = Field(
        48, ge=2, le=1_000_000, description="Episodes per generation (an even number)."
    )
    sigma: float = Field(0.1, gt=0, description="Noise standard deviation.")
    shaping: Literal["ranks", "pair_ranks"] = Field(
        "pair_ranks",
        description="Fitness shaping: centered ranks over all returns, or signed ranks of "
        "each antithetic pair's difference (its two episodes share a start).",
    )
    lr: float = lr_field(0.05, le=10)  # the master's Adam
    l2: float = Field(0.005, ge=0, description="L2 weight decay.", json_schema_extra=LIVE)
    noise_size: int = Field(
        5_000_000, ge=1000, le=2**31, description="float32 values in the shared noise table."
    )
    noise_seed: int = Field(7, ge=0, lt=2**31, description="Seed of the shared noise table.")
    obs_norm: bool = Field(True, description="Normalize observations with running statistics.")
    workers: int = Field(2, ge=1, le=4096, description="Worker processes.")
    envs_per_worker: int = Field(
        16, ge=1, le=4096, description="Episodes a worker runs side by side."
    )
    batch_pairs: int = Field(
        4, ge=1, description="Antithetic pairs per results message (at least) ..."
    )
    push_interval: float = Field(
        0.01, ge=0, description="... and at least this many seconds between messages."
    )
    stream_maxlen: int = Field(256, ge=1, description="Results-stream entries waiting.")

    @model_validator(mode="after")
    def _even_population(self) -> ESConfig:
        if self.population % 2:
            raise ValueError("population must be an even number (antithetic pairs)")
        return self
