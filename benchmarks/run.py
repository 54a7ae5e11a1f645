"""Every benchmark in one command: a JSON file per case, markdown tables and plots.

    python benchmarks/run.py [--quick] [--sizes 1,4,8] [--remote-sizes 0.125,0.25,0.5]
                             [--only NAME,...] [--repeats N] [--every 5] [--out benchmarks/results]
                             [--scratch DIR] [--readme README.md] [--timeout S] [--verbose]

Each case runs at each state size as its own subprocess (the multi-rank ones
under ``python -m torch.distributed.run --standalone``; the blocked-save case
once per tool, so that each tool's RAM peak is its own), in a scratch
directory removed afterwards. Every case compares with baselines measured in
the same run (medians over repeats) and prints its table as it goes. Written
to ``--out``:

  <case>.json                the results with the commands, date, hardware, torch, git commit
  README-performance.md      one table per case with the command that produced it
  blocked.png, durable.png, restore.png, remote_restore.png, remote_durable.png
                             time against state size, one line per tool, floors dashed

``--readme FILE`` also replaces what stands between ``<!-- perf:begin -->``
and ``<!-- perf:end -->`` in FILE with a summary (``benchmarks/report.py``
does the same from existing results without running anything).

Cases (``--only``): blocked, durable, restore, remote_restore, remote_durable,
memory, memory_training, training, elastic, history, need_only, commit_requests, peer, peer_training, restore_kinds and
check_resume (a fixed size: 1 GiB, ``--quick`` 128 MiB). ``--sizes`` (GiB) sizes the local-disk cases (default 1,4,8;
an 8 GiB state and its staging copy need about 17 GiB of RAM); the S3 cases
use ``--remote-sizes`` (moto holds objects in RAM: 0.5 GiB at most).
``--quick`` runs small sizes and few repeats (minutes on 2 cores): a check
that everything works, not numbers to quote. Run the full set on a quiet
machine: other jobs on the same cores change the ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import common  # noqa: E402
import report  # noqa: E402
from helpers import descendants  # noqa: E402


def repeats(args: argparse.Namespace, quick: int, full: int) -> str:
    return str(args.repeats or (quick if args.quick else full))


@dataclasses.dataclass
class Case:
    name: str
    title: str
    script: str
    what: str
    args: Callable[[argparse.Namespace], list[str]]
    nproc: int | None = None  # ranks under torchrun; None: one plain process
    sizes: str | None = "local"  # which size list applies: "local", "remote", or None (fixed size)
    per_tool: bool = False  # one process per tool (--tool NAME)
    memory: float = 2.0  # host RAM needed, in multiples of the state size
    disk: float = 1.5  # scratch space needed, in multiples of the state size
    plot: str | None = None


CASES = [
    Case("blocked", "Blocked per save", "bench_save_blocking.py",
         "Time the training loop waits per checkpoint: 2 ranks, an FSDP2-sharded model on CPU (gloo), the "
         "slowest rank, one warm-up save first. Floor: a copy of the local shards into host buffers allocated "
         "beforehand. Each tool runs in fresh processes: RSS peak / rank is the largest rank's high-water mark, "
         "host RAM peak the largest sum of anonymous and shared-memory RSS over every process of the job (DCP's "
         "daemons included), sampled at 5 Hz.",
         lambda a: ["--repeat", repeats(a, 2, 3)], nproc=2, per_tool=True, memory=1.2,
         disk=1.5, plot="blocked.png"),
    Case("durable", "Time to durable (save → locally committed)", "bench_durable.py",
         "One process: from `save()` until the step is committed on the local disk (`save(...).wait()`), against "
         "`dd` of the same bytes with `conv=fdatasync` (floor) and with `oflag=direct`, stock `dcp.save` and "
         "`torch.save` + `fsync`, on the disk and again on a tmpfs (/dev/shm: memory at several GB/s standing in "
         "for NVMe, skipped where the files do not fit beside the state). Every write starts after `os.sync()` "
         "with the previous output deleted.",
         lambda a: ["--repeats", repeats(a, 2, 3)], memory=2.2, disk=1.5, plot="durable.png"),
    Case("restore", "Restore from the local tier", "bench_restore.py",
         "One process restores the step into the live model: `Checkpointer.load` with checksums verified and "
         "with `verify_on_load=False`, stock `dcp.load`, against reading every file of the step (floor); with "
         "the page cache warm, and cold (the step's files evicted before every run).",
         lambda a: ["--repeats", repeats(a, 2, 3)], memory=2.2, disk=1.3, plot="restore.png"),
    Case("remote_restore", "Restore from the remote tier on an empty instance", "bench_remote.py",
         "moto's S3 server in its own process on 127.0.0.1. shardckpt `load()` into an empty `local_dir` from "
         "`remote=s3://...` against a tuned raw download of the same objects (boto3 transfer manager, "
         "32 MiB parts, 8 in flight) followed by a local load without verification (floor).",
         lambda a: ["--case", "restore", "--repeats", repeats(a, 2, 3)], sizes="remote",
         memory=10.0, disk=4.0, plot="remote_restore.png"),
    Case("remote_durable", "Time to durable remotely (RPO of a spot user)", "bench_remote.py",
         "From `save()` (sync mode, uploader process running) until the step's manifest is in the bucket, against "
         "a raw upload of the step's files (boto3 transfer manager, 32 MiB parts, 8 in flight; floor), "
         "`shardckpt push` of the committed step, and stock `dcp.async_save` straight to `s3://` (FsspecWriter, "
         "s3fs). Seconds per GiB give the largest state per node that fits a 30 s (GCP) and a 120 s (AWS) notice.",
         lambda a: ["--case", "durable", "--repeats", repeats(a, 2, 3)], sizes="remote",
         memory=10.0, disk=4.0, plot="remote_durable.png"),
    Case("compress", "Compressed uploads against a raw upload through the same link", "bench_compress.py",
         "moto's S3 server in its own process; throttling proxies (each its own process) cap each direction at "
         "40 and 100 MB/s (capped) or are left out (loopback). A process's first and only save (bf16 + fp32 "
         "master + AdamW, default options) until its manifest is in the bucket, `remote_compression` off against "
         "auto, with the bytes stored, the CPU seconds of each part and the load average. "
         "A bf16 model with its fp32 master copy and AdamW moments, "
         "a pure bf16 model and a pure fp32 model + AdamW, each a committed local step: `shardckpt push` with "
         "compression off, bytegroup-zstd and auto against a boto3 upload of the same files through the same "
         "link (floor); the restore of the compressed copy against the uncompressed one on the capped link; "
         "bytes stored / step bytes and CPU seconds per GiB to compress and decompress (notes).",
         lambda a: ["--size-mb", "64" if a.quick else "256", "--repeats", repeats(a, 1, 2)], sizes=None,
         memory=6.0, disk=3.0),
    Case("memory", "The memory tier: blocked per save, restore after a SIGKILL", "bench_memory.py",
         "One process, an MLP of fp32 parameters: `save()` kept in memory only, and kept in memory and written to "
         "disk, against a copy into host buffers allocated beforehand (floor) and `save()` without the memory tier, "
         "with the growth of the RSS high-water mark against (memory_keep + 1) x the staged bytes. Then a process "
         "saves and is SIGKILLed right after `save()` returned; fresh processes restore it: a copy of the bytes "
         "from the shared memory into the model (floor), `load()` from memory, `load()` from the disk (warm cache).",
         lambda a: ["--gib", "0.125" if a.quick else "1", "--repeats", repeats(a, 2, 3)], sizes=None, memory=4.5,
         disk=1.5),
    Case("memory_training", "Training slowdown with a memory save every step", "bench_memory.py",
         "Steps/s of the GPT of examples/train_gpt.py (4 layers x 128, block 64, batch 16, AdamW; one process) "
         "with `save()` kept in memory at every step, against the same loop without checkpoints, the two kinds of "
         "step alternating one by one.",
         lambda a: ["--part", "training", "--steps", "20" if a.quick else "40", "--repeats", repeats(a, 2, 5)],
         sizes=None),
    Case("training", "Training slowdown", "bench_train.py",
         "Steps/s of a small DDP training loop (2 ranks, an MLP of about 4 MB with AdamW) checkpointing every N "
         "steps, against the same loop without checkpoints, measured in alternating rounds.",
         lambda a: ["--every", str(a.every), "--steps", "40" if a.quick else "200",
                    "--repeats", repeats(a, 2, 5)], nproc=2, sizes=None),
    Case("elastic", "Restore 8 ranks → 4 ranks", "bench_elastic_restore.py",
         "An FSDP2 model + AdamW + sampler saved by 8 ranks, restored by 4 (gloo on CPU): shardckpt `load` with "
         "and without verification against stock `dcp.load` + `set_state_dict` (floor); the paths back to back "
         "in every round.",
         lambda a: ["--params-m", "8", "--repeats", repeats(a, 3, 11)], sizes=None),
    Case("history", "Finding the newest remote step and retention against the steps held", "bench_history.py",
         "moto's S3 server; 1, 50 and 500 committed steps (one real step copied under other numbers). HTTP "
         "requests and bytes received to find the newest step (a restore's rank 0), at an uploader's start and for "
         "a retention pass, with this tree's code and with the code before the step index (cb4d758).",
         lambda a: ["--held", "1,50" if a.quick else "1,50,500"], sizes=None),
    Case("need_only", "Need-only restores from the remote: bytes per node", "bench_need_only.py",
         "moto's S3 server; an FSDP2 model + AdamW (and, mode ddp, the same replicated on every rank) saved by K "
         "simulated nodes x 1 rank (K = 1, 2, 4), restored onto K empty disks, each node through its own "
         "byte-counting proxy: S3 bytes per node against the bytes its ranks' load plans read (.metadata "
         "included), bytes received from other nodes (read once, shared), total egress against the step's bytes, "
         "GETs per node and the restore time of the job (rank 0's log line: every rank's load is collective).",
         lambda a: ["--nodes", "1,2" if a.quick else "1,2,4", "--width", "65536" if a.quick else "1048576",
                    "--repeats", repeats(a, 1, 3)], sizes=None),
    Case("commit_requests", "Requests of a remote commit and a retention pass per node", "bench_commit_requests.py",
         "moto's S3 server; 1, 2 and 4 simulated nodes (ranks under torchrun, a directory each). HTTP requests "
         "of each node's passes of one commit (upload, a waiting poll, the commit, the pass that sees it) and of "
         "a retention pass, against the exact formulas (the run fails when they differ).",
         lambda a: ["--nodes", "1,2" if a.quick else "1,2,4"], sizes=None),
    Case("peer", "The peer tier: a replica transfer, and a restore after a node loss", "bench_peer.py",
         "A holder's peer endpoint and the raw sinks in a receiving process of their own on 127.0.0.1, moto's S3 "
         "server in the restoring process. Time to peer-durable: `PeerClient.put_replica` of the step (HTTPS on "
         "kept mutual TLS 1.3 connections, one per file in flight, checked on the holder, fsynced, manifest last) "
         "against a plain TCP copy of the same files on loopback, written and fsynced (floor), the same copy over "
         "mutual TLS 1.3, and the cost of hashing the bytes with xxh3. A replacement node's restore into an empty "
         "`local_dir` from the holder's replica (the restore's peer view) and from S3, against a restore from the "
         "node's own disk (floor). CPU seconds of both processes per tool.",
         lambda a: ["--repeats", repeats(a, 2, 3)], sizes="remote", memory=4.0, disk=4.0),
    Case("peer_training", "Training while replicating to a peer", "bench_train.py",
         "Steps/s of the training case's loop on 2 simulated nodes (two torchrun launchers, `--nnodes 2 "
         "--node-rank i`, 1 rank and a directory each) checkpointing every N steps with `peer_replicas=0` and "
         "with `peer_replicas=1` (each node's daemon sends every committed step to the other node), against the "
         "same loop without checkpoints, in alternating rounds of one run.",
         lambda a: ["--nodes", "2", "--every", str(a.every), "--steps", "40" if a.quick else "200",
                    "--repeats", repeats(a, 2, 5)], sizes=None),
    Case("restore_kinds", "Restore per state kind", "bench_restore.py",
         "One process, warm page cache, checksums verified: `Checkpointer.load` of the same bytes held as a "
         "module, an optimizer (Adam; the module a third of the bytes), a plain dict of tensors "
         "(`{\"model\": model.state_dict()}`), nested plain values (tensors in dicts with int keys and in "
         "lists, beside numbers and strings) and a stateful object, each against reading that step's files "
         "(floor).",
         lambda a: ["--kinds", "--gib", "0.125" if a.quick else "1", "--repeats", repeats(a, 2, 5)],
         sizes=None, memory=2.2, disk=1.3),
    Case("check_resume", "What shardckpt check-resume costs", "bench_check_resume.py",
         "One process, a module of 1 GiB fp32 (`--quick` 128 MiB): the time `save()` blocks in a normal run (floor) "
         "and under the check, where every call also records digests of the state (xxh3-64 over every tensor, the "
         "structure, the RNG); the digest alone; xxh3-64 over the same bytes. Then the wall time of `shardckpt "
         "check-resume --steps 12 --kill-after 7` on `tests/programs/resume_script.py` (three runs) against one "
         "plain run of the script to step 12 (floor).",
         lambda a: ["--gib", "0.125" if a.quick else "1", "--repeats", repeats(a, 2, 5)],
         sizes=None, memory=2.2, disk=1.3),
]
BY_NAME = {c.name: c for c in CASES}
QUICK_SIZES, FULL_SIZES = [0.0625, 0.25], [1.0, 4.0, 8.0]
QUICK_REMOTE, FULL_REMOTE = [0.0625], [0.125, 0.25, 0.5]


# ---------------------------------------------------------------- processes

def _ram(pid: int) -> int:
    """Anonymous and shared-memory RSS of a process (O(1) to read, unlike smaps' PSS)."""
    total = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssShmem:")):
                    total += int(line.split()[1]) * common.KIB
    except OSError:
        pass
    return total


class RamSampler(threading.Thread):
    """Peak of the summed RAM of a process tree (the root left out when it is only a launcher).

    Counts anonymous and shared memory, not the page cache of files; a
    shared-memory segment mapped by two processes counts twice.
    """

    def __init__(self, pid: int, include_root: bool, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.pid, self.include_root, self.interval = pid, include_root, interval
        self.peak = 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.interval):
            pids = descendants(self.pid) + ([self.pid] if self.include_root else [])
            self.peak = max(self.peak, sum(_ram(p) for p in pids))

    def stop(self) -> int:
        self._done.set()
        self.join()
        return self.peak


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(common.SRC), str(HERE), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("SHARDCKPT_LOG_LEVEL", "WARNING")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def command(case: Case, extra: list[str]) -> list[str]:
    script = str(HERE / case.script)
    if case.nproc:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={case.nproc}",
                script, *extra]
    return [sys.executable, script, *extra]


