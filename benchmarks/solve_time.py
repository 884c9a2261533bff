"""Time to solve a task: `qrl train ALGO` against a baseline, one after the other.

    pip install -e ".[bench]"
    python benchmarks/solve_time.py --algo apex --seeds 0 1 2      # CartPole-v1, SB3 DQN
    python benchmarks/solve_time.py --algo impala --seeds 0 1 2    # CartPole-v1, SB3 PPO
    python benchmarks/solve_time.py --algo ppo --seeds 0 1 2 3 4 # CartPole-v1, SB3 PPO
    python benchmarks/solve_time.py --algo es --seeds 0 1 2        # CartPole-v1, evotorch PGPE
    python benchmarks/solve_time.py --algo a3c --seeds 0 1 2 3 4   # CartPole-v1, SB3 A2C
    python benchmarks/solve_time.py --algo apex-dpg --seeds 0 1 2  # Pendulum-v1, SB3 TD3
    python benchmarks/solve_time.py --algo r2d2 --seeds 0 1 2      # qrl/CartPoleNoVel-v1,
                                                                   # sb3-contrib RecurrentPPO

Both sides must reach the task's target as a greedy evaluation mean over 10 episodes
(CartPole-v1 and its velocity-hidden qrl/CartPoleNoVel-v1 475, Pendulum-v1 -200),
confirmed on 100 fresh episodes (`qrl train`'s rule, gymnasium's definition of solving
CartPole-v1; training goes on when they do not confirm it). Each is timed as a whole
process, from its start (imports included) to its exit: qrl by the `qrl train` command,
exiting 0 once its evaluation passes; SB3 baselines with the rl-baselines3-zoo
hyperparameters for the task and, by default, the zoo's own step budget (its schedules are
fractions of it), evaluated every 2,000 steps by an `EvalCallback`; evotorch's PGPE
evaluating its center policy every generation. A qrl run that does not solve within the
budget counts as its budget and a baseline that does not solve as infinite (so medians
stay honest). Prints every time and the ratio of medians qrl / baseline (goal <= 1.0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

# rl-baselines3-zoo hyperparams/dqn.yml, CartPole-v1
SB3_DQN = dict(
    learning_rate=2.3e-3,
    batch_size=64,
    buffer_size=100_000,
    learning_starts=1000,
    gamma=0.99,
    target_update_interval=10,
    train_freq=256,
    gradient_steps=128,
    exploration_fraction=0.16,
    exploration_final_eps=0.04,
    policy_kwargs=dict(net_arch=[256, 256]),
)
# rl-baselines3-zoo hyperparams/ppo.yml, CartPole-v1 (n_envs 8; lin_X = linear decay from X)
SB3_PPO = dict(
    n_steps=32,
    batch_size=256,
    gae_lambda=0.8,
    gamma=0.98,
    n_epochs=20,
    ent_coef=0.0,
    learning_rate=lambda progress: 0.001 * progress,
    clip_range=lambda progress: 0.2 * progress,
)
# rl-baselines3-zoo hyperparams/a2c.yml, CartPole-v1 (n_envs 8, 5e5 steps; the rest are
# SB3's A2C defaults: n_steps 5, RMSprop lr 7e-4, vf_coef 0.5, max_grad_norm 0.5)
SB3_A2C = dict(ent_coef=0.0)
# evotorch's PGPE as its README configures it (ClipUp), with the population of 100, the
# 16-unit hidden layer and the two Ray actors of the anchor run named in the ES issue
PGPE = dict(
    popsize=100,
    center_learning_rate=0.01125,
    stdev_learning_rate=0.1,
    optimizer_config={"max_speed": 0.015},
    radius_init=0.27,
)
# rl-baselines3-zoo hyperparams/td3.yml, Pendulum-v1 (noise_type normal, noise_std 0.1)
SB3_TD3 = dict(
    gamma=0.98,
    buffer_size=200_000,
    learning_starts=10_000,
    train_freq=1,
    gradient_steps=1,
    learning_rate=1e-3,
    policy_kwargs=dict(net_arch=[400, 300]),
)
# rl-baselines3-zoo hyperparams/ppo_lstm.yml, CartPoleNoVel-v1 (n_envs 8, normalize: True,
# i.e. VecNormalize of observations and rewards with the algorithm's gamma; policy
# MlpLstmPolicy; activation_fn named here, resolved to torch.nn's in the worker)
SB3_PPO_LSTM = dict(
    n_steps=32,
    batch_size=256,
    gae_lambda=0.8,
    gamma=0.98,
    n_epochs=20,
    ent_coef=0.0,
    learning_rate=lambda progress: 0.001 * progress,
    clip_range=lambda progress: 0.2 * progress,
    policy_kwargs=dict(
        ortho_init=False,
        activation_fn="ReLU",
        lstm_hidden_size=64,
        enable_critic_lstm=True,
        net_arch=dict(pi=[64], vf=[64]),
    ),
)


class Task(NamedTuple):
    """One comparison: the env, its target, qrl's budget and the baseline's settings."""

    env: str
    target: float
    budget: float  # seconds per qrl run
    baseline: str  # display name
    cls: str  # SB3 class name (or "PGPE")
    hp: dict[str, Any]  # the zoo's hyperparameters
    n_envs: int  # SB3 n_envs (PGPE: Ray actors)
    zoo_steps: int  # the zoo's n_timesteps (0: not SB3)
    noise_std: float = 0.0  # SB3 off-policy Gaussian action noise (zoo noise_std)
    module: str = "stable_baselines3"  # where cls is (sb3_contrib for RecurrentPPO)
    policy: str = "MlpPolicy"
    normalize: bool = False  # the zoo's `normalize: True`: VecNormalize(gamma=hp gamma)
    baseline_limit: float = 600.0  # seconds a baseline run may take (then: not solved)


CONFIRM = 100  # an evaluation that reached the target is confirmed on this many episodes


TASKS = {
    "apex": Task("CartPole-v1", 475.0, 90.0, "SB3 DQN", "DQN", SB3_DQN, 1, 50_000),
    "impala": Task("CartPole-v1", 475.0, 90.0, "SB3 PPO", "PPO", SB3_PPO, 8, 100_000),
    "ppo": Task("CartPole-v1", 475.0, 90.0, "SB3 PPO", "PPO", SB3_PPO, 8, 100_000),
    "es": Task("CartPole-v1", 475.0, 90.0, "evotorch PGPE", "PGPE", PGPE, 2, 0),
    "a3c": Task("CartPole-v1", 475.0, 90.0, "SB3 A2C", "A2C", SB3_A2C, 8, 500_000),
    "apex-dpg": Task(
        "Pendulum-v1", -200.0, 300.0, "SB3 TD3", "TD3", SB3_TD3, 1, 20_000, noise_std=0.1
    ),
    "r2d2": Task(
        "qrl/CartPoleNoVel-v1",
        475.0,
        300.0,
        "sb3-contrib RecurrentPPO",
        "RecurrentPPO",
        SB3_PPO_LSTM,
        8,
        100_000,
        module="sb3_contrib",
        policy="MlpLstmPolicy",
        normalize=True,
    ),
}


def pgpe_worker(seed: int, budget: float) -> None:
    """evotorch PGPE until its center policy's greedy evaluation reaches the target."""
    import numpy as np
    import torch
    from evotorch.algorithms import PGPE as Searcher
    from evotorch.neuroevolution import GymNE

    from qrl.rl.evaluate import evaluate  # the same vectorized greedy evaluation as qrl's

    torch.manual_seed(seed)
    problem = GymNE(
        "CartPole-v1",
        "Linear(obs_length, 16) >> Tanh() >> Linear(16, act_length)",
        observation_normalization=True,
        num_actors=TASKS["es"].n_envs,
    )
    searcher = Searcher(problem, **PGPE)
    target, start, gens, best, confirmed = TASKS["es"].target, time.perf_counter(), 0, -1.0, []

    def greedy(policy):  # a batch of observations -> a batch of actions
        @torch.no_grad()
        def act(obs):
            return policy(torch.as_tensor(obs, dtype=torch.float32)).argmax(-1).numpy()

        return act

    while time.perf_counter() - start < budget:
        searcher.step()
        gens += 1
        act = greedy(problem.to_policy(searcher.status["center"]))
        score = float(np.mean(evaluate("CartPole-v1", act, 10, seed=10_000)))
        best = max(best, score)
        if score >= target:  # confirmed on fresh episodes, as qrl's are
            confirmed.append(float(np.mean(evaluate("CartPole-v1", act, CONFIRM, seed=10**6))))
            if confirmed[-1] >= target:
                break
    solved = bool(confirmed) and confirmed[-1] >= target
    print(json.dumps({"solved": solved, "steps": gens, "best": best}))


