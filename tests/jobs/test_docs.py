"""The documentation cannot rot: the site builds strictly, its reference matches the code, the quick start runs.

* ``mkdocs build --strict`` into a temporary directory: a broken link, a page
  missing from the nav, an object mkdocstrings cannot find, a generated part
  that fails (a ``SHARDCKPT_*`` variable the code reads and nothing
  describes, an exception class without its section) fail it.
* The generated parts are committed in the pages (they read the same on
  GitHub) and a stale one fails the build.
* The built reference holds every ``CheckpointConfig`` field with its
  default, every variable the package reads, every CLI command and option,
  every public exception, every public name.
* The README's quick start, extracted from README.md as it stands (the docs
  include the same block), runs twice in a fresh process and resumes.
"""

from __future__ import annotations

import argparse
import dataclasses
import html
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs"))

import gen_reference  # noqa: E402

import shardckpt  # noqa: E402

pytest.importorskip("mkdocs", reason="the docs extra is not installed: bash scripts/setup.sh installs it")


def _text(page: Path) -> str:
    """The visible text of a built page's article."""
    body = page.read_text()
    match = re.search(r"<article.*?</article>", body, re.S)
    assert match, f"{page} has no article"
    return html.unescape(re.sub(r"<[^>]+>", "", match.group(0)))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**_clean_env(), "NO_MKDOCS_2_WARNING": "1"},
    )
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    return out


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("SHARDCKPT_")}


def test_every_config_field_is_in_the_reference_with_its_default_and_variable(site: Path) -> None:
    text = _text(site / "reference" / "configuration" / "index.html")
    fields = dataclasses.fields(shardckpt.CheckpointConfig)
    assert len(fields) > 40
    for field in fields:
        assert f"{field.name}" in text, f"CheckpointConfig.{field.name} is missing from the configuration page"
    for f in gen_reference.config_fields():
        # the section of each field shows its default and (when read) its variable
        assert re.search(rf"Type {re.escape(f.type)} · default {re.escape(f.default)}", text), f.name
        if f.env:
            assert f"environment {f.env}" in text, f.name
        plain = re.sub(r":\w+:`~?([^`]+)`", r"\1", f.doc).replace("`", "")
        assert " ".join(plain.split()[:6]) in " ".join(text.split()), f"the docstring of {f.name} is missing"
    # a default the page states is the code's own: keep_last's is 3
    assert "Type int | None · default 3 · environment SHARDCKPT_KEEP_LAST" in text


def test_every_variable_the_package_reads_is_documented(site: Path) -> None:
    text = _text(site / "reference" / "environment" / "index.html")
    found = gen_reference.variables_in_code()
    assert {"SHARDCKPT_LOG_LEVEL", "SHARDCKPT_PEER_HOST", "SHARDCKPT_FAILURE_DOMAIN"} <= found
    fields = {f.env for f in gen_reference.config_fields() if f.env}
    assert "SHARDCKPT_KEEP_LAST" in fields and "SHARDCKPT_METADATA" not in fields
    for name in found | fields:
        assert name in text, f"{name} is read by the package but not on the environment page"


def test_an_undocumented_variable_fails_the_generated_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gen_reference, "variables_in_code",
                        lambda: {"SHARDCKPT_LOG_LEVEL", "SHARDCKPT_SOMETHING_NEW"})
    with pytest.raises(LookupError, match="SHARDCKPT_SOMETHING_NEW"):
        gen_reference.variables()


def test_a_stale_generated_part_fails_and_the_committed_ones_are_fresh() -> None:
    page = ROOT / "docs" / "reference" / "configuration.md"
    text = page.read_text()
    for committed in gen_reference.pages():
        assert gen_reference.stale_blocks(committed.read_text()) == [], (
            f"{committed} is stale: python docs/gen_reference.py --write")
    row = "| [`keep_last`](#keep_last) | `int | None` | `3` |"
    assert row in text  # the committed page reads on GitHub as on the site
    assert gen_reference.stale_blocks(text.replace(row, row.replace("`3`", "`4`"))) == ["config"]


def _commands() -> dict[str, argparse.ArgumentParser]:
    return gen_reference.cli_commands()


