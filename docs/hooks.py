"""MkDocs hooks: the generated parts of the site (see gen_reference.py).

* The generated parts of the pages (``<!-- gen:NAME --> ... <!-- end:gen -->``,
  committed so that the pages read the same on GitHub) must equal what
  ``gen_reference`` renders from the package now: a stale one fails the
  build, with the command that refreshes it.
* ``::: shardckpt.Name`` (mkdocstrings) is pointed at the module that defines
  the name today; the pages name public names only.
* ``benchmarks/results.md`` and its plots are generated from
  ``benchmarks/results/`` (written by ``benchmarks/run.py``): the site shows
  the tables of the last measured run, never a copy of them.
* A page the nav names that does not exist fails the strict build.

An error class exported by ``shardckpt`` without its section in
``operations/errors.md``, or a marker that names nothing, fails the build.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
RESULTS = ROOT / "benchmarks" / "results"


def _gen() -> Any:
    if str(DOCS) not in sys.path:
        sys.path.insert(0, str(DOCS))
    import gen_reference

    return gen_reference


def on_files(files: Files, config: Any) -> Files:
    page = RESULTS / "README-performance.md"
    if not page.is_file():
        raise PluginError(f"{page} is missing: run `python benchmarks/report.py` (or benchmarks/run.py) first")
    text = page.read_text()
    text = re.sub(r"^# .*$", "# Results of the last run", text, count=1, flags=re.M)
    files.append(File.generated(config, "benchmarks/results.md", content=text))
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"benchmarks/{png.name}", abs_src_path=str(png)))
    return files


_DIRECTIVE = re.compile(r"^::: shardckpt\.([A-Za-z_][A-Za-z0-9_]*)[ \t]*$", re.M)


def _public_directives(markdown: str, where: str) -> str:
    """``::: shardckpt.Name``: only public names; an anchor ``#name`` before each (the API
    table links to it); a lazily imported name pointed at the module that defines it today
    (mkdocstrings reads the source and cannot follow the package's lazy ``__getattr__``)."""
    import shardckpt

    lazy = getattr(shardckpt, "_LAZY", {})  # name -> submodule, imported on first use (with torch)

    def resolve(match: re.Match) -> str:
        name = match.group(1)
        if name not in shardckpt.__all__:
            raise PluginError(f"{where}: shardckpt.{name} is not a public name (shardckpt.__all__)")
        target = f"shardckpt.{lazy[name]}.{name}" if name in lazy else f"shardckpt.{name}"
        return f'<a id="{name.lower()}"></a>\n\n::: {target}'

    return _DIRECTIVE.sub(resolve, markdown)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if "::: shardckpt." in markdown:
        markdown = _public_directives(markdown, page.file.src_uri)
    where = page.file.src_uri
    if "<!-- gen:" not in markdown:
        if where == "operations/errors.md":
            raise PluginError("operations/errors.md lost its generated parts")
        return markdown
    gen = _gen()
    try:
        stale = gen.stale_blocks(markdown)
    except LookupError as exc:
        raise PluginError(f"{where}: {exc}") from exc
    if stale:
        raise PluginError(
            f"{where}: the generated part(s) {', '.join(stale)} differ from what the code gives now. "
            "Remedy: python docs/gen_reference.py --write (and commit the pages it rewrites)"
        )
    if where == "operations/errors.md":
        documented = {m.group(3) for m in gen.BLOCK.finditer(markdown) if m.group(2) == "error-messages"}
        missing = [c.__name__ for c in gen.error_classes() if c.__name__ not in documented]
        if missing:
            raise PluginError(
                f"operations/errors.md has no section for {', '.join(missing)}: add one "
                "(cause, remedy, and a <!-- gen:error-messages:NAME --> ... <!-- end:gen --> block)"
            )
    return markdown
