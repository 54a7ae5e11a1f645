"""Need-only restores from the remote: S3 bytes per node against the bytes its ranks read.

usage: python benchmarks/bench_need_only.py [--nodes 1,2,4] [--width 65536] [--repeats 2] [--modes fsdp,ddp]
                                           [--dir DIR] [--json FILE]

moto's S3 server in its own process on 127.0.0.1. For each mode and node count K, an
FSDP2 model + AdamW (mode ``fsdp``; ``ddp``: the same model and optimizer replicated on
every rank, every rank reading all of it) (``tests/programs/remote_train.py``, ``TinyNet`` of
``--width``) is saved by K simulated nodes x 1 rank (``torchrun --nnodes K
--node-rank i`` launchers on this machine) and committed on the remote; then the
local disks are wiped and K new nodes restore it onto empty disks, each through
its own byte-counting proxy in front of the server (``tests/faultproxy.py``),
``--repeats`` times (fresh disks each time). Per node: the bytes of every GET it
sent (index, manifest, ``.metadata``, ranges; the manifest's GETs are counted apart: one per node) against the bytes
its ranks' load plans read (the restore's log line, ``.metadata`` included) and the bytes it received
from other nodes (read once, shared); in all: the nodes' GET bytes against the step's bytes. Byte counts do not depend
on the machine; the restore times do (2 shared cores here: medians and spread are shown).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

_NEED = re.compile(r"fetched (\d+) range\(s\), (\d+) bytes, for the (\d+) bytes this node's ranks read")
_SHARED = re.compile(r"read once, shared: fetched (\d+) bytes .*? for the (\d+) bytes this node's ranks read, "
                     r"received (\d+) bytes")
_TOOK = re.compile(r"restored step \d+ from .*?, ([0-9.]+) s$", re.M)


def launch(k: int, mode: str, base: str, url: str, out: str, env_of, logs: list[str], extra: list[str]) -> None:
    from helpers import PROGRAMS, free_port, kill_job, start_torchrun

    port = free_port()
    procs = [start_torchrun(1, PROGRAMS / "remote_train.py", mode, base, url, out, *extra, nnodes=k, node_rank=i,
                            port=port, env=env_of(i), log_path=logs[i]) for i in range(k)]
    try:
        for proc, log in zip(procs, logs):
            if proc.wait(timeout=900) != 0:
                raise SystemExit(f"{mode} at {k} node(s) failed:\n" + open(log).read()[-4000:])
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_job(proc)


def one(k: int, width: int, repeats: int, scratch: str, server, mode: str = "fsdp") -> dict:
    from faultproxy import FaultProxy
    from helpers import child_env
    from s3server import BUCKET

    from shardckpt import stores
    from shardckpt.format import layout
    from shardckpt.remote import commit as remote_commit

    url = f"s3://{BUCKET}/needonly-{mode}{k}"
    base = os.path.join(scratch, f"{mode}-k{k}")
    knobs = {"RT_WIDTH": str(width), **server.env(), "SHARDCKPT_LOG_LEVEL": "INFO"}  # its log lines are read below
    if mode == "ddp":
        knobs["RT_DDP"] = "1"
    logs = [os.path.join(scratch, f"{mode}-k{k}-save{i}.log") for i in range(k)]
    launch(k, "save", os.path.join(base, "save"), url, os.path.join(base, "saved.pt"),
           lambda i: child_env(**knobs), logs, ["1"])
    shutil.rmtree(os.path.join(base, "save"))
    store = stores.open_store(url, stores.TransferOptions(endpoint_url=server.endpoint))
    manifest = remote_commit.remote_manifest(store, 1, stores.Deadline(60))
    store.close()
    rounds = []
    for r in range(repeats):
        proxies = [FaultProxy(server.endpoint) for _ in range(k)]
        logs = [os.path.join(scratch, f"{mode}-k{k}-restore{r}-{i}.log") for i in range(k)]
        target = os.path.join(base, f"restore{r}")
        try:
            launch(k, "restore", target, url, os.path.join(base, "restored.pt"),
                   lambda i: child_env(**{**knobs, "AWS_ENDPOINT_URL": proxies[i].endpoint}), logs, [])
        finally:
            for p in proxies:
                p.stop()
        nodes = []
        for i in range(k):
            text = open(logs[i]).read()
            need, took = _SHARED.search(text) or _NEED.search(text), _TOOK.search(text)  # rank 0: the job's time
            if need is None or (i == 0 and took is None):
                raise SystemExit(f"{logs[i]} lacks the need-only fetch or the restore line:\n{text[-4000:]}")
            nodes.append({
                "s3_bytes": sum(n for _path, n in proxies[i].got),
                "gets": len(proxies[i].got),
                "manifest_gets": sum(1 for path, _n in proxies[i].got if path.endswith("/" + layout.MANIFEST_NAME)),
                "needed": int(need.group(2 if need.re is _SHARED else 3))
                + manifest.files[layout.METADATA_NAME].size,
                "received": int(need.group(3)) if need.re is _SHARED else 0,
                "restore_s": float(took.group(1)) if took else None,
            })
        rounds.append(nodes)
        shutil.rmtree(target, ignore_errors=True)
    step_bytes = manifest.total_bytes
    first = rounds[0]
    return {
        "mode": mode,
        "nodes": k,
        "step_bytes": step_bytes,
        "per_node": first,
        "s3_over_need": [n["s3_bytes"] / n["needed"] for n in first],
        "egress_over_step": sum(n["s3_bytes"] for n in first) / step_bytes,
        "gets_per_node": [n["gets"] for n in first],
        "manifest_gets_per_node": [n["manifest_gets"] for n in first],
        "received_over_need": [n["received"] / n["needed"] for n in first],
        "restore_s": [nodes[0]["restore_s"] for nodes in rounds],
    }


def table(results: list[dict]) -> list[str]:
    lines = ["| state | nodes | step bytes | S3 bytes per node ÷ bytes its ranks read | received from nodes ÷ bytes "
             "its ranks read | total egress ÷ step bytes | GETs per node | manifest GETs per node | "
             "restore s (the job's, "
             "median [min–max]) |", "|---|---:|---:|---|---|---:|---|---|---|"]
    for r in results:
        ratio = ", ".join(f"{x:.2f}" for x in r["s3_over_need"])
        received = ", ".join(f"{x:.2f}" for x in r["received_over_need"])
        t = r["restore_s"]
        lines.append(f"| {r['mode']} | {r['nodes']} | {r['step_bytes']} | {ratio} | {received} | "
                     f"{r['egress_over_step']:.2f} | {', '.join(map(str, r['gets_per_node']))} | "
                     f"{', '.join(map(str, r['manifest_gets_per_node']))} | "
                     f"{statistics.median(t):.2f} [{min(t):.2f}–{max(t):.2f}] |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", default="1,2,4")
    p.add_argument("--width", type=int, default=65536)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--modes", default="fsdp,ddp", help="fsdp (sharded state), ddp (replicated state)")
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from s3server import apply_env, restore_env, start_server

    scratch = args.dir or tempfile.mkdtemp(prefix="bench-need-only-")
    os.makedirs(scratch, exist_ok=True)
    server = start_server("moto")
    server.reset()
    previous = apply_env(server)
    t0 = time.monotonic()
    try:
        results = [one(k, args.width, args.repeats, scratch, server, mode)
                   for mode in args.modes.split(",") for k in map(int, args.nodes.split(","))]
    finally:
        restore_env(previous)
        server.stop()
    print("\n".join(table(results)))
    print(f"({time.monotonic() - t0:.0f} s)")
    if args.json:
        sys.path.insert(0, HERE)
        import common

        result = common.new_result("need_only", 0, unit="ratio", ratio_label="bytes its ranks read")
        for r in results:
            common.add_row(result, f"{r['mode']}, {r['nodes']} node(s): S3 bytes per node", r["s3_over_need"],
                           group=f"{r['mode']}, {r['nodes']} node(s)", egress_over_step=r["egress_over_step"],
                           received_over_need=r["received_over_need"],
                           gets_per_node=r["gets_per_node"], manifest_gets_per_node=r["manifest_gets_per_node"],
                           restore_s=r["restore_s"], step_bytes=r["step_bytes"])
        common.write_json(args.json, result)
        with open(args.json + ".raw", "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
