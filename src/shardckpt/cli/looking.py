"""Looking at checkpoints on any tier: ``ls``, ``inspect``, ``verify``, ``export``, ``gc``, ``status``, ``adopt``."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Any

from shardckpt._text import fmt_bytes
from shardckpt.cli.common import (
    BAD,
    OK,
    add_source_args,
    best_steps,
    committed_manifests,
    open_location,
    pick_step,
    print_json,
    progress_bar,
    step_row,
    when_utc,
)
from shardckpt.errors import ShardckptError
from shardckpt.format import layout, lineage, retention, shm, step_dirs
from shardckpt.node import node_registry, peer_daemon
from shardckpt.node.uploader import (
    failure_text,
)
from shardckpt.remote import commit as remote_commit
from shardckpt.remote import compressed
from shardckpt.stores import redact


def _kept(tier: Any) -> list[tuple[int, str]]:
    """Earlier saves of step numbers set aside by later saves (local tiers only)."""
    root = getattr(tier, "root", None)
    return step_dirs.kept_versions(root) if root else []


def cmd_ls(args: argparse.Namespace) -> int:
    tier = open_location(args)
    try:
        manifests = committed_manifests(tier, tier.memory() if hasattr(tier, "memory") else None)
        live, abandoned = tier.live(manifests)
        metric, best = best_steps(manifests, live, args)
        rows = [step_row(s, m, abandoned, tier, best) for s, m in sorted(manifests.items())]  # memory steps too
        kept = _kept(tier)
        if args.json:
            print_json({"source": tier.where, "steps": rows, "best_metric": metric,
                         "unreadable": {str(k): v for k, v in tier.unreadable.items()},
                         "kept_aside": [{"step": s, "path": p} for s, p in kept]})
            return OK
        held = [r["step"] for r in rows if r["tiers"] == ["memory"]]
        print(f"{tier.where}: {len(rows) - len(held)} committed step(s)"
              + (f", {len(held)} only in memory" if held else ""))
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
    tier = open_location(args)
    try:
        manifests = committed_manifests(tier)
        step = pick_step(tier, manifests, args.step)
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
            print_json(body)
            return OK
        print(f"step {step} in {tier.step_where(step)}" + (f" ({abandoned[step]})" if step in abandoned else ""))
        print(f"  saved {when_utc(manifest.created)} UTC by world size {manifest.world_size}; {len(manifest.files)} "
              f"files, {fmt_bytes(manifest.total_bytes)}" + compressed.stored_note(manifest, fmt_bytes))
        print(f"  torch {manifest.torch_version}, shardckpt {manifest.shardckpt_version}"
              + (f", run {manifest.run_id}" if manifest.run_id else ""))
        print("  state keys: " + ", ".join(f"{k} ({v})" for k, v in sorted(manifest.keys.items())))
        if len(manifest.copies) > 1:
            print("  saved to node-local directories: " + "; ".join(f"ranks {g[0]}-{g[-1]}" for g in manifest.copies))
        print(f"  kind: {manifest.kind}"
              + (f"; metrics: {json.dumps(manifest.metrics, sort_keys=True)}" if manifest.metrics else "")
              + ("" if manifest.upload else "; kept local (remote_every)"))
        if manifest.metadata:
            print("  metadata: " + json.dumps(manifest.metadata, sort_keys=True))
        run = manifest.run or {}
        if run:
            print(f"  run: {' '.join(run.get('argv') or [])!r} on {run.get('world_size')} x {run.get('device')}, "
                  f"torch {run.get('torch')}, shardckpt {run.get('shardckpt')}"
                  + (f", run id {run['run_id']}" if run.get("run_id") else ""))
            if run.get("config") is not None:
                print("  run config: " + json.dumps(run["config"], sort_keys=True))
        for key, entries in sorted((manifest.frozen or {}).items()):
            print(f"  {key}: {len(entries)} frozen entries left out (trainable_only), "
                  f"e.g. {', '.join(sorted(entries)[:3])}")
        if looked is not None:
            print("  values: " + json.dumps(looked["values"], sort_keys=True, default=str))
            for key, described in sorted(looked["tensors"].items()):
                print(f"    {key}: tensor {described['shape']} {described['dtype']} (not read)")
        for item in keys or []:
            print(f"    {item['key']}: {item['shape'] if item['shape'] is not None else 'object'} "
                  f"{item['dtype'] or ''}".rstrip())
        return OK
    finally:
        tier.close()


def cmd_verify(args: argparse.Namespace) -> int:
    tier = open_location(args)
    try:
        manifests = committed_manifests(tier)
        steps = sorted(manifests) if args.all else [pick_step(tier, manifests, args.step)]
        total = sum(manifests[s].total_bytes for s in steps)
        bar = progress_bar(total, "verifying", not args.json)
        reports = []
        try:
            for step in steps:
                reports.append(tier.check(manifests[step], bar.update if bar is not None else None))
        finally:
            if bar is not None:
                bar.close()
        bad = [r for r in reports if not r.ok] + [None] * len([s for s in tier.unreadable if args.all])
        if args.json:
            print_json({
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
    from shardckpt.convert.export import export_step  # imports torch: only for this command

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
    tier = open_location(args)
    try:
        manifests = committed_manifests(tier)
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
        if not args.dry_run and "://" not in args.src:
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
        "failed_commits": {k: v for k, v in (info.get("failed_steps") or {}).items()
                           if k.isdigit() and int(k) in pending},
        "last_error": info.get("last_error"),
        "last_error_time": info.get("last_error_time"),
        "peer": peer_daemon.node_status(root),
        "latest_peer": peer_daemon.latest_replicated(root),
    }
    body["memory"], memory_line = shm.status(root)
    if args.json:
        print_json(body)
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
    print(f"  uploader: {state}{pid}; "
          f"last update {when_utc(info['updated']) + ' UTC' if info.get('updated') else 'never'}")
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
        print(f"  last error ({when_utc(body['last_error_time']) + ' UTC' if body['last_error_time'] else '?'}): "
              f"{body['last_error']}")
    return OK


def cmd_adopt(args: argparse.Namespace) -> int:
    from shardckpt.convert import adopt

    final = adopt.adopt(args.source, args.into, args.step, trust_pickles=args.trust_pickles)
    manifest = layout.read_manifest(final)
    print(f"adopted {args.source} as step {args.step}: {final} ({len(manifest.files)} files, "
          f"{fmt_bytes(manifest.total_bytes)}, world size {manifest.world_size})")
    return OK


def add_parsers(sub: Any) -> None:
    """The commands that look at checkpoints, on the subparsers of the ``shardckpt`` parser."""
    p = sub.add_parser("ls", help="list committed steps",
                       description="List the committed steps: size, files, world size, when saved; steps of a "
                       "branch abandoned by a rollback are marked. An absent directory or a remote without any "
                       "committed step is an error (exit 2 / 1).")
    add_source_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output (keys: see the README)")
    p.add_argument("--best-metric", help="mark the best step by this metric (default: the run's best_metric)")
    p.add_argument("--best-mode", choices=["min", "max"], help="lower (min) or higher is better (default: the run's)")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("inspect", help="show one step's manifest",
                       description="Show one step's manifest: world size, files, saved state keys and their "
                       "kinds, user metadata, the node-local copies it was saved to.")
    add_source_args(p)
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
    add_source_args(p)
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
    add_source_args(p)
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
    add_source_args(p)
    p.add_argument("--keep-last", type=int, required=True, help="keep the newest N live steps (N >= 1)")
    p.add_argument("--keep-every", type=int, help="also keep every step that is a multiple of K")
    p.add_argument("--keep-abandoned", action="store_true", help="keep steps that a rollback abandoned")
    p.add_argument("--keep-best", type=int, help="also keep the K best steps by --best-metric")
    p.add_argument("--best-metric", help="the metric recorded at save that ranks steps (e.g. val_loss)")
    p.add_argument("--best-mode", choices=["min", "max"], default="min",
                   help="lower (min, default) or higher is better")
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

