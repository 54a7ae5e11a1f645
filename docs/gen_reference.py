"""The generated parts of the documentation, built from the code itself.

Nothing here is copied by hand from the code: every ``CheckpointConfig``
field (type, default, docstring), every ``SHARDCKPT_*`` variable the package
reads, every command and option of the ``shardckpt`` CLI and every exception
class with the messages the package raises it with are read from the
package. Each part sits in its page between ``<!-- gen:NAME -->`` and
``<!-- end:gen -->``, committed, so that the pages read the same on GitHub as
on the site; ``docs/hooks.py`` fails the site's build while a part differs
from what this module renders now, and ``tests/jobs/test_docs.py`` builds the site
and checks that nothing the code has is missing from it.

    python docs/gen_reference.py --write    refresh every stale part in docs/
    python docs/gen_reference.py --check    exit 1 when one is stale
    python docs/gen_reference.py config     print one part (env, cli, errors, manifest, api)
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import inspect
import os
import re
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import shardckpt

PACKAGE_DIR = Path(inspect.getfile(shardckpt)).resolve().parent

# Variables the package reads that are not ``SHARDCKPT_<FIELD>`` of a config
# field. A variable found in the code and absent here fails the build (and
# tests/jobs/test_docs.py), so that a new variable cannot go undocumented.
OTHER_VARIABLES: dict[str, str] = {
    "SHARDCKPT_LOG_LEVEL": (
        "Level of the `shardckpt` logger (`DEBUG`, `INFO`, `WARNING`, ...) in trainers, the CLI and the "
        "node daemons. Default: `INFO` (one line per save and restore)."
    ),
    "SHARDCKPT_PEER_HOST": (
        "The address this node's peer daemon serves on. Default: the address that reaches `MASTER_ADDR`, "
        "else the host name's address."
    ),
    "SHARDCKPT_PEER_LINGER_S": (
        "Seconds a node's peer daemon keeps serving once no trainer of its node is left (other nodes may "
        "still send their replicas). A launch without the peer tier ends it at once. Default: `60`."
    ),
    "SHARDCKPT_MEMORY_LINGER_S": (
        "Seconds a node's memory keeper keeps a job's memory tier once no trainer of its node is left (a "
        "restart on the node within them resumes from memory); then it frees it. Default: `120`."
    ),
    "SHARDCKPT_SHM_DIR": (
        "The tmpfs the memory tier keeps its copies in (one directory per `local_dir` and user). Default: "
        "`/dev/shm` (containers often give it 64 MiB: raise it, or point this at a larger tmpfs)."
    ),
    "SHARDCKPT_FAILURE_DOMAIN": (
        "A label of the failure domain of this node (`rack-7`, a zone): the peer tier sends this node's "
        "replicas to nodes of other domains first. Default: none."
    ),
    "SHARDCKPT_CHECK_RESUME": (
        "Set by `shardckpt check-resume` for the runs it makes (a JSON object: the check's checkpoint directory, "
        "where each rank records, the step the run stops after). While set, every `Checkpointer`'s `local_dir` and "
        "`remote` point into the check's directory, whatever the script passes, and every `save()` call records "
        "digests of its state ([the guide](../guides/check-resume.md)). Unset in normal runs."
    ),
    "SHARDCKPT_FAILPOINTS": (
        "Testing only: named fault points at which the process kills itself (`name`, `name@N`), raises "
        "(`raise:name`) or damages bytes in transit (`flip:name`). Unset in production."
    ),
    "SHARDCKPT_FAILPOINTS_LOG": (
        "Testing only: a file to which a process killed at a fault point first appends `<point> <pid>`."
    ),
}

# Variables of the scripts (not of the package), documented on the same page.
SCRIPT_VARIABLES: dict[str, str] = {
    "SHARDCKPT_VENV": (
        "`scripts/setup.sh`, `demo.sh`, `test.sh`: the virtual environment to create or use (default `.venv`)."
    ),
}

_ENV_PATTERN = re.compile(r"SHARDCKPT_[A-Z][A-Z0-9_]*")


# ----------------------------------------------------------------- config


@dataclasses.dataclass
class Field:
    name: str
    type: str
    default: str
    env: str | None
    doc: str


def _attribute_docstrings(cls: type) -> dict[str, str]:
    """Field name -> the string literal right below its annotation (the attribute docstring)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        factory = field.default_factory  # type: ignore[misc]
        if factory not in (dict, list, set, tuple):
            return f"{factory.__module__}.{factory.__qualname__}()"  # e.g. time.time(): not a constant
        value = factory()
    else:
        return "(required)"
    if isinstance(value, str) and hasattr(value, "value") and isinstance(getattr(value, "value"), str):
        return repr(value.value)  # a str enum: its value, as users write it
    if isinstance(value, tuple) and value and all(isinstance(v, int) for v in value):
        import signal

        names = []
        for v in value:
            try:
                names.append(signal.Signals(v).name)
            except ValueError:
                names.append(str(v))
        return "(" + ", ".join(names) + ("," if len(names) == 1 else "") + ")"
    if isinstance(value, int) and not isinstance(value, bool) and value >= (1 << 20) and value % (1 << 20) == 0:
        return f"{value} ({value >> 20} MiB)"
    return repr(value)


