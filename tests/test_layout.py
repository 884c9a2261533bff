"""Algorithms declare, generic code reads: no module outside an algorithm's own places names
an algorithm or one of its message kinds, so a new algorithm (or a renamed one) needs no edit
there and no generic path behaves differently for one algorithm by its name.

An algorithm's own places are its package ``qrl/algos/NAME/`` and its actor and learner
modules ``qrl/actors/NAME.py`` and ``qrl/learners/NAME.py``; they may name themselves and a
family they belong to (``qrl/algos/apex_family/``), never another algorithm. A message kind
is one an algorithm's (or family's) ``messages`` module declares (``"apex.frames"``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from qrl.algos import ALGOS

QRL = Path(__file__).resolve().parents[1] / "qrl"
ALGOS_DIR = QRL / "algos"
_KIND = re.compile(r"[a-z0-9_-]+\.[a-z0-9_]+")


def _strings(path: Path) -> list[tuple[int, str]]:
    """Every string literal of a module (f-strings' literal parts too), with its line."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


def _packages() -> list[str]:
    return sorted(p.name for p in ALGOS_DIR.iterdir() if (p / "__init__.py").exists())


def _owned() -> dict[str, str]:
    """Each registry name and declared message kind -> the package under qrl/algos/ that
    declares it (an algorithm's, or a family's)."""
    owner = {name: algo.config.__module__.split(".")[2] for name, algo in ALGOS.items()}
    for package in _packages():
        messages = ALGOS_DIR / package / "messages.py"
        if messages.exists():
            owner |= {s: package for _, s in _strings(messages) if _KIND.fullmatch(s)}
    return owner


def _families() -> set[str]:
    """Packages under qrl/algos/ that are no algorithm's own (shared by several)."""
    return set(_packages()) - {a.config.__module__.split(".")[2] for a in ALGOS.values()}


def _named(path: Path, owner: dict[str, str], allowed: set[str]) -> list[str]:
    return [
        f"{path.relative_to(QRL.parent)}:{line}: {text!r} ({owner[text]}'s)"
        for line, text in _strings(path)
        if text in owner and owner[text] not in allowed
    ]


def test_the_registry_declares_message_kinds_to_check() -> None:
    """The check below has something to look for: every name, and the kinds the algorithms'
    messages modules declare."""
    owner = _owned()
    assert set(ALGOS) <= set(owner)
    assert {"apex.experience", "apex.frames", "impala.unrolls", "ppo.rollouts"} <= set(owner)


def test_no_generic_module_names_an_algorithm() -> None:
    """Modules outside the algorithms' own places hold no registry name and no message kind
    as a string literal; an algorithm's own actor and learner modules name no other
    algorithm's."""
    owner, families = _owned(), _families()
    packages = set(_packages())
    found = []
    for path in sorted(QRL.rglob("*.py")):
        if ALGOS_DIR in path.parents:
            continue
        own = path.stem if path.parent.name in ("actors", "learners") else None
        if own in packages:
            found += _named(path, owner, {own, *families})
        else:
            found += _named(path, owner, set())
    assert not found, "generic code names an algorithm:\n" + "\n".join(sorted(found))


def _presence_tests(path: Path) -> list[str]:
    """``getattr(cfg, "field", default)`` and ``hasattr(cfg, "field")`` of a config: a
    config field's presence tested instead of a type that declares it."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        want = {"getattr": 3, "hasattr": 2}.get(node.func.id)
        if want is None or len(node.args) != want or not isinstance(node.args[1], ast.Constant):
            continue
        if re.search(r"(cfg|config)$", ast.unparse(node.args[0])):
            out.append(f"{path.relative_to(QRL.parent)}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_module_tests_a_config_field_presence() -> None:
    """What a config has is its type's declaration (its class and mixins: generic code is
    given the type it reads), never tested field by field with a default."""
    found = [hit for path in sorted(QRL.rglob("*.py")) for hit in _presence_tests(path)]
    assert not found, "a config field's presence tested:\n" + "\n".join(found)


def test_no_config_is_typed_any() -> None:
    """A ``cfg`` parameter (or field) says which config it takes: the algorithm's class, or
    the base or mixin the generic code reads, never ``Any``."""
    found = []
    for path in sorted(QRL.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.arg):
                name, annotation = node.arg, node.annotation
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                name, annotation = node.target.id, node.annotation
            else:
                continue
            if name == "cfg" and annotation is not None and "Any" in ast.unparse(annotation):
                found.append(f"{path.relative_to(QRL.parent)}:{node.lineno}")
    assert not found, "a config typed Any:\n" + "\n".join(found)


def test_no_statement_is_packed_past_the_formatter() -> None:
    """The formatter lays out every statement: no ``# fmt: skip`` (or ``off``) packs one onto
    fewer lines, in the package, its tests or its benchmarks."""
    marker = re.compile(r"#\s*fmt:\s*(skip|off)")
    packed = [
        f"{path.relative_to(QRL.parent)}:{n}"
        for folder in ("qrl", "tests", "benchmarks", "lint")
        for path in sorted((QRL.parent / folder).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if marker.search(line) and path.name != "test_layout.py"
    ]
    assert not packed, f"statements kept from the formatter: {packed[:20]}"


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


def test_no_role_class_is_more_than_two_levels_below_its_base():
    """Roles are composed of parts passed in, not grown by subclassing: every class of qrl
    that is a Role is at most two levels below ``Role`` (``Role -> Actor`` is one), and so
    is every part class below the bases of the actor's and the learner's parts."""
    import importlib
    import pkgutil

    import qrl
    from qrl.learners.rule import Rule
    from qrl.runtime.loop import Role

    for module in pkgutil.walk_packages(qrl.__path__, "qrl."):
        if not module.name.endswith("__main__"):  # (runs the CLI)
            importlib.import_module(module.name)
    deep = []
    for base in (Role, Rule):
        for cls in _subclasses(base):
            if cls.__module__.startswith("qrl."):
                depth = cls.__mro__.index(base)
                if depth > 2:
                    deep.append(
                        f"{cls.__module__}.{cls.__qualname__}: {depth} below {base.__name__}"
                    )
    assert not deep, deep
