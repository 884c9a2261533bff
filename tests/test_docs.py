"""The documents say what the code is: the pages (README.md and docs/) name no command qrl
lacks; docs/concepts.md's diagram names only functions that exist, in the files it says,
with arrows the code takes; the examples that need a training run do what their pages say
(the environment module of Getting started, the algorithm that Adding an algorithm builds);
docs/ARCHITECTURE.md names only files, classes and functions that exist, and every module of
the tree."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from qrl.algos import ALGOS
from qrl.cli import main
from qrl.wire.keys import RunKeys
from tests.helpers import fenced

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
CONCEPTS = ROOT / "docs" / "concepts.md"
GETTING_STARTED = ROOT / "docs" / "getting-started.md"
ADDING = ROOT / "docs" / "adding-an-algorithm.md"


def pages() -> list[Path]:
    """README and every page of the site's folder."""
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def code(text: str) -> Iterator[str]:
    """The code of a page that may run ``qrl``: the lines of its shell blocks, the lines of
    its text blocks that show a prompt (``$ qrl ...``; the others are output), and its inline
    code spans (prose says "qrl" of the project too, so prose is not read)."""
    fenced = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
    for lang, block in fenced.findall(text):
        for line in block.splitlines():
            if lang in ("bash", "sh", "shell", "console") or line.startswith("$ "):
                yield line
    yield from re.findall(r"`([^`\n]+)`", fenced.sub("", text))


def named_commands(line: str) -> Iterator[tuple[str, ...]]:
    """The command words of each ``qrl ...`` in a line of code: the words after ``qrl`` while
    they name a subcommand of a group (``a|b`` standing for both); a lowercase word where a
    group expects its subcommand names one, which may not exist. Options, placeholders
    (``ALGO``) and arguments end the command."""
    for m in re.finditer(r"(?<![\w./:-])qrl((?: +[a-z][a-z0-9|-]*)+)", line):
        yield tuple(m.group(1).split())


def unknown_commands(words: tuple[str, ...]) -> list[str]:
    """The commands ``words`` name that qrl lacks (alternatives ``a|b`` each checked)."""
    wrong = []
    paths: list[tuple[click.Command, str]] = [(main, "qrl")]
    for word in words:
        nxt = []
        for cmd, said in paths:
            if not isinstance(cmd, click.Group):
                continue  # a command's argument: the command is whole
            ctx = click.Context(cmd)
            for alt in word.split("|"):
                sub = cmd.get_command(ctx, alt)
                if sub is None:
                    wrong.append(f"{said} {alt}")
                else:
                    nxt.append((sub, f"{said} {alt}"))
        if not nxt:
            break
        paths = nxt
    return wrong


def test_the_pages_name_only_commands_qrl_has() -> None:
    """Every ``qrl`` command a page's code names exists (the generated CLI reference lists
    them all)."""
    wrong = set()
    for page in pages():
        for line in code(page.read_text()):
            for words in named_commands(line):
                wrong.update(f"{page.relative_to(ROOT)}: {w}" for w in unknown_commands(words))
    assert not wrong, f"pages name commands qrl lacks: {sorted(wrong)}"


def test_the_check_of_commands_sees_a_wrong_one() -> None:
    """The two ways a name goes wrong: a subcommand no group has, an algorithm no role has."""
    lines = ("qrl run start x", "qrl actor es|apex --id 3")
    found = [unknown_commands(words) for line in lines for words in named_commands(line)]
    assert found == [["qrl run start"], ["qrl actor es"]]
    assert list(named_commands("qrl/actors/dqn.py and `qrl:{RUN}:weights`")) == []


def test_getting_started_gives_the_readmes_two_commands() -> None:
    """The install-and-train and test commands are README's first two code blocks (CI runs
    the second), and Getting started gives the same two."""
    blocks = re.compile(r"```bash\n(.*?)\n```", re.S)
    assert blocks.findall(GETTING_STARTED.read_text())[:2] == blocks.findall(README.read_text())[:2]


def assigned(node: ast.AST) -> list[str]:
    """The plain names an assignment statement binds (none for anything else)."""
    if isinstance(node, ast.AnnAssign):
        targets = [node.target]
    elif isinstance(node, ast.Assign):
        targets = node.targets
    else:
        return []
    return [t.id for t in targets if isinstance(t, ast.Name)]