def test_every_cli_command_and_option_is_in_the_reference(site: Path) -> None:
    text = _text(site / "reference" / "cli" / "index.html")
    commands = _commands()
    assert {"ls", "inspect", "verify", "export", "gc", "status", "adopt", "sync", "push", "pull"} <= set(commands)
    for name, parser in commands.items():
        assert f"shardckpt {name}" in text, f"`shardckpt {name}` is missing from the CLI reference"
        for action in parser._actions:
            for option in action.option_strings:
                assert option in text, f"`shardckpt {name} {option}` is missing from the CLI reference"


def test_every_error_has_its_cause_remedy_and_messages(site: Path) -> None:
    text = _text(site / "operations" / "errors" / "index.html")
    public = [getattr(shardckpt, n) for n in shardckpt.__all__ if n.endswith("Error")]
    assert len(public) >= 10
    sections = dict(re.findall(r"\n(\w+Error)¶\n(.*?)(?=\n\w+Error¶\n|\nOther exceptions¶)", text, re.S))
    messages = gen_reference.error_messages()
    for cls in public:
        assert issubclass(cls, shardckpt.ShardckptError)
        assert cls.__name__ in sections, f"{cls.__name__} has no section on the errors page"
        body = sections[cls.__name__]
        if cls is not shardckpt.ShardckptError:
            assert "Cause." in body and "Remedy." in body, cls.__name__
        for message in messages[cls.__name__]:
            shown = message.replace("`", "'")  # a message is shown in one code span
            assert shown in body, f"{cls.__name__}: message missing from its section: {message}"
    # the messages are the code's own: what users meet is listed as it is raised
    assert any(m.startswith("keep_last must be >= 1") for m in messages["ConfigError"])
    assert len(messages["CorruptCheckpointError"]) > 10


def test_every_public_name_is_in_the_python_api(site: Path) -> None:
    text = _text(site / "reference" / "python-api" / "index.html")
    for name in shardckpt.__all__:
        assert re.search(rf"\b{re.escape(name)}\b", text), f"shardckpt.{name} is missing from the Python API page"
    # docstrings of lazily imported names are there (ResumableSampler lives in a submodule)
    assert inspect_first_line(shardckpt.ResumableSampler) in text


def inspect_first_line(obj: object) -> str:
    import inspect

    return (inspect.getdoc(obj) or "").splitlines()[0].replace("``", "")


def test_benchmark_results_are_the_measured_ones(site: Path) -> None:
    text = _text(site / "benchmarks" / "results" / "index.html")
    measured = (ROOT / "benchmarks" / "results" / "README-performance.md").read_text()
    machine = re.search(r"^Machine: (.{30})", measured, re.M)
    assert machine and machine.group(1) in text
    for png in (ROOT / "benchmarks" / "results").glob("*.png"):
        assert (site / "benchmarks" / png.name).is_file(), png.name


def _quickstart() -> str:
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- --8<-- \[start:quickstart\] -->\n```python\n(.*?)```\n<!-- --8<-- \[end:quickstart\] -->",
                      readme, re.S)
    assert match, "README.md lost its quick start block (the docs include it by its markers)"
    return match.group(1)


def test_the_quickstart_of_the_readme_runs_and_resumes(tmp_path: Path, site: Path) -> None:
    code = _quickstart()
    # the getting-started page shows the same code, included from the README
    page = _text(site / "getting-started" / "index.html")
    assert "ckpt.save(state, step)" in page and "shardckpt.Checkpointer(local_dir=\"checkpoints/quickstart\"" in page
    script = tmp_path / "quickstart.py"
    script.write_text(code)
    outputs = []
    for _ in range(2):
        run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                             timeout=300, env=_clean_env())
        assert run.returncode == 0, run.stderr[-4000:]
        outputs.append(run.stdout)
    assert "resumed at step 0; committed steps: [15, 20]" in outputs[0]
    assert "resumed at step 20; committed steps: [35, 40]" in outputs[1]


def test_the_readme_is_a_front_page_whose_links_all_lead_somewhere() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300, "README.md is a front page: move details into docs/"
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [link.split("#")[0] for link in links if "://" not in link and not link.startswith("#")]
    assert len(local) > 20
    missing = sorted({link for link in local if not (ROOT / link).exists()})
    assert not missing, f"README.md links to files that do not exist: {missing}"
    # the three things a newcomer looks for are one click away
    for page in ("docs/guides/fsdp2-s3-multinode.md", "docs/operations/errors.md", "docs/reference/configuration.md"):
        assert f"]({page})" in readme, page
