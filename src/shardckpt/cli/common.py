"""What the ``shardckpt`` commands share: exit codes, output helpers, opening a location, picking a step."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Any

from shardckpt import steps as steps_mod
from shardckpt.errors import ShardckptError
from shardckpt.format import layout, lineage, retention
from shardckpt.remote import compressed
from shardckpt.stores import TransferOptions

OK, BAD, ERROR = 0, 1, 2


class Problem(ShardckptError):
    """What was asked about is bad or absent: exit status 1, not 2."""


# ------------------------------------------------------------ output helpers


def print_json(body: Any) -> None:
    print(json.dumps(body, indent=1, sort_keys=True, default=str))


def when_utc(created: float) -> str:
    return datetime.datetime.fromtimestamp(created, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def progress_bar(total: int, what: str, enabled: bool) -> Any:
    """A byte progress bar (tqdm) on a terminal; ``None`` otherwise (log lines say the progress)."""
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    try:
        size = os.get_terminal_size(sys.stderr.fileno())
    except OSError:
        size = os.terminal_size((0, 0))
    # A terminal that reports no size (0 x 0) would get an empty bar, or none at all.
    return tqdm(total=total, desc=what, unit="B", unit_scale=True, unit_divisor=1024, leave=False, file=sys.stderr,
                ncols=size.columns or 100, nrows=size.lines or 24)


def transfer_options(args: argparse.Namespace) -> Any:
    return TransferOptions(endpoint_url=getattr(args, "endpoint_url", None))


def open_location(args: argparse.Namespace) -> Any:
    return steps_mod.open_steps(args.src, transfer_options(args))


def committed_manifests(tier: Any, held: dict[int, layout.Manifest] | None = None) -> dict[int, layout.Manifest]:
    """The committed steps (``held``: with the memory tier's saves not on disk, for ``ls``)."""
    manifests = {**(held or {}), **tier.manifests()}
    if not manifests and not tier.unreadable:
        hint = ""
        if not tier.where.startswith(("s3://", "gs://")) and "://" not in tier.where:
            loose = [n for n in os.listdir(tier.where) if layout.parse_step_dirname(n) is not None]
            if loose:
                hint = (f" It holds {len(loose)} step directories without a manifest (interrupted saves or "
                        f"stock DCP checkpoints: see `shardckpt adopt`).")
        raise Problem(f"no committed step in {tier.where}.{hint} Remedy: check the path or URL (and the "
                      f"endpoint, for S3-compatible stores).")
    return manifests


def pick_step(tier: Any, manifests: dict[int, layout.Manifest], step: int | None) -> int:
    if step is None:
        live, _abandoned = tier.live(manifests)
        if not live:
            raise Problem(f"no live committed step in {tier.where}")
        return live[-1]
    if step not in manifests:
        if step in tier.unreadable:
            raise Problem(f"step {step} in {tier.where}: {tier.unreadable[step]}")
        raise Problem(f"step {step} is not committed in {tier.where}; committed: {sorted(manifests) or 'none'}")
    return step


def best_steps(
    manifests: dict[int, layout.Manifest], live: list[int], args: argparse.Namespace
) -> tuple[str | None, list[int]]:
    """The metric ranking steps (``--best-metric``, else the one the run configured) and the best live step."""
    metric, mode = getattr(args, "best_metric", None), getattr(args, "best_mode", None)
    if metric is None and manifests:
        best = (manifests[max(manifests, key=lambda s: manifests[s].created)].run or {}).get("best") or {}
        metric, mode = best.get("metric"), mode or best.get("mode")
    if not metric:
        return None, []
    infos = {s: lineage.info_of(m) for s, m in manifests.items()}
    return metric, retention.ranked(live, infos, metric, mode or "min")[:1]


def step_row(step: int, manifest: layout.Manifest, abandoned: dict[int, str], tier: Any = None,
              best: list[int] = ()) -> dict[str, Any]:
    info = lineage.info_of(manifest)
    return {
        "step": step,
        "bytes": manifest.total_bytes,
        "stored_bytes": compressed.stored_bytes(manifest) if manifest.stored else None,  # compressed on the remote
        "files": len(manifest.files),
        "world_size": manifest.world_size,
        "created": manifest.created,
        "created_utc": when_utc(manifest.created),
        "live": step not in abandoned,
        "abandoned": abandoned.get(step),
        "branch": info.lineage.branch,
        "run_id": manifest.run_id,
        "metadata": manifest.metadata,
        "kind": manifest.kind,
        "metrics": manifest.metrics,
        "best": step in best,
        "tiers": tier.tiers(step, manifest) if tier is not None else [],
        "for_upload": manifest.upload,
    }



def add_source_args(p: argparse.ArgumentParser, what: str = "checkpoint location") -> None:
    p.add_argument("src", metavar="SRC", help=f"{what}: a local directory (the local_dir of a Checkpointer) or a "
                   "remote URL (s3://bucket/prefix, file:///mnt/nfs/run, any fsspec URL)")
    p.add_argument("--endpoint-url", default=os.environ.get("SHARDCKPT_ENDPOINT_URL"),
                   help="S3-compatible endpoint (default: SHARDCKPT_ENDPOINT_URL, AWS_ENDPOINT_URL, or AWS)")


