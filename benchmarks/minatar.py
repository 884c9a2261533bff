"""MinAtar (issue 35): qrl's algorithms against SB3's DQN and PPO on the same wall time.

    pip install -e ".[bench,minatar,plot]"
    python benchmarks/minatar.py --seeds 0 1 2 --minutes 20 \\
        --algos apex impala ppo sb3-dqn sb3-ppo --json notes/minatar-runs.json \\
        --plot docs/minatar-20min.png

One run after the other, each a whole process timed from its start: qrl's `qrl train ALGO
--env MinAtar/GAME-v1 --seed S --max-time T` with its defaults (no `--set`) and the embedded
Redis, then `qrl eval RUN_DIR --episodes 100` (greedy); SB3's (`--sb3 ALGO`: this script in
a child process) trains until T seconds after its process started, then plays 100 episodes
deterministically. Both see the same env: `qrl.rl.envs.make_env` (channels first, the time
limit), cast to float32 for SB3, through the same network (MinAtar's: one 3x3 conv of 16
channels, 128 units). SB3's settings are rl-baselines3-zoo's Atari ones with the step counts
scaled to MinAtar (MinAtar's own DQN baseline: replay start 5,000, target sync 1,000,
epsilon to 0.1 over 100k steps): DQN lr 1e-4, buffer 100k, batch 32, train_freq 4,
learning_starts 5k, target_update_interval 1k, exploration 1.0 -> 0.01 over the first 100k
steps; PPO 8 envs, n_steps 128, 4 epochs, batch 256, lr 2.5e-4 and clip 0.1 (both linear to
0 over 10M steps, more than the budget reaches), ent_coef 0.01, vf_coef 0.5.

Printed: per run the final 100-episode mean return, wall seconds and env steps; per game and
algorithm the mean over seeds; the goals: qrl's best algorithm >= 1.5x the best SB3
baseline, and qrl's Ape-X >= 1.5x SB3's DQN, on every game (all five of MinAtar's by
default). ``--plot`` draws training return against wall time and env steps. Each record
keeps the host it ran on (CPUs and model), so that a table made over days can say so.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# run as a script, this file's folder comes first on the path, and its name would hide the
# minatar package from every import of it here
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

GAMES = ("Asterix", "Breakout", "Freeway", "Seaquest", "SpaceInvaders")
QRL_ALGOS = ("apex", "impala", "ppo", "r2d2")
SB3_ALGOS = ("sb3-dqn", "sb3-ppo")
START = time.time()  # this process's start: SB3's budget counts from it


def _host() -> str:
    """This machine as a record names it: its CPUs and their model (Linux's cpuinfo)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    model = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    return f"{os.cpu_count()} CPUs, {model.group(1) if model else 'unknown model'}"


HOST = _host()
CURVE_POINTS = 2000  # a run's curve is kept at about this many points (the JSON stays small)


def qrl_run(algo: str, game: str, seed: int, seconds: float, run_dir: Path) -> dict:
    env = f"MinAtar/{game}-v1"
    cmd = [sys.executable, "-m", "qrl.cli", "train", algo, "--env", env, "--seed", str(seed)]
    cmd += ["--max-time", str(seconds), "--run-dir", str(run_dir), "--eval-every", "60"]
    t = time.perf_counter()
    # `-m` puts the working folder first on the path: run from benchmarks/, this file would
    # hide the minatar package from the job
    where = run_dir.parent
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 600, cwd=where)
    secs = time.perf_counter() - t
    ev = subprocess.run(
        [sys.executable, "-m", "qrl.cli", "eval", str(run_dir), "--episodes", "100"],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=where,
    )
    found = re.search(r"mean\D*(-?[\d.]+)", ev.stdout)
    rows = _csv(run_dir / "metrics.csv")
    curve = [
        (float(r["time_s"]), float(r["env_steps"]), float(r["episodic_return"]))
        for r in rows
        if r.get("episodic_return") not in (None, "")
    ]
    return {
        "code": proc.returncode,
        "secs": secs,
        "steps": curve[-1][1] if curve else None,
        "final": float(found.group(1)) if found else None,
        "curve": curve,
        "err": "" if found else (ev.stdout + ev.stderr)[-500:],
    }


