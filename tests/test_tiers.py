"""The rules the suite keeps (issue 69), read off its files: README's test command is what
`.ci/run` runs and it runs every tier but docker, plain `pytest` leaves out every marked
tier, every skip goes through :func:`tests.helpers.skip_or_fail`, no assertion reads the
clock, and every sleep says why nothing could be waited on instead."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from tests.cli import ROOT

TESTS = ROOT / "tests"
PYTEST = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
CLOCK = r"\b(?:monotonic|perf_counter|time\.time)\(\)"


def _lines(*leave_out: str) -> Iterator[tuple[str, int, str, str]]:
    """``(where, number, line, the line before)`` of every module in tests/ but ``leave_out``
    (this module, whose patterns would match themselves, always)."""
    for path in sorted(TESTS.glob("*.py")):
        if path.name in (*leave_out, "test_tiers.py"):
            continue
        before = ""
        for n, line in enumerate(path.read_text().splitlines(), 1):
            yield f"tests/{path.name}:{n}", n, line, before
            before = line


def test_the_readmes_test_command_is_what_ci_runs_and_runs_every_tier_but_docker():
    command = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)[1]
    assert f"\n{command} || exit $?\n" in (ROOT / ".ci" / "run").read_text()
    assert command.endswith(" && pytest -m 'not docker'"), command


def test_plain_pytest_leaves_out_every_marked_tier_and_only_those():
    markers = {line.split(":")[0] for line in PYTEST["markers"]}
    args = shlex.split(PYTEST["addopts"])
    tier = args[args.index("-m") + 1]
    assert re.fullmatch(r"not \w+( and not \w+)*", tier), tier
    assert (
        set(re.findall(r"not (\w+)", tier)) == markers == {"slow", "cluster", "docker", "network"}
    )
    assert "--strict-markers" in args  # a marker not in the list is an error, not a new tier


def test_every_skip_goes_through_skip_or_fail():
    skips = re.compile(r"pytest\.skip\(|mark\.skip|skipif|importorskip")
    found = [where for where, _, line, _ in _lines("helpers.py") if skips.search(line)]
    assert not found, f"skip with tests.helpers.skip_or_fail (it fails under CI=true): {found}"


def test_no_assertion_reads_the_clock():
    """Elapsed time and rates are benchmarks/' to measure; a test checks an event or a
    count. Caught: an assert that reads the clock, or names what a clock difference was
    assigned to in its module."""
    found = []
    for path in sorted(TESTS.glob("test_*.py")):
        if path.name == "test_tiers.py":
            continue
        text = path.read_text()
        timed = set(re.findall(rf"(\w+) = [^\n]*{CLOCK} - ", text))
        for n, line in enumerate(text.splitlines(), 1):
            code = line.split("#")[0].strip()
            if code.startswith("assert ") and (
                re.search(CLOCK, code) or any(re.search(rf"\b{v}\b", code) for v in timed)
            ):
                found.append(f"tests/{path.name}:{n}")
    assert not found, f"assertions on elapsed time: {found}"


def test_every_sleep_says_why_nothing_can_be_waited_on():
    """A wait is on a condition (:func:`tests.helpers.wait_until`); a sleep that lets time
    pass on purpose says why, on its line or the one before."""
    found = [
        where
        for where, _, line, before in _lines()
        if "time.sleep(" in line and "#" not in line and "#" not in before
    ]
    assert not found, f"sleeps with no reason given: {found}"
