"""Requests of a remote commit, of waiting for a dead node and of a failed step's report, per node,
at 1, 2 and 4 simulated nodes, and the 1,000-node extrapolation.

usage: python benchmarks/bench_commit_requests.py [--nodes 1,2,4] [--dir DIR] [--json FILE]

moto's S3 server in its own process on 127.0.0.1. ``K`` nodes are ``K``
ranks under torchrun each saving into a directory of its own
(``tests/programs/multinode.py save --layout rank --steps 5``: one rank per
node, its shard files and a copy of ``.metadata``). Each node then runs the
commit protocol (``remote_commit.push_step``) with a store of its own, every
HTTP request counted (botocore's event hooks), in this order:

* ``upload``: every node but the committer uploads its files and marker (the step waits);
* ``poll``: each of them polls again once (the step still waits: a waiting node's pass);
* ``commit``: the committer uploads its files, checks the markers and objects, commits;
* ``confirm``: each other node's pass that sees the commit (it marks its copy uploaded);
* step 2 the same, the committer with ``KeepLast(1)``: ``commit+retention`` deletes step 1;
* steps 3, 4, 5 (``K >= 2``): the last node is dead (never uploads); every other node uploads
  and then each polls every blocked step once (``dead poll``: the committer with its marker
  cache, as its uploader holds one); each poll's count must not depend on how many newer
  steps are blocked;
* ``report``: past the deadline, the committer writes step 3's report naming the dead node's
  ranks (the node of the highest rank is dead: the committer alone reports); each other node
  reads it (``Uploader._failure_details``, the uploader's own code).

The counts are checked against the formulas in :func:`formulas` (``F``: files
per non-committer node, ``F0``: the committer's, with ``.metadata``; ``N``:
the files of the step); :func:`at_scale` extrapolates them to 1,000 nodes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PHASES = ("upload", "poll", "commit", "confirm", "commit+retention", "dead poll", "report")
BLOCKED = (3, 4, 5)


def formulas(k: int, f: int, f0: int, confirms_crc: bool = False) -> dict[str, dict[str, dict[str, int]]]:
    """Requests per phase and node role: small files (one PUT each), fewer than 1,000 objects per listing.

    ``confirms_crc``: the store answers a PUT with the CRC32 it stored (AWS S3
    does); moto does not, so each uploaded file costs one HEAD more to check it.
    """
    check_f, check_f0 = (0, 0) if confirms_crc else (f, f0)
    commit = {
        "GET": 2 + k + 1,  # step record (404), own marker (404), every node's marker (each read once), the index
        "HEAD": 2 + check_f0,  # manifest (404) at the start and after the uploads, uploads checked
        "LIST": 4,  # the markers, the step's objects before and after the manifest, the step directories
        "PUT": f0 + 4,  # files, marker, manifest, step record, index
    }
    retention = {  # what KeepLast(1) adds to the committer's pass when it deletes one step
        "GET": 2,  # the index (retention's survey), again before the deletion
        "LIST": 3,  # the step directories (is a newer step committed?), retention's survey, the doomed step's objects
        "PUT": 1,  # the index without the doomed step
        "DELETE": 3,  # its step record, its manifest, its objects (one batch)
    }
    return {
        # step record (404), own marker (404), index; manifest (404) at the start and after the uploads
        "upload": {"other": {"GET": 3, "HEAD": 2 + check_f, "PUT": f + 1}},
        "poll": {"other": {"GET": 2, "HEAD": 1}},  # step record and manifest (404s), the index (superseded?)
        "commit": {"committer": commit},
        "confirm": {"other": {"GET": 1, "HEAD": 1}},  # manifest, step record
        "commit+retention": {"committer": {x: commit.get(x, 0) + retention.get(x, 0)
                                           for x in sorted(set(commit) | set(retention))}},
        # a blocked step's poll: step record and manifest (404s), (the committer: the markers'
        # listing, none read again), the index: the same for every blocked step, however many
        # newer ones wait
        "dead poll": {"committer": {"GET": 2, "HEAD": 1, "LIST": 1}, "other": {"GET": 2, "HEAD": 1}},
        # the report (404), this step's markers (listed, none read again), the newest committed
        # step's markers (listed, the dead node's read), the report; the others: one GET
        "report": {"committer": {"GET": 2, "LIST": 2, "PUT": 1}, "other": {"GET": 1}},
    }


def child(nodes: list[int], scratch: str) -> dict:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from helpers import PROGRAMS, run_torchrun
    from remote_history import RequestLog
    from s3server import BUCKET

    from shardckpt import stores
    from shardckpt.format import layout
    from shardckpt.format.retention import KeepLast
    from shardckpt.node.uploader import Uploader
    from shardckpt.remote import commit as remote_commit

    out: dict = {}
    for k in nodes:
        base, saved = os.path.join(scratch, f"k{k}"), os.path.join(scratch, f"k{k}-out")
        os.makedirs(saved, exist_ok=True)
        run_torchrun(k, PROGRAMS / "multinode.py", "save", base, saved, "--layout", "rank", "--steps", "5", timeout=600)
        url = f"s3://{BUCKET}/commit{k}"
        dirs = [os.path.join(base, f"rank{r}") for r in range(k)]
        opened = [stores.open_store(url) for _ in dirs]
        logs = [RequestLog(s) for s in opened]
        caches = [remote_commit.MarkerCache() for _ in dirs]
        counts: dict = {p: {"committer": [], "other": []} for p in PHASES}

        def counted(node: int, phase: str, fn):
            logs[node].clear()
            result = fn()
            got = logs[node]
            counts[phase]["committer" if node == 0 else "other"].append(
                {"kinds": dict(got.kinds), "manifest_gets": got.manifest_gets, "bytes_in": got.bytes_in})
            return result

        def run(node: int, step: int, phase: str, policy=None, skip=None) -> remote_commit.PushResult:
            return counted(node, phase, lambda: remote_commit.push_step(
                opened[node], dirs[node], step, node=f"n{node}", policy=policy, skip_upload_digest=skip,
                markers=caches[node]))

        for step, policy in ((1, None), (2, KeepLast(1))):
            marks = {}
            for node in range(1, k):
                result = run(node, step, "upload")
                assert result.state == remote_commit.WAITING, result
                marks[node] = result.marked
            for node in range(1, k):
                result = run(node, step, "poll", skip=marks[node])
                assert result.state == remote_commit.WAITING, result
            result = run(0, step, "commit" if step == 1 else "commit+retention", policy)
            assert result.state == remote_commit.COMMITTED, result
            for node in range(1, k):
                result = run(node, step, "confirm", skip=marks[node])
                assert result.state == remote_commit.COMMITTED, result
        if k >= 2:  # the last node is dead from step 3 on
            alive = list(range(1, k - 1)) + [0]  # the committer's first pass after the others' markers
            marks = {}
            for step in BLOCKED:
                for node in alive:
                    logs[node].clear()
                    result = remote_commit.push_step(opened[node], dirs[node], step, node=f"n{node}", policy=None,
                                                     markers=caches[node])
                    assert result.state == remote_commit.WAITING, result
                    marks[(node, step)] = result.marked
            for step in BLOCKED:
                for node in alive:
                    result = run(node, step, "dead poll", skip=marks[(node, step)])
                    assert result.state == remote_commit.WAITING, result
            for node in sorted(alive):  # the committer's report first, then the others read it
                up = Uploader(dirs[node], opened[node], node=f"n{node}")
                up.markers, up.latest_remote = caches[node], 2
                failed: dict = {"detail": ""}
                counted(node, "report", lambda: up._failure_details(BLOCKED[0], failed))
                assert failed.get("ranks") == [k - 1] and failed.get("nodes") == [f"n{k - 1}"], failed
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
    """``(nodes, phase, role, counts, formula)`` of every pass a node went through."""
    for k, body in got.items():
        expected = formulas(int(k), body["F"], body["F0"])
        for phase in PHASES:
            for role in ("committer", "other"):
                for c in body["counts"][phase][role]:
                    yield k, phase, role, c, expected[phase].get(role)


def check(got: dict) -> list[str]:
    """Rows of the README's table (one per phase and role: every pass of it counted the same);
    raises when a count differs from its formula."""
    lines = ["| nodes | phase | node | passes | GET | HEAD | LIST | PUT | DELETE | manifest GETs | bytes in |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    problems = []
    rows: dict = {}
    for k, phase, role, c, expected in measured(got):
        kinds = {key: v for key, v in c["kinds"].items() if v}
        if kinds != expected:
            problems.append(f"{k} nodes, {phase}, {role}: measured {kinds}, formula {expected}")
        row = rows.setdefault((k, phase, role), [kinds, 0, c["manifest_gets"], c["bytes_in"]])
        row[1] += 1
    for (k, phase, role), (kinds, passes, mgets, bytes_in) in rows.items():
        lines.append(f"| {k} | {phase} | {role} | {passes} | " + " | ".join(str(kinds.get(x, 0)) for x in
                     ("GET", "HEAD", "LIST", "PUT", "DELETE")) + f" | {mgets} | {bytes_in} |")
    if problems:
        raise SystemExit("request counts differ from the formulas:\n" + "\n".join(problems) + "\n" + "\n".join(lines))
    return lines


# ------------------------------------------------------------ 1,000 nodes

SCALE = {"nodes": 1000, "ranks_per_node": 8, "files_per_rank": 2, "step_bytes": 840e9, "manifest_bytes": 5.9e6,
         "marker_bytes": 2.4e3, "marker_bytes_before": 1.4e3, "inflight": 8, "request_s": 0.020, "list_page_s": 0.100,
         "put_bytes_per_s": 100e6,
         "commit_poll_s": 0.5, "old_slot_s": 5.0, "young_s": 120.0, "poll_s": 0.5, "save_every_s": 60.0,
         "prefix_get_per_s": 5500.0}
"""The model's inputs: the issue's job (1,000 nodes x 8 ranks x 2 files, an 840 GB step, a
5.9 MB manifest), S3's per-prefix budget, a small request's latency, one listing page's, the
requests in flight (``transfer_concurrency``) and the uploader's polling constants."""


