"""Random-kill soak of the memory tier: every resume is bitwise a save that returned.

    nice -n 10 .venv/bin/python benchmarks/soak_memory.py --kills 50            # 2 ranks (torchrun)
    nice -n 10 .venv/bin/python benchmarks/soak_memory.py --kills 5 --ranks 2   # a short run

One directory, resumed again and again as a job preempted again and again: each
launch (torchrun, ``--ranks`` ranks on this machine) loads, checks what it got,
then trains, saving every step (kept in memory every step, ``memory_keep=1``;
on disk every ``--disk-every`` steps, so disk writes are in flight while
memory copies run), and is SIGKILLed (every rank and the launcher) at a random
moment (``--min-s`` to ``--max-s`` after its first save). After each
``save()`` returned, each rank appends the step to its own file. The next
launch must resume a step no older than the newest step whose ``save()``
returned on every rank (the newest returned save survives the next copy, and
a disk write in flight), with the model, the optimizer state and a plain value
bitwise those of that step (the state of step s is a function of s alone).

Prints one line per kill and a summary (resumed bitwise to a returned step /
total); exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))


def _state_of(step: int, rank: int):
    """The training state at ``step`` (a function of the step alone; a plain value that differs by rank)."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    weights = torch.randn(256, 256, generator=g)
    moments = torch.randn(256, 256, generator=g)
    return {"model": {"weight": weights, "bias": torch.full((256,), float(step))},
            "optim": {"exp_avg": moments, "step": torch.tensor(float(step))},
            "meta": {"step": step, "tokens": step * 4096}}


def worker(root: str, out: str, disk_every: int) -> None:
    """One rank of one launch: load and check, then train and save until killed."""
    import torch
    import torch.distributed as dist

    import shardckpt

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ckpt = shardckpt.Checkpointer(local_dir=root, memory_every_steps=1, memory_keep=1, every_steps=disk_every,
                                  preemption_signals=())
    state = {"model": {"weight": torch.zeros(256, 256), "bias": torch.zeros(256)},
             "optim": {"exp_avg": torch.zeros(256, 256), "step": torch.tensor(0.0)}, "meta": {}}
    got = ckpt.load(state)
    same = None
    if got is not None:
        want = _state_of(got, rank)
        same = (all(torch.equal(state[k][n], want[k][n]) for k in ("model", "optim") for n in want[k])
                and state["meta"] == want["meta"])
    with open(os.path.join(out, f"loaded.rank{rank}.json"), "w") as f:
        json.dump({"got": got, "same": same, "from": ckpt.status()["restored_from"]}, f)
    dist.barrier()
    step = (got or 0) + 1
    with open(os.path.join(out, f"returned.rank{rank}"), "a") as marks:
        while True:
            live = _state_of(step, rank)
            for k in ("model", "optim"):
                for n, v in live[k].items():
                    state[k][n].copy_(v)
            state["meta"] = live["meta"]
            ckpt.save(state, step)
            marks.write(f"{step}\n")
            marks.flush()
            step += 1


def _returned(out: Path, ranks: int) -> int | None:
    """The newest step whose save() returned on every rank (None: none yet)."""
    newest = []
    for r in range(ranks):
        path = out / f"returned.rank{r}"
        steps = [int(x) for x in path.read_text().split()] if path.exists() else []
        newest.append(max(steps) if steps else None)
    return None if any(n is None for n in newest) else min(newest)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--disk-every", type=int, default=5)
    parser.add_argument("--min-s", type=float, default=0.5)
    parser.add_argument("--max-s", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from helpers import child_env, torchrun_cmd

    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="soak-memory-"))
    root = work / "ck"
    env = child_env(SHARDCKPT_MEMORY_LINGER_S="120")
    ok = failures = 0
    expected: int | None = None
    try:
        for kill in range(args.kills + 1):
            out = work / f"launch{kill}"
            out.mkdir()
            cmd = torchrun_cmd(args.ranks, Path(__file__), "--worker", root, out, args.disk_every)
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            deadline = time.monotonic() + 240
            while not all((out / f"returned.rank{r}").exists() for r in range(args.ranks)):
                if proc.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            loaded = [json.loads((out / f"loaded.rank{r}.json").read_text())
                      if (out / f"loaded.rank{r}.json").exists() else None for r in range(args.ranks)]
            if kill:  # check the resume of the launch before
                got = loaded[0]["got"] if loaded[0] else "no load"
                good = (all(rec is not None and rec["got"] == got and rec["same"] for rec in loaded)
                        and expected is not None and isinstance(got, int) and got >= expected)
                ok += good
                failures += not good
                print(f"kill {kill:3d}: newest returned on every rank {expected}, resumed {got} from "
                      f"{(loaded[0] or {}).get('from', '?')}: {'bitwise' if good else 'FAILED ' + str(loaded)}",
                      flush=True)
            if kill == args.kills:
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(rng.uniform(args.min_s, args.max_s))
            os.killpg(proc.pid, signal.SIGKILL)  # every rank and the launcher
            proc.wait()
            if proc.stdout is not None:
                log = proc.stdout.read().decode(errors="replace")
                (out / "log").write_text(log)
            expected = _returned(out, args.ranks)
            if expected is None:  # killed before every rank's first save returned: the resume before stands
                expected = loaded[0]["got"] if loaded[0] else None
        print(f"memory soak ({args.ranks} ranks, memory_keep=1, disk every {args.disk_every}): {ok}/{ok + failures} "
              f"resumes bitwise to a returned step", flush=True)
        return 1 if failures else 0
    finally:
        from shardckpt.format import shm

        shm.purge(str(root))
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
