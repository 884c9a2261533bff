"""A toy model of PBT's schedule on one slot: how many segments the population needs, against
random search, under each selection setting (no RL, no Redis; seconds to run).

    python benchmarks/pbt_model.py

Four trials take turns on one slot (the one waiting longest goes next). A segment adds the
trial's learning-rate quality to its depth (1 at the best lr, falling off in log lr); its
score is its depth plus Gaussian noise (``sigma``, in segments of the best draw's progress).
Before a segment, a trial past its burn-in copies the depth and lr of the trial qrl's own
selection picks (``qrl.pbt.exploit.choose`` over the trials past their burn-in, as the
worker calls it), the lr explored by ``qrl.pbt.exploit.explore`` (x0.8/x1.2 or, with the
resample chance, redrawn from 1e-5..1e-1, log). The population stops when a trial reaches
depth ``D``. The draws are LunarLander seed 2's shape: one good lr, one that collapses, two
that crawl. Prints each setting's median segments over random search's (and the 75th
percentile's), for a short run (D = 12.5, seed 1's size) and a long one (D = 32, seed 2's),
at three noise levels. What the model leaves out (a perturbed copy that collapses, the
confirmation's luck) makes real runs slower and noisier; it ranks the settings, it does not
predict a time.
"""

from __future__ import annotations

import math
import random
import statistics

from qrl.pbt.config import Explore, PBTConfig
from qrl.pbt.exploit import choose, explore

LR_BEST, WIDTH = math.log(3e-4), 1.2
DRAWS = (3.9e-4, 0.07, 3e-5, 1e-2)  # seed 2's shape
# (quantile, resample, burn-in)
SETTINGS = [(0.25, 0.25, 6), (0.25, 0, 6), (0.5, 0, 6), (0.75, 0, 6), (0.75, 0, 3), (0.75, 0.25, 6)]


def quality(lr: float) -> float:
    return math.exp(-((math.log(lr) - LR_BEST) ** 2) / (2 * WIDTH**2))


def segments(
    seed: int,
    depth: float,
    sigma: float,
    quantile: float,
    resample: float,
    burn_in: int,
    exploit: bool = True,
    cap: int = 1000,
) -> int:
    rng = random.Random(seed)
    lr_range = Explore.parse("lr=1e-5..1e-1:log")
    pcfg = PBTConfig(
        name="model",
        algo="ppo",
        env="LunarLander-v3",
        explore=[lr_range],
        quantile=quantile,
        resample=resample,
        burn_in=burn_in,
    )
    trials = [f"t{k}" for k in range(len(DRAWS))]
    lr = dict(zip(trials, DRAWS, strict=True))
    d, score, own = dict.fromkeys(trials, 0.0), dict.fromkeys(trials, 0.0), dict.fromkeys(trials, 0)
    for t in range(1, cap + 1):
        i = trials[(t - 1) % len(trials)]  # turns: the trial waiting longest
        ranked = {j: score[j] for j in trials if own[j] >= burn_in}
        if exploit and (s := choose(i, ranked, quantile, rng)) is not None:
            d[i] = d[s]
            lr[i] = explore(pcfg, {"lr": lr[s]}, rng)["lr"]
        d[i] += quality(lr[i])
        own[i] += 1
        score[i] = d[i] + rng.gauss(0, sigma)
        if d[i] >= depth:
            return t
    return cap


def main() -> None:
    runs = range(300)
    for depth in (12.5, 32.0):
        for sigma in (0.75, 1.5, 3.0):
            base = statistics.median(segments(s, depth, sigma, 0.25, 0, 0, False) for s in runs)
            cells = []
            for q, r, b in SETTINGS:
                got = sorted(segments(s, depth, sigma, q, r, b) for s in runs)
                cells.append(
                    f"q{q} r{r} b{b}: {statistics.median(got) / base:.2f} "
                    f"({got[len(got) * 3 // 4] / base:.2f})"
                )
            print(f"D={depth} sigma={sigma} random {base:.0f}:", " | ".join(cells))


if __name__ == "__main__":
    main()
