"""What every torch learner shares: device choice, resuming (:mod:`qrl.learners.resume`), the
guarded optimizer step, weight publication, the learner pool, and its part of the role loop
(:mod:`qrl.runtime.loop`).

A subclass builds its network and optimizer, starts its data-loading threads, and turns a
batch into a loss; the rest is here and in the loop.

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
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch

from qrl.learners.group import GroupLost, LearnerGroup
from qrl.learners.resume import load_optimizer, resume, settle
from qrl.rl.envspec import EnvSpec
from qrl.runtime.algorithm import RoleContext
from qrl.runtime.checkpoint import save_checkpoint
from qrl.runtime.config import live_fields
from qrl.runtime.loop import Role, StopCheck
from qrl.runtime.snapshot import capture, write_file
from qrl.wire.keys import RunKeys
from qrl.wire.weights import WeightStore

log = logging.getLogger(__name__)


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
    (docs/benchmarks.md, "Adam's fused kernel")."""
    return torch.optim.Adam(params, fused=True, **kwargs)


class Learner(Role):
    """Base learner. Subclasses set ``algo`` and implement ``build``, ``optimizer``,
    ``next_batch`` and ``loss``; they may override ``start_threads``/``stop_threads``,
    ``after_step``, ``extra_metrics`` and ``learning_rates``. The config has ``grad_clip``
    (:class:`qrl.runtime.config.GradientClip`), read at every update, and the learning
    rates that :meth:`learning_rates` names: both may change while the run runs."""

    algo = ""
    name = "learner"
    counter = "updates"

    def __init__(
        self,
        client_factory: Callable[[], redis.Redis],
        keys: RunKeys,
        cfg: Any,
        device: str = "auto",
        checkpoint: Path | None = None,
        threads: int = 1,
        env: EnvSpec | None = None,
        snapshot: Path | None = None,
    ) -> None:
        self.client_factory, self.keys, self.cfg = client_factory, keys, cfg
        self.env = env or EnvSpec.of(cfg.env)  # what build reads: the launcher's, read once
        self.client = client_factory()
        self.device = pick_device(device)
        torch.set_num_threads(threads)  # actors share the cores: one compute thread by default
        torch.manual_seed(cfg.seed)
        self.stopping = threading.Event()
        self.net = self.build()
        self._opt: torch.optim.Optimizer | None = None
        self.skipped = 0  # for a non-finite loss
        # seconds waiting for data (of them: making the batch's tensors), averaging gradients
        self.wait_s, self.transfer_s, self.allreduce_s = 0.0, 0.0, 0.0
        self.group = LearnerGroup(0, 1, self.device)  # alone until start() joins the pool
        self.held: Any = None  # this learner's batch, waiting for the pool's
        self.losses: list[float] = []  # since the last report
        self.checkpoint = checkpoint
        self.snapshot = snapshot  # the state a PBT slot hands in, and takes back as it stops
        self.resumed = resume(self.net, self.algo, cfg, checkpoint, snapshot)
        self.updates = self.resumed.updates
        self.weights = WeightStore(self.client, keys)

    @property
    def opt(self) -> torch.optim.Optimizer:
        """The optimizer, made on first use: making torch's first optimizer imports
        ``torch._dynamo`` (seconds: docs/benchmarks.md, "Start method of role processes"),
        so the learner publishes its initial weights first and the actors start meanwhile
        (:meth:`start`)."""
        if self._opt is None:
            self._opt = self.optimizer()
            if load_optimizer(self._opt, self.resumed):
                self._set_learning_rates()  # the run's, not those saved with the state
        return self._opt

    @classmethod
    def from_context(cls, ctx: RoleContext) -> Learner:
        """The learner a role context asks for (what the builders' ``make`` returns)."""
        return cls(
            ctx.connect,
            ctx.keys,
            ctx.cfg,
            ctx.device,
            checkpoint=ctx.checkpoint,
            threads=ctx.threads,
            env=ctx.env,
            snapshot=ctx.snapshot,
        )

    # -- for subclasses
    def build(self) -> torch.nn.Module:
        """The network (and whatever else the learner needs: target networks, consumers)."""
        raise NotImplementedError

    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer of ``self.net``."""
        raise NotImplementedError

    def next_batch(self, timeout: float) -> Any | None:
        """The next batch, or ``None`` if none came within ``timeout`` seconds."""
        raise NotImplementedError

    def loss(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def after_step(self, batch: Any) -> None:
        """Called after a successful optimizer step (priorities, acks, target sync)."""

    def after_skip(self, batch: Any) -> None:
        """Called when ``batch`` gave a non-finite loss or gradient and no step was taken."""

    def start_threads(self) -> None:
        """Start what loads batches: a process (IMPALA and PPO: the loader; the replay
        learners' sampler)."""

    def stop_threads(self) -> None:
        """Stop what :meth:`start_threads` started."""

    def extra_metrics(self) -> dict[str, float]:
        return {}

    def learning_rates(self) -> list[float]:
        """The learning rate of each of the optimizer's parameter groups, from ``self.cfg``:
        ``cfg.lr`` (:class:`qrl.runtime.config.LearningRate`) for one group by default."""
        return [self.cfg.lr]

    def published(self) -> torch.nn.Module:
        """What actors need and the weights carry: the whole network unless a subclass
        publishes less (Ape-X DPG: the actor network, its names as in ``self.net``)."""
        return self.net

    # -- shared
    def update(self, batch: Any) -> float:
        """One guarded gradient step; returns the loss (NaN if skipped because the loss or
        the gradient is not finite: then no step is taken and nothing is published)."""
        loss = self.loss(batch)
        if self.group.world == 1 and not torch.isfinite(loss):
            return self._skip(batch, "loss")  # (in a pool its gradient is not finite either)
        if not self.step_on(loss):
            return self._skip(batch, "gradient")
        self.updates += 1
        self.after_step(batch)
        if self.updates % self.cfg.publish_every == 0:
            self.publish()
        return loss.item()

    def step_on(self, loss: torch.Tensor) -> bool:
        """Backward, the gradient averaged over the pool, clipped, one optimizer step; False
        (no step) if the gradient is not finite. A non-finite loss on one learner makes the
        average non-finite on all of them: they all skip together."""
        alone = self.group.world == 1
        self.opt.zero_grad(set_to_none=alone)
        loss.backward()
        params = list(self.net.parameters())
        if not alone:
            self.allreduce_s += self.group.all_reduce_mean_(self.group.grads(params))
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        if not torch.isfinite(norm):
            self.opt.zero_grad(set_to_none=True)
            return False
        self.opt.step()
        return True

    def _skip(self, batch: Any, what: str) -> float:
        self.skipped += 1
        log.warning(
            "non-finite %s at update %d: skipped, weights not published", what, self.updates
        )
        self.after_skip(batch)
        return float("nan")

    def publish(self) -> None:
        """Publish the weights as version ``updates`` (in a pool: the leader); if another
        writer stored a newer version, they go above it and the learner counts on from there (see
        :meth:`qrl.wire.weights.WeightStore.publish`). Parameters that are not finite are never
        published."""
        if not self.group.leader:
            return
        module = self.published()
        if not all(torch.isfinite(p).all() for p in module.parameters()):
            log.error("parameters at update %d are not finite: not published", self.updates)
            return
        self.updates = self.weights.publish(module, version=self.updates)

    def reconfigure(self, cfg: Any) -> None:
        """A live config change: the learning rates go to the optimizer at once."""
        super().reconfigure(cfg)
        self._set_learning_rates()

    def _set_learning_rates(self) -> None:
        groups = self.opt.param_groups
        for group, lr in zip(groups, self.learning_rates(), strict=True):
            group["lr"] = lr

    def save(self) -> None:
        if not self.group.leader:
            return
        if self.checkpoint is not None:
            save_checkpoint(self.checkpoint, self.algo, self.cfg, self.net, self.opt, self.updates)
        if self.snapshot is not None:
            try:
                write_file(self.snapshot, capture(self.net, self.opt, self.updates))
            except OSError as e:  # the checkpoint above holds it
                log.warning("could not save the snapshot to %s: %s", self.snapshot, e)

    # -- the role (run by :func:`qrl.runtime.loop.run_role`)
    def start(self, should_stop: StopCheck) -> bool:
        group = LearnerGroup.join(
            self.client,
            self.keys,
            getattr(self.cfg, "learners", 1),
            self.device,
            timeout_s=getattr(self.cfg, "rendezvous_timeout", 60.0),
            should_stop=should_stop,
        )
        if group is None:
            return False
        self.group = group
        if group.world > 1:
            log.info("learner rank %d of %d", group.rank, group.world)
        self.updates, behind = settle(self.weights, self.published(), self.updates)
        if behind:  # actors start from the learner's initial (or resumed) weights
            self.publish()
        self.stopping.clear()
        self.start_threads()
        _ = self.opt  # made now, while the actors start on the published weights
        if group.world > 1:  # every learner from the state of the one furthest on
            synced = group.sync(self.net, self.opt, self.updates)
            if synced != self.updates:
                log.info("took the pool's state at update %d (had %d)", synced, self.updates)
            self.updates = synced
            if self.weights.version() != self.updates:
                self.publish()
        return True

    def step(self, should_stop: StopCheck) -> bool:
        """Wait up to 0.2 s for a batch and train on it (in a pool: once every learner has
        one)."""
        if self.stopping.is_set():
            return False
        if not self.weights.kept():  # a writer's blob in place of ours: actors that rejected
            self.updates += 1  # it wait for a new version (see qrl.wire.weights)
            self.publish()
        if self.held is None:
            t0 = time.monotonic()
            self.held = self.next_batch(0.2)
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

    def train(self, batch: Any) -> float:
        """Train on one batch: one :meth:`update` (PPO: epochs of minibatches); the loss."""
        return self.update(batch)

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
            "transfer_s": self.transfer_s,
            "skipped": self.skipped,
            "lr": float(self.opt.param_groups[0]["lr"]),  # what the optimizer steps with
            **(self.group_metrics() if self.group.world > 1 else {}),
            **self.extra_metrics(),
        }

    def group_metrics(self) -> dict[str, float]:
        """A pool member's rank, all-reduce time and a checksum of its parameters: the
        pool's learners report the same checksum when they hold the same parameters (they
        do after every update)."""
        crc = 0
        for p in self.net.parameters():
            crc = zlib.crc32(p.detach().cpu().numpy().tobytes(), crc)
        return {"rank": self.group.rank, "allreduce_s": self.allreduce_s, "params_crc": crc}

    def close(self, should_stop: StopCheck) -> None:
        self.stopping.set()
        self.stop_threads()
        if self.weights.version() < self.updates:
            self.publish()
        self.group.close()

    def fail(self, what: str) -> None:
        """Called by a data thread that cannot go on: the learner stops and exits non-zero."""
        super().fail(what)
        self.stopping.set()
