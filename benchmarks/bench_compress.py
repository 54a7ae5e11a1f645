"""Compressed uploads against plain ones through the same link (case ``compress``).

    python benchmarks/bench_compress.py [--case first|push|all] [--size-mb 256] [--caps-mb 40,100]
        [--repeats 3] [--states bf16_adam,bf16,fp32_adam] [--files 4] [--json FILE]

moto's S3 server in its own process on 127.0.0.1; throttling proxies (tests/faultproxy.py with its
bandwidth cap, each in a process of its own) in front of it cap each direction at each of
``--caps-mb`` MB/s (the "capped" links); the "loopback" link goes to moto directly. The machine's
one-minute load average is recorded with every run (column ``load_1m``): on shared cores the times
spread with what else runs.

``--case first`` (issue 39's figures): a process's first and only save, with the default options,
as a spot job that is preempted before its second save sees it. Each run is a fresh Python process
(``first-save``, below) that builds a bf16 + fp32 master + AdamW state of ``--size-mb``, then times
``save(state, 1)`` (sync mode, ``--files`` shard files, the trainer's uploader started by that save)
until ``step_1/shardckpt.json`` is in the bucket (polled every 20 ms): the time to remote-durable.
Per link, round-robin after one warm-up run each:

  remote_compression="off" (floor)   nothing compressed
  remote_compression="auto"          the default: the uploader measures the link as it starts,
                                     while the save is written (no decision kept from earlier runs)

with the bytes the step takes on the remote over its bytes (``stored_ratio``) and ``save()``'s own
time (the local commit, ``local_commit_s``).

``--case push``: three states, each saved once as a committed local step (``--files`` shard files):

  bf16_adam   bf16 weights, their fp32 master copy and AdamW moments (after 3 steps)
  bf16        bf16 weights alone
  fp32_adam   fp32 weights and AdamW moments

Per state and link (the first cap, and loopback), round-robin after one warm-up call each:

  boto3 upload (floor)                the step's files through one boto3 transfer manager
  shardckpt push, compression off     ``shardckpt push`` of the step (upload, verify, marker, manifest)
  shardckpt push, bytegroup-zstd      the same, every shard file compressed
  shardckpt push, auto                the same with ``auto`` (decided by the warm-up call, kept after)

and on the capped link the restore onto an empty disk (``Checkpointer.load`` from the remote)
of the compressed and the uncompressed copy. Beside them: bytes stored / step bytes, and the
CPU seconds per GiB to compress and to decompress the step's files (one thread).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import common  # noqa: E402  (puts src/ on sys.path)
import torch

import shardckpt  # noqa: E402
from shardckpt import cli, stores  # noqa: E402
from shardckpt.format import codec, layout  # noqa: E402
from shardckpt.remote import auto_compress, compressed  # noqa: E402
from shardckpt.remote import commit as remote_commit  # noqa: E402

TESTS = Path(__file__).resolve().parent.parent / "tests"
PROXY = (
    "import sys; sys.path.insert(0, {tests!r})\n"
    "from faultproxy import FaultProxy\n"
    "p = FaultProxy({upstream!r}); p.cap_bytes_per_s = {cap!r}\n"
    "print(p.port, flush=True); sys.stdin.read()\n"
)


@contextlib.contextmanager
def throttled(upstream: str, cap: float):
    proc = subprocess.Popen([sys.executable, "-c", PROXY.format(tests=str(TESTS), upstream=upstream, cap=cap)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield f"http://127.0.0.1:{int(proc.stdout.readline())}"
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def make_state(kind: str, nbytes: int) -> dict[str, Any]:
    """A training state of about ``nbytes``: real AdamW moments after 3 steps of a linear model."""
    per = {"bf16_adam": 2 + 4 * 3, "bf16": 2, "fp32_adam": 4 * 3}[kind]
    width = 4096
    rows = max(8, nbytes // per // width)
    torch.manual_seed(0)
    master = torch.nn.Linear(width, rows, bias=False)
    with torch.no_grad():
        master.weight.normal_(0, 0.02)
    optim = torch.optim.AdamW(master.parameters(), lr=1e-3)
    for _ in range(3):
        master(torch.randn(16, width)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    bf16 = torch.nn.Linear(width, rows, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        bf16.weight.copy_(master.weight)
    if kind == "bf16":
        return {"model": bf16}
    if kind == "fp32_adam":
        return {"model": master, "optimizer": optim}
    return {"model": bf16, "master": master, "optimizer": optim}


class Bench:
    def __init__(self, args: argparse.Namespace, endpoint: str, root: Path, kind: str) -> None:
        from boto3.s3.transfer import create_transfer_manager

        self.args, self.endpoint, self.root, self.kind = args, endpoint, root, kind
        self.bucket = args.bucket
        self.part = args.part_mb * common.MIB
        self.state = make_state(kind, args.size_mb * common.MIB)
        self.src = root / f"src-{kind}"
        self.step_dir, self.names, self.step_bytes = common.saved_step(self.src, self.state, args.files)
        self.runs = 0
        self.managers: dict[str, Any] = {}
        self.admin = common.s3_client(endpoint)
        self.create = create_transfer_manager

    def manager(self, endpoint: str) -> Any:
        if endpoint not in self.managers:
            self.managers[endpoint] = self.create(common.s3_client(endpoint),
                                                  common.transfer_config(self.part, self.args.concurrency))
        return self.managers[endpoint]

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def clear(self) -> None:
        """Untimed: drop earlier runs' objects (moto holds them in RAM)."""
        keys = []
        for page in self.admin.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
            keys += [o["Key"] for o in page.get("Contents", []) if not o["Key"].startswith("keep/")]
        for i in range(0, len(keys), 1000):
            self.admin.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})
        self.runs += 1

    def push(self, endpoint: str, compression: str, prefix: str | None = None) -> None:
        prefix = prefix or f"push/{self.runs}"
        argv = ["push", "--local", str(self.src), "--remote", self.url(prefix), "--step", "1",
                "--endpoint-url", endpoint, "--concurrency", str(self.args.concurrency),
                "--part-size", str(self.part), "--compression", compression]
        with contextlib.redirect_stdout(io.StringIO()) as said:
            code = cli.main(argv)
        if code != 0:
            raise RuntimeError(f"shardckpt {' '.join(argv)} exited {code}: {said.getvalue().strip()}")

    def upload(self, endpoint: str) -> None:
        manager = self.manager(endpoint)
        futures = [manager.upload(str(self.step_dir / n), self.bucket, f"raw/{self.runs}/{n}") for n in self.names]
        for f in futures:
            f.result()

    def restore(self, endpoint: str, prefix: str) -> None:
        target = common.fresh_dir(self.root / "restore")
        ckpt = shardckpt.Checkpointer(local_dir=str(target), remote=self.url(prefix), uploader="off",
                                      endpoint_url=endpoint, transfer_concurrency=self.args.concurrency,
                                      part_size=self.part, preemption_signals=())
        try:
            if ckpt.load(self.state) != 1:
                raise RuntimeError(f"load() from {prefix} did not restore step 1")
        finally:
            ckpt.close()

    def stored_ratio(self, prefix: str) -> float:
        store = stores.open_store(self.url(prefix), stores.TransferOptions(endpoint_url=self.endpoint))
        try:
            manifest = remote_commit.remote_manifest(store, 1, stores.Deadline(60))
        finally:
            store.close()
        return compressed.stored_bytes(manifest) / self.step_bytes

    def cpu_per_gib(self) -> tuple[float, float]:
        """CPU seconds per GiB to encode and to decode the step's shard files, one thread."""
        enc = dec = 0.0
        total = 0
        for name in self.names:
            if name.endswith(".distcp"):
                data = (self.step_dir / name).read_bytes()
                total += len(data)
                for i in range(0, len(data), layout.CHUNK_BYTES):
                    piece = data[i:i + layout.CHUNK_BYTES]
                    t0 = time.process_time()
                    stored = codec.encode_chunk(piece)
                    t1 = time.process_time()
                    codec.decode_chunk(stored, len(piece))
                    enc += t1 - t0
                    dec += time.process_time() - t1
        return enc / (total / common.GIB), dec / (total / common.GIB)

    def close(self) -> None:
        for manager in self.managers.values():
            manager.shutdown()


