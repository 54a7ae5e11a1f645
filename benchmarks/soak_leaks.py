"""Many consecutive async saves: host memory, file descriptors, threads and processes stay flat.

    .venv/bin/python benchmarks/soak_leaks.py --saves 100 --mib 100

Prints one JSON line: RSS after the first save and at the end (growth in
percent), open file descriptors, threads and child processes before/after.
The test suite runs a smaller version (tests/jobs/test_reliability.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402

import shardckpt  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def counts() -> dict:
    children = 0
    me = str(os.getpid())
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == me:
                        children += 1
            except OSError:
                pass
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "python_threads": threading.active_count(),
        "children": children,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--saves", type=int, default=100)
    parser.add_argument("--mib", type=int, default=100, help="state size in MiB")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="soak-leaks-")
    torch.manual_seed(0)
    n = args.mib * (1 << 20) // 4 // 8
    model = torch.nn.ModuleList([torch.nn.Linear(n // 256, 256, bias=False) for _ in range(8)])
    optim = torch.optim.SGD(model.parameters(), lr=0.0)
    state = {"model": model, "optimizer": optim, "extra": {"i": 0}}
    before = counts()
    ckpt = shardckpt.Checkpointer(local_dir=root, keep_last=2, preemption_signals=())
    ckpt.save(state, 0).wait()
    rss_first = rss_bytes()
    during = counts()
    for i in range(1, args.saves + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        state["extra"]["i"] = i
        ckpt.save(state, i)  # async; the next call waits for the previous write
    ckpt.close()
    rss_last = rss_bytes()
    after = counts()
    print(json.dumps({
        "saves": args.saves,
        "state_mib": args.mib,
        "rss_after_first_mib": round(rss_first / (1 << 20), 1),
        "rss_end_mib": round(rss_last / (1 << 20), 1),
        "rss_growth_pct": round(100.0 * (rss_last - rss_first) / rss_first, 2),
        "before": before,
        "with_checkpointer": during,
        "after_close": after,
        "committed": ckpt.steps(),
    }))


if __name__ == "__main__":
    main()