def _csv(path: Path) -> list[dict[str, str]]:
    try:
        with path.open() as f:
            return list(csv.DictReader(f))
    except OSError:
        return []


def sb3_run(algo: str, game: str, seed: int, seconds: float, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--sb3", algo, "--game", game, "--seed", str(seed)]
    cmd += ["--seconds", str(seconds), "--out", str(out)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 1200)
    secs = time.perf_counter() - t
    try:
        result = json.loads(out.read_text())
    except (OSError, json.JSONDecodeError):
        result = {"final": None, "steps": None, "curve": [], "err": proc.stderr[-500:]}
    return {"code": proc.returncode, "secs": secs, **result}


def sb3_child(algo: str, game: str, seed: int, seconds: float, out: Path) -> None:
    """SB3 training to the wall budget, then 100 deterministic episodes; a JSON to ``out``."""
    import gymnasium as gym
    import numpy as np
    import torch
    from stable_baselines3 import DQN, PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.torch_layers import BaseFeaturesExtractor

    from qrl.rl.envs import make_env
    from qrl.rl.models import conv_torso

    torch.set_num_threads(1)  # as qrl's roles (each process one thread on a 2-core machine)

    class Floats(gym.ObservationWrapper):
        def __init__(self, env: gym.Env) -> None:
            super().__init__(env)
            self.observation_space = gym.spaces.Box(0.0, 1.0, env.observation_space.shape)

        def observation(self, obs: np.ndarray) -> np.ndarray:
            return obs.astype(np.float32)

    class MinAtarNet(BaseFeaturesExtractor):
        def __init__(self, space: gym.spaces.Box) -> None:
            net, width = conv_torso(space.shape, "minatar", 1.0)
            super().__init__(space, width)
            self.net = net

        def forward(self, obs: torch.Tensor) -> torch.Tensor:
            return self.net(obs)

    env_id, curve, t0 = f"MinAtar/{game}-v1", [], START

    class Budget(BaseCallback):
        def _on_step(self) -> bool:
            for info in self.locals.get("infos", []):
                if "episode" in info:
                    curve.append((time.time() - t0, self.num_timesteps, info["episode"]["r"]))
            return time.time() - t0 < seconds

    def make() -> gym.Env:
        return Floats(make_env(env_id))

    policy = {"features_extractor_class": MinAtarNet, "net_arch": []}
    if algo == "sb3-dqn":
        model = DQN(
            "MlpPolicy",
            make_vec_env(make, 1, seed=seed),
            learning_rate=1e-4,
            buffer_size=100_000,
            learning_starts=5_000,
            batch_size=32,
            train_freq=4,
            gradient_steps=1,
            target_update_interval=1_000,
            exploration_fraction=0.01,
            exploration_final_eps=0.01,
            policy_kwargs=policy,
            seed=seed,
            verbose=0,
        )
        total = 10_000_000  # exploration over its first 1%: 100k steps
    else:
        linear = lambda v: lambda progress: v * progress  # noqa: E731
        model = PPO(
            "MlpPolicy",
            make_vec_env(make, 8, seed=seed),
            n_steps=128,
            n_epochs=4,
            batch_size=256,
            learning_rate=linear(2.5e-4),
            clip_range=linear(0.1),
            ent_coef=0.01,
            vf_coef=0.5,
            policy_kwargs=policy,
            seed=seed,
            verbose=0,
        )
        total = 10_000_000
    model.learn(total, callback=Budget())
    returns = []
    env = make()
    for i in range(100):
        obs, _ = env.reset(seed=12345 + i)
        done, total_r = False, 0.0
        while not done:
            action, _ = model.predict(obs, deterministic=True)
            obs, r, term, trunc, _ = env.step(int(action))
            total_r, done = total_r + float(r), term or trunc
        returns.append(total_r)
    out.write_text(
        json.dumps({"final": float(np.mean(returns)), "steps": model.num_timesteps, "curve": curve})
    )


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    games = sorted({k[0] for k in results})
    algos = sorted({k[1] for k in results})
    colour = {a: f"C{i}" for i, a in enumerate(algos)}  # one per algorithm, a style per seed
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(len(games), 2, figsize=(12, 4 * len(games)), squeeze=False)
    for row, game in enumerate(games):
        for (g, algo, seed), r in sorted(results.items()):
            if g != game or not r["curve"]:
                continue
            t, steps, ret = zip(*r["curve"], strict=True)
            style = {
                "label": f"{algo} seed {seed}",
                "color": colour[algo],
                "linestyle": styles[seed % len(styles)],
            }
            axes[row][0].plot([x / 60 for x in t], _smooth(ret), **style)
            axes[row][1].plot(steps, _smooth(ret), **style)
        axes[row][0].set(title=f"{game}: training return", xlabel="minutes", ylabel="return")
        axes[row][1].set(title=f"{game}: training return", xlabel="env steps")
        axes[row][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _smooth(ys: tuple, k: int = 50) -> list[float]:
    return [statistics.fmean(ys[max(0, i - k + 1) : i + 1]) for i in range(len(ys))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--games", nargs="+", choices=GAMES, default=list(GAMES))
    p.add_argument("--algos", nargs="+", default=[*QRL_ALGOS[:3], *SB3_ALGOS])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--plot", help="PNG of the curves")
    p.add_argument("--json", help="write every run's result here (and skip the runs done in it)")
    p.add_argument("--sb3", choices=SB3_ALGOS, help=argparse.SUPPRESS)
    p.add_argument("--game", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.sb3:
        return sb3_child(args.sb3, args.game, args.seed, args.seconds, args.out)
    seconds = args.minutes * 60
    results: dict = {}
    if args.json and os.path.exists(args.json):
        for r in json.loads(Path(args.json).read_text()):
            results[(r["game"], r["algo"], r["seed"])] = r
    work = Path(tempfile.mkdtemp(prefix="minatar-bench-"))
    for game in args.games:
        for seed in args.seeds:
            for algo in args.algos:
                if results.get((game, algo, seed), {}).get("final") is not None:
                    continue  # done (one that failed, with no final return, runs again)
                where = work / f"{game}-{algo}-{seed}"
                if algo in SB3_ALGOS:
                    r = sb3_run(algo, game, seed, seconds, where.with_suffix(".json"))
                else:
                    r = qrl_run(algo, game, seed, seconds, where)
                r["curve"] = r["curve"][:: max(1, len(r["curve"]) // CURVE_POINTS)]
                results[(game, algo, seed)] = {
                    "game": game,
                    "algo": algo,
                    "seed": seed,
                    "host": HOST,
                    **r,
                }
                print(
                    f"{game} {algo} seed {seed}: final {r['final']} in {r['secs']:.0f} s, "
                    f"{r['steps']} env steps (exit {r['code']}) {r.get('err', '')[:200]}",
                    flush=True,
                )
                if args.json:
                    Path(args.json).write_text(json.dumps(list(results.values())))
    for game in args.games:
        best = {}
        for algo in args.algos:
            finals = [r["final"] for (g, a, _), r in results.items() if (g, a) == (game, algo)]
            finals = [f for f in finals if f is not None]
            if finals:
                best[algo] = statistics.fmean(finals)
                print(f"{game} {algo}: mean final return {best[algo]:.2f} over {len(finals)} seeds")
        ours = max((v for a, v in best.items() if a in QRL_ALGOS), default=None)
        theirs = max((v for a, v in best.items() if a in SB3_ALGOS), default=None)
        if ours is not None and theirs:
            print(f"{game}: qrl's best / SB3's best = {ours / theirs:.2f} (goal >= 1.5)")
        if best.get("apex") is not None and best.get("sb3-dqn"):
            ratio = best["apex"] / best["sb3-dqn"]
            print(f"{game}: qrl's Ape-X / SB3's DQN = {ratio:.2f} (goal >= 1.5)")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
