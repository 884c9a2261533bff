"""The learner role: one class for every torch learner, composed of parts that each
algorithm's builder (``qrl/algos/NAME/builder.py``) passes in:

- a batch source (:class:`Source`: the replay's samplers, :mod:`qrl.learners.replay`; the
  unroll loader, :mod:`qrl.learners.unrolls`), started and stopped with the learner;
- an update rule (:class:`qrl.learners.rule.Rule`): the network(s), the optimizer, a batch
  made losses;
- how a gradient becomes a step (:class:`qrl.learners.step.LocalStep`, or Gorila's push to
  the parameter server);
- a publisher (:class:`qrl.learners.publish.Publisher`) and a checkpointer
  (:class:`qrl.learners.resume.Checkpointer`), each ``None`` where the learner keeps
  neither (Gorila's: its parameter server does).

:meth:`Learner.train` is the one update path: it counts updates and skipped steps,
publishes, and hands the batch back to its source (acknowledged, or released with its new
priorities).

The pool (a config with ``learners`` > 1, :class:`qrl.runtime.config.LearnerPool`): the
learners meet through Redis (:class:`qrl.learners.group.LearnerGroup`), start from the state
of the one furthest on, and take every update together: before each, one collective says
that every learner has its batch, whether one stops, and the leader's live
hyperparameters (so a live change applies to all at the same update); after each backward
pass the gradients are averaged by one all-reduce, so all take the same step and hold the
same parameters. The leader (rank 0) publishes the weights and writes the checkpoint. A
learner whose peer is gone stops with a message saying to restart the pool (it resumes from
the checkpoint); a peer that left because the run stops is a clean stop.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import redis
import torch

from qrl.learners.group import GroupLost, LearnerGroup
from qrl.learners.publish import Publisher
from qrl.learners.resume import Checkpointer, Resumed, load_optimizer
from qrl.learners.rule import Rule, Update
from qrl.learners.step import LocalStep
from qrl.rl.envspec import EnvSpec
from qrl.runtime.algorithm import RoleContext
from qrl.runtime.config import Config, LearnerPool, live_fields
from qrl.runtime.loop import Role, StopCheck
from qrl.wire.weights import WeightStore

log = logging.getLogger(__name__)

# the pool of a config that is no LearnerPool: this learner alone
ALONE = LearnerPool()


def pick_device(device: str) -> torch.device:
    """``auto`` is CUDA when available, else CPU; ``cuda`` without a GPU is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for, but torch sees no CUDA device")
    return torch.device(device)


def adam(params: Any, **kwargs: Any) -> torch.optim.Adam:
    """Adam with its fused kernel: one pass over all parameters instead of a Python loop
    over them, which on one CPU thread is a large share of a small network's update
    (notes/benchmarks-notebook.md, "Adam's fused kernel")."""
    return torch.optim.Adam(params, fused=True, **kwargs)


def prepare(ctx: RoleContext) -> tuple[torch.device, EnvSpec]:
    """What comes before a learner's parts are built: its device and env spec (the
    launcher's, read once), torch's threads (actors share the cores: one compute thread by
    default) and seed (the networks' first weights follow from it)."""
    device = pick_device(ctx.device)
    torch.set_num_threads(ctx.threads)
    torch.manual_seed(ctx.cfg.seed)
    return device, ctx.env or EnvSpec.of(ctx.cfg.env)


class Source(Protocol):
    """Where a learner's batches come from (:class:`qrl.learners.fed.FedSource`)."""

    transfer_s: float  # seconds making batches' tensors

    def start(self, fail: Callable[[str], None]) -> None:
        """Start loading (``fail``: what a loader that cannot go on calls)."""

    def stop(self) -> None: ...

    def next(self, timeout: float, updates: int) -> Any | None:
        """The next batch, ``None`` if none came within ``timeout`` seconds (``updates``:
        the learner's, which the policy lag is measured against)."""

    def done(self, batch: Any, update: Update | None) -> None:
        """The learner is done with ``batch``: ``update`` is its last step's output, or
        ``None`` if no step was taken."""

    def metrics(self) -> dict[str, float]: ...


