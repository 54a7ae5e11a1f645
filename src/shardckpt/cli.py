"""The ``shardckpt`` command line: inspect, verify and maintain checkpoints.

    shardckpt ls DIR                 committed steps, sizes, world sizes
    shardckpt inspect DIR [--step N] one step's manifest and saved keys
    shardckpt verify DIR [--step N]  re-hash every file against its manifest
    shardckpt gc DIR --keep-last N   apply retention by hand (committed steps only)
    shardckpt sync --local DIR --remote URL   the per-node uploader (sidecar / by hand)
    shardckpt push --local DIR --remote URL [--step N]   upload committed steps now
    shardckpt pull --remote URL --local DIR [--step N]   fetch a remote step into DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Sequence

from . import __version__, layout, lineage, local, retention
from .errors import ShardckptError


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _pick_step(root: str, step: int | None) -> int:
    steps = layout.committed_steps(root)
    if step is None:
        if not steps:
            raise ShardckptError(f"no committed step in {root}")
        return steps[-1]
    if step not in steps:
        raise ShardckptError(f"step {step} is not committed in {root}; committed: {steps or 'none'}")
    return step


def cmd_ls(args: argparse.Namespace) -> int:
    steps = layout.committed_steps(args.dir)
    if not steps:
        print(f"no committed steps in {args.dir}")
        return 0
    _live, abandoned = lineage.classify(lineage.local_infos(args.dir))
    print(f"{'step':>10}  {'size':>10}  {'files':>5}  {'world':>5}  saved at")
    for step in steps:
        manifest = layout.read_manifest(os.path.join(args.dir, layout.step_dirname(step)))
        when = datetime.datetime.fromtimestamp(manifest.created, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        note = f"  ({abandoned[step]})" if step in abandoned else ""
        print(f"{step:>10}  {_human(manifest.total_bytes):>10}  {len(manifest.files):>5}  {manifest.world_size:>5}  {when} UTC{note}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    step = _pick_step(args.dir, args.step)
    step_dir = os.path.join(args.dir, layout.step_dirname(step))
    manifest = layout.read_manifest(step_dir)
    if args.json:
        print(manifest.to_json())
        return 0
    print(f"step {manifest.step} in {step_dir}")
    print(f"  world size {manifest.world_size}, {len(manifest.files)} files, {_human(manifest.total_bytes)}")
    print(f"  torch {manifest.torch_version}, shardckpt {manifest.shardckpt_version}")
    print("  state keys: " + ", ".join(f"{k} ({v})" for k, v in sorted(manifest.keys.items())))
    if manifest.metadata:
        print("  metadata: " + json.dumps(manifest.metadata, sort_keys=True))
    if args.keys:
        metadata = local.read_metadata(step_dir, step)
        for fqn, md in sorted(metadata.state_dict_metadata.items()):
            size = getattr(md, "size", None)
            dtype = getattr(getattr(md, "properties", None), "dtype", None)
            print(f"    {fqn}: {tuple(size) if size is not None else 'object'} {dtype or ''}".rstrip())
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    steps = layout.committed_steps(args.dir) if args.all else [_pick_step(args.dir, args.step)]
    failed = 0
    for step in steps:
        step_dir = os.path.join(args.dir, layout.step_dirname(step))
        try:
            manifest = layout.read_manifest(step_dir)
            names, elsewhere = layout.copy_files(step_dir, manifest)
            layout.verify_files(step_dir, manifest, names)
            local.read_metadata(step_dir, step)
        except ShardckptError as exc:
            failed += 1
            print(f"FAIL step {step}: {exc}")
        else:
            size = sum(manifest.files[n].size for n in names)
            note = ""
            if elsewhere:
                spans = ", ".join(f"ranks {g[0]}-{g[-1]}" if len(g) > 1 else f"rank {g[0]}" for g in elsewhere)
                note = f" (a node-local copy: the files of {spans} are in other nodes' directories or the remote)"
            print(f"ok   step {step}: {len(names)} files, {_human(size)}{note}")
    return 1 if failed else 0


def cmd_gc(args: argparse.Namespace) -> int:
    live, abandoned = lineage.classify(lineage.local_infos(args.dir))
    policy = retention.policy_from(args.keep_last, args.keep_every)
    doomed = retention.plan_deletions(live, policy)
    if not args.keep_abandoned:
        doomed = sorted(set(doomed) | set(abandoned))
    for step in doomed:
        why = f" ({abandoned[step]})" if step in abandoned else ""
        print(f"{'would delete' if args.dry_run else 'deleting'} step {step}{why}")
        if not args.dry_run:
            local.delete_step(args.dir, step)
    removed = [] if args.dry_run else local.clean_leftovers(args.dir, keep_nonce=None)
    for name in removed:
        print(f"removed leftover {name}")
    return 0


def _store(args: argparse.Namespace):
    from .uploader import store_from_args

    return store_from_args(args)


def _remote_policy(args: argparse.Namespace):
    from .uploader import policy_from_args

    return policy_from_args(args)


def cmd_sync(args: argparse.Namespace) -> int:
    from .uploader import sync_from_args

    return sync_from_args(args)


def cmd_push(args: argparse.Namespace) -> int:
    import socket

    from . import remote_commit

    store = _store(args)
    try:
        committed = layout.committed_steps(args.local)
        if args.step is not None and args.step not in committed:
            raise ShardckptError(f"step {args.step} is not committed in {args.local}; committed: {committed or 'none'}")
        if args.step is not None:
            steps = [args.step]
        elif args.no_verify:
            steps = remote_commit.pending_steps(args.local, args.remote)
        else:
            steps = committed
        failed = 0
        for step in steps:
            result = remote_commit.push_step(
                store, args.local, step, node=args.node or socket.gethostname(), policy=_remote_policy(args),
                verify_remote=not args.no_verify,
            )
            if result.state == remote_commit.COMMITTED:
                what = f"{_human(result.uploaded_bytes)} sent" + (f"; {result.detail}" if result.detail else "")
                print(f"committed step {step} on {store.where(layout.step_dirname(step))} ({what})")
            else:
                failed += 1
                print(f"step {step}: uploaded this node's files; not committed yet ({result.detail or result.state})")
        if not steps:
            print(f"nothing to push: every committed step of {args.local} is committed on the remote")
        return 1 if failed else 0
    finally:
        store.close()


def cmd_pull(args: argparse.Namespace) -> int:
    from . import remote_commit
    from .remote import Deadline

    store = _store(args)
    try:
        step = args.step
        if step is None:
            manifests = remote_commit.remote_manifests(store, Deadline(args.step_deadline))
            live, _abandoned = lineage.classify({s: lineage.info_of(m) for s, m in manifests.items()})
            if not live:
                raise ShardckptError(f"no committed step on {store.where('')}")
            step = live[-1]
        step_dir = os.path.join(args.local, layout.step_dirname(step))
        had = layout.read_manifest(step_dir) is not None
        fetched = remote_commit.fetch_step(store, args.local, step, verify_local=True)
        if had:
            print(f"step {step} in {step_dir}: local files checked; fetched {len(fetched)} missing or failing "
                  f"file(s){': ' + ', '.join(sorted(fetched)) if fetched else ''}; all verified")
        else:
            print(f"step {step} in {step_dir}: fetched {len(fetched)} file(s), all verified")
        return 0
    finally:
        store.close()


def _transfer_args(p: argparse.ArgumentParser) -> None:
    from .uploader import add_transfer_args

    add_transfer_args(p)


def cmd_adopt(args: argparse.Namespace) -> int:
    final = local.adopt(args.source, args.into, args.step, trust_pickles=args.trust_pickles)
    manifest = layout.read_manifest(final)
    print(f"adopted {args.source} as step {args.step}: {final} ({len(manifest.files)} files, "
          f"{_human(manifest.total_bytes)}, world size {manifest.world_size})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardckpt",
        description="Inspect, verify and maintain shardckpt checkpoints. A checkpoint directory holds "
        "one step_<N> directory per committed step; steps without a manifest are ignored.",
    )
    parser.add_argument("--version", action="version", version=f"shardckpt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("ls", help="list committed steps", description="List the committed steps of a checkpoint directory.")
    p.add_argument("dir", help="checkpoint directory (the local_dir of a Checkpointer)")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("inspect", help="show one step's manifest", description="Show one step's manifest: world size, files, saved state keys, user metadata.")
    p.add_argument("dir", help="checkpoint directory")
    p.add_argument("--step", type=int, help="step to show (default: newest committed)")
    p.add_argument("--keys", action="store_true", help="also list every saved tensor / object key with its shape")
    p.add_argument("--json", action="store_true", help="print the raw manifest as JSON")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("verify", help="re-hash files against the manifest", description="Re-hash every file of a step against its manifest. Exit status 1 when any file is missing, truncated or corrupt.")
    p.add_argument("dir", help="checkpoint directory")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--step", type=int, help="step to verify (default: newest committed)")
    group.add_argument("--all", action="store_true", help="verify every committed step")
    p.set_defaults(func=cmd_verify)

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

    p = sub.add_parser("gc", help="apply retention by hand", description="Delete committed steps that the retention policy drops (never the newest) and leftovers of interrupted saves. Do not run while a job is saving into the directory.")
    p.add_argument("dir", help="checkpoint directory")
    p.add_argument("--keep-last", type=int, required=True, help="keep the newest N committed steps (N >= 1)")
    p.add_argument("--keep-every", type=int, help="also keep every step that is a multiple of K")
    p.add_argument("--dry-run", action="store_true", help="only print what would be deleted")
    p.add_argument("--keep-abandoned", action="store_true", help="keep steps that a rollback abandoned (deleted by default)")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser(
        "sync",
        help="run the per-node uploader",
        description="Upload every committed step of a node's local directory to the remote and commit it "
        "there (files, then this node's marker; the node holding rank 0's files writes the manifest once "
        "every node's marker is present). Runs until SIGTERM unless --once or --exit-when-idle. One "
        "uploader per directory: a second one exits at once.",
    )
    from .uploader import add_sync_args

    add_sync_args(p)
    p.set_defaults(func=cmd_sync)

    p = sub.add_parser("push", help="upload committed steps now", description="Upload this node's files of committed local steps and commit them when every node's files are there. Steps already committed remotely are checked: this node's objects are downloaded and hashed, and any that fail are uploaded again (--no-verify skips that).")
    _transfer_args(p)
    p.add_argument("--step", type=int, help="step to push (default: every committed local step)")
    p.add_argument("--no-verify", action="store_true", help="only upload pending steps; do not check (and repair) the remote copies of steps already committed there")
    p.add_argument("--keep-last", type=int, help="remote retention after the commit: keep the newest N")
    p.add_argument("--keep-every", type=int, help="remote retention: also keep every multiple of K")
    p.set_defaults(func=cmd_push)

    p = sub.add_parser("pull", help="fetch a remote step into a local directory", description="Download a committed remote step (default: the newest) into the local directory, verifying every file against the manifest; the step becomes a committed local step only once all files passed.")
    _transfer_args(p)
    p.add_argument("--step", type=int, help="step to fetch (default: newest committed on the remote)")
    p.set_defaults(func=cmd_pull)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "keep_last", None) is not None and args.keep_last < 1:
        parser.error("--keep-last must be >= 1")
    try:
        return int(args.func(args) or 0)
    except ShardckptError as exc:
        from .remote import redact

        print(f"shardckpt: error: {redact(str(exc))}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