def run_state(args: argparse.Namespace, endpoint: str, capped: str, root: Path, kind: str) -> dict:
    bench = Bench(args, endpoint, root, kind)
    result = common.new_result(f"compress_{kind}", bench.step_bytes, repeats=args.repeats)
    try:
        for group, link in (("capped", capped), ("loopback", endpoint)):
            tools = [
                common.Tool("boto3 upload (floor)", lambda link=link: bench.upload(link), before=bench.clear,
                            floor=True),
                common.Tool("shardckpt push, compression off", lambda link=link: bench.push(link, "off"),
                            before=bench.clear),
                common.Tool("shardckpt push, bytegroup-zstd", lambda link=link: bench.push(link, "bytegroup-zstd"),
                            before=bench.clear),
                common.Tool("shardckpt push, auto", lambda link=link: bench.push(link, "auto"), before=bench.clear),
            ]
            auto_compress.forget()  # auto decides anew for this link (in the warm-up call)
            common.compare(result, tools, args.repeats, group=f"upload, {group}")
            store = stores.open_store(bench.url("push"), stores.TransferOptions(endpoint_url=link,
                                                                                   compression="auto"))
            decision = auto_compress.decision(store, auto_compress.links_path(str(bench.src)))
            store.close()
            if decision is not None:
                result["notes"].append(f"auto on the {group} link: {decision.text()}")
        bench.clear()
        bench.push(endpoint, "off", "keep/plain")
        bench.push(endpoint, "bytegroup-zstd", "keep/zc")
        restore = [
            common.Tool("restore, uncompressed copy (floor)", lambda: bench.restore(capped, "keep/plain"), floor=True),
            common.Tool("restore, compressed copy", lambda: bench.restore(capped, "keep/zc")),
        ]
        common.compare(result, restore, args.repeats, group="restore, capped")
        ratio = bench.stored_ratio("keep/zc")
        enc, dec = bench.cpu_per_gib()
        result["info"].update(stored_ratio=ratio, cpu_s_per_gib_compress=enc, cpu_s_per_gib_decompress=dec,
                              cores=os.cpu_count(), workers=auto_compress.WORKERS)
        result["notes"].append(f"{kind}: stored / step bytes {ratio:.3f}; CPU s/GiB compress {enc:.2f}, decompress "
                               f"{dec:.2f} (one thread); {auto_compress.WORKERS} compression thread(s) on "
                               f"{os.cpu_count()} cores; link cap {args.caps[0]} MB/s each way; load average "
                               f"{os.getloadavg()[0]:.1f}")
        bench.admin.delete_objects(Bucket=bench.bucket, Delete={"Objects": [
            {"Key": k} for k in _keys(bench.admin, bench.bucket, "keep/")]})
    finally:
        bench.close()
    return result


