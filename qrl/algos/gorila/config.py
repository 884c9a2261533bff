"""Gorila's configuration (Nair et al. 2015): Ape-X's actors and prioritized replay, and
``learners`` processes that each sample the replay, compute double-DQN gradients and push
them to the parameter-server shards, which apply them with Adam as they come, dropping stale
ones and (Gorila's rule) those whose loss is far off the running mean. The defaults solve
CartPole-v1 on a 2-core machine (docs/benchmarks.md, "The defaults: A3C and Gorila")."""

from __future__ import annotations

from pydantic import Field

from qrl.algos.apex_family.config import QLearning, ReplayConfig
from qrl.ps.config import ParameterServerConfig
from qrl.runtime.config import LIVE, Layers, LearningRate, lr_field


class GorilaConfig(LearningRate, QLearning, ReplayConfig, ParameterServerConfig):
    """Gorila: actors -> replay -> learners -> gradient streams -> parameter server."""

    hidden: Layers = Field((256, 256), description="Hidden layer sizes of the Q-network.")
    lr: float = lr_field(5e-3, description="The servers' Adam learning rate.")
    learners: int = Field(
        2, ge=1, le=256, description="Learner processes, each pushing its gradients."
    )
    pull_every: int = Field(
        1, ge=1, le=10_000, description="Gradients a learner pushes between parameter pulls."
    )
    ps_loss_sigmas: float = Field(
        5.0,
        ge=0,
        description="Gorila's outlier rule: a gradient whose loss is more than this many "
        "standard deviations from the running mean is dropped (0: off).",
        json_schema_extra=LIVE,
    )
