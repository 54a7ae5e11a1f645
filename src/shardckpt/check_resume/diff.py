"""``shardckpt diff``: how two committed steps differ, per key (torch-free until it runs).

::

    shardckpt diff A [B] [--step N] [--step M] [--json] [--trust-pickles] [--endpoint-url URL]

A and B: a ``local_dir``, one ``step_<N>`` directory of it, or a remote URL
(``s3://bucket/prefix``, ``file:///path``). One source and two ``--step``:
two steps of one run; two sources: the same step of each (one ``--step``),
a step of each (two), or the newest live step of each (none). Every saved key
is compared with the fingerprints of ``shardckpt check-resume``
(:mod:`.step_values`): per key, equal, or which entries differ (for tensors the
number of differing elements, the largest absolute difference and both norms;
plain values side by side), and the keys only one side holds. Exit status 0:
equal; 1: they differ; 2: a step could not be read (the reason and the remedy).
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from shardckpt.errors import ShardckptError
from shardckpt.stores import TransferOptions

OK, DIFFERENT, ERROR = 0, 1, 2
SHOWN = 8
"""Differing entries listed per key in the text output (all of them with --json)."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "diff", help="how two committed steps differ, per key (of one run or of two)",
        description="Compare two committed steps key by key, bit for bit (NaN equal to NaN): of one checkpoint "
        "directory or URL (A and two --step), or of two runs (A and B, local or remote). Per key: equal, or the "
        "entries that differ (tensors: differing elements, largest absolute difference, both norms; plain values "
        "side by side). Exit status 0: equal; 1: different; 2: a step could not be read. Imports torch.",
    )
    p.add_argument("a", metavar="A", help="a local_dir, one step_<N> directory, or a remote URL")
    p.add_argument("b", metavar="B", nargs="?", help="a second run's (default: A)")
    p.add_argument("--step", type=int, action="append", default=[], metavar="N",
                   help="the step to compare (once: that step of A and of B; twice: the first of A, the second of "
                   "B; default: the newest live step of each)")
    p.add_argument("--json", action="store_true", help="the comparison as JSON (every differing entry)")
    p.add_argument("--trust-pickles", action="store_true", help="read non-tensor values without the allow-list")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint for s3:// sources")
    p.set_defaults(func=cmd_diff)


def _sides(args: argparse.Namespace) -> tuple[tuple[str, int | None], tuple[str, int | None]]:
    steps = list(args.step)
    if len(steps) > 2:
        raise ShardckptError("diff compares two steps: give --step at most twice.")
    b = args.b or args.a
    if args.b is None and len(steps) != 2:
        raise ShardckptError("diff with one source compares two of its steps: give --step twice (e.g. --step 10 "
                             "--step 20), or a second source.")
    first = steps[0] if steps else None
    return (args.a, first), (b, steps[1] if len(steps) == 2 else first)


def cmd_diff(args: argparse.Namespace) -> int:
    from shardckpt.check_resume import step_values  # imports torch: only for this command

    try:
        (src_a, step_a), (src_b, step_b) = _sides(args)
        options = TransferOptions(endpoint_url=args.endpoint_url)
        a = step_values.read_step(src_a, step_a, trust_pickles=args.trust_pickles, options=options)
        b = step_values.read_step(src_b, step_b, trust_pickles=args.trust_pickles, options=options)
    except ShardckptError as exc:
        print(f"shardckpt diff: {exc}")
        return ERROR
    keys = step_values.compare_keys(a, b)
    equal = all(k["status"] == "equal" for k in keys.values())
    if args.json:
        print(json.dumps({"a": {"source": a.source, "step": a.step}, "b": {"source": b.source, "step": b.step},
                          "equal": equal, "keys": keys}, indent=1, sort_keys=True, default=_json))
    else:
        print("\n".join(report(f"step {a.step} of {a.source}", f"step {b.step} of {b.source}", keys)))
    return OK if equal else DIFFERENT


def _json(value: Any) -> Any:
    return repr(value)


def _num(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    return repr(value) if isinstance(value, str) else str(value)


def _entry_text(name: str, detail: dict[str, Any]) -> str:
    name = name or "value"  # a key that is one plain value or tensor
    if "only in" in detail:
        return f"{name}: only in {detail['only in']}"
    if "max_abs_diff" in detail:
        return (f"{name} {detail['dtype']}{detail['shape']}: {detail['differing']} element(s) differ, max |A-B| "
                f"{_num(detail['max_abs_diff'])}, norm {_num(detail['norm_a'])} (A) vs {_num(detail['norm_b'])} (B)")
    if "shape_b" in detail:
        return f"{name}: {detail['dtype']}{detail['shape']} (A) vs {detail['dtype_b']}{detail['shape_b']} (B)"
    return f"{name}: {_num(detail['a'])} (A) vs {_num(detail['b'])} (B)"


def _label(key: str) -> str:
    return "process RNG" if key == "_shardckpt" else key  # the reserved key: this process's generators, per rank


def report(name_a: str, name_b: str, keys: dict[str, dict[str, Any]]) -> list[str]:
    """The text report: one line per key, and the differing entries below each key that differs."""
    differ = [k for k, v in keys.items() if v["status"] != "equal"]
    lines = [f"shardckpt diff: A = {name_a}", f"shardckpt diff: B = {name_b}"]
    for key, found in keys.items():
        label = _label(key)
        if found["status"] == "equal":
            lines.append(f"  {label} [{found['kind']}]: equal")
        elif found["status"] != "differs":
            lines.append(f"  {label} [{found['kind']}]: {found['status']}")
        else:
            entries = found["entries"]
            lines.append(f"  {label} [{found['kind']}]: {len(entries)} of {found['leaves']} entries differ")
            lines += [f"    {_entry_text(n, d)}" for n, d in list(entries.items())[:SHOWN]]
            if len(entries) > SHOWN:
                lines.append(f"    ... and {len(entries) - SHOWN} more (--json lists them all)")
    lines.append(f"shardckpt diff: {'equal' if not differ else 'differ'}: {len(keys) - len(differ)} key(s) equal"
                 + (f", {len(differ)} differ ({', '.join(map(_label, differ))})" if differ else ""))
    return lines