def _keys(client: Any, bucket: str, prefix: str) -> list[str]:
    out = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out += [o["Key"] for o in page.get("Contents", [])]
    return out or ["none"]


# ---------------------------------------------------------------- the first save of a process


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far, its threads included; 0 when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_pids(*names: str) -> list[int]:
    """The other processes on this host whose command line names one of ``names`` (a port, a directory)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(n in arg for n in names for arg in argv) and int(pid) != os.getpid():
            found.append(int(pid))
    return found


def first_save(argv: list[str]) -> None:
    """The child of ``--case first``: one process, one save; prints what it measured as JSON."""
    parser = argparse.ArgumentParser(prog="bench_compress.py first-save")
    for name in ("--local", "--url", "--link", "--direct", "--mode", "--state"):
        parser.add_argument(name, required=True)
    for name in ("--size-mb", "--files", "--concurrency", "--part-mb"):
        parser.add_argument(name, type=int, required=True)
    args = parser.parse_args(argv)
    state = make_state(args.state, args.size_mb * common.MIB)
    bucket, _, prefix = args.url.removeprefix("s3://").partition("/")
    client = common.s3_client(args.direct)  # polled directly, not through the capped link
    key = f"{prefix}/{layout.step_dirname(1)}/{layout.MANIFEST_NAME}"
    ckpt = shardckpt.Checkpointer(local_dir=args.local, remote=args.url, endpoint_url=args.link, uploader="auto",
                                  mode="sync", io_threads=args.files, keep_last=None, remote_compression=args.mode,
                                  transfer_concurrency=args.concurrency, part_size=args.part_mb * common.MIB,
                                  preemption_signals=(), drain_timeout_s=900)
    load = os.getloadavg()[0]
    t0, cpu0 = time.perf_counter(), time.process_time()
    ckpt.save(state, 1)
    local = time.perf_counter() - t0
    while True:
        try:
            client.head_object(Bucket=bucket, Key=key)
            break
        except client.exceptions.ClientError:
            if time.perf_counter() - t0 > 900:
                raise TimeoutError(f"{key} not in the bucket 900 s after save(); status: {ckpt.status()}")
            time.sleep(0.02)
    took, trainer_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    uploader_cpu = sum(cpu_s(pid) for pid in server_pids(args.local))  # the uploader: its command line names it
    ckpt.close()
    store = stores.open_store(args.url, stores.TransferOptions(endpoint_url=args.direct))
    try:
        manifest = remote_commit.remote_manifest(store, 1, stores.Deadline(60))
    finally:
        store.close()
    said = (Path(args.local) / ".shardckpt-remote" / "uploader.log").read_text()
    decided = [ln.split("remote_compression=auto for ", 1)[1] for ln in said.splitlines()
               if "remote_compression=auto" in ln]
    print(json.dumps({"seconds": took, "local_commit_s": local, "load_1m": max(load, os.getloadavg()[0]),
                      "trainer_cpu_s": trainer_cpu, "uploader_cpu_s": uploader_cpu,
                      "stored_ratio": compressed.stored_bytes(manifest) / manifest.total_bytes,
                      "decision": decided[-1].split(": ", 1)[1] if decided else ""}))


def run_first(args: argparse.Namespace, endpoint: str, links: dict[str, str], root: Path) -> dict:
    """``--case first``: per link, ``off`` against ``auto``, each run a process of its own."""
    per = 2 + 4 * 3  # bytes per parameter of bf16_adam: what make_state sizes the state by
    result = common.new_result("compress_first_save", args.size_mb * common.MIB // per * per, repeats=args.repeats,
                               files=args.files, state="bf16_adam")
    admin = common.s3_client(endpoint)
    decisions: dict[str, list[str]] = {}

    def clear() -> None:
        """Untimed: drop earlier runs' objects (moto holds them in RAM) and their local directories."""
        keys = [o["Key"]
                for page in admin.get_paginator("list_objects_v2").paginate(Bucket=args.bucket, Prefix="first/")
                for o in page.get("Contents", [])]
        for i in range(0, len(keys), 1000):
            admin.delete_objects(Bucket=args.bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})
        common.fresh_dir(root / "first")

    servers = server_pids(*(f":{u.rsplit(':', 1)[1]}" for u in [endpoint, *links.values()]),
                          endpoint.rsplit(":", 1)[1])

    def one(group: str, link: str, mode: str) -> common.Measured:
        run = uuid.uuid4().hex[:8]
        before = sum(cpu_s(pid) for pid in servers)
        argv = [sys.executable, __file__, "first-save", "--local", str(root / "first" / run),
                "--url", f"s3://{args.bucket}/first/{run}", "--link", link, "--direct", endpoint, "--mode", mode,
                "--state", "bf16_adam", "--size-mb", str(args.size_mb), "--files", str(args.files),
                "--concurrency", str(args.concurrency), "--part-mb", str(args.part_mb)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"first-save exited {proc.returncode}: {proc.stderr[-2000:]}")
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        got["servers_cpu_s"] = sum(cpu_s(pid) for pid in servers) - before
        if got["decision"]:
            decisions.setdefault(group, []).append(got["decision"])
        return common.Measured(got["seconds"], {k: got[k] for k in (
            "stored_ratio", "local_commit_s", "load_1m", "trainer_cpu_s", "uploader_cpu_s", "servers_cpu_s")})

    for group, link in links.items():
        tools = [common.Tool('remote_compression="off" (floor)', lambda g=group, lk=link: one(g, lk, "off"),
                             before=clear, floor=True),
                 common.Tool('remote_compression="auto"', lambda g=group, lk=link: one(g, lk, "auto"), before=clear)]
        common.compare(result, tools, args.repeats, group=f"first save, {group}")
    clear()
    for group, said in decisions.items():
        result["notes"].append(f"auto on the {group} link decided, run by run: " + "; ".join(said))
    result["notes"].append(f"one save per process, {args.files} shard files, {auto_compress.WORKERS} compression "
                           f"thread(s) on {os.cpu_count()} cores; load_1m: the one-minute load average at the save; "
                           f"CPU seconds of the trainer (save to remote-durable), its uploader (from its start) and "
                           f"the S3 server and proxies (over the whole run)")
    return result


