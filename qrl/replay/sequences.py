"""R2D2's replay items: fixed-length sequences with the LSTM state at their start, one
replay item (one sorted-set member, one record) per sequence.

* :class:`Sequencer` cuts each env slot's episodes into sequences of ``length`` steps, a new
  one every ``length - overlap`` steps; an episode's end cuts the sequence it is in, which is
  padded with zeros after its final observation (``steps`` says how many are real). A
  sequence's record holds ``obs [length + 1]`` (the observation after its last step
  bootstraps), ``action``, ``reward [length]``, ``steps``, ``terminal``, ``first`` and the
  LSTM state ``h0``, ``c0`` the actor had before its first step.
* :class:`SequenceLayout` is that record (a :class:`qrl.replay.store.RecordLayout` with
  other fields): the replay, its shards and the sampler store and sample it like a
  transition.
* :class:`SequenceFiller` is the replay role for them (``qrl replay`` of an R2D2 run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qrl.algos.r2d2.config import R2D2Config
from qrl.algos.r2d2.messages import sequence_schema
from qrl.replay.role import ReplayFiller
from qrl.replay.store import RecordLayout
from qrl.rl.envspec import EnvSpec
from qrl.wire.schema import Schema

# the fields of a sequence, as the actor sends them and the replay stores them
FIELDS = ("obs", "action", "reward", "steps", "terminal", "first", "h0", "c0")


@dataclass
class SequenceLayout(RecordLayout):
    """The record of one sequence of ``length`` steps with an LSTM state of ``lstm``."""

    length: int = field(default=1, kw_only=True)
    lstm: int = field(default=1, kw_only=True)

    def fields(self) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
        t, f4, i4 = self.length, np.dtype("<f4"), np.dtype("<i4")
        return [
            ("obs", np.dtype(self.obs_dtype).newbyteorder("<"), (t + 1, *self.obs_shape)),
            ("action", i4, (t,)),
            ("reward", f4, (t,)),
            ("steps", i4, ()),
            ("terminal", np.dtype("?"), ()),
            ("first", np.dtype("?"), ()),
            ("h0", f4, (self.lstm,)),
            ("c0", f4, (self.lstm,)),
        ]


def sequence_spec(
    cfg: R2D2Config, env: EnvSpec, max_rows: int = 4096
) -> tuple[SequenceLayout, Schema]:
    """The replay layout and the stream schema of ``cfg``'s sequences on ``env``."""
    obs_shape, obs_dtype, n_actions = env.obs_shape, env.obs_dtype, env.discrete_actions()
    layout = SequenceLayout(
        obs_shape, obs_dtype, length=cfg.sequence_length, lstm=cfg.lstm, n_actions=n_actions
    )
    schema = sequence_schema(
        obs_shape, obs_dtype, n_actions, cfg.sequence_length, cfg.lstm, max_rows=max_rows
    )
    return layout, schema


def max_rows(cfg: R2D2Config) -> int:
    """The most sequences one actor message holds (a batch, plus one per env slot that
    ended an episode in the step that filled it)."""
    return cfg.actor_batch + 2 * cfg.envs_per_actor


class SequenceFiller(ReplayFiller):
    """Drains R2D2's sequence stream into the replay (``qrl replay`` of an R2D2 run)."""

    def spec(self, cfg: R2D2Config, env: EnvSpec) -> tuple[RecordLayout, Schema]:
        return sequence_spec(cfg, env, max_rows(cfg))


class Sequencer:
    """Per env slot, the steps of the current sequence. ``add`` returns the sequences that
    became complete (dicts of :data:`FIELDS`, numpy arrays), their env slots in ``slots``."""

    def __init__(
        self,
        num_envs: int,
        length: int,
        overlap: int,
        obs_shape: tuple[int, ...],
        obs_dtype: str,
        lstm: int,
    ) -> None:
        if not 0 <= overlap < length:
            raise ValueError(f"overlap {overlap} must be in [0, length {length})")
        self.length, self.overlap = length, overlap
        self.obs_shape, self.obs_dtype, self.lstm = tuple(obs_shape), obs_dtype, lstm
        # per slot: (obs, action, reward, h, c) of each step since the sequence's start
        self.buf: list[list[tuple[np.ndarray, int, float, np.ndarray, np.ndarray]]] = [
            [] for _ in range(num_envs)
        ]
        self.sent = [0] * num_envs  # leading steps of the buffer already in a sequence sent
        self.first = [True] * num_envs  # the buffer starts an episode
        self.slots: list[int] = []

    def add(
        self,
        obs: np.ndarray,
        actions: np.ndarray,
        rewards: np.ndarray,
        next_obs: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
        h: np.ndarray,
        c: np.ndarray,
    ) -> list[dict[str, Any]]:
        """One vector step: ``obs`` the observations acted on, ``h``, ``c`` the LSTM state
        the actor had before acting, ``next_obs`` the true next observations (an ended
        episode's final one)."""
        out, self.slots = [], []
        for j, buf in enumerate(self.buf):
            buf.append((obs[j], int(actions[j]), float(rewards[j]), h[j], c[j]))
            if terminated[j] or truncated[j]:
                if len(buf) > self.sent[j]:  # steps no sequence holds yet
                    out.append(self._sequence(j, next_obs[j], bool(terminated[j])))
                    self.slots.append(j)
                buf.clear()
                self.sent[j], self.first[j] = 0, True
            elif len(buf) == self.length:
                out.append(self._sequence(j, next_obs[j], False))
                self.slots.append(j)
                del buf[: self.length - self.overlap]
                self.sent[j], self.first[j] = self.overlap, False
        return out

    def _sequence(self, j: int, last_obs: np.ndarray, terminal: bool) -> dict[str, Any]:
        buf, t = self.buf[j], self.length
        n = len(buf)
        obs = np.zeros((t + 1, *self.obs_shape), self.obs_dtype)
        action, reward = np.zeros(t, np.int32), np.zeros(t, np.float32)
        for i, (o, a, r, _, _) in enumerate(buf):
            obs[i], action[i], reward[i] = o, a, r
        obs[n] = last_obs
        return {
            "obs": obs,
            "action": action,
            "reward": reward,
            "steps": n,
            "terminal": terminal,
            "first": self.first[j],
            "h0": np.asarray(buf[0][3], np.float32),
            "c0": np.asarray(buf[0][4], np.float32),
        }


def stack(sequences: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Sequences as one array per field (the message's and the record's dtypes)."""
    dtypes = {"steps": np.int32, "terminal": np.bool_, "first": np.bool_}
    return {
        k: np.asarray([s[k] for s in sequences], dtypes.get(k))
        if k in dtypes
        else np.stack([s[k] for s in sequences])
        for k in FIELDS
    }
