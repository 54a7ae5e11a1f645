"""Moving steps between tiers: ``sync`` (the per-node uploader), ``push``, ``pull``."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Any

from shardckpt import steps as steps_mod
from shardckpt._text import fmt_bytes
from shardckpt.cli.common import BAD, OK, Problem, progress_bar
from shardckpt.format import layout, lineage
from shardckpt.node.uploader import (
    add_best_args,
    add_sync_args,
    add_transfer_args,
    policy_from_args,
    store_from_args,
    sync_from_args,
)
from shardckpt.remote import commit as remote_commit
from shardckpt.remote import index as remote_index
from shardckpt.stores import Deadline


def _with_bars(enabled: bool) -> None:
    """Transfers of push / pull / sync show tqdm bars on a terminal (else their log lines)."""
    remote_commit.Progress.bar_factory = (
        (lambda what, total: progress_bar(total, what, True)) if enabled and sys.stderr.isatty() else None
    )


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


def add_parsers(sub: Any) -> None:
    """The commands that move steps between tiers, on the subparsers of the ``shardckpt`` parser."""
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
