"""Remote tier throughput against tuned boto3, on the same endpoint and the same files.

    python benchmarks/bench_remote.py [--size-mb 256] [--files 4] [--repeats 3]
                                      [--endpoint URL --bucket NAME]

Without ``--endpoint`` a moto S3 server is started on 127.0.0.1 (a free
port). One checkpoint (a single-process save split over ``--files`` shard
files) is written locally once; then, alternating, ``--repeats`` times:

* upload:  boto3 ``upload_file`` per file with a tuned ``TransferConfig``
  (multipart at the part size, ``max_concurrency`` = the concurrency)
  vs. shardckpt's ``push_step`` (upload + verification + node marker +
  manifest = a remote commit) of the same step;
* restore: boto3 ``download_file`` of the same objects (same TransferConfig)
  followed by a local ``Checkpointer.load`` vs. ``Checkpointer.load`` on an
  empty local dir with ``remote=`` (fetch + checksum + load).

Reports medians in MB/s and seconds, and the median of the per-round
(paired) ratios against the targets (upload >= 1.0x boto3 throughput,
restore <= 1.2x raw download + local load). moto runs as its own process.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import shardckpt  # noqa: E402
from shardckpt import layout, remote, remote_commit  # noqa: E402


def make_state(size_mb: int) -> dict:
    n = max(1, int(size_mb * (1 << 20) / 4 / 8))
    torch.manual_seed(0)
    return {"model": torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n)) for _ in range(8)])}


def fresh_state(size_mb: int) -> dict:
    n = max(1, int(size_mb * (1 << 20) / 4 / 8))
    return {"model": torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n)) for _ in range(8)])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--files", type=int, default=4, help="shard files (DCP writer threads)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--part-mb", type=int, default=32)
    parser.add_argument("--endpoint", help="existing S3 endpoint (default: start moto on 127.0.0.1)")
    parser.add_argument("--bucket", default="shardckpt-bench")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    logging.getLogger("shardckpt").setLevel(logging.WARNING)

    server = None
    if args.endpoint is None:
        # moto in its own process: the client's threads do not share a GIL with the server's.
        import subprocess
        import urllib.request

        from helpers import free_port
        from s3server import CREDENTIALS

        port = free_port()
        moto = Path(sys.executable).with_name("moto_server")
        server = subprocess.Popen([str(moto), "-H", "127.0.0.1", "-p", str(port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        endpoint = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).read()
                break
            except OSError:
                time.sleep(0.1)
        os.environ.update(CREDENTIALS)
    else:
        endpoint = args.endpoint
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    import boto3
    from boto3.s3.transfer import TransferConfig

    client = boto3.client("s3", endpoint_url=endpoint, region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))
    try:
        client.create_bucket(Bucket=args.bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    part = args.part_mb << 20
    tcfg = TransferConfig(multipart_threshold=2 * part, multipart_chunksize=part, max_concurrency=args.concurrency, use_threads=True)
    opts = remote.TransferOptions(endpoint_url=endpoint, concurrency=args.concurrency, part_size=part, multipart_threshold=2 * part)

    work = Path(tempfile.mkdtemp(prefix="shardckpt-bench-"))
    try:
        src = work / "src"
        state = make_state(args.size_mb)
        ckpt = shardckpt.Checkpointer(local_dir=str(src), io_threads=args.files, keep_last=None, preemption_signals=())
        ckpt.save(state, 1).wait()
        ckpt.close()
        step_dir = src / layout.step_dirname(1)
        manifest = layout.read_manifest(str(step_dir))
        names = sorted(manifest.files) + [layout.MANIFEST_NAME]
        total = sum(os.path.getsize(step_dir / n) for n in names)
        expected = {k: v.detach().clone() for k, v in state["model"].state_dict().items()}

        def clear(prefix: str) -> None:
            store = remote.open_store(f"s3://{args.bucket}/{prefix}", opts)
            store.delete_prefix("", remote.Deadline(600))
            store.close()

        def boto_upload(prefix: str) -> float:
            t0 = time.perf_counter()
            for n in names:
                client.upload_file(str(step_dir / n), args.bucket, f"{prefix}/{layout.step_dirname(1)}/{n}", Config=tcfg)
            return time.perf_counter() - t0

        def ours_upload(prefix: str) -> float:
            for marker in step_dir.glob(remote_commit.UPLOADED_NAME):
                marker.unlink()
            store = remote.open_store(f"s3://{args.bucket}/{prefix}", opts)
            t0 = time.perf_counter()
            result = remote_commit.push_step(store, str(src), 1, node="bench", policy=None)
            took = time.perf_counter() - t0
            store.close()
            if result.state != remote_commit.COMMITTED:
                raise RuntimeError(f"push_step did not commit: {result}")
            return took

        def check(st: dict) -> None:
            got = st["model"].state_dict()
            for k, v in expected.items():
                if not torch.equal(got[k], v):
                    raise RuntimeError(f"restored {k} differs")

        def boto_restore(prefix: str) -> float:
            dest = work / "raw" / layout.step_dirname(1)
            shutil.rmtree(work / "raw", ignore_errors=True)
            dest.mkdir(parents=True)
            st = fresh_state(args.size_mb)
            t0 = time.perf_counter()
            for n in names:
                client.download_file(args.bucket, f"{prefix}/{layout.step_dirname(1)}/{n}", str(dest / n), Config=tcfg)
            c = shardckpt.Checkpointer(local_dir=str(work / "raw"), preemption_signals=())
            c.load(st)
            took = time.perf_counter() - t0
            c.close()
            check(st)
            return took

        def ours_restore(prefix: str) -> float:
            shutil.rmtree(work / "new", ignore_errors=True)
            st = fresh_state(args.size_mb)
            t0 = time.perf_counter()
            c = shardckpt.Checkpointer(
                local_dir=str(work / "new"), remote=f"s3://{args.bucket}/{prefix}", uploader="off",
                endpoint_url=endpoint, transfer_concurrency=args.concurrency, part_size=part, preemption_signals=(),
            )
            c.load(st)
            took = time.perf_counter() - t0
            c.close()
            check(st)
            return took

        results: dict[str, list[float]] = {"boto3_upload": [], "shardckpt_upload": [], "boto3_restore": [], "shardckpt_restore": []}
        # Warm-up (not counted): first requests, allocator growth in the server.
        for fn, prefix in ((boto_upload, "raw"), (ours_upload, "ours")):
            clear(prefix)
            fn(prefix)
        boto_restore("raw")
        ours_restore("ours")
        for i in range(args.repeats):
            order = [("boto3_upload", boto_upload, "raw"), ("shardckpt_upload", ours_upload, "ours")]
            if i % 2:
                order.reverse()
            for name, fn, prefix in order:
                clear(prefix)
                results[name].append(fn(prefix))
            order = [("boto3_restore", boto_restore, "raw"), ("shardckpt_restore", ours_restore, "ours")]
            if i % 2:
                order.reverse()
            for name, fn, prefix in order:
                results[name].append(fn(prefix))
            print(f"round {i + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in results.items()), flush=True)
        med = {k: statistics.median(v) for k, v in results.items()}
        mb = total / 1e6
        # Paired: each round ran both sides back to back (order alternating).
        up_ratio = statistics.median(b / o for b, o in zip(results["boto3_upload"], results["shardckpt_upload"]))
        re_ratio = statistics.median(o / b for b, o in zip(results["boto3_restore"], results["shardckpt_restore"]))
        print()
        print(f"{mb:.0f} MB in {len(names)} files, part {args.part_mb} MiB, concurrency {args.concurrency}, "
              f"endpoint {'moto_server on 127.0.0.1' if server else remote.safe_url(endpoint)}, median of {args.repeats} rounds")
        print()
        print("| operation | tuned boto3 | shardckpt | ratio | target |")
        print("|---|---|---|---|---|")
        print(f"| upload (MB/s) | {mb / med['boto3_upload']:.0f} | {mb / med['shardckpt_upload']:.0f} | "
              f"{up_ratio:.2f}x throughput | >= 1.0x {'(met)' if up_ratio >= 1.0 else '(NOT met)'} |")
        print(f"| restore (s) | {med['boto3_restore']:.2f} (download + load) | {med['shardckpt_restore']:.2f} | "
              f"{re_ratio:.2f}x time | <= 1.2x {'(met)' if re_ratio <= 1.2 else '(NOT met)'} |")
        if args.json:
            Path(args.json).write_text(json.dumps({"bytes": total, "files": len(names), "runs": results, "median": med,
                                                   "upload_ratio": up_ratio, "restore_ratio": re_ratio}, indent=1))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if server is not None:
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