def shown(cmd: list[str], names: dict[str, str] | None = None) -> str:
    """A command as a reader would type it from the repository root, temporary paths by ``names``."""
    names = names or {}
    out = ["python" if c == sys.executable else names[c] if c in names
           else os.path.relpath(c, common.ROOT) if c.startswith(str(common.ROOT)) else c for c in cmd]
    return shlex.join(out)


ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Timeout\w*|Interrupt)): .*")


def error_from_log(log: str) -> str:
    """The last exception line of a failed run (torchrun's own summary lines left out)."""
    found = [m.group(0).strip() for line in log.splitlines() if (m := ERROR_LINE.match(line.strip()))
             and "ChildFailedError" not in line and "SignalException" not in line]
    return found[-1] if found else (log.strip().splitlines() or ["no output"])[-1]


def _kill_group(pid: int) -> None:
    """End a child that ran out of time, with everything it started (its own session)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_child(cmd: list[str], timeout: float, verbose: bool, log_path: Path, include_root: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=common.ROOT, env=child_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        sampler = RamSampler(proc.pid, include_root)
        sampler.start()
        timer = threading.Timer(timeout, _kill_group, (proc.pid,))
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                if verbose or line.lstrip().startswith(("round ", "skipped ")):
                    print("    " + line.rstrip(), flush=True)
            rc = proc.wait()
        finally:
            timer.cancel()
            peak = sampler.stop()
    wall = time.perf_counter() - t0
    text = log_path.read_text(errors="replace")
    out = {"cmd": shown(cmd), "rc": rc, "wall_s": round(wall, 2), "host_peak_bytes": peak}
    if rc != 0:
        out["error"] = f"timed out after {timeout:.0f} s" if wall >= timeout else error_from_log(text)
        out["log_tail"] = text[-4000:]
    return out


# -------------------------------------------------------------------- cases

def sizes_for(case: Case, args: argparse.Namespace) -> list[float | None]:
    if case.sizes == "local":
        return args.sizes
    if case.sizes == "remote":
        return args.remote_sizes
    return [None]


def room(case: Case, gib: float, scratch: str) -> str | None:
    """Why this size cannot run here (RAM or scratch space), or None."""
    need = case.memory * gib * common.GIB
    if common.mem_available() < need + common.GIB:
        return (f"needs about {common.fmt_bytes(need)} of RAM (+1 GiB); {common.fmt_bytes(common.mem_available())} "
                "available")
    free = os.statvfs(scratch)
    if free.f_bavail * free.f_frsize < case.disk * gib * common.GIB + common.GIB:
        return f"needs about {common.fmt_bytes(case.disk * gib * common.GIB)} free in {scratch}"
    return None


def tools_of(case: Case) -> dict[str | None, str]:
    if not case.per_tool:
        return {None: "all"}
    from bench_save_blocking import TOOLS

    return dict(TOOLS)


def predicted_peak(history: list[tuple[int, int]], size: int) -> float | None:
    """RAM peak at ``size`` extrapolated from the peaks at smaller sizes (linear; one point: proportional)."""
    points = sorted(p for p in history if p[0] < size and p[1] > 0)
    if not points:
        return None
    if len(points) == 1:
        return points[0][1] * size / points[0][0]
    (s1, p1), (s2, p2) = points[-2:]
    return p2 + max((p2 - p1) / (s2 - s1), 0.0) * (size - s2)


def too_big(history: list[tuple[int, int]], size: int) -> str | None:
    """Why running at ``size`` would risk exhausting the RAM, judged by the smaller sizes; or None."""
    peak = predicted_peak(history, size)
    have = common.mem_available()
    if peak is None or 1.1 * peak + common.GIB <= have:
        return None
    seen = ", ".join(f"{common.fmt_bytes(p)} at {common.fmt_size(s)}" for s, p in sorted(history))
    return (f"the RAM peaks of the smaller states ({seen}) extrapolate to about {common.fmt_bytes(peak)} "
            f"here; {common.fmt_bytes(have)} available")


def run_size(case: Case, gib: float | None, args: argparse.Namespace, work: Path,
             history: dict[str | None, list[tuple[int, int]]]) -> tuple[dict, list[dict]]:
    size_bytes = int((gib or 0) * common.GIB)
    invocations: list[dict] = []
    parts: list[dict] = []
    reason = room(case, gib, args.scratch) if gib is not None else None
    if reason is not None:
        result = common.new_result(case.name, size_bytes)
        common.add_skip(result, "every tool", reason)
        return result, invocations
    for tool, label in tools_of(case).items():
        if gib is not None and (reason := too_big(history.get(tool, []), size_bytes)) is not None:
            skipped = common.new_result(case.name, size_bytes)
            common.add_skip(skipped, label if tool else "every tool", reason)
            parts.append(skipped)
            continue
        with common.scratch(case.name, args.scratch) as scratch:
            out = work / f"{case.name}-{gib}-{tool}.json"
            extra = [*(["--gib", str(gib)] if gib is not None else []), *(["--tool", tool] if tool else []),
                     *case.args(args), "--json", str(out)]
            extra += ["--dir", str(scratch)]
            cmd = command(case, extra)
            display = shown(cmd, {str(out): "RESULT.json", str(scratch): "SCRATCH"})
            print(f"  $ {display}", flush=True)
            inv = run_child(cmd, args.timeout, args.verbose, work / f"{out.stem}.log", include_root=not case.nproc)
            inv["cmd"] = display
        inv.update(size_bytes=size_bytes, tool=tool)
        invocations.append(inv)
        history.setdefault(tool, []).append((size_bytes, inv["host_peak_bytes"]))
        if inv["rc"] == 0 and out.exists():
            got = json.loads(out.read_text())
            part = got if isinstance(got, dict) else got[0]
            if case.per_tool:
                for row in part["rows"]:
                    row["extra"]["host_peak_bytes"] = inv["host_peak_bytes"]
            parts.append(part)
        else:
            failed = common.new_result(case.name, size_bytes)
            common.add_skip(failed, label, inv.get("error") or f"exit status {inv['rc']}, no result")
            parts.append(failed)
    result = common.merge(parts)
    if not any(p["rows"] for p in parts):
        result["size_bytes"] = size_bytes
    return result, invocations


def case_command(case: Case, args: argparse.Namespace) -> str:
    """run.py restricted to this case, with this run's options."""
    argv = ["python", "benchmarks/run.py", *(["--quick"] if args.quick else []), "--only", case.name]
    if case.sizes == "local" and args.sizes_given:
        argv += ["--sizes", ",".join(f"{s:g}" for s in args.sizes)]
    if case.sizes == "remote" and args.remote_sizes_given:
        argv += ["--remote-sizes", ",".join(f"{s:g}" for s in args.remote_sizes)]
    if args.repeats:
        argv += ["--repeats", str(args.repeats)]
    if case.name == "training" and args.every != 5:
        argv += ["--every", str(args.every)]
    return shlex.join(argv)


