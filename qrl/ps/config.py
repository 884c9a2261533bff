"""The parameter server's settings, a mixin of the configs of the algorithms that share
gradients through it (A3C, Gorila). No torch here: builders import it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from qrl.runtime.config import LIVE
from qrl.wire.keys import MAX_SHARDS


class ParameterServerConfig(BaseModel):
    """Mixin: ``ps_shards`` server processes, each owning a block of the parameters."""

    ps_shards: int = Field(
        1,
        ge=1,
        le=MAX_SHARDS,
        description="Parameter-server processes, each owning one block of the parameters "
        "and its gradient stream (its own Cluster slot).",
    )
    ps_max_staleness: int = Field(
        16,
        ge=0,
        description="A gradient computed on parameters more than this many versions older "
        "than the server's is dropped (counted as stale).",
        json_schema_extra=LIVE,
    )
    ps_loss_sigmas: float = Field(
        0.0,
        ge=0,
        description="Gorila's outlier rule: a gradient whose loss is more than this many "
        "standard deviations from the running mean is dropped (0: off).",
        json_schema_extra=LIVE,
    )
    ps_max_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="The most of any 128 gradients in a row a server applies that may come "
        "from one worker while another pushes too (its others are dropped, counted as flood): "
        "one worker cannot steer the model by pushing faster. 0: 1.5 / the run's workers "
        "(1: no bound, with one worker).",
        json_schema_extra=LIVE,
    )
    ps_batch: int = Field(
        16, ge=1, le=1024, description="Gradients a server reads (and applies) per cycle."
    )
    ps_queue: int = Field(
        8,
        ge=1,
        le=4096,
        description="Gradients waiting per shard before workers back off: each worker's own "
        "stream of a shard holds its share of them (at least 1).",
    )
    ps_grad_dtype: Literal["float32", "float16"] = Field(
        "float32", description="How gradients travel (float16 halves the bytes)."
    )
    ps_publish_s: float = Field(
        0.25,
        gt=0,
        le=60,
        description="Seconds between publications of the whole network to the run's weights "
        "key (for evaluation, checkpoints and actors); each shard publishes its block every "
        "cycle.",
    )
