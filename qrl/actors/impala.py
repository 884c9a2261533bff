"""The IMPALA actor's sink: unrolls with the behaviour logits to the trajectory stream
(:class:`qrl.actors.unrolls.UnrollSink`); ``qrl/learners/impala.py`` consumes them. Its
other parts are the unroll algorithms' (:class:`qrl.actors.unrolls.SampledPolicy`)."""

from __future__ import annotations

import redis

from qrl.actors.unrolls import UnrollSink
from qrl.algos.impala.config import ImpalaConfig
from qrl.algos.impala.keys import trajectories
from qrl.algos.impala.messages import unroll_schema
from qrl.rl.envspec import EnvSpec
from qrl.wire.keys import RunKeys


def trajectory_sink(
    client: redis.Redis, keys: RunKeys, cfg: ImpalaConfig, actor_id: int, env: EnvSpec
) -> UnrollSink:
    return UnrollSink(client, keys, trajectories(keys), cfg, actor_id, env, unroll_schema)
