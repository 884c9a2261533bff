"""The replay role: drains the experience stream through the consumer group into the
prioritized replay, acknowledging each entry only after its insert. Several can run side by
side; a re-delivered batch is not inserted twice (the insert is idempotent by batch id).
With ``replay_shards`` > 1, filler ``i`` drains shard ``i mod replay_shards``: that shard's
stream into that shard's replay (:mod:`qrl.replay.shards`)."""

from __future__ import annotations

import logging
from typing import Any

import redis

from qrl.algos.apex_family.config import ReplayConfig
from qrl.algos.apex_family.messages import experience_schema, frames_schema
from qrl.replay.frames import is_frame_stack, layout_for, replay_class
from qrl.replay.shards import filler_shard, shard_capacity
from qrl.replay.store import PrioritizedReplay, RecordLayout
from qrl.rl.envspec import EnvSpec
from qrl.runtime.loop import Role, StopCheck
from qrl.wire.keys import RunKeys
from qrl.wire.schema import Schema
from qrl.wire.streams import Entry, StreamConsumer

log = logging.getLogger(__name__)


def experience_spec(env: EnvSpec, max_rows: int = 4096) -> tuple[RecordLayout, Schema]:
    """The replay layout and the experience-stream schema of ``env``'s transitions:
    discrete actions (Ape-X; stacked frames sent and stored once) or a Box action vector
    (Ape-X DPG: float32, within the space's bounds)."""
    obs_shape, obs_dtype = env.obs_shape, env.obs_dtype
    if env.action_kind == "continuous":
        low, high = env.box_actions()
        layout = RecordLayout(obs_shape, obs_dtype, action_shape=low.shape, action_dtype="float32")
        return layout, experience_schema(obs_shape, obs_dtype, 0, max_rows, (low, high))
    n_actions = env.discrete_actions()
    if is_frame_stack(obs_shape, obs_dtype):
        schema = frames_schema(obs_shape, n_actions, max_rows=max_rows)
    else:
        schema = experience_schema(obs_shape, obs_dtype, n_actions, max_rows=max_rows)
    return layout_for(obs_shape, obs_dtype, n_actions), schema


def make_replay(
    client: redis.Redis,
    keys: RunKeys,
    cfg: ReplayConfig,
    seed: int | None = None,
    shard: int = 0,
    layout: RecordLayout | None = None,
) -> PrioritizedReplay:
    """Shard ``shard`` of the run's replay (the whole replay when it has one shard), of
    ``layout``'s records (default: the transitions of ``cfg.env``, :func:`experience_spec`)."""
    layout = layout or experience_spec(EnvSpec.of(cfg.env))[0]
    return replay_class(layout)(
        client,
        keys.shards(cfg.replay_shards)[shard],
        layout,
        shard_capacity(cfg.replay_capacity, cfg.replay_shards),
        mode=cfg.replay_mode,  # type: ignore[arg-type]
        alpha=cfg.alpha,
        seed=seed,
    )


class ReplayFiller(Role):
    """Drains the experience stream into the replay (``qrl replay``). A replay of other
    items (R2D2's sequences) overrides :meth:`spec`: its layout makes them of a message
    (:meth:`qrl.replay.store.RecordLayout.items`)."""

    name = "replay"
    counter = "inserted"

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        cfg: ReplayConfig,
        ident: int = 0,
        env: EnvSpec | None = None,
    ) -> None:
        self.client, self.ident = client, ident
        self.shard = filler_shard(ident, cfg.replay_shards)
        layout, schema = self.spec(cfg, env or EnvSpec.of(cfg.env))
        self.replay = make_replay(client, keys, cfg, shard=self.shard, layout=layout)
        self.keys = self.replay.keys  # the shard's: its stream, dead letters and counters
        self.consumer = StreamConsumer(
            client,
            self.keys,
            self.keys.experience,
            schema,
            count=8,
            claim_idle_ms=cfg.claim_idle_ms,
        )
        self.inserted = 0
        if cfg.replay_shards > 1:
            log.info(
                "filler %d drains shard %d of %d (each shard needs a filler: fillers 0-%d)",
                ident,
                self.shard,
                cfg.replay_shards,
                cfg.replay_shards - 1,
            )

    def spec(self, cfg: ReplayConfig, env: EnvSpec) -> tuple[RecordLayout, Schema]:
        """The replay's record layout and the schema of the stream's messages."""
        rows = cfg.actor_batch + cfg.envs_per_actor * cfg.n_step
        return experience_spec(env, max_rows=rows)

    def records(self, d: dict[str, Any]) -> Any:
        """The replay items of a decoded message, in the order of its ``priority``: its
        layout's (records, or chunks of frames)."""
        return self.replay.layout.items(d)

    def handle(self, entries: list[Entry]) -> None:
        for e in entries:
            d = e.data
            if self.replay.insert(self.records(d), d["priority"], batch_id=d["batch"]) >= 0:
                self.inserted += len(d["priority"])

    def step(self, should_stop: StopCheck) -> bool:
        self.consumer.process(self.handle, block_ms=200)
        return True

    def close(self, should_stop: StopCheck) -> None:
        self.consumer.close()

    def metrics(self) -> dict[str, float]:
        return {
            "inserted": self.inserted,
            "size": self.replay.stats()["size"],
            "shard": self.shard,
            "rejected": self.consumer.rejected,
        }
