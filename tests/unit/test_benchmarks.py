"""The benchmark harness's own logic: ratios, tables, the README markers, the RAM guard, the report."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

import common  # noqa: E402
import report  # noqa: E402
import run  # noqa: E402


def result_with_groups() -> dict:
    result = common.new_result("restore", 64 * common.MIB)
    common.add_row(result, "read (floor)", [1.0, 3.0, 2.0], group="warm", floor=True)
    common.add_row(result, "shardckpt load", [4.0, 4.0, 5.0], group="warm")
    common.add_row(result, "read (floor)", [10.0], group="cold", floor=True)
    common.add_row(result, "shardckpt load", [15.0], group="cold", gb_per_s=0.5)
    return result


def test_ratios_use_the_first_floor_of_the_same_group():
    rows = common.summarize(result_with_groups())["rows"]
    assert [r["median"] for r in rows] == [2.0, 4.0, 10.0, 15.0]
    assert [r["ratio"] for r in rows] == [1.0, 2.0, 1.0, 1.5]


def test_merge_of_separate_processes_keeps_rows_and_skips():
    a = common.new_result("blocked", common.GIB)
    common.add_row(a, "floor", [1.0], floor=True)
    b = common.new_result("blocked", common.GIB)
    common.add_row(b, "tool", [3.0])
    c = common.new_result("blocked", common.GIB)
    common.add_skip(c, "broken", "RuntimeError: no")
    merged = common.merge([a, b, c])
    assert [r["ratio"] for r in merged["rows"]] == [1.0, 3.0]
    assert merged["skipped"] == [{"tool": "broken", "group": "", "reason": "RuntimeError: no"}]


def test_table_shows_groups_and_extra_columns():
    lines = common.table([result_with_groups()])
    assert lines[0].startswith("| state | cache | tool |") and "GB/s" in lines[0]
    assert "| 64 MiB | cold | **shardckpt load** | 15.00 | 15.00 | 1.50 | 0.5 |" in lines


def test_readme_markers_are_replaced_and_required():
    text = "intro\n<!-- perf:begin -->\nold\n<!-- perf:end -->\ntail\n"
    assert report.replace_between_markers(text, "new") == "intro\n<!-- perf:begin -->\nnew\n<!-- perf:end -->\ntail\n"
    with pytest.raises(ValueError, match="markers"):
        report.replace_between_markers("no markers\n", "new")


def test_ram_guard_extrapolates_from_smaller_sizes(monkeypatch):
    g = common.GIB
    assert run.predicted_peak([], 4 * g) is None
    assert run.predicted_peak([(g, 2 * g)], 4 * g) == 8 * g
    assert run.predicted_peak([(g, 2 * g), (2 * g, 3 * g)], 8 * g) == 9 * g
    monkeypatch.setattr(common, "mem_available", lambda: 12 * g)
    assert run.too_big([(g, 2 * g), (2 * g, 3 * g)], 8 * g) is None
    assert "extrapolate" in run.too_big([(g, 2 * g), (2 * g, 4 * g)], 8 * g)


def test_report_writes_page_plot_and_readme(tmp_path):
    pytest.importorskip("matplotlib")
    results = []
    for size in (common.GIB, 4 * common.GIB):
        r = common.new_result("restore", size)
        common.add_row(r, "read (floor)", [1.0], group="warm", floor=True)
        common.add_row(r, "shardckpt load", [2.0], group="warm")
        common.add_skip(r, "dcp.load", "OSError: refused", group="warm")
        results.append(r)
    doc = {"case": "restore", "order": 2, "title": "Restore", "what": "what it measures",
           "command": "python benchmarks/run.py --only restore", "date": "2026-01-01T00:00:00Z",
           "hardware": common.hardware(tmp_path), "git": {"commit": "abc", "dirty": False}, "plot": "restore.png",
           "results": results, "invocations": []}
    common.write_json(tmp_path / "restore.json", doc)
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- perf:begin -->\n<!-- perf:end -->\n")
    written = report.write(tmp_path, readme=readme)
    assert (tmp_path / "restore.png").stat().st_size > 0
    page = (tmp_path / report.PAGE).read_text()
    assert "python benchmarks/run.py --only restore" in page and "`OSError: refused`" in page
    summary = readme.read_text()
    assert "shardckpt load 2.000 s (2.00×)" in summary and "](restore.png)" in summary
    assert str(readme) in written
