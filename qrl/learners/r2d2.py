"""The R2D2 learner: the Ape-X learner's sampler process, priority writes, target syncs and
skipped-batch handling (:class:`qrl.learners.replay.ReplayLearner`) on a replay of sequences;
the loss is R2D2's (:mod:`qrl.algos.r2d2.rule`): the LSTM unrolled from each
sequence's stored state,
n-step double-Q targets under the value rescaling, loss after the burn-in, and the
sequence priority ``eta max|delta| + (1 - eta) mean|delta|`` written back."""

from __future__ import annotations

import numpy as np
import torch

from qrl.algos.r2d2.rule import Sequences, rule_of, sequence_loss, sequence_priority, sequence_td
from qrl.learners.base import adam
from qrl.learners.replay import ReplayLearner
from qrl.replay.sequences import sequence_spec
from qrl.replay.store import Sample
from qrl.rl.models import recurrent_q_network


class SequenceBatch:
    """A sample of sequences as tensors on the learner's device."""

    def __init__(self, s: Sample, device: torch.device) -> None:
        self.ids, self.slot = s.ids, s.slot
        self.seq = Sequences.of(s.batch, device)
        self.weight = torch.from_numpy(s.weights).to(device)
        self.priority: torch.Tensor | None = None
        self.new_priorities: np.ndarray | None = None


class R2D2Learner(ReplayLearner):
    algo = "r2d2"
    batch_type = SequenceBatch

    def build(self) -> torch.nn.Module:
        cfg = self.cfg
        self.target = recurrent_q_network(cfg, self.env).to(self.device).requires_grad_(False)
        self.rule = rule_of(cfg)
        self.layout, _ = sequence_spec(cfg, self.env)
        return recurrent_q_network(cfg, self.env).to(self.device)

    def optimizer(self) -> torch.optim.Optimizer:
        return adam(self.net.parameters(), lr=self.cfg.lr, eps=self.cfg.adam_eps)

    def start_items(self) -> int:
        return self.cfg.start_sequences

    def loss(self, b: SequenceBatch) -> torch.Tensor:  # type: ignore[override]
        q, y, mask = sequence_td(self.net, self.target, b.seq, self.rule)
        b.priority = sequence_priority((y - q).detach(), mask, self.rule.eta)
        return sequence_loss(q, y, mask, b.weight)
