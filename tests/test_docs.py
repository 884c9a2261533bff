"""The documents say what the code is: README's command list names every command the CLI
has (and none it lacks), and docs/ARCHITECTURE.md names only files, classes and functions
that exist, and every module of the tree."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import click

from qrl.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"


def commands(cmd: click.Command, path: tuple[str, ...] = ()) -> Iterator[str]:
    """Every command a user can run, as its words after ``qrl``."""
    if isinstance(cmd, click.Group):
        ctx = click.Context(cmd)
        for name in cmd.list_commands(ctx):
            yield from commands(cmd.get_command(ctx, name), (*path, name))
    else:
        yield " ".join(path)


def documented_commands() -> set[str]:
    """The commands README's command list names: each ``qrl`` line's words up to its first
    option or argument (or its description, after two spaces), ``a|b`` standing for both."""
    text = README.read_text()
    block = text.split("## Commands", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    found: set[str] = set()
    for line in block.splitlines():
        if not line.startswith("qrl "):
            continue
        words = []
        usage = re.split(r"\s{2,}", line)[0]  # two spaces or more: its description follows
        for word in usage.split()[1:]:
            if not re.fullmatch(r"[a-z0-9][a-z0-9|-]*", word):
                break
            words.append(word.split("|"))
        prefixes = [""]
        for alternatives in words:
            prefixes = [f"{p} {a}".strip() for p in prefixes for a in alternatives]
        found.update(prefixes)
    return found


def test_readme_lists_every_command_and_only_those() -> None:
    real = set(commands(main))
    documented = documented_commands()
    missing = sorted(real - documented)
    # a group's own line (`qrl run ...`) is a prefix of its commands, not a command
    unknown = sorted(d for d in documented - real if not any(r.startswith(d) for r in real))
    assert not missing, f"README's command list lacks: {missing}"
    assert not unknown, f"README's command list names commands qrl lacks: {unknown}"


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
