"""The remote tier against tuned boto3 on the same endpoint (cases ``remote_restore``, ``remote_durable``).

    python benchmarks/bench_remote.py [--case restore|durable|all] [--size-mb 256 | --gib 0.25]
        [--repeats 3] [--files 4] [--concurrency 8] [--part-mb 32]
        [--endpoint URL --bucket NAME] [--dir DIR] [--json FILE]

Without ``--endpoint`` moto's S3 server runs on 127.0.0.1 (a free port) in a
process of its own, so that client threads and server do not share a GIL.
moto keeps every object in memory: keep states at 512 MiB or less. One
process saves a state of ``--size-mb`` (fp32, ``--files`` shard files) as a
committed local step; the tools then run round-robin, the order rotating
each round, after one warm-up call each (not counted).

``--case restore`` (remote_restore): an empty instance restores the step from the bucket.

  boto3 download + local load (floor)  every object of the step through one boto3 transfer
                                       manager (``download_file``: ``--part-mb`` parts,
                                       ``--concurrency`` in flight), then ``Checkpointer.load``
                                       of that directory with ``verify_on_load=False``
  shardckpt load from the remote       ``Checkpointer(local_dir=<empty>, remote=s3://...,
                                       uploader="off").load(state)``: fetch, verify, load
  shardckpt load from the remote, no verify   the same, ``verify_on_load=False``

``--case durable`` (remote_durable): the RPO of a spot user, from ``save()`` until
the step's manifest is on the remote; reported also as seconds per GiB and as
the largest state per node that fits a 30 s (GCP) and a 120 s (AWS) notice.

  boto3 upload (floor)            the committed step's files through one transfer manager
                                  (``upload_file``, same parts and concurrency)
  shardckpt push (CLI)            ``shardckpt push --step N`` of the committed step (upload,
                                  verify, node marker, manifest last)
  shardckpt save → remote commit  ``save(state, step)`` (sync mode) with the uploader process
                                  running (``uploader="auto"``) until ``step_<N>/shardckpt.json``
                                  is in the bucket (polled every 20 ms); "local commit" is when
                                  ``save()`` returned. Each shard file is uploaded as soon as it
                                  is written (``shardckpt.remote.early_upload``)
  ..., upload after the local commit   the same with the early upload off: every file goes up
                                  only once the step is committed locally
  dcp.async_save → s3 (FsspecWriter)  stock DCP straight to ``s3://`` through s3fs, until its
                                  future completes
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import common  # noqa: E402  (puts src/ on sys.path)

import shardckpt  # noqa: E402
from shardckpt import cli  # noqa: E402

NOTICES = {"fits_30s_gib": 30.0, "fits_120s_gib": 120.0}


class Bench:
    """The bucket, the client side and the committed source step both cases use."""

    def __init__(self, args: argparse.Namespace, endpoint: str, root: Path) -> None:
        from boto3.s3.transfer import create_transfer_manager

        self.args = args
        self.endpoint = endpoint
        self.bucket = args.bucket
        self.root = root
        self.part = args.part_mb * common.MIB
        self.client = common.s3_client(endpoint)
        self.manager = create_transfer_manager(self.client, common.transfer_config(self.part, args.concurrency))
        self.model, self.state, self.nbytes = common.sized_state(args.gib)
        self.src = root / "src"
        self.step_dir, self.names, self.step_bytes = common.saved_step(self.src, self.state, args.files)

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def transfer(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint, "transfer_concurrency": self.args.concurrency, "part_size": self.part}

    def keys(self, prefix: str) -> list[str]:
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix + "/"):
            out += [o["Key"] for o in page.get("Contents", [])]
        return out

    def delete(self, prefix: str) -> None:
        keys = self.keys(prefix)
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=key)
            return True
        except self.client.exceptions.ClientError:
            return False

    def push(self, prefix: str) -> None:
        # Uncompressed, as the floor's raw download reads the step's files under their own names (``auto``
        # may compress them on a fast machine: stored under other names, they would not be a step to load).
        argv = ["push", "--local", str(self.src), "--remote", self.url(prefix), "--step", "1",
                "--endpoint-url", self.endpoint, "--concurrency", str(self.args.concurrency),
                "--part-size", str(self.part), "--compression", "off"]
        with contextlib.redirect_stdout(io.StringIO()) as said:
            code = cli.main(argv)
        if code != 0:
            raise RuntimeError(f"shardckpt {' '.join(argv)} exited {code}: {said.getvalue().strip()}")

    def upload(self, prefix: str) -> None:
        futures = [self.manager.upload(str(self.step_dir / n), self.bucket, f"{prefix}/{self.step_dir.name}/{n}")
                   for n in self.names]
        for f in futures:
            f.result()

    def download(self, prefix: str, dest: Path) -> None:
        step_prefix = f"{prefix}/{self.step_dir.name}"
        futures = []
        for key in self.keys(step_prefix):
            target = dest / self.step_dir.name / key[len(step_prefix) + 1:]
            target.parent.mkdir(parents=True, exist_ok=True)
            futures.append(self.manager.download(self.bucket, key, str(target)))
        for f in futures:
            f.result()


def load_into(bench: Bench, local_dir: Path, **kwargs: Any) -> None:
    ckpt = shardckpt.Checkpointer(local_dir=str(local_dir), preemption_signals=(), **kwargs)
    try:
        if ckpt.load(bench.state) != 1:
            raise RuntimeError(f"load() from {local_dir} did not restore step 1")
    finally:
        ckpt.close()


def case_restore(bench: Bench, repeats: int) -> dict:
    result = common.new_result("remote_restore", bench.nbytes, repeats=repeats)
    bench.push("restore")
    raw, new = bench.root / "raw", bench.root / "new"

    def floor() -> None:
        bench.download("restore", raw)
        load_into(bench, raw, verify_on_load=False)

    def ours(verify: bool) -> None:
        load_into(bench, new, remote=bench.url("restore"), uploader="off", verify_on_load=verify, **bench.transfer())

    check = common.RestoreCheck(bench.model)
    tools = [
        common.Tool("boto3 download + local load (floor)", floor, before=lambda: common.fresh_dir(raw), floor=True),
        common.Tool("shardckpt load from the remote", lambda: ours(True), before=lambda: common.fresh_dir(new)),
        common.Tool("shardckpt load from the remote, no verify", lambda: ours(False),
                    before=lambda: common.fresh_dir(new)),
    ]
    rows = common.compare(result, [check.wrap(t) for t in tools], repeats)
    common.add_rate(rows, bench.step_bytes)
    return result


@contextlib.contextmanager
def uploading_checkpointer(bench: Bench, prefix: str):
    """A Checkpointer with its uploader process; that process is gone afterwards."""
    ckpt = shardckpt.Checkpointer(local_dir=str(bench.root / prefix), remote=bench.url(prefix), uploader="auto",
                                  mode="sync", keep_last=1, remote_keep_last=1, io_threads=bench.args.files,
                                  preemption_signals=(), **bench.transfer())
    pid = None
    try:
        yield ckpt
    finally:
        pid = (ckpt.status().get("uploader") or {}).get("pid")
        ckpt.close()
        deadline = time.monotonic() + 15  # it exits by itself once idle with no trainer left
        while pid and time.monotonic() < deadline and (ckpt.status().get("uploader") or {}).get("running"):
            time.sleep(0.1)
        if pid and (ckpt.status().get("uploader") or {}).get("running"):
            os.kill(pid, signal.SIGTERM)


def case_durable(bench: Bench, repeats: int) -> dict:
    from torch.distributed.checkpoint import async_save
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    result = common.new_result("remote_durable", bench.nbytes, repeats=repeats)
    runs = {"push": 0, "dcp": 0}

    def renew(prefix: str) -> None:
        """Untimed: drop earlier runs' objects (moto holds them in RAM); the next run gets a fresh prefix."""
        bench.delete(prefix)
        runs[prefix] += 1

    def push() -> None:
        bench.push(f"push/{runs['push']}")  # a fresh prefix: the step is not committed there yet

    def dcp_fsspec() -> None:
        writer = FsspecWriter(f"s3://{bench.bucket}/dcp/{runs['dcp']}", endpoint_url=bench.endpoint)
        async_save(bench.state, storage_writer=writer).result()

    with uploading_checkpointer(bench, "rpo") as ckpt:
        step = [0]

        def after_commit() -> common.Measured:
            """The same, with every file uploaded only after the local commit (no early upload)."""
            done, ckpt._writer.file_done = ckpt._writer.file_done, None
            try:
                return save_to_remote()
            finally:
                ckpt._writer.file_done = done

        def save_to_remote() -> common.Measured:
            step[0] += 1
            t0 = time.perf_counter()
            ckpt.save(bench.state, step[0])
            local = time.perf_counter() - t0
            (step_dir,) = (bench.root / "rpo").glob("step_*")  # keep_last=1: the step just committed
            key = f"rpo/{step_dir.name}/shardckpt.json"
            deadline = t0 + 600
            while not bench.exists(key):
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"{key} not in the bucket 600 s after save(); status: {ckpt.status()}")
                time.sleep(0.02)
            return common.Measured(time.perf_counter() - t0, {"local_commit_s": local})

        tools = [
            common.Tool("boto3 upload (floor)", lambda: bench.upload("raw"), before=lambda: bench.delete("raw"),
                        floor=True),
            common.Tool("shardckpt push (CLI)", push, before=lambda: renew("push")),
            common.Tool("shardckpt save → remote commit", save_to_remote),
            common.Tool("shardckpt save → remote commit, upload after the local commit", after_commit),
        ]
        if not bench.args.no_fsspec:
            tools.append(common.Tool("dcp.async_save → s3 (FsspecWriter)", dcp_fsspec, before=lambda: renew("dcp")))
        rows = common.compare(result, tools, repeats)
    for row in rows:
        per_gib = statistics.median(row["values"]) / (bench.nbytes / common.GIB)
        row["extra"]["s_per_gib"] = per_gib
        for key, notice in NOTICES.items():
            row["extra"][key] = notice / per_gib
    result["notes"].append("fits a notice: notice length / (seconds per GiB) at this size; a fixed delay "
                           "(the uploader's scan of the local directory, requests) weighs more on small states")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=("restore", "durable", "all"), default="all")
    parser.add_argument("--size-mb", type=int, default=256, help="state size in MiB (default 256)")
    parser.add_argument("--gib", type=float, help="state size in GiB (instead of --size-mb)")
    parser.add_argument("--files", type=int, default=4, help="shard files per step (the writer threads)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=common.CONCURRENCY)
    parser.add_argument("--part-mb", type=int, default=common.PART // common.MIB)
    parser.add_argument("--endpoint", help="existing S3 endpoint (default: start moto on 127.0.0.1)")
    parser.add_argument("--bucket", default="shardckpt-bench")
    parser.add_argument("--dir", default=None, help="where the scratch directory goes (default: the system's temp)")
    parser.add_argument("--json", help="write the result here (a list of results with --case all)")
    parser.add_argument("--no-fsspec", action="store_true", help="leave out the stock dcp.async_save → s3 row")
    args = parser.parse_args()
    if args.gib is None:
        args.gib = args.size_mb / 1024
    server = contextlib.nullcontext(args.endpoint) if args.endpoint else common.moto_server(args.bucket)
    results = []
    with server as endpoint, common.scratch("remote", args.dir) as root:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        bench = Bench(args, endpoint, root)
        note = (f"{bench.step_bytes / 1e6:.0f} MB in {len(bench.names)} files, parts of {args.part_mb} MiB, "
                f"{args.concurrency} in flight, endpoint "
                + ("moto_server on 127.0.0.1 (own process)" if not args.endpoint else "given by --endpoint"))
        for name, fn in (("restore", case_restore), ("durable", case_durable)):
            if args.case in (name, "all"):
                result = fn(bench, args.repeats)
                result["notes"].insert(0, note)
                common.emit(result, None)
                results.append(result)
        bench.manager.shutdown()
    if args.json:
        common.write_json(args.json, results[0] if len(results) == 1 else results)


if __name__ == "__main__":
    main()