def definitions() -> dict[str, set[str]]:
    """Each module file of qrl (a path from the root) -> the names it defines: its classes,
    functions and assignments, and each class's members as ``Class.member``."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / "qrl").rglob("*.py")):
        names: set[str] = set()
        for node in ast.parse(path.read_text()).body:
            names.update(assigned(node))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names.add(node.name)
                for member in ast.walk(node):
                    if isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef):
                        names.add(f"{node.name}.{member.name}")
                    names.update(f"{node.name}.{n}" for n in assigned(member))
        out[path.relative_to(ROOT).as_posix()] = names
    return out


def quoted(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def test_architecture_names_only_paths_that_exist() -> None:
    text = ARCHITECTURE.read_text()
    paths = [q for q in quoted(text) if re.fullmatch(r"(qrl|lint|tests|benchmarks)/[\w/.]*", q)]
    assert paths, "no paths found: the pattern no longer fits the document"
    # NAME stands for any algorithm's name
    gone = sorted({p for p in paths if "NAME" not in p and not (ROOT / p.rstrip("/")).exists()})
    assert not gone, f"docs/ARCHITECTURE.md names paths that do not exist: {gone}"


def test_architecture_names_only_classes_and_functions_that_exist() -> None:
    """A ``Class.member`` anywhere, and a name followed by the file it is in (`` `name`
    (`qrl/...py`) ``), must be defined (there)."""
    defs = definitions()
    everything = set().union(*defs.values())
    text = ARCHITECTURE.read_text()
    wrong = []
    for q in quoted(text):
        name = q.removesuffix("()")
        if re.fullmatch(r"[A-Z]\w*\.\w+", name) and name not in everything:
            wrong.append(name)
    for name, path in re.findall(r"`(\w[\w.]*)(?:\(\))?` \(`(qrl/[\w/]+\.py)`", text):
        if name.startswith("qrl."):
            continue  # a module's attribute: an import path, not a definition of that file
        if path in defs and name not in defs[path] and name.split(".")[0] not in defs[path]:
            wrong.append(f"{name} in {path}")
    assert not wrong, f"docs/ARCHITECTURE.md names what the code lacks: {sorted(set(wrong))}"


def test_architecture_tree_lists_every_module() -> None:
    """The tree block names every module of qrl (by its file name, under its package)."""
    text = ARCHITECTURE.read_text()
    tree = text.split("## The tree", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    # the block lists a package's folder (its name followed by /) then its modules' names
    listed: set[str] = set()
    package = ""
    for line in tree.splitlines():
        head = re.match(r"\s*([\w]+)/", line)
        if head:
            package = head.group(1)
        for module in re.findall(r"([\w]+)\.py", line):
            listed.add(f"{package}/{module}.py")
    missing = []
    for path in sorted((ROOT / "qrl").rglob("*.py")):
        rel = path.relative_to(ROOT / "qrl")
        if rel.name == "__init__.py" and rel.parent.as_posix() not in ("algos", "cli", "."):
            continue  # a package's marker
        parent = rel.parent.name or "qrl"
        if f"{parent}/{rel.name}" not in listed:
            missing.append(rel.as_posix())
    assert not missing, f"docs/ARCHITECTURE.md's tree lacks: {missing}"


def test_the_readme_has_a_row_for_every_algorithm() -> None:
    """README's table of algorithms has a row for each of the registry's, linking its page."""
    text = README.read_text()
    missing = [
        n for n in ALGOS if f"| `{n}` |" not in text or f"(docs/algorithms/{n}.md)" not in text
    ]
    assert not missing, f"README's table of algorithms lacks: {missing}"


def diagram() -> tuple[dict[str, tuple[str, str]], list[tuple[str, str, str, str]]]:
    """docs/concepts.md's mermaid diagram: its boxes (id -> (name, file): each label's first
    two lines) and arrows (from, ``-->`` or ``-.->``, label or "", to)."""
    block = CONCEPTS.read_text().split("```mermaid", 1)[1].split("```", 1)[0]
    boxes = {
        node: (name, path)
        for node, name, path in re.findall(r'^\s*(\w+)\["([^"<]+)<br/>([^"<]+)', block, re.M)
    }
    arrows = re.findall(r'^\s*(\w+) (-->|-\.->)(?:\|"([^"]+)"\|)? (\w+)\s*$', block, re.M)
    lines = [line for line in block.splitlines() if "-->" in line or "-.->" in line]
    assert boxes and len(arrows) == len(lines), "the pattern no longer fits the diagram"
    return boxes, arrows


def source(path: str, name: str) -> str | None:
    """The source of function ``name`` (or ``Class.method``) of file ``path``, its ``def``
    line left out; ``None`` if the file defines no such function."""
    text = (ROOT / path).read_text()
    body: list[ast.stmt] = ast.parse(text).body
    *owners, func = name.split(".")
    for owner in owners:
        found = [n for n in body if isinstance(n, ast.ClassDef) and n.name == owner]
        if not found:
            return None
        body = found[0].body
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == func:
            segment = ast.get_source_segment(text, node) or ""
            return segment.split(":\n", 1)[1]  # after the signature
    return None


def test_the_concepts_diagram_names_functions_where_they_are() -> None:
    """Each box names a function (or ``Class.method``) defined in the file it gives."""
    boxes, _ = diagram()
    wrong = [f"{name} in {path}" for name, path in boxes.values() if source(path, name) is None]
    assert not wrong, f"docs/concepts.md's diagram names what the code lacks: {wrong}"


def test_the_concepts_diagram_draws_only_arrows_the_code_takes() -> None:
    """A solid arrow is a call within one process: the function it leaves refers to the one
    it reaches (``.name(``, ``name(`` or ``.name``, a callback handed on). A dotted arrow
    crosses processes through what its label names: a key qrl makes under ``qrl:{RUN}:``, or
    a class of the shared-memory ring."""
    boxes, arrows = diagram()
    ring = re.findall(r"^class (\w+)", (ROOT / "qrl/replay/ring.py").read_text(), re.M)
    qrl_code = "\n".join(p.read_text() for p in (ROOT / "qrl").rglob("*.py"))
    wrong = []
    for start, kind, label, end in arrows:
        if start not in boxes or end not in boxes:
            wrong.append(f"{start} {kind} {end}: a box without a label")
            continue
        (name, path), target = boxes[start], boxes[end][0].split(".")[-1]
        if kind == "-->":
            body = source(path, name) or ""
            if not re.search(rf"(\.|\b){re.escape(target)}\b", body):
                wrong.append(f"{name} does not call {boxes[end][0]}")
        elif label.startswith("qrl:{RUN}:"):
            if f'key("{label.removeprefix("qrl:{RUN}:")}")' not in qrl_code:
                wrong.append(f"{label}: no such key")
        elif label not in ring:
            wrong.append(f"{label}: not a class of qrl/replay/ring.py")
    unused = set(boxes) - {a[0] for a in arrows} - {a[3] for a in arrows}
    assert not wrong and not unused, f"docs/concepts.md's diagram: {wrong}, unused {unused}"


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``args`` in ``cwd``, with this checkout's qrl and ``cwd``'s modules importable."""
    env = {**os.environ, "PYTHONPATH": f"{cwd}{os.pathsep}{ROOT}"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_environment_module_of_getting_started_trains(redis_server, keys: RunKeys, tmp_path):
    """Getting started's env module, saved as its page says: PPO learns it named
    ``my_envs:Corridor-v0`` (the target its registration gives), and ``qrl eval`` plays the
    result once told the module."""
    (module,) = [b for _, _, b in fenced(GETTING_STARTED, "python") if '"Corridor-v0"' in b]
    (tmp_path / "my_envs.py").write_text(module)
    qrl_cli = [sys.executable, "-m", "qrl.cli"]
    run_dir = tmp_path / "runs" / "corridor"
    trained = run(
        [*qrl_cli, "train", "ppo", "--env", "my_envs:Corridor-v0", "--redis", redis_server.url]
        + ["--run", keys.run, "--run-dir", str(run_dir), "--max-time", "120"],
        tmp_path,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert json.loads((run_dir / "result.json").read_text())["target"] == 0.99
    played = run([*qrl_cli, "eval", str(run_dir), "--env-module", "my_envs"], tmp_path)
    assert played.returncode == 0 and "my_envs:Corridor-v0: mean return" in played.stdout


@pytest.mark.slow
def test_the_algorithm_of_adding_an_algorithm_trains(redis_server, keys: RunKeys, tmp_path):
    """The page's blocks, but its tries, are one file, ``a2c.py``: the qrl command line with
    A2C in it, whose ``train`` reaches a return of 100 on CartPole and whose ``eval`` plays
    the checkpoint."""
    code = [b for _, _, b in fenced(ADDING, "python") if not b.startswith("# a try")]
    (tmp_path / "a2c.py").write_text("\n\n".join(code))
    run_dir = tmp_path / "runs" / "a2c"
    trained = run(
        [sys.executable, "a2c.py", "train", "a2c", "--env", "CartPole-v1", "--redis"]
        + [redis_server.url, "--run", keys.run, "--run-dir", str(run_dir)]
        + ["--target-return", "100", "--max-time", "120"],
        tmp_path,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    played = run([sys.executable, "a2c.py", "eval", str(run_dir), "--episodes", "3"], tmp_path)
    assert played.returncode == 0 and "(a2c step " in played.stdout, played.stderr[-3000:]
