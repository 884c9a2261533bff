"""What a role declares besides how to make it: what its processes report (the run's progress
columns, what ``qrl status`` shows) and the Redis keys and commands it needs (its ACL user).

The generic code reads these declarations and nothing else of a role: ``qrl status``
(:mod:`qrl.runtime.status`), the run log (:mod:`qrl.runtime.runlog`: ``metrics.csv``,
TensorBoard, ``qrl train``'s table) and the per-role ACL users (:mod:`qrl.jobs.acl`). The
rest of a role's declaration is :class:`qrl.runtime.algorithm.RoleDef`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# what a run needs of Redis, whatever the role: the per-run rule (`qrl run rule`). No
# scripting: a user's own Lua could stall the whole Redis; qrl.jobs.acl adds to a rule the
# scripts of qrl's that its user runs, by SHA
RUN_COMMANDS = "+@all -@admin -@dangerous -@scripting -scan -select +cluster|info +cluster|slots"
# a role that only feeds the run (an actor): reads, plus the writes of its streams,
# heartbeats, leases and counters
ACTOR_COMMANDS = RUN_COMMANDS + " -@write +xadd +set +del +hincrby"

# qrl's Lua scripts (by name: :func:`qrl.wire.scripts.every_script`) that a role runs for
# each thing it does; its user may run those it declares (``Access.scripts``) and no others.
# Every role runs EVERY_ROLE_SCRIPTS: its number's lease (qrl.runtime.ids), the live config
# (qrl.runtime.live) and dead letters; one that follows the run's metrics into the run dir
# (``RoleDef.logs_run``) METRICS_SCRIPTS (qrl.runtime.metrics.MetricsReader).
# qrl.jobs.acl.role_access adds both.
EVERY_ROLE_SCRIPTS = ("ids.look", "ids.take", "ids.keep", "live.read", "streams.dead_letter")
METRICS_SCRIPTS = ("metrics.range",)
# a stream's producer and consumer (qrl.wire.streams: StreamProducer, StreamConsumer)
PRODUCER_SCRIPTS = ("streams.add_if_room",)
CONSUMER_SCRIPTS = (
    "streams.ensure_group",
    "streams.read",
    "streams.adopt",
    "streams.ack",
    "streams.leave",
)
# a writer of a chunked store (qrl.wire.chunks.ChunkedStore: weights, a PS state, a snapshot)
PUBLISHER_SCRIPTS = ("chunks.publish", "chunks.kept")
# a learner of a pool (qrl.learners.group: the pool forms through Redis)
POOL_SCRIPTS = ("group.join", "group.look", "group.abandon")


@dataclass(frozen=True)
class Access:
    """What one role's user may do: the key names (within the run's prefix and its shards',
    glob patterns allowed, e.g. ``replay:*``) it reads and writes, and its command rule
    (:data:`RUN_COMMANDS`, :data:`ACTOR_COMMANDS` or a rule of your own). Every role also
    reads ``config``, ``control`` and the metrics and writes its heartbeats, leases and
    metrics, ``stats`` and ``deadletter`` (:func:`qrl.jobs.acl.role_access` adds them).
    ``mine``: the keys of one process of the role, ``{id}`` standing for its number (a
    stepper's request and reply lists): a per-instance user (``qrl run join``) writes its
    own number's only, the role's shared user every number's. ``scripts``: the names of
    qrl's Lua scripts its code runs (e.g. :data:`PRODUCER_SCRIPTS`), the only ones its user
    may run, besides :data:`EVERY_ROLE_SCRIPTS` (and :data:`METRICS_SCRIPTS` for a role that
    logs the run)."""

    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    commands: str = RUN_COMMANDS
    mine: tuple[str, ...] = ()
    scripts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Column:
    """One column of a run's progress row: a ``metrics.csv`` column, its TensorBoard tag
    (``None``: CSV only) and a line of ``qrl train``'s table. ``digits``: the decimals a
    value keeps; ``None`` makes it a count (a whole number from 0 to
    :data:`qrl.runtime.runlog.MAX_COUNT`). ``start``: its value before anything fed it.
    A column that is not ``logged`` is shown in ``qrl train``'s table only."""

    name: str
    tag: str | None = None
    digits: int | None = 4
    start: float | None = None
    logged: bool = True

    @property
    def count(self) -> bool:
        return self.digits is None


# every run's progress row has these columns, in this order (metrics.csv's header and the
# TensorBoard tags that users' plots rely on); roles feed them and may add columns of theirs
TIME = Column("time_s", digits=2)  # the run log's own: seconds since it started
ENV_STEPS = Column("env_steps", digits=None, start=0)
ENV_STEPS_PER_S = Column("env_steps_per_s", "charts/env_steps_per_s", digits=1, start=0.0)
UPDATES = Column("updates", digits=None, start=0)
UPDATES_PER_S = Column("updates_per_s", "charts/updates_per_s", digits=1, start=0.0)
REPLAY_SIZE = Column("replay_size", "charts/replay_size", digits=None, start=0)
EPISODES = Column("episodes", digits=None, start=0)
EPISODIC_RETURN = Column("episodic_return", "charts/episodic_return")
EVAL_RETURN = Column("eval_return", "charts/eval_return")  # qrl train's: the last evaluation
EVALS = Column("evals", digits=None, start=0)  # qrl train's: a row where it grew has a new eval
LOSS = Column("loss", "losses/loss")
POLICY_LAG = Column("policy_lag", "charts/policy_lag")
COLUMNS = (
    TIME,
    ENV_STEPS,
    ENV_STEPS_PER_S,
    UPDATES,
    UPDATES_PER_S,
    REPLAY_SIZE,
    EPISODES,
    EPISODIC_RETURN,
    EVAL_RETURN,
    EVALS,
    LOSS,
    POLICY_LAG,
)


@dataclass(frozen=True)
class Feed:
    """How one value a role reports makes a column of the run's progress:

    - ``sum``: the sum over the role's processes of the latest value each reported (``by``
      names another reported value that tells the summed sources apart instead of the
      process id, e.g. a replay shard; values of ``by`` must be below ``bound``);
    - ``last``: the latest value any process of the role reported;
    - ``items``: how many numbers its processes reported in lists (e.g. episodes ended);
    - ``recent``: the mean of the last 50 numbers reported in lists (e.g. their returns).

    Two feeds of one column (say a learner's and a replay filler's replay size): the column
    shows the one reported last."""

    column: Column
    metric: str
    how: Literal["sum", "last", "items", "recent"] = "last"
    by: str | None = None
    bound: int | None = None


@dataclass(frozen=True)
class Reports:
    """What a role's processes report that others show. ``counter`` is its progress counter:
    the role loop reports it with its rate ``COUNTER_per_s`` (:mod:`qrl.runtime.loop`), which
    ``qrl status`` shows per process and sums per role; a stop-after option counts it.
    ``shown``: more values ``qrl status`` lists beside the counter. ``progress``: the
    columns its reports feed. ``acts_on``: the value naming the weights version its
    processes act with (``qrl status``'s policy lag is the published version minus the
    oldest of these, unless a process reports a measured one into :data:`POLICY_LAG`)."""

    counter: str = "steps"
    shown: tuple[str, ...] = ()
    progress: tuple[Feed, ...] = ()
    acts_on: str | None = None

    @property
    def rate(self) -> str:
        return f"{self.counter}_per_s"

    @property
    def listed(self) -> tuple[str, ...]:
        """What ``qrl status`` lists of a process: the counter, then ``shown``."""
        return (self.counter, *self.shown)


# what the roles that play an env report (qrl.actors.actor.Actor and ES workers)
ACTOR_PROGRESS = (
    Feed(ENV_STEPS, "steps", "sum"),
    Feed(ENV_STEPS_PER_S, "steps_per_s", "sum"),
    Feed(EPISODES, "episode_returns", "items"),
    Feed(EPISODIC_RETURN, "episode_returns", "recent"),
)
# what every trainer reports (qrl.learners.base.Learner and the ES master)
LEARNER_PROGRESS = (
    Feed(UPDATES, "updates"),
    Feed(UPDATES_PER_S, "updates_per_s"),
    Feed(LOSS, "loss"),
)


def shown_only(name: str) -> Feed:
    """A value shown in ``qrl train``'s table only (its latest), not logged."""
    return Feed(Column(name, logged=False), name)
