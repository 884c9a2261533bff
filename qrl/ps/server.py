"""A parameter-server shard (Gorila, Nair et al. 2015; A3C's shared optimizer, Mnih et al.
2016): applies the gradients of its block of the parameters as they come, one optimizer step
each, and publishes the block with a version.

Each cycle it reads up to ``ps_batch`` gradients from its workers' streams (one stream per
worker number, :func:`qrl.ps.protocol.gradients`: one read over them all, taking a gradient
of each worker that has one waiting in turn) and applies them one by one, dropping (and
counting) a gradient computed on a block more than ``ps_max_staleness`` versions old
(``stale``), on a version it has not reached (``future``: a writer's invention, or a server
that lost state), or, with ``ps_loss_sigmas``, whose loss is that many standard deviations
off the running mean (``outlier``, Gorila's rule), and rejecting one whose block norm is over
the workers' gradient clip (``norm``: no worker of ours sends one), and dropping one from a
worker that already has its share (``ps_max_share``) of the last gradients applied
(``flood``): the worker whose stream it came from, whatever the message says. Malformed
entries never reach it (the stream consumer dead-letters them). Then, in this order: its
state (block, optimizer state, version, the last entry applied of each worker's stream, loss
statistics) is saved (chunks, then one manifest switch), the block is published, the
gradients are acknowledged. A server killed anywhere in that resumes from the saved state,
skips the entries of each stream it already applied and re-reads the rest (its consumer name
is its shard's). Shard 0
also publishes the whole network to the run's weights key every ``ps_publish_s`` and writes
the run's checkpoint, with its own state, from which shards with nothing in Redis start (the
others with their block of the network and a fresh optimizer).

Its times (the whole network's publication, a worker's share) and waits (a read finding no
gradient polls) read :mod:`qrl.wire.clock`, so in a one-process run (``qrl train
--one-process``) it takes turns with its workers and applies the same gradients every time.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch

from qrl.ps import protocol
from qrl.ps.client import Flat, fetch_blocks
from qrl.runtime.checkpoint import load_checkpoint, save_checkpoint
from qrl.runtime.config import Config
from qrl.runtime.loop import Role, StopCheck
from qrl.runtime.snapshot import state_names
from qrl.wire import clock
from qrl.wire.codec import CodecError
from qrl.wire.keys import RunKeys
from qrl.wire.stream_scripts import dead_letter, optional
from qrl.wire.streams import Entry, StreamConsumer
from qrl.wire.weights import WeightStore

log = logging.getLogger(__name__)

MakeOptimizer = Callable[[list[torch.nn.Parameter], Any], torch.optim.Optimizer]
WARMUP = 20  # gradients before the outlier rule applies (the running statistics settle)
DROPS = ("stale", "future", "outlier", "norm", "flood")
SHARE_WINDOW = 128  # ps_max_share counts a worker's gradients among this many applied in a row
ALONE_S = 5.0  # a worker no other one pushed beside for this long crowds no one out: no share
# the staleness histogram qrl status shows: gradients (applied or not) by how many versions
# behind the block they were computed on, since the server started
LAGS = (("lag_0", 1), ("lag_1_3", 4), ("lag_4_15", 16), ("lag_16_up", None))


class ParameterServer(Role):
    name = "ps"
    counter = "updates"

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        cfg: Config,
        shard: int,
        net: torch.nn.Module,
        make_opt: MakeOptimizer,
        *,
        algo: str,
        checkpoint: Path | None = None,
        workers: int = 1,
    ) -> None:
        torch.set_num_threads(1)
        n = cfg.ps_shards
        if not 0 <= shard < n:
            raise ValueError(f"shard {shard}: the run has ps_shards={n} (0..{n - 1})")
        self.client, self.keys, self.cfg, self.shard, self.algo = client, keys, cfg, shard, algo
        self.net, self.flat = net, Flat(net, n)
        self.sk = protocol.shard_keys(keys, n, shard)
        self.length = self.flat.bounds[shard + 1] - self.flat.bounds[shard]
        self.param = torch.nn.Parameter(self.flat.vector()[self.flat.block(shard)].clone())
        self.make_opt, self.opt = make_opt, make_opt([self.param], cfg)
        self.opt_names = state_names(self.opt)
        self.updates = 0
        # the workers' streams (any number a worker process may hold) and the last entry
        # applied of each (worker number -> entry id; "0-0" when none)
        self.streams = [protocol.gradients(self.sk, w) for w in protocol.workers(workers)]
        self.worker_of = {stream: w for w, stream in enumerate(self.streams)}
        self.last_ids: dict[int, str] = {}
        self.published = -1  # the version of the block last published (read at the start)
        self.loss_stats = [0.0, 0.0, 0.0]  # running mean, variance, count
        self.drops = dict.fromkeys(DROPS, 0)
        self.rejected = self.replayed = 0
        self.staleness: list[int] = []
        self.lags = dict.fromkeys((name for name, _ in LAGS), 0)
        self.losses: list[float] = []
        self.workers = workers  # the run's pushers: ps_max_share's default is relative to them
        self.applied: deque[int] = deque()  # the workers of the last SHARE_WINDOW - 1 applied
        self.held: Counter[int] = Counter()  # ... how many each of them has there
        self.pushed: dict[int, float] = {}  # the last two workers that pushed: when
        self.store = WeightStore(client, keys, protocol.params(self.sk))
        self.saved = protocol.state_store(client, self.sk, self.length, len(self.streams))
        self.consumer = StreamConsumer(  # the shard's dead letters and stats: its slot
            client,
            self.sk,
            self.streams,
            protocol.gradient_schema(self.length),
            consumer=f"ps-{shard}",
            count=cfg.ps_batch,
            block_ms=100,
            claim_idle_ms=cfg.claim_idle_ms,
        )
        self.checkpoint = checkpoint
        # shard 0: the other shards' blocks, for the run's weights and the checkpoint
        shards = [protocol.shard_keys(keys, n, k) for k in range(n)]
        self.peers = [WeightStore(client, keys, protocol.params(sk)) for sk in shards]
        self.peer_versions = [-1] * n
        self.whole = self.flat.vector().clone()
        self.run_weights = WeightStore(client, keys, wire=cfg.wire)  # (the blocks: exact)
        self.run_from = -1  # the blocks' version last published to the run's weights
        self.next_publish = 0.0

    # -- state
    def state(self) -> dict[str, Any]:
        """What a restarted server resumes from (:func:`qrl.ps.protocol.state_schema`)."""
        opt = {
            k: v.detach().cpu().numpy().astype(np.float32)
            for k, v in self.opt.state.get(self.param, {}).items()
        }
        return {
            "version": self.updates,
            "last_ids": {str(w): i for w, i in sorted(self.last_ids.items())},
            "params": self.param.detach().cpu().numpy().copy(),
            "opt": opt,
            "loss": [float(x) for x in self.loss_stats],
        }

    def load_state(self, msg: dict[str, Any]) -> None:
        """Take a saved state (validated here: a writer may have put anything there)."""
        loss = msg["loss"]
        if len(loss) != 3 or not all(isinstance(x, float) and math.isfinite(x) for x in loss):
            raise CodecError(f"loss statistics {loss!r} are not three finite numbers")
        mean, var, n = loss
        if abs(mean) > protocol.MAX_LOSS or not 0 <= var <= 4 * protocol.MAX_LOSS**2 or n < 0:
            raise CodecError(f"loss statistics {loss!r} out of range")
        opt = msg["opt"]
        if opt and set(opt) != self.opt_names:
            raise CodecError(f"optimizer state {sorted(opt)}, expected {sorted(self.opt_names)}")
        last_ids = {}
        for w, entry_id in (msg["last_ids"] or {}).items():
            if not (w.isdigit() and str(int(w)) == w and int(w) < len(self.streams)):
                raise CodecError(f"last entry of worker {w!r}: no stream of this server's")
            protocol.entry_order(entry_id)  # a stream id, or ValueError
            last_ids[int(w)] = entry_id
        with torch.no_grad():
            self.param.copy_(torch.from_numpy(np.array(msg["params"])))
        self.opt = self.make_opt([self.param], self.cfg)
        if opt:
            sd = self.opt.state_dict()
            sd["state"] = {0: {k: torch.from_numpy(np.array(v)) for k, v in opt.items()}}
            self.opt.load_state_dict(sd)
        self.updates, self.last_ids = msg["version"], last_ids
        self.loss_stats = list(loss)

    def restore(self) -> str:
        """Resume from Redis, else from the checkpoint, else start; says which."""
        got = self.saved.read()  # None if there is none, or it failed (dead-lettered)
        if got is not None:
            try:
                msg = got[1]
                self._version_reachable(msg["version"])
                self.load_state(msg)
                self._last_id_at_most_the_streams()
                return f"resumed from Redis at version {self.updates}"
            except (CodecError, ValueError) as e:
                why = str(e)
                dead_letter(self.client, self.sk, self.saved.source, why, None)
            log.warning("shard %d: saved state unusable (%s): not resumed from it", self.shard, why)
        if self.checkpoint is not None and self.checkpoint.exists():
            return self._from_checkpoint(self.checkpoint)
        return "started from the initial parameters"

    def _version_reachable(self, version: int) -> None:
        """A saved version this server could not have reached is not its own save: each
        cycle it saves its state, then publishes its block at the same version, having
        applied at most ``ps_batch`` gradients (one version more when it republishes a
        replaced block), so a save is never more than that past the published block (a key
        only the servers write)."""
        published = max(self.store.version(), 0)
        if version > published + self.cfg.ps_batch + 1:
            raise CodecError(
                f"saved version {version} is past what a cycle could reach from the published "
                f"block's {published}"
            )

    def _last_id_at_most_the_streams(self) -> None:
        """A saved last entry past the newest its stream ever made (a writer's) would have
        the server skip every gradient to come of that worker as applied already: it is cut
        back to it."""
        for w, last in list(self.last_ids.items()):
            try:
                newest = self.client.xinfo_stream(self.streams[w])["last-generated-id"]
                newest = newest.decode() if isinstance(newest, bytes) else str(newest)
            except redis.ResponseError:  # no stream (or not one): nothing was applied from it
                newest = "0-0"
            if protocol.entry_order(last) > protocol.entry_order(newest):
                log.warning(
                    "shard %d: saved last entry %s of worker %d is past its stream's "
                    "newest %s: cut back",
                    self.shard,
                    last,
                    w,
                    newest,
                )
                self.last_ids[w] = newest

    def _from_checkpoint(self, path: Path) -> str:
        ckpt = load_checkpoint(path, self.algo, self.cfg)
        saved = ckpt["extra"].get("ps", {})
        states = saved.get("states", [])
        if saved.get("shards") == self.cfg.ps_shards and states[self.shard] is not None:
            s = states[self.shard]
            msg = {
                "version": int(s["version"]),
                "last_ids": {},  # new streams: entries of a lost Redis are gone
                "params": s["params"].numpy(),
                "opt": {k: v.numpy() for k, v in s["opt"].items()},
                "loss": [float(x) for x in s["loss"].tolist()],
            }
            self.load_state(msg)
            return f"resumed from {path} at version {self.updates}"
        self.net.load_state_dict(ckpt["model"])
        with torch.no_grad():
            self.param.copy_(self.flat.vector()[self.flat.block(self.shard)])
        return f"took its block from {path} (other shard count: a fresh optimizer)"

    # -- the role
    def start(self, should_stop: StopCheck) -> bool:
        how = self.restore()
        log.info(
            "ps shard %d of %d (%d parameters): %s",
            self.shard,
            self.cfg.ps_shards,
            self.length,
            how,
        )
        self.published = self.store.version()
        if self.published != self.updates:
            self.publish_block()
        return True

    def step(self, should_stop: StopCheck) -> bool:
        if not self.store.kept():  # a writer's blob in place of the block (see Learner.step)
            self.updates += 1
            self.publish_block()
        entries = self.consumer.read()
        if entries:
            for e in entries:
                self.apply(e)
            self.persist()
            if self.published != self.updates:
                self.publish_block()
            self.consumer.ack(entries)
        if self.shard == 0 and clock.now() >= self.next_publish:
            self.next_publish = clock.now() + self.cfg.ps_publish_s
            self.publish()
        return True

    def apply(self, e: Entry) -> None:
        m, worker = e.data, self.worker_of[e.stream]  # who sent it: whose stream it is
        if protocol.entry_order(e.id) <= protocol.entry_order(self.last_ids.get(worker, "0-0")):
            self.replayed += 1  # applied before a restart, not acknowledged then
            return
        self.last_ids[worker] = e.id
        if m["shard"] != self.shard:
            self.rejected += 1
            why = f"a gradient for shard {m['shard']} on shard {self.shard}'s stream"
            dead_letter(self.client, self.sk, self.consumer.source(e.stream), why, None, e.id)
            return
        lag = self.updates - m["version"]
        if lag < 0:
            self.drops["future"] += 1
            return
        self.staleness.append(lag)
        self.lags[next(name for name, below in LAGS if below is None or lag < below)] += 1
        if lag > self.cfg.ps_max_staleness:
            self.drops["stale"] += 1
            return
        if not self.typical(m["loss"]):
            self.drops["outlier"] += 1
            return
        grad = torch.from_numpy(m["grad"].astype(np.float32))
        # a worker clips its whole gradient to grad_clip: no block of it is longer
        if float(grad.norm()) > self.cfg.grad_clip * 1.001 + 1e-6:
            self.drops["norm"] += 1
            return
        if not self.admit(worker):
            self.drops["flood"] += 1
            return
        self.param.grad = grad.to(self.param.device)
        self.opt.step()
        self.updates += 1
        self.losses.append(m["loss"])

    def admit(self, worker: int) -> bool:
        """Whether a gradient of ``worker`` may be applied (then counted as applied): not if,
        with it, the worker would have more than ``ps_max_share`` of the last
        :data:`SHARE_WINDOW` applied while another worker pushed in the last
        :data:`ALONE_S` seconds. Pushing faster than the others then wins a worker no more
        than its share, and the others' gradients still go in; a worker left alone (the
        others stopped or died) is not held back.

        ``worker`` is the number of the stream the gradient came from, never what a message
        says: with per-instance users (``qrl run join``: each machine its own user, which
        writes its own number's streams only) the share bounds what one machine gets
        applied, whatever it claims. A user of the whole role (``qrl run create --acl``'s
        shared worker user, or no ACL user) writes every worker's stream, so it may still
        push as many workers and get as many shares."""
        now = clock.now()
        self.pushed[worker] = now
        if len(self.pushed) > 2:  # the latest other pusher is always one of the last two
            del self.pushed[min(self.pushed, key=self.pushed.__getitem__)]
        share = self.cfg.ps_max_share or min(1.0, 1.5 / self.workers)
        crowded = any(w != worker and now - t < ALONE_S for w, t in self.pushed.items())
        if crowded and self.held[worker] >= math.ceil(share * SHARE_WINDOW):
            return False
        self.applied.append(worker)
        self.held[worker] += 1
        if len(self.applied) >= SHARE_WINDOW:
            gone = self.applied.popleft()
            self.held[gone] -= 1
            if not self.held[gone]:
                del self.held[gone]
        return True

    def typical(self, loss: float) -> bool:
        """Gorila's rule: whether ``loss`` is within ``ps_loss_sigmas`` standard deviations
        of the running mean (always, while that is off or warming up). The statistics take
        every loss, an outlier's at the rule's edge, so one writer cannot drag them far and a
        real drift still moves them."""
        mean, var, n = self.loss_stats
        k = self.cfg.ps_loss_sigmas
        edge = k * math.sqrt(var)
        ok = k == 0 or n < WARMUP or abs(loss - mean) <= edge
        x = loss if ok or k == 0 else mean + math.copysign(edge, loss - mean)
        n += 1
        a = max(1.0 / n, 0.01)
        d = x - mean
        self.loss_stats = [mean + a * d, (1 - a) * (var + a * d * d), n]
        return ok

    def persist(self) -> None:
        """Save the state a restart resumes from (chunks, then one manifest switch); skipped,
        with a warning, while Redis refuses writes (out of memory): a restart then resumes
        from an older one."""
        state = self.state()
        if optional(self.saved.key, lambda: self.saved.replace(state)) is None:
            log.warning("shard %d: Redis refused its state (out of memory?)", self.shard)

    def publish_block(self) -> None:
        block = {"block": self.param.detach().cpu().numpy()}
        self.updates = self.published = self.store.publish(block, self.updates)

    def _whole(self) -> int | None:
        """The whole parameter vector in ``self.whole`` (the others' blocks as published);
        its version (the newest block's: the gradients applied, each going to every shard,
        so that rates per version mean what they mean with one learner), or None while a
        block is missing."""
        self.whole[self.flat.block(self.shard)] = self.param.detach().cpu()
        self.peer_versions[self.shard] = self.updates
        fetch_blocks(self.peers, self.peer_versions, self.flat, self.whole, skip=self.shard)
        return None if min(self.peer_versions) < 0 else max(self.peer_versions)

    def publish(self) -> None:
        """The whole network to the run's weights key, when it changed (shard 0 does, every
        ``ps_publish_s``)."""
        version = self._whole()
        if version is None or version == self.run_from:
            return
        self.flat.load(self.whole)
        self.run_weights.publish(self.net, version)  # (above a writer's newer one, if any)
        self.run_from = version

    def save(self) -> None:
        """Shard 0: the run's checkpoint, the whole network (the blocks as published) and its
        own saved state. Not the other shards' saved states: a state it did not make is
        not its to vouch for; a shard without one in the checkpoint takes its block from
        the network, with a fresh optimizer."""
        if self.checkpoint is None or self.shard != 0:
            return
        version = self._whole()
        if version is None:
            return
        self.flat.load(self.whole)
        s = self.state()
        own = {
            "version": s["version"],
            "params": torch.from_numpy(s["params"]),
            "opt": {n: torch.from_numpy(v) for n, v in s["opt"].items()},
            "loss": torch.tensor(s["loss"], dtype=torch.float64),
        }
        states = [own if k == self.shard else None for k in range(self.cfg.ps_shards)]
        extra = {"ps": {"shards": self.cfg.ps_shards, "states": states}}
        save_checkpoint(self.checkpoint, self.algo, self.cfg, self.net, None, version, extra)

    def reconfigure(self, cfg: Config) -> None:
        super().reconfigure(cfg)
        for group in self.opt.param_groups:
            group["lr"] = cfg.lr

    def metrics(self) -> dict[str, Any]:
        losses, self.losses = self.losses, []
        lags, self.staleness = self.staleness, []
        pct = np.percentile(lags, [50, 90, 100]) if lags else [0.0, 0.0, 0.0]
        return {
            "updates": self.updates,
            "loss": float(np.mean(losses)) if losses else 0.0,
            "staleness_p50": float(pct[0]),
            "staleness_p90": float(pct[1]),
            "staleness_max": float(pct[2]),
            **{k: float(v) for k, v in self.drops.items()},
            **{k: float(v) for k, v in self.lags.items()},
            "rejected": float(self.rejected + self.consumer.rejected),
            "replayed": float(self.replayed),
            "shard": self.shard,
            "lr": float(self.opt.param_groups[0]["lr"]),
        }

    def close(self, should_stop: StopCheck) -> None:
        if self.shard == 0:
            self.publish()
        self.consumer.close()