def baseline_worker(
    algo: str, seed: int, max_steps: int, env_id: str | None = None, eval_id: str | None = None
) -> None:
    """Runs in a child process: train the baseline until an evaluation reaches the target
    and 100 fresh episodes confirm it (qrl's rule), or the step budget runs out. ``env_id``
    and ``eval_id`` replace the task's env for training and for evaluation."""
    import importlib

    import numpy as np
    import torch
    from stable_baselines3.common.callbacks import BaseCallback, EvalCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.evaluation import evaluate_policy
    from stable_baselines3.common.noise import NormalActionNoise
    from stable_baselines3.common.vec_env import VecNormalize, sync_envs_normalization

    import qrl  # noqa: F401  (registers qrl/CartPoleNoVel-v1)

    task = TASKS[algo]
    hp = dict(task.hp)

    def vec_env(n: int, env_seed: int, training: bool) -> Any:
        """The zoo's env: VecNormalize'd if the task says so (evaluation envs keep the
        training statistics, synced before each evaluation, and raw rewards)."""
        env_ = (env_id if training else eval_id or env_id) or task.env
        env = make_vec_env(env_, n_envs=n, seed=env_seed)
        if not task.normalize:
            return env
        if training:
            return VecNormalize(env, gamma=hp["gamma"])
        return VecNormalize(env, gamma=hp["gamma"], training=False, norm_reward=False)

    env = vec_env(task.n_envs, seed, True)
    kwargs = dict(hp.get("policy_kwargs", {}))
    if isinstance(kwargs.get("activation_fn"), str):
        kwargs["activation_fn"] = getattr(torch.nn, kwargs["activation_fn"])
        hp["policy_kwargs"] = kwargs
    if task.noise_std:
        dim = env.action_space.shape[0]
        hp["action_noise"] = NormalActionNoise(np.zeros(dim), task.noise_std * np.ones(dim))
    cls = getattr(importlib.import_module(task.module), task.cls)
    model = cls(task.policy, env, seed=seed, verbose=0, **hp)
    confirm_env = vec_env(CONFIRM, 1_000_000 + seed * 10_000, False)
    confirmed: list[float] = []

    class Confirm(BaseCallback):
        """After each evaluation: one that reached the target is confirmed on CONFIRM fresh
        episodes (one per env, in parallel); training stops once one is."""

        def _on_step(self) -> bool:
            if self.parent.last_mean_reward < task.target:
                return True
            if task.normalize:
                sync_envs_normalization(self.training_env, confirm_env)
            mean, _ = evaluate_policy(self.model, confirm_env, CONFIRM, deterministic=True)
            confirmed.append(float(mean))
            return mean < task.target

    cb = EvalCallback(  # syncs a VecNormalize'd eval env with the training env itself
        vec_env(1, seed + 10_000, False),
        callback_after_eval=Confirm(),
        eval_freq=max(2000 // task.n_envs, 1),
        n_eval_episodes=10,
        deterministic=True,
        verbose=0,
    )
    model.learn(total_timesteps=max_steps, callback=cb)
    solved = bool(confirmed) and confirmed[-1] >= task.target
    best = float(cb.best_mean_reward)
    print(json.dumps({"solved": solved, "steps": model.num_timesteps, "best": best}))


def timed(cmd: list[str], budget: float) -> tuple[float, int | None, str, str]:
    """(seconds, exit code, stdout, stderr) of ``cmd``; exit code None past ``budget`` + 60 s
    (a negative code: killed by that signal)."""
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=budget + 60)
        return time.perf_counter() - t, p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired:
        return time.perf_counter() - t, None, "timeout", ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algo", default="apex", choices=sorted(TASKS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument(
        "--budget", type=float, default=None, help="seconds per qrl run (default: the task's)"
    )
    ap.add_argument(
        "--baseline-steps",
        type=int,
        default=None,
        help="baseline step budget (default: the zoo's n_timesteps for the task)",
    )
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--worker", nargs=2, metavar=("SEED", "STEPS"), help=argparse.SUPPRESS)
    ap.add_argument("--worker-env", nargs=2, metavar=("ENV", "EVAL_ENV"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        if args.algo == "es":
            pgpe_worker(int(args.worker[0]), float(args.worker[1]))
        else:
            envs = args.worker_env or (None, None)
            baseline_worker(args.algo, int(args.worker[0]), int(args.worker[1]), *envs)
        return
    task = TASKS[args.algo]
    budget = args.budget or task.budget
    steps = args.baseline_steps or task.zoo_steps or int(budget)
    ours, theirs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            cmd = [
                sys.executable,
                "-m",
                "qrl.cli",
                "train",
                args.algo,
                "--env",
                task.env,
                "--seed",
                str(seed),
                "--target-return",
                str(task.target),
                "--max-time",
                str(budget),
                "--run-dir",
                str(Path(tmp) / f"{args.algo}-{seed}"),
            ]
            secs, code, _, _ = timed(cmd, budget)
            ours.append(secs if code == 0 else max(secs, budget))
            verdict = "solved" if code == 0 else "FAILED"
            print(f"seed {seed}: qrl {args.algo} {verdict} in {secs:.1f}s", flush=True)
            if args.skip_baseline:
                continue
            cmd = [sys.executable, __file__, "--algo", args.algo, "--worker", str(seed), str(steps)]
            secs, code, out, err = timed(cmd, task.baseline_limit)
            try:
                res = json.loads(out.strip().splitlines()[-1])
            except (json.JSONDecodeError, IndexError):
                if code is not None:  # a crash or a kill is no result, not an infinite time
                    why = (err.strip().splitlines() or ["no output"])[-1]
                    raise SystemExit(
                        f"{task.baseline} worker failed (exit {code}): {why}\n"
                        'the baselines need: pip install -e ".[bench]"'
                    ) from None
                res = {"solved": False, "steps": None, "best": None}
            theirs.append(secs if res["solved"] else float("inf"))
            verdict = "solved" if res["solved"] else "FAILED"
            unit = "generations" if args.algo == "es" else "steps"
            detail = f"{res['steps']} {unit}, best eval {res['best']}"
            print(f"seed {seed}: {task.baseline} {verdict} in {secs:.1f}s ({detail})", flush=True)
    mo = statistics.median(ours)
    print(f"qrl {args.algo}: median {mo:.1f}s over seeds {args.seeds}")
    if theirs:
        mt = statistics.median(theirs)
        print(f"{task.baseline}: median {mt:.1f}s; ratio qrl/{task.baseline} = {mo / mt:.2f}")


if __name__ == "__main__":
    main()
