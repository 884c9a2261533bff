"""Each algorithm's typed configuration. A run's config is written to Redis once
(:func:`qrl.config.create_run`) and read back by every role that joins."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ApexConfig:
    """Ape-X (Horgan et al. 2018) with double DQN, a dueling head and n-step returns.

    The defaults solve CartPole-v1 on a 2-core machine; see docs/benchmarks.md."""

    env: str = "CartPole-v1"
    seed: int = 0
    # network
    hidden: tuple[int, ...] = (256, 256)
    dueling: bool = True
    # learning
    gamma: float = 0.99
    n_step: int = 3
    lr: float = 1e-3
    adam_eps: float = 1e-5
    batch_size: int = 64
    grad_clip: float = 10.0
    target_update: int = 500  # learner updates between target-network syncs
    learning_starts: int = 1000  # transitions in the replay before the first update
    publish_every: int = 10  # learner updates between weight publications
    # replay
    replay_capacity: int = 100_000
    replay_mode: str = "rank"  # rank | proportional
    alpha: float = 0.6
    beta: float = 0.4
    # actors
    actors: int = 2  # used for the per-actor epsilon schedule
    envs_per_actor: int = 8
    eps_base: float = 0.4
    eps_alpha: float = 7.0
    actor_batch: int = 256  # transitions per experience-stream entry
    weight_poll: int = 10  # vector steps between weight-version checks
    stream_maxlen: int = 64  # experience-stream entries before actors wait
    claim_idle_ms: int = 30_000  # a dead consumer's entries are claimed after this idle time
    # rate limit: all actors together take at most learning_starts + steps_per_update x
    # (learner updates) env steps, so cheap envs cannot outrun the learner (0: no limit)
    steps_per_update: float = 4.0

    def __post_init__(self) -> None:
        if self.replay_mode not in ("rank", "proportional"):
            raise ValueError(f"replay_mode must be rank or proportional, not {self.replay_mode!r}")
        for name in ("n_step", "batch_size", "actors", "envs_per_actor", "actor_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0 < self.gamma <= 1:
            raise ValueError("gamma must be in (0, 1]")


@dataclass
class ImpalaConfig:
    """IMPALA (Espeholt et al. 2018): actors send unrolls, the learner corrects for policy
    lag with V-trace. The defaults solve CartPole-v1 on a 2-core machine."""

    env: str = "CartPole-v1"
    seed: int = 0
    hidden: tuple[int, ...] = (64, 64)
    # learning
    gamma: float = 0.99
    lr: float = 2e-3
    optimizer: str = "adam"  # adam | rmsprop
    grad_clip: float = 40.0
    rho_bar: float = 1.0
    c_bar: float = 1.0
    entropy_cost: float = 0.01
    baseline_cost: float = 0.5
    reward_scale: float = 1.0  # rewards are multiplied by this for learning (not for reports)
    batch_unrolls: int = 32  # unrolls per learner update
    publish_every: int = 1
    max_policy_lag: int = 0  # drop unrolls older than this many updates (0: keep all)
    # actors
    actors: int = 2
    envs_per_actor: int = 16  # unrolls per stream entry
    unroll: int = 20
    weight_poll: int = 1  # unrolls between weight-version checks
    stream_maxlen: int = 8  # trajectory-stream entries before actors wait
    claim_idle_ms: int = 30_000  # a dead consumer's entries are claimed after this idle time

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "rmsprop"):
            raise ValueError(f"optimizer must be adam or rmsprop, not {self.optimizer!r}")
        for name in ("batch_unrolls", "actors", "envs_per_actor", "unroll", "publish_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


@dataclass
class ESConfig:
    """Evolution Strategies (Salimans et al. 2017) with Redis as the only coordinator."""

    env: str = "CartPole-v1"
    seed: int = 0
    hidden: tuple[int, ...] = (16,)
    population: int = 48  # episodes per generation (antithetic pairs = population / 2)
    sigma: float = 0.1
    lr: float = 0.05
    l2: float = 0.005
    noise_size: int = 5_000_000  # float32 values in the shared noise table
    noise_seed: int = 7
    obs_norm: bool = True
    workers: int = 2
    envs_per_worker: int = 16  # episodes a worker runs side by side
    batch_pairs: int = 4  # antithetic pairs per results message (at least) ...
    push_interval: float = 0.01  # ... and at least this many seconds between messages
    stream_maxlen: int = 256
    claim_idle_ms: int = 30_000  # a dead consumer's entries are claimed after this idle time

    def __post_init__(self) -> None:
        if self.population < 2 or self.population % 2:
            raise ValueError("population must be an even number >= 2")
        if self.sigma <= 0 or self.noise_size < 1000:
            raise ValueError("sigma must be > 0 and noise_size >= 1000")
        for name in ("workers", "envs_per_worker", "batch_pairs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
