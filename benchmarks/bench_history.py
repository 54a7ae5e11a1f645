"""Requests to find the newest remote step and to run a retention pass, against the steps held.

usage: python benchmarks/bench_history.py [--held 1,50,500] [--before REV] [--dir DIR] [--json FILE]

moto's S3 server in its own process on 127.0.0.1. One real step is saved and
committed by the uploader, then copied under other step numbers (each with its
own manifest) until ``--held`` steps are committed; the index is brought up to
date by one survey. Then, counting every HTTP request boto3 sends (botocore's
event hooks) and the bytes of the answers:

* ``find newest``: what a restore's rank 0 does before any fetch
  (``remote_listing.remote_infos``);
* ``uploader start``: ``remote_listing.remote_steps``;
* ``retention``: ``remote_listing.apply_remote_retention`` with ``KeepLast(held - 1)``
  (one step deleted; none at one step held).

Each runs once with this tree's code ("after") and once with the code of
``--before`` (a git revision, extracted with ``git archive``; "before").
Request counts do not depend on the machine; manifest bytes grow with the
files of a step (this step's manifest is a few KiB; at 1,000 nodes × 8 ranks
it is about 2 MB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OPS = ("find newest", "uploader start", "retention")


def child(held: list[int], scratch: str) -> dict:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import torch
    from remote_history import RequestLog, clone_steps
    from s3server import BUCKET

    import shardckpt
    from shardckpt import stores
    from shardckpt.format.retention import KeepLast
    from shardckpt.node import uploader
    from shardckpt.remote import listing as remote_listing

    out: dict = {}
    for n in held:
        url = f"s3://{BUCKET}/held{n}"
        local = os.path.join(scratch, f"local{n}")
        ckpt = shardckpt.Checkpointer(local_dir=local, keep_last=None, preemption_signals=())
        ckpt.save({"model": torch.nn.Linear(64, 64)}, 1).wait()
        ckpt.close()
        assert uploader.Uploader(local, stores.open_store(url), node="n0", once=True, poll_s=0.05).run() == 0
        store = stores.open_store(url)
        clone_steps(store, 1, list(range(2, n + 1)))
        deadline = stores.Deadline(300)
        bring_index_up_to_date(store, deadline)
        log = RequestLog(store)
        row = {}
        for op in OPS:
            log.clear()
            if op == "find newest":
                infos, _bad = remote_listing.remote_infos(store, deadline)
                assert max(infos) == n
            elif op == "uploader start":
                assert remote_listing.remote_steps(store, deadline)[-1] == n
            else:
                doomed = remote_listing.apply_remote_retention(store, KeepLast(max(1, n - 1)), deadline)
                assert doomed == ([1] if n > 1 else [])
            row[op] = {"requests": log.requests(), "kinds": dict(log.kinds), "manifest_gets": log.manifest_gets,
                       "bytes_in": log.bytes_in}
        out[str(n)] = row
        store.close()
    return out


def bring_index_up_to_date(store, deadline) -> None:
    """As the committer's commits keep it (in code before the index there is none to update)."""
    from shardckpt.remote import listing as remote_listing

    try:
        from shardckpt.remote import index as remote_index
    except ImportError:
        return
    try:
        remote_index.survey(store, deadline, write_back=True)
    except TypeError:  # code in which every survey writes its repairs back
        remote_listing.remote_infos(store, deadline)


def run_child(src: str, held: list[int], scratch: str) -> dict:
    return run_against_moto(os.path.abspath(__file__), ["--held", ",".join(map(str, held))], src, scratch)


def run_against_moto(script: str, args: list[str], src: str, scratch: str) -> dict:
    """``script --child ARGS --dir SCRATCH --json FILE`` with ``src`` on the path, against a fresh moto
    server in its own process; returns what it wrote to FILE."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from s3server import apply_env, start_server

    server = start_server("moto")
    server.reset()  # an empty server holding the bucket
    previous = apply_env(server)
    try:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.path.join(ROOT, "tests")]))
        os.makedirs(scratch, exist_ok=True)
        res = os.path.join(scratch, "child.json")
        subprocess.run([sys.executable, script, "--child", *args, "--dir", scratch, "--json", res], env=env, check=True)
        with open(res, encoding="utf-8") as f:
            return json.load(f)
    finally:
        from s3server import restore_env

        restore_env(previous)
        server.stop()


def table(before: dict, after: dict, held: list[int]) -> list[str]:
    lines = ["| steps held | operation | requests before | requests after | manifest GETs before | manifest GETs after "
             "| bytes in before | bytes in after |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for n in held:
        for op in OPS:
            b, a = before[str(n)][op], after[str(n)][op]
            lines.append(f"| {n} | {op} | {b['requests']} | {a['requests']} | {b['manifest_gets']} | "
                         f"{a['manifest_gets']} | {b['bytes_in']} | {a['bytes_in']} |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--held", default="1,50,500")
    p.add_argument("--before", default="cb4d758")
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true")
    args = p.parse_args()
    held = [int(x) for x in args.held.split(",")]
    scratch = args.dir or tempfile.mkdtemp(prefix="bench-history-")
    if args.child:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(child(held, scratch), f)
        return 0
    old = os.path.join(scratch, "before")
    os.makedirs(old, exist_ok=True)
    archive = subprocess.run(["git", "-C", ROOT, "archive", args.before, "src"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
    after = run_child(os.path.join(ROOT, "src"), held, os.path.join(scratch, "a"))
    before = run_child(os.path.join(old, "src"), held, os.path.join(scratch, "b"))
    print("\n".join(table(before, after, held)))
    if args.json:
        sys.path.insert(0, HERE)
        import common

        result = common.new_result("history", 0, unit="requests", ratio_label="before", before_rev=args.before)
        for n in held:
            for op in OPS:
                for when, got in (("before", before), ("after", after)):
                    m = got[str(n)][op]
                    common.add_row(result, when, [m["requests"]], group=f"{n} steps held: {op}",
                                   floor=when == "before", manifest_gets=m["manifest_gets"], bytes_in=m["bytes_in"])
        common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
