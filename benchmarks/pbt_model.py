"""A toy model of PBT's schedule on one slot: how many segments the population needs, against
random search, under each selection setting (no RL, no Redis; seconds to run).

    python benchmarks/pbt_model.py

Four trials take turns on one slot (the one waiting longest goes next). A segment adds the
trial's learning-rate quality to its depth (1 at the best lr, falling off in log lr); its
score is its depth plus Gaussian noise (``sigma``, in segments of the best draw's progress).
Before a segment, a trial past its burn-in that ranks in the bottom quantile copies a top
trial's depth and lr, the lr perturbed by x0.8/x1.2 or, with the resample chance, redrawn
from 1e-5..1e-1 (log). The population stops when a trial reaches depth ``D``. The draws are
LunarLander seed 2's shape: one good lr, one that collapses, two that crawl. Prints each
setting's median segments over random search's (and the 75th percentile's), for a short run
(D = 12.5, seed 1's size) and a long one (D = 32, seed 2's), at three noise levels. What the
model leaves out (a perturbed copy that collapses, the confirmation's luck) makes real runs
slower and noisier; it ranks the settings, it does not predict a time.
"""

from __future__ import annotations

import math
import random
import statistics

LR_BEST, WIDTH = math.log(3e-4), 1.2
DRAWS = (3.9e-4, 0.07, 3e-5, 1e-2)  # seed 2's shape
# (quantile, resample, burn-in)
SETTINGS = [(0.25, 0.25, 6), (0.25, 0, 6), (0.5, 0, 6), (0.75, 0, 6), (0.75, 0, 3), (0.75, 0.25, 6)]


def quality(lr: float) -> float:
    return math.exp(-((math.log(lr) - LR_BEST) ** 2) / (2 * WIDTH**2))


def segments(seed: int, depth: float, sigma: float, quantile: float, resample: float,
             burn_in: int, exploit: bool = True, cap: int = 1000) -> int:  # fmt: skip
    rng = random.Random(seed)
    n = len(DRAWS)
    lr, d, score, own = list(DRAWS), [0.0] * n, [0.0] * n, [0] * n
    for t in range(1, cap + 1):
        i = (t - 1) % n  # turns: the trial waiting longest
        ranked = sorted((j for j in range(n) if own[j] >= burn_in), key=lambda j: score[j])
        if exploit and i in ranked and len(ranked) >= 2:
            k = min(max(1, int(len(ranked) * quantile)), len(ranked) - 1)
            top = ranked[-min(k, len(ranked) - k) :]
            if i in ranked[:k] and i not in top:
                s = rng.choice(top)
                if score[s] > score[i]:
                    d[i] = d[s]
                    redraw = rng.random() < resample
                    lr[i] = math.exp(rng.uniform(math.log(1e-5), math.log(1e-1))) if redraw \
                        else lr[s] * rng.choice((0.8, 1.2))  # fmt: skip
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
                cells.append(f"q{q} r{r} b{b}: {statistics.median(got) / base:.2f} "
                             f"({got[len(got) * 3 // 4] / base:.2f})")  # fmt: skip
            print(f"D={depth} sigma={sigma} random {base:.0f}:", " | ".join(cells))


if __name__ == "__main__":
    main()
