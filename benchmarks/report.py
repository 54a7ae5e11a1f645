"""Markdown, plots and the README summary from the JSON files of ``benchmarks/run.py``.

    python benchmarks/report.py [--out benchmarks/results] [--readme README.md]

``benchmarks/run.py`` calls this after running; by hand it re-renders
``README-performance.md`` and the PNGs from results already there, and with
``--readme`` replaces what stands between ``<!-- perf:begin -->`` and
``<!-- perf:end -->`` in that file with a summary: one line per case at its
largest state, links to the full tables and the plots.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

BEGIN, END = "<!-- perf:begin -->", "<!-- perf:end -->"
PAGE = "README-performance.md"


def load(out: str | os.PathLike) -> list[dict]:
    docs = []
    for path in sorted(Path(out).glob("*.json")):
        doc = json.loads(path.read_text())
        if isinstance(doc, dict) and "results" in doc and "case" in doc:
            docs.append(doc)
    return sorted(docs, key=lambda d: (d.get("order", 99), d["case"]))


# ------------------------------------------------------------------ markdown

def describe_machine(doc: dict) -> str:
    hw, git = doc["hardware"], doc["git"]
    commit = (git.get("commit") or "?")[:10] + (" (with local changes)" if git.get("dirty") else "")
    return (f"{hw['cpu']}, {hw['cores']} cores, {hw['ram']} RAM, disk {hw['disk']}"
            f"{' (' + hw['disk_device'] + ')' if hw.get('disk_device') else ''}, Linux {hw['kernel']}, "
            f"Python {hw['python']}, torch {hw['torch']}{', GPU ' + hw['gpu'] if hw.get('gpu') else ''}; "
            f"shardckpt at commit {commit}")


def busy_warning(doc: dict) -> str | None:
    load_avg, cores = doc["hardware"].get("loadavg") or [0], doc["hardware"].get("cores") or 1
    if load_avg[0] > 0.25 * cores:
        return (f"The machine was busy when this case started (load average {load_avg[0]:.2f} on {cores} cores): "
                "the ratios are noisy.")
    return None


def case_markdown(doc: dict) -> list[str]:
    lines = [f"## {doc['title']}", "", doc["what"], "", "```bash", doc["command"], "```", ""]
    load_avg = (doc["hardware"].get("loadavg") or [0])[0]
    lines += [f"{'Quick run (small sizes, few repeats), ' if doc.get('quick') else ''}started {doc['date']}, "
              f"load average {load_avg:.2f} at the start.", ""]
    if (warning := busy_warning(doc)) is not None:
        lines += [f"> {warning}", ""]
    rows = [r for r in doc["results"] if r["rows"]]
    if rows:
        lines += common.table(rows) + [""]
    skipped = [(r["size_bytes"], s) for r in doc["results"] for s in r["skipped"]]
    if skipped:
        lines += ["Skipped:", ""]
        lines += [f"- {common.fmt_size(size) if size else ''} {s['tool']}"
                  f"{' (' + s['group'] + ')' if s.get('group') else ''}: `{s['reason']}`" for size, s in skipped]
        lines += [""]
    notes = list(dict.fromkeys(n for r in doc["results"] for n in r.get("notes", [])))
    if notes:
        lines += [f"- {n}" for n in notes] + [""]
    if doc.get("plot") and rows:
        lines += [f"![{doc['title']}]({doc['plot']})", ""]
    if doc.get("invocations"):
        lines += ["<details><summary>processes</summary>", "", "| command | exit | wall (s) | host RAM peak |",
                  "|---|---|---|---|"]
        lines += [f"| `{i['cmd']}` | {i['rc']} | {i['wall_s']} | {common.fmt_bytes(i['host_peak_bytes'])} |"
                  for i in doc["invocations"]]
        lines += ["", "</details>", ""]
    return lines


def page(docs: list[dict]) -> str:
    first = docs[0]
    lines = ["# shardckpt performance", "",
             f"Written by `{first.get('run_command', 'python benchmarks/run.py')}` "
             f"({first['date']} to {max(d.get('finished', d['date']) for d in docs)}).", "",
             f"Machine: {describe_machine(first)}.", "", "```", first["hardware"].get("disk_df", ""), "```", "",
             "Ratios are medians over repeats divided by the median of the floor (or baseline) measured in the "
             "same run on the same machine; absolute times on shared machines drift, the ratios much less.", ""]
    if any(d.get("quick") for d in docs):
        lines += ["> Quick run: small states and few repeats, to check that every case works. Do not quote "
                  "these numbers; run `python benchmarks/run.py` on a quiet machine.", ""]
    for doc in docs:
        lines += case_markdown(doc)
    return "\n".join(lines).rstrip() + "\n"


# --------------------------------------------------------------------- plots

OURS = ["#d62728", "#ff7f0e", "#e377c2"]  # shardckpt: warm colours, drawn thick
FLOORS = ["#333333", "#888888"]  # dashed
OTHERS = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#bcbd22", "#7f7f7f", "#aec7e8"]


def line_colors(tools: list[str], floors: set[str]) -> dict[str, str]:
    """The same kind of line looks alike in every plot: shardckpt warm, floors grey, the rest cool."""
    out, used = {}, {"ours": 0, "floor": 0, "other": 0}
    for tool in tools:
        kind, palette = (("floor", FLOORS) if tool in floors else ("ours", OURS) if tool.startswith("shardckpt")
                         else ("other", OTHERS))
        out[tool] = palette[used[kind] % len(palette)]
        used[kind] += 1
    return out


def plot(doc: dict, out: Path) -> Path | None:
    """Median time against state size, one line per tool, floors dashed; a panel per cache state."""
    results = [r for r in doc["results"] if r["rows"]]
    if not doc.get("plot") or not results:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    groups = list(dict.fromkeys(row["group"] for r in results for row in r["rows"]))
    tools = list(dict.fromkeys(row["tool"] for r in results for row in r["rows"]))
    sizes = sorted({r["size_bytes"] for r in results})
    fig, axes = plt.subplots(1, len(groups), figsize=(5.6 * len(groups) + 1.0, 4.2 + 0.22 * len(tools)),
                             squeeze=False, sharey=True)
    floors = {row["tool"] for r in results for row in r["rows"] if row["floor"]}
    colors = line_colors(tools, floors)
    for ax, group in zip(axes[0], groups):
        for tool in tools:
            points = sorted((r["size_bytes"], row["median"]) for r in results for row in r["rows"]
                            if row["tool"] == tool and row["group"] == group and not math.isnan(row["median"]))
            if not points:
                continue
            floor = any(row["floor"] for r in results for row in r["rows"] if row["tool"] == tool)
            ours = tool.startswith("shardckpt")
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=colors[tool],
                    label=tool + (" (floor)" if floor and "floor" not in tool else ""),
                    linestyle="--" if floor else "-", linewidth=2.6 if ours else 1.4, zorder=3 if ours else 2)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [common.fmt_size(s) for s in sizes])
        ax.minorticks_off()
        ax.set_xlabel("state size")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
            lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.grid(True, which="major", alpha=0.3)
        ax.set_title(f"{doc['title']}"
                     f"{f' — {group} page cache' if group in ('warm', 'cold') else f' — {group}' if group else ''}",
                     fontsize=10)
    axes[0][0].set_ylabel(f"median time ({results[0]['unit']}, log scale)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    stamp = f"{doc['date'][:10]}, {doc['hardware']['cpu']}, {doc['hardware']['cores']} cores"
    fig.text(0.99, 0.005, stamp + (" — quick run" if doc.get("quick") else ""), ha="right", fontsize=7, alpha=0.7)
    fig.tight_layout(rect=(0, 0.04 + 0.04 * ((len(tools) + 1) // 2), 1, 1))
    path = out / doc["plot"]
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -------------------------------------------------------------------- README

def summary(docs: list[dict], out: Path, readme: Path) -> str:
    """The README block: per case at its largest state, shardckpt against the floor and the others."""
    rel = os.path.relpath(out, readme.parent)
    rel = "" if rel == "." else rel + "/"
    first = docs[0]
    lines = [f"Measured by `{first.get('run_command', 'python benchmarks/run.py')}` on {first['date'][:10]}: "
             f"{describe_machine(first)}. Full tables, commands and what was skipped: "
             f"[{rel}{PAGE}]({rel}{PAGE}).", "",
             "| case | state | floor / baseline | shardckpt (× floor) | others (× floor) |", "|---|---|---|---|---|"]
    for doc in docs:
        results = [common.summarize(r) for r in doc["results"] if r["rows"]]
        if not results:
            continue
        last = results[-1]
        groups = list(dict.fromkeys(row["group"] for row in last["rows"]))
        for group in groups:
            rows = [row for row in last["rows"] if row["group"] == group]
            floor = next((row for row in rows if row["floor"]), None)
            unit = last["unit"]

            def show(row: dict) -> str:
                ratio = f" ({row['ratio']:.2f}×)" if row["ratio"] is not None else ""
                fits = ""
                if "fits_30s_gib" in row["extra"]:
                    fits = (f"; fits {common.fmt_number(row['extra']['fits_30s_gib'])} GiB in 30 s, "
                            f"{common.fmt_number(row['extra']['fits_120s_gib'])} GiB in 120 s")
                return f"{row['tool']} {common.fmt_number(row['median'])} {unit}{ratio}{fits}"

            ours = [show(r) for r in rows if r["tool"].startswith("shardckpt")]
            others = [show(r) for r in rows if r is not floor and not r["tool"].startswith("shardckpt")]
            title = doc["title"] + (f", {group} cache" if group in ("warm", "cold") else f", {group}" if group else "")
            floor_text = f"{floor['tool']} {common.fmt_number(floor['median'])} {unit}" if floor else "–"
            lines.append(f"| {title} | {common.fmt_size(last['size_bytes'])} | {floor_text} | "
                         f"{'<br>'.join(ours) or '–'} | {'<br>'.join(others) or '–'} |")
    plots = [d for d in docs if d.get("plot") and (out / d["plot"]).exists()]
    if plots:
        lines += [""] + [f"![{d['title']}]({rel}{d['plot']})" for d in plots]
    if any(d.get("quick") for d in docs):
        lines += ["", "(Quick run: small states, few repeats — not numbers to quote.)"]
    return "\n".join(lines)


def replace_between_markers(text: str, block: str) -> str:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < 0 or end < start:
        raise ValueError(f"the file needs the markers {BEGIN} and {END} (in that order)")
    return text[:start + len(BEGIN)] + "\n" + block.rstrip() + "\n" + text[end:]


def update_readme(readme: str | os.PathLike, docs: list[dict], out: Path) -> None:
    path = Path(readme)
    text = replace_between_markers(path.read_text(), summary(docs, out.resolve(), path.resolve()))
    path.write_text(text)


def write(out: str | os.PathLike, readme: str | os.PathLike | None = None) -> list[str]:
    """Render everything from the JSON files in ``out``; returns the paths written."""
    out = Path(out)
    docs = load(out)
    if not docs:
        raise SystemExit(f"no results in {out}: run benchmarks/run.py first")
    written = []
    (out / PAGE).write_text(page(docs))
    written.append(str(out / PAGE))
    for doc in docs:
        if (path := plot(doc, out)) is not None:
            written.append(str(path))
    if readme is not None:
        update_readme(readme, docs, out)
        written.append(str(readme))
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"),
                        help="the results directory (default benchmarks/results)")
    parser.add_argument("--readme", help="file whose perf markers get the summary")
    args = parser.parse_args()
    try:
        for path in write(args.out, args.readme):
            print(path)
    except ValueError as exc:
        print(f"report: {args.readme}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