def main() -> None:
    if sys.argv[1:2] == ["first-save"]:
        first_save(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=("first", "push", "all"), default="all")
    parser.add_argument("--size-mb", type=int, default=256, help="state size in MiB (default 256)")
    parser.add_argument("--caps-mb", default="40,100", help="the capped links, MB/s each way (default 40,100)")
    parser.add_argument("--states", default="bf16_adam,bf16,fp32_adam", help="--case push: the states")
    parser.add_argument("--files", type=int, default=4, help="shard files per step (the writer threads)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=common.CONCURRENCY)
    parser.add_argument("--part-mb", type=int, default=common.PART // common.MIB)
    parser.add_argument("--bucket", default="shardckpt-bench")
    parser.add_argument("--dir", default=None, help="where the scratch directory goes (default: the system's temp)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    args.caps = [float(c) for c in args.caps_mb.split(",") if c]
    results = []
    with common.moto_server(args.bucket) as endpoint, contextlib.ExitStack() as stack, \
            common.scratch("compress", args.dir) as root:
        capped = {f"capped {cap:g} MB/s": stack.enter_context(throttled(endpoint, cap * 1e6)) for cap in args.caps}
        if args.case in ("first", "all"):
            result = run_first(args, endpoint, {**capped, "loopback": endpoint}, root)
            common.emit(result, None)
            results.append(result)
        if args.case in ("push", "all"):
            for kind in args.states.split(","):
                result = run_state(args, endpoint, next(iter(capped.values())), root, kind)
                common.emit(result, None)
                results.append(result)
    if args.json:
        common.write_json(args.json, results[0] if len(results) == 1 else results)


if __name__ == "__main__":
    main()