def run_case(case: Case, order: int, args: argparse.Namespace, work: Path, run_command: str) -> dict:
    print(f"\n== {case.name}: {case.title}", flush=True)
    doc: dict[str, Any] = {
        "case": case.name, "order": order, "title": case.title, "what": case.what,
        "command": case_command(case, args), "run_command": run_command, "quick": args.quick,
        "date": common.now_utc(), "hardware": common.hardware(args.scratch), "git": common.git_info(),
        "plot": case.plot, "results": [], "invocations": [],
    }
    path = Path(args.out) / f"{case.name}.json"
    history: dict[str | None, list[tuple[int, int]]] = {}  # RAM peaks per tool, to stop before one will not fit
    for gib in sorted(sizes_for(case, args), key=lambda g: g or 0):
        result, invocations = run_size(case, gib, args, work, history)
        doc["results"].append(result)
        doc["invocations"] += invocations
        doc["finished"] = common.now_utc()
        common.write_json(path, doc)  # after every size: a long run that dies keeps what it measured
        print("\n" + "\n".join(common.table([result])), flush=True)
        for skipped in result["skipped"]:
            print(f"  skipped: {skipped['tool']}: {skipped['reason']}", flush=True)
    return doc


def parse_sizes(text: str) -> list[float]:
    try:
        sizes = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"sizes are GiB separated by commas, got {text!r}") from None
    if not sizes or any(s <= 0 for s in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats: minutes, numbers not quotable")
    parser.add_argument("--sizes", type=parse_sizes, help="state sizes in GiB for the local-disk cases (default 1,4,8)")
    parser.add_argument("--remote-sizes", type=parse_sizes,
                        help="state sizes in GiB for the S3 cases (default 0.125,0.25,0.5; moto keeps them in RAM)")
    parser.add_argument("--only", help=f"comma-separated cases: {', '.join(BY_NAME)}")
    parser.add_argument("--repeats", type=int, help="timed repeats per tool (default 3, --quick 2)")
    parser.add_argument("--every", type=int, default=5, help="training case: checkpoint every N steps (default 5)")
    parser.add_argument("--out", default=str(HERE / "results"), help="where results go (default benchmarks/results)")
    parser.add_argument("--scratch", default=tempfile.gettempdir(),
                        help="where the cases write their checkpoints (the disk under test; default the system's temp)")
    parser.add_argument("--readme", help="also put a summary between the perf markers of this file")
    parser.add_argument("--timeout", type=float, help="seconds per subprocess (default 600, full sizes 3600)")
    parser.add_argument("--verbose", "-v", action="store_true", help="show every line the benchmarks print")
    args = parser.parse_args(argv)
    args.sizes_given, args.remote_sizes_given = args.sizes is not None, args.remote_sizes is not None
    if args.sizes is None:
        args.sizes = QUICK_SIZES if args.quick else FULL_SIZES
    if args.remote_sizes is None:
        args.remote_sizes = QUICK_REMOTE if args.quick else FULL_REMOTE
    if args.timeout is None:
        args.timeout = 600.0 if args.quick else 3600.0
    names = [n.strip() for n in args.only.split(",")] if args.only else list(BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    if args.readme and not os.path.isfile(args.readme):
        parser.error(f"--readme {args.readme}: no such file")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    run_command = shlex.join(["python", "benchmarks/run.py", *(sys.argv[1:] if argv is None else argv)])

    t0 = time.perf_counter()
    hw = common.hardware(args.scratch)
    print(f"{hw['cpu']}, {hw['cores']} cores, {hw['ram']} RAM, torch {hw['torch']}; scratch {args.scratch} "
          f"({hw['disk']}); load average {hw['loadavg'][0]:.2f}", flush=True)
    if hw["loadavg"][0] > 0.25 * (hw["cores"] or 1):
        print("warning: the machine is busy; ratios will be noisy", flush=True)
    with tempfile.TemporaryDirectory(prefix="shardckpt-bench-run-") as work:
        for case in CASES:
            if case.name in names:
                run_case(case, CASES.index(case), args, Path(work), run_command)
    wall = time.perf_counter() - t0
    written = report.write(args.out, readme=args.readme)
    print(f"\nwall time {wall:.0f} s; wrote {', '.join(written)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