def at_scale(p: dict = SCALE) -> list[str]:
    """The 1,000-node figures of points 1-3 of the issue, by the formulas above (AWS S3 confirms
    the CRC32 of a PUT: no HEAD per upload) beside what the protocol sent before."""
    k, f = p["nodes"], p["ranks_per_node"] * p["files_per_rank"]
    n = f + 1 + (k - 1) * f
    pages = lambda objects: max(1, math.ceil(objects / 1000))  # noqa: E731
    rounds = lambda requests: math.ceil(requests / p["inflight"])  # noqa: E731
    req, page = p["request_s"], p["list_page_s"]
    # After the last node's marker lands: the committer's next poll, the markers' listing (pages one
    # after another), that marker's GET, the objects' listing before and after the manifest (pages
    # concurrently), the manifest's PUT, the step record's PUT.
    check = rounds(pages(n)) * page
    latency = (p["commit_poll_s"] + pages(k) * page + req + check
               + (req + p["manifest_bytes"] / p["put_bytes_per_s"]) + check + req)
    before = rounds(2 * n) * req  # 2N HEADs at `inflight`, the rest left out
    # Waiting for a dead node, per node: the blocked steps share one poll per old_slot_s (2 requests;
    # the committer's 3 + its listing's extra pages), each new step is young for young_s: polls at
    # poll_s, then after half the time waited.
    young_polls, t = 0, p["poll_s"]
    while t < p["young_s"]:
        young_polls += 1
        t += max(p["poll_s"], t / 2)
    per_node = 3 / p["old_slot_s"] + 3 * young_polls / p["save_every_s"]
    fleet = k * per_node + (pages(k) + 1) / p["old_slot_s"] + 4 / p["commit_poll_s"]
    # The failed step's report: the committer lists both steps' markers and reads the dead node's,
    # the node of the highest rank (if alive) reads every marker; every other node one GET.
    report_requests = 2 * pages(k) + 2 + (2 * pages(k) + k + 1) + (k - 2)
    report_bytes = (k + 1) * p["marker_bytes"] + k * 300
    return [
        "| at 1,000 nodes | before | now |",
        "|---|---:|---:|",
        f"| committer's identity check | {2 * n:,} HEADs | {2 * pages(n)} LISTs ({pages(n)} pages, "
        f"{p['inflight']} at a time, twice) |",
        f"| commit latency after the last node's marker ({req * 1000:.0f} ms a request, {page * 1000:.0f} ms a "
        f"listing page, {p['inflight']} in flight) | >= {before:.0f} s | <= {latency:.2f} s |",
        f"| a failed step's report, whole fleet | ~{2 * k * k / 1e6:.1f} M GETs, "
        f"~{2 * k * k * p['marker_bytes_before'] / 1e9:.1f} GB | {report_requests:,} requests, "
        f"~{report_bytes / 1e6:.1f} MB |",
        f"| waiting for a dead node, per node (a save every {p['save_every_s']:.0f} s) | grows with the steps "
        f"blocked (~1,800 requests/s over the fleet after 1 h) | <= {per_node:.2f} requests/s at any time: "
        f"{3 / p['old_slot_s']:.2f} for all the blocked steps, the rest the young polls of new saves |",
        f"| the same, whole fleet | ~21,600 requests/s after 4 h | <= {fleet:,.0f} requests/s "
        f"({100 * fleet / p['prefix_get_per_s']:.0f}% of one prefix's GET/HEAD budget) |",
    ]


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
    print()
    print("\n".join(at_scale()))
    if args.json:
        sys.path.insert(0, HERE)
        import common

        result = common.new_result("commit_requests", 0, unit="requests", ratio_label="formula")
        for k, phase, role, c, expected in measured(got):
            group = f"{k} nodes: {phase} ({role})"
            common.add_row(result, "formula", [sum((expected or {}).values())], group=group, floor=True)
            common.add_row(result, "measured", [sum(c["kinds"].values())], group=group,
                           manifest_gets=c["manifest_gets"], bytes_in=c["bytes_in"])
        common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
