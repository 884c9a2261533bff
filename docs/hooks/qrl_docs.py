"""The site's generated parts (an MkDocs hook, named in mkdocs.yml): a page that holds
``<!-- qrl:config NAME -->`` gets algorithm NAME's config reference there, a table of every
field of its pydantic model (type, default, range from the field's constraints, whether
``qrl run set`` may change it while the run runs, description); ``<!-- qrl:roles NAME -->``
gets the roles its job runs; ``<!-- qrl:algorithms -->`` a table of every registered
algorithm; ``<!-- qrl:config-base -->`` the fields every algorithm has. The tables are
read from the registry (:mod:`qrl.algos`) as the site builds, so a field added to a model
is on the site with no page edited.

It is also a griffe extension (``SphinxRoles``, named in mkdocs.yml's mkdocstrings options):
qrl's docstrings cross-reference with Sphinx roles (``:class:`Config```), which Markdown
would show as they are; the extension writes each as inline code.
"""

from __future__ import annotations

import inspect
import json
import posixpath
import re
import textwrap
import typing
from typing import Any

import click
import griffe
from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from qrl.algos import ALGOS
from qrl.cli import main
from qrl.runtime.config import Config, live_fields

MARKER = re.compile(r"<!-- qrl:([a-z-]+)(?: ([a-z0-9-]+))? -->")
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|obj|exc):`[~!]?([^`]+)`")


def cell(text: str) -> str:
    """``text`` as one Markdown table cell: one line, its pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def code(value: Any) -> str:
    """A value as TOML would take it in a config file (JSON scalars and lists are TOML)."""
    return f"`{json.dumps(value)}`"


def bounds(metadata: list[Any]) -> list[str]:
    """The constraints pydantic keeps as a field's (or an item's) metadata, in words."""
    out = []
    for m in metadata:
        if isinstance(m, Ge):
            out.append(f"≥ {m.ge}")
        elif isinstance(m, Gt):
            out.append(f"> {m.gt}")
        elif isinstance(m, Le):
            out.append(f"≤ {m.le}")
        elif isinstance(m, Lt):
            out.append(f"< {m.lt}")
        elif isinstance(m, MinLen) and m.min_length == 1:
            out.append("not empty")
        elif isinstance(m, MinLen) and m.min_length:
            out.append(f"at least {m.min_length} long")
        elif isinstance(m, MaxLen):
            out.append(f"at most {m.max_length} long")
    return out


def kind(annotation: Any) -> tuple[str, list[str]]:
    """A field's type in words, and the constraints its type itself carries (a Literal's
    choices, the bounds of a tuple's items)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        choices = ", ".join(code(c) for c in typing.get_args(annotation))
        return "str", [f"one of {choices}"]
    if origin is tuple:  # tuple[Annotated[int, Field(...)], ...]: a list of ints
        item = typing.get_args(annotation)[0]
        inner: list[Any] = []
        if typing.get_origin(item) is typing.Annotated:
            item, *extra = typing.get_args(item)
            for e in extra:
                inner += e.metadata if isinstance(e, FieldInfo) else [e]
        each = bounds(inner)
        return f"list of {item.__name__}", [f"each {', '.join(each)}"] if each else []
    return annotation.__name__, []


def styled(rows: list[str], css: str = "qrl-table") -> str:
    """A Markdown table in a ``div`` of class ``css`` (docs/stylesheets/extra.css)."""
    return f'<div class="{css}" markdown>\n\n' + "\n".join(rows) + "\n\n</div>"


def config_table(cls: type[BaseModel], image_defaults: dict[str, Any] | None = None) -> str:
    """Every field of ``cls``: name, type, default, range, live, description."""
    live = set(live_fields(cls))
    defaults = cls.model_construct().model_dump(mode="json")
    rows = [
        "| field | type | default | range | live | description |",
        "|---|---|---|---|---|---|",
    ]
    for name, info in cls.model_fields.items():
        type_text, constraints = kind(info.annotation)
        default = code(defaults[name])
        if image_defaults and name in image_defaults:
            default += f"; images: {code(image_defaults[name])}"
        ranged = ", ".join(bounds(info.metadata) + constraints) or "any"
        cells = [
            f"`{name}`",
            type_text,
            default,
            ranged,
            "live" if name in live else "no",
            info.description or "",
        ]
        rows.append("| " + " | ".join(cell(c) for c in cells) + " |")
    return styled(rows, "qrl-config")


def algorithm_config(name: str, page: Any) -> str:
    a = ALGOS[name]
    return config_table(a.config, a.config.image_defaults)


def roles_table(name: str, page: Any) -> str:
    """The roles of algorithm ``name``: the command that starts one, how many a job runs."""
    rows = ["| role | command | processes | what it does |", "|---|---|---|---|"]
    for r in ALGOS[name].roles:
        many = f"`{r.count}` (a config field)" if r.count else "1"
        cells = [r.name, f"`qrl {' '.join(r.command)}`", many, r.help]
        rows.append("| " + " | ".join(cell(c) for c in cells) + " |")
    return styled(rows)


def algorithms_table(_: str | None, page: Any) -> str:
    """Every registered algorithm: its page (linked from ``page``), what flows between its
    roles (its config class's first line), its action spaces, whether ``qrl pbt`` trains it."""
    here = posixpath.dirname(page.file.src_uri) or "."
    rows = [
        "| algorithm | what flows through Redis | actions | `qrl pbt` |",
        "|---|---|---|---|",
    ]
    for name, a in ALGOS.items():
        first = inspect.cleandoc(a.config.__doc__ or "").split("\n\n")[0]
        what = first.split(": ", 1)[-1].replace("->", "→")
        cells = [
            f"[{name}]({posixpath.relpath(f'algorithms/{name}.md', here)})",
            what,
            ", ".join(sorted(a.actions)),
            "yes" if a.pbt else "no",
        ]
        rows.append("| " + " | ".join(cell(c) for c in cells) + " |")
    return styled(rows)


def help_text(text: str) -> str:
    """A click help text as Markdown: its paragraphs as they are, a ``\\b`` paragraph (one
    click does not rewrap: examples, lists) as a code block; ``\\f`` ends what is shown."""
    out = []
    for para in inspect.cleandoc(text).split("\f")[0].split("\n\n"):
        if para.startswith("\b\n"):
            out.append("```text\n" + textwrap.dedent(para[2:]) + "\n```")
        else:
            out.append(para)
    return "\n\n".join(out)


def command_doc(cmd: click.Command, ctx: click.Context, depth: int) -> list[str]:
    """``cmd``'s section (its help, usage and options) and its subcommands' after it."""
    path = ctx.command_path
    out = [f"{'#' * depth} `{path}`", help_text(cmd.help or "")]
    usage = " ".join(cmd.collect_usage_pieces(ctx))
    out.append(f"```text\nUsage: {path} {usage}\n```")
    rows = [
        (names, text)
        for p in cmd.get_params(ctx)
        if (record := p.get_help_record(ctx)) and (names := record[0]) != "--help"
        for text in [record[1]]
    ]
    if rows:
        table = ["| option | description |", "|---|---|"]
        table += [f"| {cell(f'`{names}`')} | {cell(text)} |" for names, text in rows]
        out.append(styled(table))
    if isinstance(cmd, click.Group):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            assert sub is not None
            sub_ctx = click.Context(sub, parent=ctx, info_name=name)
            out += command_doc(sub, sub_ctx, depth + 1 if ctx.parent else depth)
    return out


def cli_reference(_: str | None, page: Any) -> str:
    """Every command of ``qrl`` under a heading of its own: the top-level ones beside ``qrl``
    itself, the commands of a group under the group's."""
    root = click.Context(main, info_name="qrl")
    out = command_doc(main, root, 2)
    return "\n\n".join(out)


RENDER = {
    "cli": cli_reference,
    "config": algorithm_config,
    "roles": roles_table,
    "algorithms": algorithms_table,
    "config-base": lambda _, page: config_table(Config),
}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    def render(m: re.Match[str]) -> str:
        if m[1] not in RENDER:
            raise ValueError(f"{page.file.src_path}: unknown marker {m[0]}")
        return RENDER[m[1]](m[2], page)

    return MARKER.sub(render, markdown)


class SphinxRoles(griffe.Extension):
    """``:class:`qrl.x.Y``` in a docstring as ```qrl.x.Y```."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(r"`\1`", obj.docstring.value)