@functools.lru_cache(maxsize=None)
def config_fields() -> tuple[Field, ...]:
    """Every field of ``shardckpt.CheckpointConfig``, in declaration order."""
    cls = shardckpt.CheckpointConfig
    docs = _attribute_docstrings(cls)
    env_names = _env_fields()
    out = []
    for field in dataclasses.fields(cls):
        out.append(Field(
            name=field.name,
            type=str(field.type).replace("'", ""),
            default=_default_text(field),
            env=("SHARDCKPT_" + field.name.upper()) if field.name in env_names else None,
            doc=docs.get(field.name, ""),
        ))
    return tuple(out)


def _env_fields() -> set[str]:
    """The fields ``CheckpointConfig.from_env`` reads, found by asking it (each variable set alone)."""
    names = set()
    for field in dataclasses.fields(shardckpt.CheckpointConfig):
        probe = {"SHARDCKPT_" + field.name.upper(): "__probe__"}
        try:
            shardckpt.CheckpointConfig.from_env(environ=probe)
        except Exception:  # noqa: BLE001 - with no variable set it raises nothing: it read this one
            names.add(field.name)
        else:
            if getattr(shardckpt.CheckpointConfig.from_env(environ=probe), field.name) in ("__probe__", ("__probe__",)):
                names.add(field.name)
    return names


def _md_cell(text: str) -> str:
    """Text for a table cell: one line, its pipes escaped (outside code spans, where they are literal)."""
    parts = " ".join(text.split("\n")).split("`")
    return "`".join(p if i % 2 else p.replace("|", "\\|") for i, p in enumerate(parts))


def render_config() -> str:
    lines = [
        "| field | type | default | environment variable |",
        "|---|---|---|---|",
    ]
    for f in config_fields():
        env = f"`{f.env}`" if f.env else "—"
        lines.append(f"| [`{f.name}`](#{f.name}) | {_code(f.type)} | {_code(f.default)} | {env} |")
    lines.append("")
    for f in config_fields():
        lines.append(f"## `{f.name}`")  # its anchor: #{f.name}, here and on GitHub
        lines.append("")
        meta = f"**Type** `{f.type}` · **default** `{f.default}`"
        if f.env:
            meta += f" · **environment** `{f.env}`"
        lines.append(meta)
        lines.append("")
        lines.append(_rst_to_md(f.doc) or "(no docstring)")
        lines.append("")
    return "\n".join(lines)


def _code(text: str) -> str:
    """A table cell holding ``text`` as one code span (its pipes stay literal there)."""
    return _md_cell("`" + text + "`")