class Learner(Role):
    """A learner: its ``rule``'s network trained on its ``source``'s batches, each gradient
    made a step by ``step`` (by default its own optimizer's), the weights published by
    ``publisher`` and its state kept by ``checkpointer``. The config has ``grad_clip``
    (:class:`qrl.runtime.config.GradientClip`) and the learning rates the rule names: both
    may change while the run runs."""

    name = "learner"
    counter = "updates"

    def __init__(
        self,
        ctx: RoleContext,
        device: torch.device,
        rule: Rule,
        source: Source,
        *,
        step: Any = None,
        publisher: Publisher | None = None,
        checkpointer: Checkpointer | None = None,
        client: redis.Redis | None = None,
    ) -> None:
        self.keys, self.cfg, self.device = ctx.keys, ctx.cfg, device
        self.client = client or ctx.connect()  # its own (the pool's rendezvous, the weights)
        self.rule, self.source = rule, source
        self.step_part = step or LocalStep()
        self.publisher, self.checkpointer = publisher, checkpointer
        self.net = rule.net
        self.stopping = threading.Event()
        self._opt: torch.optim.Optimizer | None = None
        self.skipped = 0  # steps not taken for a non-finite loss or gradient
        self.wait_s = 0.0  # seconds waiting for data
        self.group = LearnerGroup(0, 1, device)  # alone until start() joins the pool
        self.held: Any = None  # this learner's batch, waiting for the pool's
        self.losses: list[float] = []  # since the last report
        self.resumed = checkpointer.resume(self.net, ctx.cfg) if checkpointer else Resumed()
        self.updates = self.resumed.updates

    @classmethod
    def publishing(
        cls,
        ctx: RoleContext,
        device: torch.device,
        rule: Rule,
        source: Source,
        algo: str,
        every: int = 1,
    ) -> Learner:
        """The usual learner: it steps its own optimizer, publishes the run's weights every
        ``every`` updates, and keeps its state in its checkpoint (of ``algo``) and the run's
        snapshot."""
        client = ctx.connect()
        return cls(
            ctx,
            device,
            rule,
            source,
            publisher=Publisher(WeightStore(client, ctx.keys, wire=ctx.cfg.wire), every),
            checkpointer=Checkpointer(algo, ctx.checkpoint, ctx.snapshot),
            client=client,
        )

    @property
    def opt(self) -> torch.optim.Optimizer:
        """The optimizer, made on first use: making torch's first optimizer imports
        ``torch._dynamo`` (seconds: docs/benchmarks.md, "Start method of role processes"),
        so the learner publishes its initial weights first and the actors start meanwhile
        (:meth:`start`)."""
        if self._opt is None:
            self._opt = self.step_part.optimizer(self.rule)
            if load_optimizer(self._opt, self.resumed):
                self._set_learning_rates()  # the run's, not those saved with the state
        return self._opt

    # -- one update
    def train(self, batch: Any) -> float:
        """One update on ``batch``: a guarded step on each of the rule's parts of it; the
        mean loss of the steps taken (NaN if none: then, unless the rule counts such an
        update, it is not counted and nothing is published). The batch goes back to its
        source in any case."""
        losses: list[float] = []
        kept: Update | None = None
        try:
            for part in self.rule.parts(batch, self.group):
                out = self.rule.loss(part, self.updates)
                if self.group.world == 1 and not torch.isfinite(out.loss):
                    self._skip("loss")  # (in a pool its gradient is not finite either)
                    continue
                if not self.step_part.take(
                    out.loss, self.net, self.opt, self.group, self.cfg.grad_clip
                ):
                    self._skip("gradient")
                    continue
                kept = out
                losses.append(out.loss.item())
            if losses or self.rule.counts_skipped:
                self.updates += 1
                self.rule.after_step(self.updates, len(losses))
                self._set_learning_rates()  # a rule's schedule (PPO's anneal) moves them
                self.step_part.after(self.updates, self.cfg)
                if self.publisher is not None and self.publisher.due(self.updates):
                    self.publish(wait=False)
        finally:
            self.source.done(batch, kept)
        return float(np.mean(losses)) if losses else float("nan")

    def _skip(self, what: str) -> None:
        self.skipped += 1
        log.warning("non-finite %s at update %d: step skipped", what, self.updates)

    def publish(self, wait: bool = True) -> None:
        """Publish the weights as version ``updates`` (in a pool: the leader); if another
        writer stored a newer version, they go above it and the learner counts on from
        there. Without ``wait`` (an update's publication) it goes on while the learner
        trains on (:class:`qrl.learners.publish.Publisher`)."""
        if self.publisher is not None and self.group.leader:
            module, updates = self.rule.published(), self.updates
            self.updates = self.publisher.publish(module, updates, wait=wait)

    def reconfigure(self, cfg: Config) -> None:
        """A live config change: the rule reads it, the learning rates go to the optimizer
        at once."""
        super().reconfigure(cfg)
        self.rule.reconfigure(cfg)
        self._set_learning_rates()

    def _set_learning_rates(self) -> None:
        groups = self.opt.param_groups
        for group, lr in zip(groups, self.rule.learning_rates(), strict=True):
            group["lr"] = lr

    def save(self) -> None:
        if self.checkpointer is not None and self.group.leader:
            self.checkpointer.save(self.cfg, self.net, self.opt, self.updates)

    # -- the role (run by :func:`qrl.runtime.loop.run_role`)
    def start(self, should_stop: StopCheck) -> bool:
        pool = self.cfg if isinstance(self.cfg, LearnerPool) else ALONE
        group = LearnerGroup.join(
            self.client,
            self.keys,
            pool.learners,
            self.device,
            timeout_s=pool.rendezvous_timeout,
            should_stop=should_stop,
        )
        if group is None:
            return False
        self.group = group
        if group.world > 1:
            log.info("learner rank %d of %d", group.rank, group.world)
        if self.publisher is not None:
            self.updates, behind = self.publisher.settle(self.rule.published(), self.updates)
            if behind:  # actors start from the learner's initial (or resumed) weights
                self.publish()
        if not self.step_part.start(should_stop):  # (Gorila's: the first pull)
            return False
        self.stopping.clear()
        self.rule.begin()
        self.source.start(self.fail)
        _ = self.opt  # made now, while the actors start on the published weights
        if group.world > 1:  # every learner from the state of the one furthest on
            synced = group.sync(self.net, self.opt, self.updates)
            if synced != self.updates:
                log.info("took the pool's state at update %d (had %d)", synced, self.updates)
            self.updates = synced
            if self.publisher is not None and self.publisher.behind(self.updates):
                self.publish()
        return True

    def step(self, should_stop: StopCheck) -> bool:
        """Wait up to 0.2 s for a batch and train on it (in a pool: once every learner has
        one)."""
        if self.stopping.is_set():
            return False
        if self.publisher is not None and not self.publisher.kept():
            self.updates += 1  # a writer's blob in place of ours: actors that rejected it
            self.publish()  # wait for a new version (see qrl.wire.weights)
        if self.publisher is not None and self.publisher.owes():
            self.publish(wait=False)  # skipped while the one before was under way
        if self.held is None:
            t0 = time.monotonic()
            self.held = self.source.next(0.2, self.updates)
            self.wait_s += time.monotonic() - t0
        if self.group.world == 1:
            batch, self.held = self.held, None
            if batch is not None:
                self.losses.append(self.train(batch))
            return True
        try:
            ready, stop = self._agree(should_stop)
            if stop:
                return False
            if ready:
                batch, self.held = self.held, None
                self.losses.append(self.train(batch))
        except GroupLost as e:
            time.sleep(0.5)  # a peer that left because the run stops: the stop flag says so
            if should_stop():
                log.info("a learner of the pool left as the run stops: %s", e)
                return False
            self.fail(str(e))
            return False
        return True

    def _agree(self, should_stop: StopCheck) -> tuple[bool, bool]:
        """One collective: (every learner holds a batch, one of them stops); the leader's
        live hyperparameters become everyone's."""
        names = [n for n in live_fields(type(self.cfg)) if isinstance(getattr(self.cfg, n), float)]
        mine = [float(getattr(self.cfg, n)) if self.group.leader else 0.0 for n in names]
        flags = [float(self.held is not None), float(should_stop()), *mine]
        out = self.group.sum(torch.tensor(flags, dtype=torch.float64)).tolist()
        leader = dict(zip(names, out[2:], strict=True))
        if any(getattr(self.cfg, n) != v for n, v in leader.items()):
            self.reconfigure(self.cfg.replace(**leader))
        return out[0] == self.group.world, out[1] > 0

    def metrics(self) -> dict[str, Any]:
        finite, self.losses = [x for x in self.losses if np.isfinite(x)], []
        return {
            "updates": self.updates,
            "loss": float(np.mean(finite)) if finite else 0.0,
            "wait_s": self.wait_s,
            "transfer_s": self.source.transfer_s,
            "skipped": self.skipped,
            "lr": float(self.opt.param_groups[0]["lr"]),  # what the optimizer steps with
            **(self.group_metrics() if self.group.world > 1 else {}),
            **self.source.metrics(),
            **self.rule.metrics(),
            **self.step_part.metrics(),
        }

    def group_metrics(self) -> dict[str, float]:
        """A pool member's rank, all-reduce time and a checksum of its parameters: the
        pool's learners report the same checksum when they hold the same parameters (they
        do after every update)."""
        crc = 0
        for p in self.net.parameters():
            crc = zlib.crc32(p.detach().cpu().numpy().tobytes(), crc)
        allreduce_s = self.step_part.allreduce_s
        return {"rank": self.group.rank, "allreduce_s": allreduce_s, "params_crc": crc}

    def close(self, should_stop: StopCheck) -> None:
        self.stopping.set()
        self.source.stop()
        if self.publisher is not None:
            if self.publisher.stale(self.updates):
                self.publish()
            self.publisher.close()  # the last publication done
        self.step_part.close()  # (a Gorila learner's push under way)
        self.group.close()

    def fail(self, what: str) -> None:
        """Called by a batch source that cannot go on: the learner stops and exits
        non-zero."""
        super().fail(what)
        self.stopping.set()
