"""Env steps A3C's gradient needs to solve CartPole-v1 with nothing distributed: one worker's
parts (:class:`qrl.actors.a3c.A3CPolicy` and :class:`qrl.actors.a3c.GradientSink`, the code
the workers run) in one process, the gradient applied at once by a local optimizer built as
the parameter server builds it, so no asynchrony, no staleness and no Redis. Learning per
env step, apart from the job around it: what SB3's A2C is measured on too.

    python benchmarks/a3c_steps.py --seeds 0 1 2 3 4 5 6 7
    python benchmarks/a3c_steps.py --seeds 0 1 2 3 --set activation=relu

Every 2,000 env steps (SB3's `EvalCallback` cadence in `benchmarks/solve_time.py`) the
greedy policy plays 10 episodes; a mean at 475 is confirmed on 100 fresh ones (as `qrl
train` does). Prints the env steps each seed needed (or that it did not solve within
``--max-steps``); seeds run one after the other, each in its own process's time.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from qrl.actors.a3c import A3CPolicy, GradientSink
from qrl.actors.envs import EnvRunner
from qrl.algos.a3c.builder import make_optimizer
from qrl.algos.a3c.config import A3CConfig
from qrl.rl.envspec import EnvSpec
from qrl.rl.evaluate import evaluate
from qrl.rl.models import policy_value_net
from qrl.runtime.config import parse_config, parse_overrides

ENV, TARGET, EVERY = "CartPole-v1", 475.0, 2_000


class LocalServer:
    """What :class:`GradientSink` pushes to, applying each gradient at once (the parameter
    server's optimizer step, without the server)."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt

    def push(self, loss: float, should_stop: object) -> bool:
        self.opt.step()
        return True

    def waited_s(self) -> float:
        return 0.0


def steps_to_solve(cfg: A3CConfig, max_steps: int) -> int | None:
    torch.manual_seed(cfg.seed)
    spec = EnvSpec.of(cfg.env)
    net = policy_value_net(cfg, spec)
    runner = EnvRunner(cfg, 0, spec, cfg.envs_per_worker)
    policy = A3CPolicy(net, cfg, 0)
    sink = GradientSink(net, LocalServer(make_optimizer(list(net.parameters()), cfg)), cfg)  # type: ignore[arg-type]

    def greedy(obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return net(torch.as_tensor(obs))[0].argmax(-1).numpy()

    def score(episodes: int, seed: int) -> float:
        return float(np.mean(evaluate(cfg.env, greedy, episodes, seed=seed)))

    obs, steps, next_eval = runner.reset(), 0, EVERY
    while steps < max_steps:
        actions, extra = policy.act(obs, lambda: False)
        step = runner.step(actions)
        if sink.add(obs, actions, extra, step, 0):
            sink.flush(steps, None, lambda: False)  # type: ignore[arg-type]
        obs, steps = step.next_obs, steps + len(actions)
        if steps >= next_eval:
            next_eval += EVERY
            if score(10, 10_000 + steps) >= TARGET and score(100, 1_000_000) >= TARGET:
                return steps
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--max-steps", type=int, default=500_000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    needed = []
    for seed in args.seeds:
        values = {"env": ENV, "seed": seed, **parse_overrides(tuple(args.sets))}
        cfg = parse_config(A3CConfig, values)
        n = steps_to_solve(cfg, args.max_steps)
        needed.append(args.max_steps if n is None else n)
        print(f"seed {seed}: " + ("not solved" if n is None else f"solved at {n} env steps"))
    settings = " ".join(args.sets) or "the defaults"
    print(f"median {int(np.median(needed))} env steps over seeds {args.seeds} ({settings})")


if __name__ == "__main__":
    main()
