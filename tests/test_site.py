"""The documentation site (mkdocs.yml, docs/) builds, covers the code, and its examples run.

The site is built once, with the command README names, ``mkdocs build --strict`` (into a
temporary folder): a broken link or anchor, a page left out of the nav, or a docstring the
API reference cannot render fails the build. Then:

- every command of the CLI (qrl.cli's groups walked), every registered algorithm (a page of
  its own, ``algorithms/NAME.md``) and every config field of every algorithm's model (a row
  of its page's config table) is in the built site;
- no page of the site carries a commit hash (7 to 40 hex digits, digits and letters both), a
  path under /tmp/, or a date (``2026-11-25``, ``November 25, 2026``, ``25 Nov 2026``,
  ``Nov 2026``) but on a line, or a table row, that says "measured on";
- the examples run. The convention, for every page of the site and README.md:

  * every `````python`` block runs, unless the line right before its fence is
    ``<!-- not run -->`` (a training, anything slow or that needs a service). A page's
    blocks run in order in one namespace (a block may use what an earlier one made; this
    test's process, so torch is imported once), in a fresh working directory holding
    ``runs/cartpole/``: a trained CartPole-v1 run (the IMPALA checkpoint of tests/data),
    which an example may load;
  * a `````bash`` block runs only when the line right before its fence is ``<!-- run -->``
    (keep those cheap: ``qrl --help``, ``qrl config show``): as one ``bash -e`` script, in
    such a directory, with this interpreter's ``qrl`` first on PATH; it must exit 0.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from qrl.algos import ALGOS
from qrl.cli import main
from tests.helpers import fenced

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CHECKPOINT = ROOT / "tests" / "data" / "checkpoints" / "impala-cartpole.pt"
EXAMPLE_PAGES = [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]

HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
MONTH = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
    r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)\.?"
)
DATE = re.compile(
    rf"\b\d{{4}}-\d{{2}}-\d{{2}}\b"  # 2026-11-25
    rf"|\b{MONTH}\s+(?:\d{{1,2}}(?:st|nd|rd|th)?,?\s+)?\d{{4}}\b"  # Nov 25, 2026; Nov 2026
    rf"|\b\d{{1,2}}\s+{MONTH},?\s+\d{{4}}\b"  # 25 November 2026
)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's notice about MkDocs 2
        timeout=240,
    )
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stderr[-6000:]}"
    return out


def page_html(site: Path, page: str) -> str:
    """The article of a built page (``page`` as its source path, e.g. ``algorithms/apex.md``),
    without the navigation around it."""
    stem = page.removesuffix(".md")
    built = (
        f"{stem.removesuffix('index')}index.html"
        if stem.split("/")[-1] == "index"
        else f"{stem}/index.html"
    )
    return (site / built).read_text().split("<article", 1)[1].split("</article>", 1)[0]


def text_lines(article: str) -> list[str]:
    """A built page's text, line by line as its source had them; a table row is one line."""
    rows = re.sub(r"<tr>.*?</tr>", lambda m: m[0].replace("\n", " "), article, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", "", rows)).splitlines()


def commands(cmd: click.Command, ctx: click.Context) -> Iterator[str]:
    """Every command a user can run, as its whole command line (``qrl run create``)."""
    if isinstance(cmd, click.Group):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            assert sub is not None
            yield from commands(sub, click.Context(sub, parent=ctx, info_name=name))
    else:
        yield ctx.command_path


def test_every_command_has_its_section_in_the_cli_reference(site: Path) -> None:
    cli = page_html(site, "reference/cli.md")
    every = list(commands(main, click.Context(main, info_name="qrl")))
    missing = [c for c in every if not re.search(rf"<h\d[^>]*><code>{c}</code>", cli)]
    assert len(every) > 40 and not missing, f"commands without a section: {missing}"


@pytest.mark.parametrize("name", sorted(ALGOS))
def test_every_algorithm_has_a_page_with_every_config_field(site: Path, name: str) -> None:
    page = page_html(site, f"algorithms/{name}.md")
    fields = list(ALGOS[name].config.model_fields)
    missing = [f for f in fields if f"<td><code>{f}</code></td>" not in page]
    assert not missing, f"algorithms/{name}.md's config table lacks {missing}"


def test_no_page_carries_a_commit_hash_a_tmp_path_or_a_date(site: Path) -> None:
    found = []
    for source in sorted(DOCS.rglob("*.md")):
        page = source.relative_to(DOCS).as_posix()
        if page.startswith("hooks/"):
            continue
        for line in text_lines(page_html(site, page)):
            if "measured on" in line:
                continue
            for pattern in (HASH, DATE, re.compile(r"/tmp/")):
                found += [
                    f"{page}: {m[0]!r} in {line.strip()[:120]!r}" for m in pattern.finditer(line)
                ]
    assert not found, "\n".join(found)


def examples(language: str, runs: bool) -> list[Path]:
    """The pages with a ``language`` block that runs (``runs``: by default, unless marked not
    to; otherwise only when marked to)."""
    return [
        p
        for p in EXAMPLE_PAGES
        if any(
            (before != "<!-- not run -->") if runs else (before == "<!-- run -->")
            for _, before, _ in fenced(p, language)
        )
    ]


def page_id(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A fresh directory holding a trained CartPole-v1 run, ``runs/cartpole/``."""
    (tmp_path / "runs" / "cartpole").mkdir(parents=True)
    shutil.copy(CHECKPOINT, tmp_path / "runs" / "cartpole" / "checkpoint.pt")
    return tmp_path


def run_shell(script: str, workdir: Path) -> None:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        ["bash", "-e", "-"],
        input=script,
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, f"{script}\n--- exit {done.returncode}:\n{done.stderr[-4000:]}"


@pytest.mark.parametrize("page", examples("python", runs=True), ids=page_id)
def test_python_examples_run(page: Path, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(workdir)
    namespace: dict[str, object] = {"__name__": "__main__"}
    for line, before, code in fenced(page, "python"):
        if before != "<!-- not run -->":  # a traceback names the page and its line
            # compiled as a reader's own file would be: without this module's `from
            # __future__ import annotations`, which would leave a page's pydantic models
            # with annotations to look up in a module that is not the page's
            compiled = compile("\n" * line + code, str(page), "exec", dont_inherit=True)
            exec(compiled, namespace)


@pytest.mark.parametrize("page", examples("bash", runs=False), ids=page_id)
def test_marked_shell_examples_run(page: Path, workdir: Path) -> None:
    for line, before, code in fenced(page, "bash"):
        if before == "<!-- run -->":
            run_shell(f"# {page_id(page)}, line {line}\n{code}", workdir)
