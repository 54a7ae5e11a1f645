"""Requests of one remote commit and of a retention pass, per node, at 1, 2 and 4 simulated nodes.

usage: python benchmarks/bench_commit_requests.py [--nodes 1,2,4] [--dir DIR] [--json FILE]

moto's S3 server in its own process on 127.0.0.1. ``K`` nodes are ``K``
ranks under torchrun each saving into a directory of its own
(``tests/programs/multinode.py save --layout rank --steps 2``: one rank per
node, its shard files and a copy of ``.metadata``). Each node then runs the
commit protocol (``remote_commit.push_step``) with a store of its own, every
HTTP request counted (botocore's event hooks), in this order:

* ``upload``: every node but the committer uploads its files and marker (the step waits);
* ``poll``: each of them polls again once (the step still waits: a waiting node's pass);
* ``commit``: the committer uploads its files, checks the markers and objects, commits;
* ``confirm``: each other node's pass that sees the commit (it marks its copy uploaded);
* step 2 the same, the committer with ``KeepLast(1)``: ``commit+retention`` deletes step 1.

The counts are checked against the formulas in :func:`formulas` (``F``: files
per non-committer node, ``F0``: the committer's, with ``.metadata``; ``N``:
the files of the step); the README extrapolates them to 1,000 nodes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PHASES = ("upload", "poll", "commit", "confirm", "commit+retention")


def formulas(k: int, f: int, f0: int, confirms_crc: bool = False) -> dict[str, dict[str, int]]:
    """Requests per node and phase: small files (one PUT each), fewer than 1,000 objects per listing.

    ``confirms_crc``: the store answers a PUT with the CRC32 it stored (AWS S3
    does); moto does not, so each uploaded file costs one HEAD more to check it.
    """
    n = f0 + (k - 1) * f  # files of the step
    check_f, check_f0 = (0, 0) if confirms_crc else (f, f0)
    commit = {
        "GET": 2 + k + 1,  # step record (404), own marker (404), every node's marker, the index
        "HEAD": 1 + check_f0 + 2 * n,  # manifest (404), uploads checked, every object's identity before + after
        "LIST": 3,  # the markers, the step's objects, the step directories (the index's survey)
        "PUT": f0 + 4,  # files, marker, manifest, step record, index
    }
    retention = {  # what KeepLast(1) adds to the committer's pass when it deletes one step
        "GET": 2,  # the index (retention's survey), again before the deletion
        "LIST": 3,  # the step directories (is a newer step committed?), retention's survey, the doomed step's objects
        "PUT": 1,  # the index without the doomed step
        "DELETE": 3,  # its step record, its manifest, its objects (one batch)
    }
    return {
        "upload": {"GET": 2, "HEAD": 1 + check_f, "LIST": 1, "PUT": f + 1},
        "poll": {"GET": 1, "HEAD": 1, "LIST": 1},  # step record (404), manifest HEAD (404), step directories
        "commit": commit,
        "confirm": {"GET": 1},  # the step record
        "commit+retention": {x: commit.get(x, 0) + retention.get(x, 0) for x in sorted(set(commit) | set(retention))},
    }


def child(nodes: list[int], scratch: str) -> dict:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from helpers import PROGRAMS, run_torchrun
    from remote_history import RequestLog
    from s3server import BUCKET
    from shardckpt.format import layout
    from shardckpt.tiers import remote_commit
    from shardckpt import stores
    from shardckpt.format.retention import KeepLast

    out: dict = {}
    for k in nodes:
        base, saved = os.path.join(scratch, f"k{k}"), os.path.join(scratch, f"k{k}-out")
        os.makedirs(saved, exist_ok=True)
        run_torchrun(k, PROGRAMS / "multinode.py", "save", base, saved, "--layout", "rank", "--steps", "2", timeout=600)
        url = f"s3://{BUCKET}/commit{k}"
        dirs = [os.path.join(base, f"rank{r}") for r in range(k)]
        opened = [stores.open_store(url) for _ in dirs]
        logs = [RequestLog(s) for s in opened]
        counts: dict = {p: {"committer": None, "other": None} for p in PHASES}

        def run(node: int, step: int, policy=None, skip=None) -> tuple[remote_commit.PushResult, dict]:
            logs[node].clear()
            result = remote_commit.push_step(opened[node], dirs[node], step, node=f"n{node}", policy=policy,
                                             skip_upload_digest=skip)
            got = logs[node]
            return result, {"kinds": dict(got.kinds), "manifest_gets": got.manifest_gets, "bytes_in": got.bytes_in}

        for step, policy in ((1, None), (2, KeepLast(1))):
            marks = {}
            for node in range(1, k):
                result, c = run(node, step)
                assert result.state == remote_commit.WAITING, result
                marks[node] = result.marked
                counts["upload"]["other"] = c
            for node in range(1, k):
                result, c = run(node, step, skip=marks[node])
                assert result.state == remote_commit.WAITING, result
                counts["poll"]["other"] = c
            result, c = run(0, step, policy)
            assert result.state == remote_commit.COMMITTED, result
            counts["commit" if step == 1 else "commit+retention"]["committer"] = c
            for node in range(1, k):
                result, c = run(node, step, skip=marks[node])
                assert result.state == remote_commit.COMMITTED, result
                counts["confirm"]["other"] = c
        manifest = layout.read_manifest(os.path.join(dirs[0], layout.step_dirname(1)))
        f0 = sum(1 for e in manifest.files.values() if e.rank == 0)
        f = (len(manifest.files) - f0) // max(1, k - 1)
        out[str(k)] = {"counts": counts, "F": f, "F0": f0, "files": len(manifest.files),
                       "manifest_bytes": len(manifest.to_json().encode())}
        for s in opened:
            s.close()
    return out


def run_child(nodes: list[int], scratch: str) -> dict:
    sys.path.insert(0, HERE)
    from bench_history import run_against_moto

    return run_against_moto(os.path.abspath(__file__), ["--nodes", ",".join(map(str, nodes))],
                            os.path.join(ROOT, "src"), scratch)


def measured(got: dict):
    """``(nodes, phase, role, counts, formula)`` of every phase a node went through."""
    for k, body in got.items():
        expected = formulas(int(k), body["F"], body["F0"])
        for phase in PHASES:
            for role in ("committer", "other"):
                c = body["counts"][phase][role]
                if c is not None:
                    yield k, phase, role, c, expected[phase]


def check(got: dict) -> list[str]:
    """Rows of the README's table; raises when a count differs from its formula."""
    lines = ["| nodes | phase | node | GET | HEAD | LIST | PUT | DELETE | manifest GETs | bytes in |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    problems = []
    for k, phase, role, c, expected in measured(got):
        kinds = {key: v for key, v in c["kinds"].items() if v}
        if kinds != expected:
            problems.append(f"{k} nodes, {phase}, {role}: measured {kinds}, formula {expected}")
        lines.append(f"| {k} | {phase} | {role} | " + " | ".join(str(kinds.get(x, 0)) for x in
                     ("GET", "HEAD", "LIST", "PUT", "DELETE")) + f" | {c['manifest_gets']} | {c['bytes_in']} |")
    if problems:
        raise SystemExit("request counts differ from the formulas:\n" + "\n".join(problems) + "\n" + "\n".join(lines))
    return lines


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", default="1,2,4")
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true")
    args = p.parse_args()
    nodes = [int(x) for x in args.nodes.split(",")]
    scratch = args.dir or tempfile.mkdtemp(prefix="bench-commit-requests-")
    if args.child:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(child(nodes, scratch), f)
        return 0
    got = run_child(nodes, os.path.join(scratch, "run"))
    print("\n".join(check(got)))
    if args.json:
        sys.path.insert(0, HERE)
        import common

        result = common.new_result("commit_requests", 0, unit="requests", ratio_label="formula")
        for k, phase, role, c, expected in measured(got):
            group = f"{k} nodes: {phase} ({role})"
            common.add_row(result, "formula", [sum(expected.values())], group=group, floor=True)
            common.add_row(result, "measured", [sum(c["kinds"].values())], group=group,
                           manifest_gets=c["manifest_gets"], bytes_in=c["bytes_in"])
        common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
