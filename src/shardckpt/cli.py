"""The ``shardckpt`` command line (also ``python -m shardckpt``).

Looking at checkpoints, on either tier (a local directory or a remote URL)::

    shardckpt ls SRC [--json]                       committed steps: size, world size, live or abandoned
    shardckpt inspect SRC [--step N] [--keys] [--values] [--json]   one step's manifest (saved keys, plain values)
    shardckpt verify SRC [--step N | --all] [--json]     check every file against its manifest
    shardckpt export SRC OUT [--step N] [--format torch|safetensors] [--optimizer]
    shardckpt gc SRC --keep-last N [--keep-every K] [--keep-abandoned] [--dry-run]
    shardckpt status DIR [--json]                   the node's uploader, peer and memory tiers
    shardckpt adopt DCP_DIR --into DIR --step N     commit a copy of a stock DCP checkpoint
    shardckpt check-resume [--steps N] [--kill-after STEP] -- COMMAND   a script resumes exactly? (check_resume.py)

Moving steps between tiers::

    shardckpt sync --local DIR --remote URL         the per-node uploader (sidecar / by hand)
    shardckpt push --local DIR --remote URL [--step N]   upload now; check and repair the remote copy
    shardckpt pull --remote URL --local DIR [--step N]   fetch; check and repair the local copy

Exit status: 0 all good; 1 what was asked about is bad or absent (a file
fails verification, nothing is committed, a step is not committed remotely
yet); 2 the command could not run (bad arguments, no such directory, the
remote unreachable). Errors are one line with the remedy; ``--debug`` adds
the traceback. ``ls``, ``inspect`` (without ``--keys`` / ``--values``), ``verify``, ``gc``,
``status``, ``sync``, ``push``, ``pull`` and ``check-resume`` do not import torch.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shutil
import socket
import sys
from typing import Any, Sequence

from shardckpt import check_resume
from shardckpt._version import __version__
from shardckpt.format import layout, lineage, retention, shm, step_dirs
from shardckpt._text import fmt_bytes
from shardckpt.errors import ShardckptError
from shardckpt.node import node_registry, peer_daemon
from shardckpt.node.uploader import (
    add_best_args,
    add_sync_args,
    add_transfer_args,
    failure_text,
    policy_from_args,
    store_from_args,
    sync_from_args,
)
from shardckpt.stores import Deadline, TransferOptions, redact
from shardckpt.tiers import compressed, remote_commit, remote_index, steps as steps_mod
from shardckpt.tiers.steps import open_steps

OK, BAD, ERROR = 0, 1, 2


class Problem(ShardckptError):
    """What was asked about is bad or absent: exit status 1, not 2."""


# ------------------------------------------------------------ output helpers


def _print_json(body: Any) -> None:
    print(json.dumps(body, indent=1, sort_keys=True, default=str))


def _when(created: float) -> str:
    return datetime.datetime.fromtimestamp(created, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _bar(total: int, what: str, enabled: bool) -> Any:
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


def _transfer_options(args: argparse.Namespace) -> Any:
    return TransferOptions(endpoint_url=getattr(args, "endpoint_url", None))


def _open(args: argparse.Namespace) -> Any:
    return open_steps(args.src, _transfer_options(args))


def _committed(tier: Any, held: dict[int, layout.Manifest] | None = None) -> dict[int, layout.Manifest]:
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


def _pick(tier: Any, manifests: dict[int, layout.Manifest], step: int | None) -> int:
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


def _best_steps(manifests: dict[int, layout.Manifest], live: list[int], args: argparse.Namespace) -> tuple[str | None, list[int]]:
    """The metric ranking steps (``--best-metric``, else the one the run configured) and the best live step."""
    metric, mode = getattr(args, "best_metric", None), getattr(args, "best_mode", None)
    if metric is None and manifests:
        best = (manifests[max(manifests, key=lambda s: manifests[s].created)].run or {}).get("best") or {}
        metric, mode = best.get("metric"), mode or best.get("mode")
    if not metric:
        return None, []
    infos = {s: lineage.info_of(m) for s, m in manifests.items()}
    return metric, retention.ranked(live, infos, metric, mode or "min")[:1]


def _step_row(step: int, manifest: layout.Manifest, abandoned: dict[int, str], tier: Any = None,
              best: list[int] = ()) -> dict[str, Any]:
    info = lineage.info_of(manifest)
    return {
        "step": step,
        "bytes": manifest.total_bytes,
        "stored_bytes": compressed.stored_bytes(manifest) if manifest.stored else None,  # compressed on the remote
        "files": len(manifest.files),
        "world_size": manifest.world_size,
        "created": manifest.created,
        "created_utc": _when(manifest.created),
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


# ------------------------------------------------------------ looking at checkpoints


def _kept(tier: Any) -> list[tuple[int, str]]:
    """Earlier saves of step numbers set aside by later saves (local tiers only)."""
    root = getattr(tier, "root", None)
    return step_dirs.kept_versions(root) if root else []


def cmd_ls(args: argparse.Namespace) -> int:
    tier = _open(args)
    try:
        manifests = _committed(tier, tier.memory() if hasattr(tier, "memory") else None)
        live, abandoned = tier.live(manifests)
        metric, best = _best_steps(manifests, live, args)
        rows = [_step_row(s, m, abandoned, tier, best) for s, m in sorted(manifests.items())]  # memory steps too
        kept = _kept(tier)
        if args.json:
            _print_json({"source": tier.where, "steps": rows, "best_metric": metric,
                         "unreadable": {str(k): v for k, v in tier.unreadable.items()},
                         "kept_aside": [{"step": s, "path": p} for s, p in kept]})
            return OK
        held = [r["step"] for r in rows if r["tiers"] == ["memory"]]
        print(f"{tier.where}: {len(rows) - len(held)} committed step(s)" + (f", {len(held)} only in memory" if held else ""))
        print(f"{'step':>10}  {'size':>10}  {'files':>5}  {'world':>5}  {'kind':>5}  {'tiers':<12}  saved at (UTC)")
        for row in rows:
            notes = [f"{k}={v:g}" for k, v in sorted(row["metrics"].items())]
            if row["best"]:
                notes.append(f"best by {metric}")
            if not row["for_upload"] and "remote" not in row["tiers"]:
                notes.append("not for upload (remote_every)")
            if row["abandoned"]:
                notes.append(row["abandoned"])
            if row["stored_bytes"] is not None:
                notes.append(f"stored compressed: {fmt_bytes(row['stored_bytes'])}")
            print(f"{row['step']:>10}  {fmt_bytes(row['bytes']):>10}  {row['files']:>5}  {row['world_size']:>5}  "
                  f"{row['kind']:>5}  {'+'.join(row['tiers']):<12}  {row['created_utc']}"
                  + (f"  ({'; '.join(notes)})" if notes else ""))
        for step, why in sorted(tier.unreadable.items()):
            print(f"{step:>10}  unreadable manifest: {why}")
        for step, path in kept:
            print(f"{step:>10}  an earlier save of step {step}, kept aside (abandoned) at {path}")
        return OK
    finally:
        tier.close()


def cmd_inspect(args: argparse.Namespace) -> int:
    tier = _open(args)
    try:
        manifests = _committed(tier)
        step = _pick(tier, manifests, args.step)
        manifest = manifests[step]
        _live, abandoned = tier.live(manifests)
        keys = looked = None
        if args.keys or args.values:
            from shardckpt.restoring import step_peek  # imports torch: only for --keys / --values

            if args.keys:
                keys = step_peek.saved_keys(tier, step, args.trust_pickles)
            if args.values:
                looked = step_peek.read_step(tier, manifest, trust_pickles=args.trust_pickles).to_json()
        if args.json:
            body = json.loads(manifest.to_json())
            body.update(source=tier.where, where=tier.step_where(step), abandoned=abandoned.get(step))
            if keys is not None:
                body["saved_keys"] = keys
            if looked is not None:
                body.update(values=looked["values"], value_tensors=looked["tensors"], run_config=looked["run_config"])
            _print_json(body)
            return OK
        print(f"step {step} in {tier.step_where(step)}" + (f" ({abandoned[step]})" if step in abandoned else ""))
        print(f"  saved {_when(manifest.created)} UTC by world size {manifest.world_size}; {len(manifest.files)} "
              f"files, {fmt_bytes(manifest.total_bytes)}" + compressed.stored_note(manifest, fmt_bytes))
        print(f"  torch {manifest.torch_version}, shardckpt {manifest.shardckpt_version}"
              + (f", run {manifest.run_id}" if manifest.run_id else ""))
        print("  state keys: " + ", ".join(f"{k} ({v})" for k, v in sorted(manifest.keys.items())))
        if len(manifest.copies) > 1:
            print("  saved to node-local directories: " + "; ".join(f"ranks {g[0]}-{g[-1]}" for g in manifest.copies))
        print(f"  kind: {manifest.kind}" + (f"; metrics: {json.dumps(manifest.metrics, sort_keys=True)}" if manifest.metrics else "")
              + ("" if manifest.upload else "; kept local (remote_every)"))
        if manifest.metadata:
            print("  metadata: " + json.dumps(manifest.metadata, sort_keys=True))
        run = manifest.run or {}
        if run:
            print(f"  run: {' '.join(run.get('argv') or [])!r} on {run.get('world_size')} x {run.get('device')}, "
                  f"torch {run.get('torch')}, shardckpt {run.get('shardckpt')}" + (f", run id {run['run_id']}" if run.get("run_id") else ""))
            if run.get("config") is not None:
                print("  run config: " + json.dumps(run["config"], sort_keys=True))
        for key, entries in sorted((manifest.frozen or {}).items()):
            print(f"  {key}: {len(entries)} frozen entries left out (trainable_only), e.g. {', '.join(sorted(entries)[:3])}")
        if looked is not None:
            print("  values: " + json.dumps(looked["values"], sort_keys=True, default=str))
            for key, described in sorted(looked["tensors"].items()):
                print(f"    {key}: tensor {described['shape']} {described['dtype']} (not read)")
        for item in keys or []:
            print(f"    {item['key']}: {item['shape'] if item['shape'] is not None else 'object'} {item['dtype'] or ''}".rstrip())
        return OK
    finally:
        tier.close()


def cmd_verify(args: argparse.Namespace) -> int:
    tier = _open(args)
    try:
        manifests = _committed(tier)
        steps = sorted(manifests) if args.all else [_pick(tier, manifests, args.step)]
        total = sum(manifests[s].total_bytes for s in steps)
        bar = _bar(total, "verifying", not args.json)
        reports = []
        try:
            for step in steps:
                reports.append(tier.check(manifests[step], bar.update if bar is not None else None))
        finally:
            if bar is not None:
                bar.close()
        bad = [r for r in reports if not r.ok] + [None] * len([s for s in tier.unreadable if args.all])
        if args.json:
            _print_json({
                "source": tier.where,
                "ok": not bad,
                "steps": [{"step": r.step, "ok": r.ok, "files": len(r.names), "bytes": r.bytes,
                           "problems": [{"file": f, "problem": p} for f, p in r.problems],
                           "held_elsewhere": r.elsewhere} for r in reports],
                "unreadable": {str(k): v for k, v in tier.unreadable.items()} if args.all else {},
            })
            return BAD if bad else OK
        for r in reports:
            if r.ok:
                note = ""
                if r.elsewhere:
                    spans = ", ".join(f"ranks {g[0]}-{g[-1]}" if len(g) > 1 else f"rank {g[0]}" for g in r.elsewhere)
                    note = f" (a node-local copy: the files of {spans} are in other nodes' directories or the remote)"
                print(f"ok   step {r.step}: {len(r.names)} files, {fmt_bytes(r.bytes)}{note}")
            else:
                print(f"FAIL step {r.step} in {tier.step_where(r.step)}: {len(r.problems)} bad file(s)")
                for name, problem in r.problems:
                    print(f"       {name}: {problem}")
        if args.all:
            for step, why in sorted(tier.unreadable.items()):
                print(f"FAIL step {step}: {why}")
        if bad:
            print(f"{len(bad)} step(s) failed. Remedy: `shardckpt pull` replaces bad local files from the remote, "
                  f"`shardckpt push` bad remote objects from a node's local copy; or load an earlier step.")
        return BAD if bad else OK
    finally:
        tier.close()


def cmd_export(args: argparse.Namespace) -> int:
    """``shardckpt export``: write the file and print one line saying what was written."""
    from shardckpt.export import export_step  # imports torch: only for this command

    result = export_step(
        args.src, args.out, step=args.step, fmt=args.format, optimizer=args.optimizer, key=args.key,
        trust_pickles=args.trust_pickles, endpoint_url=args.endpoint_url,
    )
    what = f"{result.tensors} tensors"
    if result.optimizer_key is not None:
        what += f" ({len(result.optimizer_keys)} of optimizer {result.optimizer_key!r})"
    line = (f"exported step {result.step} of {redact(args.src)} (module {result.module_key!r}): {what}, "
            f"{fmt_bytes(result.bytes)} {result.format} -> {result.path}")
    if result.fetched_files is not None:
        line += (f"; fetched {result.fetched_files} of {result.step_files} files "
                 f"({fmt_bytes(result.fetched_bytes or 0)} of {fmt_bytes(result.step_bytes)})")
    print(line)
    return OK


def cmd_gc(args: argparse.Namespace) -> int:
    tier = _open(args)
    try:
        manifests = _committed(tier)
        live, abandoned = tier.live(manifests)
        policy = retention.policy_from(args.keep_last, args.keep_every, keep_best=args.keep_best,
                                       best_metric=args.best_metric, best_mode=args.best_mode,
                                       keep_last_light=args.keep_last_light)
        infos = {s: lineage.info_of(m) for s, m in manifests.items()}
        doomed = retention.plan_deletions(live, policy, infos=infos)
        if not args.keep_abandoned:
            doomed = sorted(set(doomed) | set(abandoned))
            for step, path in _kept(tier):
                print(f"{'would delete' if args.dry_run else 'deleting'} the earlier save of step {step} kept "
                      f"aside at {path}")
                if not args.dry_run:
                    shutil.rmtree(path, ignore_errors=True)
        for step in doomed:
            why = f" ({abandoned[step]})" if step in abandoned else ""
            print(f"{'would delete' if args.dry_run else 'deleting'} step {step}{why}")
            if not args.dry_run:
                tier.delete(step)
        if not doomed:
            print(f"nothing to delete in {tier.where}")
        if not args.dry_run and not ("://" in args.src):
            for name in step_dirs.clean_leftovers(tier.where, keep_nonce=None):
                print(f"removed leftover {name}")
        return OK
    finally:
        tier.close()


def cmd_status(args: argparse.Namespace) -> int:
    root = os.path.abspath(args.dir)
    if not os.path.isdir(root):
        raise ShardckptError(f"no checkpoint directory at {root}. Remedy: give the local_dir of a Checkpointer.")
    info = node_registry.read_status(root)
    steps = layout.committed_steps(root)
    url = info.get("remote")
    pending = remote_commit.pending_steps(root, url) if url else []
    running = node_registry.uploader_running(root)
    latest_remote = info.get("latest_remote")
    body = {
        "local_dir": root,
        "remote": url,
        "latest_local": steps[-1] if steps else None,
        "latest_remote": latest_remote,
        "lag_steps": (steps[-1] - latest_remote) if steps and isinstance(latest_remote, int) else None,
        "pending_steps": pending,
        "pending_bytes": sum(remote_commit.local_bytes(root, s) for s in pending),
        "uploader": {"running": running is not None, "pid": running or None, "state": info.get("state"),
                     "node": info.get("node"), "updated": info.get("updated")},
        "uploaded_bytes": info.get("uploaded_bytes"),
        "waiting": info.get("waiting") or {},
        "failed": info.get("failed") or {},
        "failed_commits": {k: v for k, v in (info.get("failed_steps") or {}).items() if k.isdigit() and int(k) in pending},
        "last_error": info.get("last_error"),
        "last_error_time": info.get("last_error_time"),
        "peer": peer_daemon.node_status(root),
        "latest_peer": peer_daemon.latest_replicated(root),
    }
    body["memory"], memory_line = shm.status(root)
    if args.json:
        _print_json(body)
        return OK if url else BAD
    if not url:
        print(f"{root}: {len(steps)} committed step(s), newest {body['latest_local']}"
              + (f" (peer-durable: {body['latest_peer']})" if body["peer"] else "")
              + "; no uploader has run here (no remote configured, or it never started)")
        for line in filter(None, (peer_daemon.status_line(body["peer"]) if body["peer"] else None, memory_line)):
            print(line)
        return BAD
    state = "running" if running is not None else (body["uploader"]["state"] or "not running")
    pid = f" (pid {running})" if running else ""
    print(f"{root} -> {url}")
    print(f"  uploader: {state}{pid}; last update {_when(info['updated']) + ' UTC' if info.get('updated') else 'never'}")
    print(f"  newest step: local {body['latest_local']}"
          + (f", peer {body['latest_peer']}" if body["peer"] else "") + f", remote {latest_remote}"
          + (f" (lag {body['lag_steps']} steps)" if body["lag_steps"] else ""))
    print(f"  pending: {pending or 'nothing'}" + (f" ({fmt_bytes(body['pending_bytes'])})" if pending else ""))
    for line in filter(None, (peer_daemon.status_line(body["peer"]) if body["peer"] else None, memory_line)):
        print(line)
    for step, why in sorted(body["waiting"].items()):
        print(f"  step {step} waits: {why}")
    if body["failed_commits"]:
        for step, failed in sorted(body["failed_commits"].items(), key=lambda kv: int(kv[0])):
            print(f"  FAILED: {failure_text(int(step), failed, url)}")
    if body["last_error"]:
        print(f"  last error ({_when(body['last_error_time']) + ' UTC' if body['last_error_time'] else '?'}): "
              f"{body['last_error']}")
    return OK


def cmd_adopt(args: argparse.Namespace) -> int:
    from shardckpt.tiers import adopt

    final = adopt.adopt(args.source, args.into, args.step, trust_pickles=args.trust_pickles)
    manifest = layout.read_manifest(final)
    print(f"adopted {args.source} as step {args.step}: {final} ({len(manifest.files)} files, "
          f"{fmt_bytes(manifest.total_bytes)}, world size {manifest.world_size})")
    return OK


# ------------------------------------------------------------ moving steps between tiers


def _with_bars(enabled: bool) -> None:
    """Transfers of push / pull / sync show tqdm bars on a terminal (else their log lines)."""
    remote_commit.Progress.bar_factory = (lambda what, total: _bar(total, what, True)) if enabled and sys.stderr.isatty() else None


def cmd_sync(args: argparse.Namespace) -> int:
    return sync_from_args(args)


def cmd_push(args: argparse.Namespace) -> int:
    _with_bars(True)
    store = store_from_args(args)
    try:
        committed = layout.committed_steps(args.local)
        if args.step is not None and args.step not in committed:
            raise Problem(f"step {args.step} is not committed in {args.local}; committed: {committed or 'none'}")
        if args.step is not None:
            steps = [args.step]
        elif args.no_verify:
            steps = remote_commit.pending_steps(args.local, args.remote)
        else:
            steps = committed
        failed = 0
        for step in steps:
            result = remote_commit.push_step(
                store, args.local, step, node=args.node or socket.gethostname(), policy=policy_from_args(args),
                verify_remote=not args.no_verify,
            )
            if result.state == remote_commit.COMMITTED:
                what = f"{fmt_bytes(result.uploaded_bytes)} sent" + (f"; {result.detail}" if result.detail else "")
                print(f"committed step {step} on {store.where(layout.step_dirname(step))} ({what})")
            else:
                failed += 1
                print(f"step {step}: uploaded this node's files; not committed yet ({result.detail or result.state})")
        if not steps:
            print(f"nothing to push: every committed step of {args.local} is committed on the remote")
        return BAD if failed else OK
    finally:
        store.close()


def cmd_pull(args: argparse.Namespace) -> int:
    _with_bars(True)
    store = store_from_args(args)
    try:
        step = args.step
        if step is None:
            infos, _unreadable = remote_index.survey(store, Deadline(args.step_deadline))
            live, _abandoned = lineage.classify(infos)
            if not live:
                raise Problem(f"no committed step on {store.where('')}. Remedy: check the URL and the endpoint.")
            step = live[-1]
        step_dir = os.path.join(args.local, layout.step_dirname(step))
        had = layout.read_manifest(step_dir) is not None
        fetched = steps_mod.fetch_step(store, args.local, step, verify_local=True)
        if had:
            print(f"step {step} in {step_dir}: local files checked; fetched {len(fetched)} missing or failing "
                  f"file(s){': ' + ', '.join(sorted(fetched)) if fetched else ''}; all verified")
        else:
            print(f"step {step} in {step_dir}: fetched {len(fetched)} file(s), all verified")
        return OK
    finally:
        store.close()


# ------------------------------------------------------------ the parser


def _source_args(p: argparse.ArgumentParser, what: str = "checkpoint location") -> None:
    p.add_argument("src", metavar="SRC", help=f"{what}: a local directory (the local_dir of a Checkpointer) or a "
                   "remote URL (s3://bucket/prefix, file:///mnt/nfs/run, any fsspec URL)")
    p.add_argument("--endpoint-url", default=os.environ.get("SHARDCKPT_ENDPOINT_URL"),
                   help="S3-compatible endpoint (default: SHARDCKPT_ENDPOINT_URL, AWS_ENDPOINT_URL, or AWS)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardckpt",
        description="Look at, verify, export, clean up and move shardckpt checkpoints, on a local directory or "
        "a remote (S3 or any fsspec URL). A step exists once its manifest (shardckpt.json) does; anything "
        "else in a checkpoint directory is ignored.",
        epilog="Exit status: 0 all good, 1 what was asked about is bad or absent, 2 the command could not run. "
        "`shardckpt COMMAND --help` explains each command.",
    )
    parser.add_argument("--version", action="version", version=f"shardckpt {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_parser = sub.add_parser
    sub.add_parser = lambda *a, **kw: add_parser(*a, parents=[common], **kw)  # type: ignore[method-assign]

    p = sub.add_parser("ls", help="list committed steps",
                       description="List the committed steps: size, files, world size, when saved; steps of a "
                       "branch abandoned by a rollback are marked. An absent directory or a remote without any "
                       "committed step is an error (exit 2 / 1).")
    _source_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output (keys: see the README)")
    p.add_argument("--best-metric", help="mark the best step by this metric (default: the run's best_metric)")
    p.add_argument("--best-mode", choices=["min", "max"], help="lower (min) or higher is better (default: the run's)")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("inspect", help="show one step's manifest",
                       description="Show one step's manifest: world size, files, saved state keys and their "
                       "kinds, user metadata, the node-local copies it was saved to.")
    _source_args(p)
    p.add_argument("--step", type=int, help="step to show (default: the newest live step)")
    p.add_argument("--keys", action="store_true", help="also list every saved tensor / object with shape and dtype "
                   "(reads DCP's metadata through the restricted unpickler; imports torch)")
    p.add_argument("--values", action="store_true", help="also show the plain values of the state (numbers, "
                   "strings, dicts, small tensors; read through the restricted unpickler, no model tensors; "
                   "imports torch) and the run config")
    p.add_argument("--trust-pickles", action="store_true",
                   help="with --keys / --values: read without the allow-list")
    p.add_argument("--json", action="store_true", help="the manifest (with --keys the saved keys, with --values "
                   "values, value_tensors and run_config) as JSON")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("verify", help="check files against the manifest",
                       description="Check every file of a step (size and checksum) against its manifest; a "
                       "remote step's objects are streamed through the checksum. Each bad file is named; exit "
                       "status 1 when any fails.")
    _source_args(p)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--step", type=int, help="step to verify (default: the newest live step)")
    group.add_argument("--all", action="store_true", help="verify every committed step")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("export", help="write one step as a single file of full tensors",
                       description="Export a step's model (and with --optimizer its optimizer state) as one file "
                       "of full, unsharded tensors with the keys of model.state_dict() of the unwrapped module: "
                       "for inference and tools that do not read DCP. From a remote URL only the files holding "
                       "the exported tensors are downloaded (each checked against the manifest).")
    _source_args(p)
    p.add_argument("out", metavar="OUT", help="output file")
    p.add_argument("--step", type=int, help="step to export (default: the newest live step)")
    p.add_argument("--format", choices=["safetensors", "torch"], default="safetensors",
                   help="safetensors (default; safetensors.torch.load_file reads it) or torch "
                   "(torch.load(OUT, weights_only=True) reads it)")
    p.add_argument("--optimizer", action="store_true", help="also export the optimizer state")
    p.add_argument("--key", help="the state key of the module to export, when the step holds several")
    p.add_argument("--trust-pickles", action="store_true", help="read DCP metadata without the allow-list")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("gc", help="apply retention by hand",
                       description="Delete committed steps that the retention policy drops among the live steps "
                       "(never the newest), the steps a rollback abandoned (unless --keep-abandoned), and, in a "
                       "local directory, leftovers of interrupted saves. Do not run while a job saves there.")
    _source_args(p)
    p.add_argument("--keep-last", type=int, required=True, help="keep the newest N live steps (N >= 1)")
    p.add_argument("--keep-every", type=int, help="also keep every step that is a multiple of K")
    p.add_argument("--keep-abandoned", action="store_true", help="keep steps that a rollback abandoned")
    p.add_argument("--keep-best", type=int, help="also keep the K best steps by --best-metric")
    p.add_argument("--best-metric", help="the metric recorded at save that ranks steps (e.g. val_loss)")
    p.add_argument("--best-mode", choices=["min", "max"], default="min", help="lower (min, default) or higher is better")
    p.add_argument("--keep-last-light", type=int, help="keep the newest N light steps (default: --keep-last)")
    p.add_argument("--dry-run", action="store_true", help="only print what would be deleted")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("status", help="the node's uploader (pending steps, lag, last error), peer and memory tiers",
                       description="What the uploader serving a local directory is doing: whether it runs, the "
                       "newest step locally and remotely, the steps waiting for upload and their size, why they "
                       "wait, and the last error; the peer tier's replicas and the steps the memory tier holds on "
                       "this machine. Reads local files only.")
    p.add_argument("dir", metavar="DIR", help="the local_dir of a Checkpointer")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser(
        "adopt",
        help="make a stock DCP checkpoint a committed step",
        description="Copy a checkpoint directory written by torch.distributed.checkpoint.save into a "
        "shardckpt directory as a committed step: files hashed, manifest written last. Its metadata is "
        "read with the restricted unpickler; --trust-pickles lifts that for a checkpoint whose origin you "
        "trust (loading it later still needs load(..., trust_pickles=True) if it holds arbitrary objects).",
    )
    p.add_argument("source", help="the stock DCP checkpoint directory (holds .metadata)")
    p.add_argument("--into", required=True, help="shardckpt checkpoint directory (local_dir)")
    p.add_argument("--step", type=int, required=True, help="step number to commit it as")
    p.add_argument("--trust-pickles", action="store_true", help="read the metadata without the allow-list")
    p.set_defaults(func=cmd_adopt)

    p = sub.add_parser(
        "sync",
        help="run the per-node uploader",
        description="Upload every committed step of a node's local directory to the remote and commit it "
        "there (files, then this node's marker; the node holding rank 0's files writes the manifest once "
        "every node's marker is present). Runs until SIGTERM unless --once or --exit-when-idle. One "
        "uploader per directory: a second one exits at once. Options default to the SHARDCKPT_* "
        "variables of the same fields.",
    )
    add_sync_args(p)
    p.set_defaults(func=cmd_sync)

    p = sub.add_parser("push", help="upload committed steps now; repair the remote copy",
                       description="Upload this node's files of committed local steps and commit them when "
                       "every node's files are there. Steps already committed remotely are checked: this "
                       "node's objects are downloaded and hashed, and any that fail are uploaded again "
                       "(--no-verify skips that).")
    add_transfer_args(p)
    p.add_argument("--step", type=int, help="step to push (default: every committed local step)")
    p.add_argument("--keep-last", type=int, help="remote retention after the commit: keep the newest N")
    p.add_argument("--keep-every", type=int, help="remote retention: also keep every multiple of K")
    add_best_args(p)
    p.add_argument("--no-verify", action="store_true", help="only upload pending steps; do not check (and repair) "
                   "the remote copies of steps already committed there")
    p.set_defaults(func=cmd_push)

    p = sub.add_parser("pull", help="fetch a remote step; repair the local copy",
                       description="Download a committed remote step (default: the newest live one) into the "
                       "local directory, checking every file against the manifest; the step becomes a "
                       "committed local step only once all files passed. A local copy that exists is checked "
                       "and its missing or failing files are replaced.")
    add_transfer_args(p)
    p.add_argument("--step", type=int, help="step to fetch (default: the newest live step on the remote)")
    p.set_defaults(func=cmd_pull)
    check_resume.add_parser(sub)
    return parser


def _setup_logging() -> None:
    """The library's INFO lines (progress of long transfers, what was repaired) go to stderr."""
    logger = logging.getLogger("shardckpt")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(os.environ.get("SHARDCKPT_LOG_LEVEL", "INFO").upper())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "keep_last", None) is not None and args.keep_last < 1:
        parser.error("--keep-last must be >= 1")
    _setup_logging()
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("shardckpt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `shardckpt ls DIR | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return OK
    except Exception as exc:  # noqa: BLE001 - one readable line, the traceback with --debug
        if args.debug:
            raise
        return _report(exc)


def _report(exc: BaseException) -> int:
    code = BAD if isinstance(exc, Problem) else ERROR
    text = redact(str(exc)) if isinstance(exc, ShardckptError) else redact(f"{type(exc).__name__}: {exc}")
    hint = "" if isinstance(exc, ShardckptError) else " (run with --debug for the traceback)"
    print(f"shardckpt: error: {text}{hint}", file=sys.stderr)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
