"""Why qrl validates configs with pydantic: the cost of each candidate library, measured.

Config validation runs a handful of times per process (at start, joining a run), so speed
matters only through start-up: the import cost, then one validation. Both libraries give
strict types and ranges; pydantic also gives per-field descriptions (``qrl`` help texts and
docs) and error messages that name the field and the rule. Each figure is the median of
fresh interpreters (imports) or of many calls (validation), side by side in one run.

    pip install msgspec   # only for this comparison
    python benchmarks/config.py
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import timeit

IMPORTS = {
    "pydantic": "import pydantic",
    "msgspec": "import msgspec",
    "qrl.algos.apex.config (pydantic model)": "import qrl.algos.apex.config",
}


def import_ms(stmt: str, rounds: int = 7) -> float:
    times = []
    for _ in range(rounds):
        code = f"import time; t = time.perf_counter(); {stmt}; print(time.perf_counter() - t)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        times.append(float(out.stdout))
    return 1000 * statistics.median(times)


def main() -> None:
    import msgspec

    from qrl.algos.apex.config import ApexConfig
    from qrl.runtime.config import parse_config

    data = ApexConfig().to_dict() | {"lr": 5e-4, "hidden": [128, 128]}
    fields = {
        name: (tuple[int, ...], tuple(v)) if isinstance(v, list) else (type(v), v)
        for name, v in ApexConfig().to_dict().items()
    }
    Spec = msgspec.defstruct(  # noqa: N806  (the same fields, defaults and types)
        "Spec",
        [(n, t, msgspec.field(default=d)) for n, (t, d) in fields.items()],
        forbid_unknown_fields=True,
    )
    print(f"{'import':40s} {'ms':>8s}")
    for name, stmt in IMPORTS.items():
        print(f"{name:40s} {import_ms(stmt):8.1f}")
    n = 2000
    p = min(timeit.repeat(lambda: parse_config(ApexConfig, data), number=n, repeat=5)) / n
    m = min(timeit.repeat(lambda: msgspec.convert(data, Spec), number=n, repeat=5)) / n
    print(
        f"\none validation of an ApexConfig dict: pydantic {p * 1e6:.1f} us, msgspec "
        f"{m * 1e6:.1f} us"
    )


if __name__ == "__main__":
    main()
