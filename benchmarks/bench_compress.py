"""Compressed uploads against a raw upload of the same bytes through the same link (case ``compress``).

    python benchmarks/bench_compress.py [--size-mb 256] [--cap-mb 100] [--repeats 2]
        [--states bf16_adam,bf16,fp32_adam] [--files 4] [--json FILE]

moto's S3 server in its own process on 127.0.0.1; a throttling proxy (tests/faultproxy.py
with its bandwidth cap, in a process of its own) in front of it caps each direction at
``--cap-mb`` MB/s (the "capped" link); the "loopback" link goes to moto directly. Three
states, each saved once as a committed local step (``--files`` shard files):

  bf16_adam   bf16 weights, their fp32 master copy and AdamW moments (after 3 steps)
  bf16        bf16 weights alone
  fp32_adam   fp32 weights and AdamW moments

Per state and link, round-robin after one warm-up call each (``common.compare``):

  boto3 upload (floor)                the step's files through one boto3 transfer manager
  shardckpt push, compression off     ``shardckpt push`` of the step (upload, verify, marker, manifest)
  shardckpt push, bytegroup-zstd      the same, every shard file compressed
  shardckpt push, auto                the same with ``auto`` (decided by the warm-up call, as an
                                      uploader decides once per process)

and on the capped link the restore onto an empty disk (``Checkpointer.load`` from the remote)
of the compressed and the uncompressed copy. Beside them: bytes stored / step bytes, and the
CPU seconds per GiB to compress and to decompress the step's files (one thread).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common  # noqa: E402  (puts src/ on sys.path)
import torch

import shardckpt  # noqa: E402
from shardckpt import cli, stores  # noqa: E402
from shardckpt.format import codec, layout  # noqa: E402
from shardckpt.tiers import compressed, remote_commit  # noqa: E402

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
            compressed._decided.clear()  # auto decides anew for this link (in the warm-up call)
            common.compare(result, tools, args.repeats, group=f"upload, {group}")
            decision = next(iter(compressed._decided.values()), None)
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
                              cores=os.cpu_count(), workers=compressed.WORKERS)
        result["notes"].append(f"{kind}: stored / step bytes {ratio:.3f}; CPU s/GiB compress {enc:.2f}, decompress "
                               f"{dec:.2f} (one thread); {compressed.WORKERS} compression thread(s) on "
                               f"{os.cpu_count()} cores; link cap {args.cap_mb} MB/s each way")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=256, help="state size in MiB (default 256)")
    parser.add_argument("--cap-mb", type=float, default=100.0, help="the capped link, MB/s each way (default 100)")
    parser.add_argument("--states", default="bf16_adam,bf16,fp32_adam")
    parser.add_argument("--files", type=int, default=4, help="shard files per step (the writer threads)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=common.CONCURRENCY)
    parser.add_argument("--part-mb", type=int, default=common.PART // common.MIB)
    parser.add_argument("--bucket", default="shardckpt-bench")
    parser.add_argument("--dir", default=None, help="where the scratch directory goes (default: the system's temp)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = []
    with common.moto_server(args.bucket) as endpoint, throttled(endpoint, args.cap_mb * 1e6) as capped, \
            common.scratch("compress", args.dir) as root:
        for kind in args.states.split(","):
            result = run_state(args, endpoint, capped, root, kind)
            common.emit(result, None)
            results.append(result)
    if args.json:
        common.write_json(args.json, results[0] if len(results) == 1 else results)


if __name__ == "__main__":
    main()
