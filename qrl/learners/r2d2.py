"""The R2D2 learner's update rule, on the Ape-X family's replay source
(:class:`qrl.learners.replay.ReplaySource`) of sequences: the LSTM unrolled from each
sequence's stored state (:mod:`qrl.algos.r2d2.rule`), n-step double-Q targets under the
value rescaling, loss after the burn-in, the sequence priority
``eta max|delta| + (1 - eta) mean|delta|`` returned for the replay, and the target network
copied every ``target_update`` updates."""

from __future__ import annotations

import torch

from qrl.algos.r2d2.config import R2D2Config
from qrl.algos.r2d2.rule import Sequences, rule_of, sequence_loss, sequence_priority, sequence_td
from qrl.learners.base import adam
from qrl.learners.rule import Rule, Update
from qrl.replay.sequences import sequence_spec
from qrl.replay.store import Sample
from qrl.rl.envspec import EnvSpec
from qrl.rl.models import recurrent_q_network


class SequenceBatch:
    """A sample of sequences as tensors on the learner's device."""

    def __init__(self, s: Sample, device: torch.device) -> None:
        self.ids, self.slot = s.ids, s.slot
        self.seq = Sequences.of(s.batch, device)
        self.weight = torch.from_numpy(s.weights).to(device)


class R2D2Rule(Rule):
    def __init__(self, cfg: R2D2Config, env: EnvSpec, device: torch.device) -> None:
        self.cfg = cfg
        self.target = recurrent_q_network(cfg, env).to(device).requires_grad_(False)
        self.sequences = rule_of(cfg)  # its maths' settings
        self.layout, _ = sequence_spec(cfg, env)
        self.net = recurrent_q_network(cfg, env).to(device)

    def optimizer(self) -> torch.optim.Optimizer:
        return adam(self.net.parameters(), lr=self.cfg.lr, eps=self.cfg.adam_eps)

    def begin(self) -> None:
        self.target.load_state_dict(self.net.state_dict())

    def loss(self, b: SequenceBatch, updates: int) -> Update:
        q, y, mask = sequence_td(self.net, self.target, b.seq, self.sequences)
        priorities = sequence_priority((y - q).detach(), mask, self.sequences.eta)
        return Update(sequence_loss(q, y, mask, b.weight), priorities)

    def after_step(self, updates: int, steps: int) -> None:
        if updates % self.cfg.target_update == 0:
            self.target.load_state_dict(self.net.state_dict())