def _rst_to_md(text: str) -> str:
    """The few reST forms the docstrings use: ``code``, :class:`X` / :func:`x`."""
    text = re.sub(r":(?:class|func|meth|attr|exc|mod):`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


# -------------------------------------------------------------- variables


def _source_files() -> Iterator[Path]:
    yield from sorted(PACKAGE_DIR.rglob("*.py"))


def variables_in_code() -> set[str]:
    """Every ``SHARDCKPT_<NAME>`` literal in the package's source (the bare prefix excluded)."""
    found: set[str] = set()
    for path in _source_files():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.update(m for m in _ENV_PATTERN.findall(node.value) if not m.endswith("_"))
    return found


@dataclasses.dataclass
class Variable:
    name: str
    meaning: str
    field: str | None = None
    default: str | None = None


def variables() -> list[Variable]:
    """Every variable: one per config field read from the environment, then the others the code reads."""
    out = [Variable(f.env, _first_paragraph(f.doc), f.name, f.default) for f in config_fields() if f.env]
    field_vars = {v.name for v in out}
    undocumented = sorted(variables_in_code() - field_vars - set(OTHER_VARIABLES))
    if undocumented:
        raise LookupError(
            f"the package reads {', '.join(undocumented)} but docs/gen_reference.py documents "
            "no such variable: add it to OTHER_VARIABLES (what it does, its default)"
        )
    out.extend(Variable(name, text) for name, text in sorted(OTHER_VARIABLES.items()))
    return out


def _first_paragraph(doc: str) -> str:
    """The docstring's first paragraph (the rest is on the configuration page)."""
    return _rst_to_md(" ".join(doc.split("\n\n")[0].split()))


def render_env() -> str:
    lines = [
        "| variable | field | default | meaning |",
        "|---|---|---|---|",
    ]
    for v in variables():
        field = f"[`{v.field}`](configuration.md#{v.field})" if v.field else "—"
        default = _code(v.default) if v.default is not None else "—"
        lines.append(f"| `{v.name}` | {field} | {default} | {_md_cell(v.meaning)} |")
    lines += ["", "Variables of the scripts in `scripts/` (not read by the package):", "",
              "| variable | meaning |", "|---|---|"]
    lines += [f"| `{name}` | {_md_cell(text)} |" for name, text in sorted(SCRIPT_VARIABLES.items())]
    return "\n".join(lines)


# -------------------------------------------------------------------- CLI


@contextlib.contextmanager
def _clean_environment() -> Iterator[None]:
    """The parser's defaults follow SHARDCKPT_* variables: document those of a clean environment."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("SHARDCKPT_")}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def cli_parser() -> argparse.ArgumentParser:
    from shardckpt import cli

    with _clean_environment():
        return cli.build_parser()


def cli_commands() -> dict[str, argparse.ArgumentParser]:
    parser = cli_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise LookupError("shardckpt's parser has no sub-commands")


def _command_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a.help or "" for a in action._choices_actions}
    return {}


def _argument_rows(sub: argparse.ArgumentParser) -> list[str]:
    rows = ["| argument | default | meaning |", "|---|---|---|"]
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if action.option_strings:
            name = ", ".join(action.option_strings)
            if action.nargs != 0:
                name += " " + (action.metavar or action.dest.upper())
        else:
            name = action.metavar or action.dest
        if action.required and action.option_strings:
            name += " (required)"
        if action.choices and not isinstance(action.choices, dict):
            name += " {" + ",".join(map(str, action.choices)) + "}"
        default = action.default
        if action.nargs == 0 or default in (None, argparse.SUPPRESS) or not action.option_strings:
            default_text = "—"
        else:
            default_text = f"`{default}`"
        help_text = (action.help or "") % {"default": default} if action.help else ""
        rows.append(f"| `{_md_cell(name)}` | {default_text} | {_md_cell(help_text)} |")
    return rows


def render_cli() -> str:
    parser = cli_parser()
    helps = _command_help(parser)
    lines = [_md_cell(parser.description or ""), "", _md_cell(parser.epilog or ""), "",
             "| command | what it does |", "|---|---|"]
    commands = cli_commands()
    lines += [f"| [`shardckpt {name}`](#shardckpt-{name}) | {_md_cell(helps.get(name, ''))} |" for name in commands]
    lines.append("")
    for name, sub in commands.items():
        lines.append(f"### `shardckpt {name}`")  # its anchor: #shardckpt-{name}
        lines.append("")
        lines.append(_md_cell(sub.description or helps.get(name, "")))
        lines.append("")
        lines.append("```text")
        lines.append(" ".join(sub.format_usage().split()).replace("usage: ", "", 1))
        lines.append("```")
        lines.append("")
        lines += _argument_rows(sub)
        lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------- errors


def error_classes() -> list[type]:
    """The exception classes of ``shardckpt``'s public names, the base first."""
    # vars(), not getattr(): the lazily imported names (and torch with them) stay unimported
    classes = [vars(shardckpt).get(n) for n in shardckpt.__all__]
    classes = [c for c in classes if isinstance(c, type) and issubclass(c, shardckpt.ShardckptError)]
    return sorted(classes, key=lambda c: (c is not shardckpt.ShardckptError, c.__name__))  # type: ignore[union-attr]


def _render_message(node: ast.AST) -> str | None:
    """The text of a message expression: literals kept, each interpolated value as ``{expr}``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            elif isinstance(value, ast.FormattedValue):
                parts.append("{" + ast.unparse(value.value) + "}")
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
        left, right = _render_message(node.left), _render_message(node.right)
        if isinstance(node.op, ast.Mod):
            return left
        if left is None and right is None:
            return None
        return (left if left is not None else "{…}") + (right if right is not None else "{…}")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join":
        return "{…}"
    if isinstance(node, ast.Name):
        return "{" + node.id + "}"
    return None


@functools.lru_cache(maxsize=None)
def error_messages() -> dict[str, list[str]]:
    """Class name -> the distinct messages the package constructs it with (in source order)."""
    names = {c.__name__ for c in error_classes()}
    found: dict[str, list[str]] = {n: [] for n in names}
    for path in _source_files():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names):
                continue
            if not node.args:
                continue
            text = _render_message(node.args[0])
            if not text:
                continue
            text = " ".join(text.split())
            if len(re.sub(r"\{[^}]*\}|\W", "", text)) < 3:
                continue  # a message passed through (``ConfigError(str(exc))``): nothing to show
            if text not in found[node.func.id]:
                found[node.func.id].append(text)
    return found


def render_error_summary() -> str:
    lines = ["| exception | also a | meaning |", "|---|---|---|"]
    for cls in error_classes():
        bases = ", ".join(f"`{b.__name__}`" for b in cls.__mro__[1:]
                          if b not in (object, BaseException, Exception, shardckpt.ShardckptError, cls))
        lines.append(f"| [`{cls.__name__}`](#{cls.__name__.lower()}) | {bases or '—'} | "
                     f"{_md_cell(_rst_to_md(inspect.getdoc(cls) or ''))} |")
    return "\n".join(lines)


def render_error_messages(name: str) -> str:
    cls = getattr(shardckpt, name)
    messages = error_messages().get(name, [])
    head = (f"`{name}` — {_rst_to_md(inspect.getdoc(cls) or '')} "
            f"The package raises it with {len(messages)} message{'s' if len(messages) != 1 else ''} "
            "(`{…}` stands for the values filled in: the step, the path, the rank, ...):")
    if not messages:
        return f"`{name}` — {_rst_to_md(inspect.getdoc(cls) or '')}"
    body = [f'??? note "The {len(messages)} message{"s" if len(messages) != 1 else ""} of {name}"', ""]
    body += ["    - `" + m.replace("`", "'") + "`" for m in messages]
    return head + "\n\n" + "\n".join(body)


# --------------------------------------------------------------- manifest


def manifest_fields() -> list[Field]:
    """The keys of a step's manifest (``shardckpt.json``): the fields of its dataclass."""
    from shardckpt.format import layout

    out = []
    for cls in (layout.Manifest, layout.FileEntry):
        docs = _attribute_docstrings(cls)
        for field in dataclasses.fields(cls):
            prefix = "files.<name>." if cls is layout.FileEntry else ""
            default = "—" if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING \
                else _default_text(field)
            out.append(Field(prefix + field.name, str(field.type).replace("'", ""), default, None,
                             docs.get(field.name, "")))
    return out


def render_manifest() -> str:
    from shardckpt.format import layout

    lines = [f"The manifest's `format` is `{layout.MANIFEST_FORMAT}`; a manifest of another format is refused "
             "as unreadable.", "",
             "| key | type | default when absent | meaning |", "|---|---|---|---|"]
    for f in manifest_fields():
        lines.append(f"| `{f.name}` | {_code(f.type)} | {_code(f.default)} | "
                     f"{_md_cell(_rst_to_md(f.doc)) or '—'} |")
    return "\n".join(lines)


# -------------------------------------------------------------- the API


def _static_docstring(module: str, name: str) -> str:
    """The docstring of ``name`` in ``module``, read from its source (no import: no torch)."""
    path = PACKAGE_DIR.joinpath(*module.split(".")[1:]).with_suffix(".py")
    if not path.is_file():
        path = path.with_suffix("") / "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
            return ast.get_docstring(node) or ""
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ""
    raise LookupError(f"shardckpt.{name}: no definition in {path.name}")


def public_names() -> list[tuple[str, str, str]]:
    """(name, kind, summary) of every name in ``shardckpt.__all__``."""
    lazy = getattr(shardckpt, "_LAZY", {})
    out = []
    for name in shardckpt.__all__:
        if name in lazy:
            doc = _static_docstring(f"shardckpt.{lazy[name]}", name)
            kind = "class" if name[:1].isupper() else "function"
        else:
            obj = vars(shardckpt)[name]
            doc = inspect.getdoc(obj) or ""
            if doc.startswith(name + "("):
                doc = ""  # the signature a dataclass without a docstring is given, not a description
            if isinstance(obj, type):
                kind = "exception" if issubclass(obj, BaseException) else "class"
            else:
                kind = "function"
        out.append((name, kind, _rst_to_md(" ".join(doc.split("\n\n")[0].split()))))
    order = {"class": 0, "function": 1, "exception": 2}
    return sorted(out, key=lambda t: (order[t[1]], t[0].lower()))


def render_api() -> str:
    lines = ["| name | kind | what it is |", "|---|---|---|"]
    for name, kind, summary in public_names():
        lines.append(f"| [`shardckpt.{name}`](#{name.lower()}) | {kind} | {_md_cell(summary) or '—'} |")
    return "\n".join(lines)


# ------------------------------------------------- the blocks in the pages
#
# A page holds each generated part between two markers, committed with it so
# that the page reads the same on GitHub as on the site:
#
#     <!-- gen:config -->
#     ...generated...
#     <!-- end:gen -->
#
# `python docs/gen_reference.py --write` refreshes them; the site's build
# (docs/hooks.py) fails while any of them differs from what the code gives.

BLOCK = re.compile(r"(<!-- gen:([a-z-]+)(?::([A-Za-z_]+))? -->\n)(.*?)(<!-- end:gen -->)", re.S)

def render_restore_order() -> str:
    """The restore's order of sources, as ``restoring/sources.py`` states it (the one place it is written)."""
    doc = (PACKAGE_DIR / "restoring" / "sources.py").read_text()
    doc = ast.get_docstring(ast.parse(doc)) or ""
    start = doc.index("\n0. ")
    end = doc.index("\n\n", doc.index("\n5. "))
    items = re.split(r"\n(?=\d\. )", doc[start:end].strip())
    lines = []
    for item in items:
        text = " ".join(line.strip() for line in item.splitlines())
        lines.append(_rst_to_md(text))
    return ("The order, as `restoring/sources.py` states it (generated from its docstring):\n\n"
            + "\n".join(lines) + "\n")


RENDERERS = {
    "restore-order": render_restore_order,
    "config": render_config,
    "env": render_env,
    "cli": render_cli,
    "errors": render_error_summary,
    "manifest": render_manifest,
    "api": render_api,
}


def render(kind: str, arg: str | None = None) -> str:
    if kind == "error-messages":
        if not arg or not isinstance(vars(shardckpt).get(arg), type):
            raise LookupError(f"no shardckpt exception named {arg!r}")
        return render_error_messages(arg)
    if kind not in RENDERERS:
        raise LookupError(f"unknown generated part {kind!r} (known: {', '.join(sorted(RENDERERS))}, error-messages)")
    return RENDERERS[kind]()


def refresh(text: str) -> str:
    """``text`` with every generated block rendered afresh."""
    return BLOCK.sub(lambda m: m.group(1) + "\n" + render(m.group(2), m.group(3)).strip("\n") + "\n\n" + m.group(5),
                     text)


def stale_blocks(text: str) -> list[str]:
    """The names of the blocks of ``text`` that differ from what the code gives now."""
    fresh = {m.start(): m.group(4) for m in BLOCK.finditer(refresh(text))}
    stale = []
    for (old, new) in zip(BLOCK.finditer(text), fresh.values()):
        if old.group(4) != new:
            stale.append(old.group(2) + (f":{old.group(3)}" if old.group(3) else ""))
    return stale


def pages() -> list[Path]:
    docs = Path(__file__).resolve().parent
    return sorted(p for p in docs.rglob("*.md") if BLOCK.search(p.read_text()))


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Refresh or check the generated parts of docs/*.md.")
    parser.add_argument("--write", action="store_true", help="rewrite the stale blocks in place")
    parser.add_argument("--check", action="store_true", help="exit 1 when a block is stale")
    parser.add_argument("part", nargs="?", help="print one part instead: " + ", ".join(sorted(RENDERERS)))
    args = parser.parse_args(argv)
    if args.part:
        print(render(args.part))
        return 0
    status = 0
    for page in pages():
        text = page.read_text()
        stale = stale_blocks(text)
        if not stale:
            continue
        if args.write:
            page.write_text(refresh(text))
            print(f"{page.relative_to(page.parents[1])}: refreshed {', '.join(stale)}")
        else:
            print(f"{page.relative_to(page.parents[1])}: stale {', '.join(stale)}")
            status = 1
    return status if args.check or not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
