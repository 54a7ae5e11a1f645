"""Crash-consistency soak: SIGKILL the trainer at random moments and at named kill points.

    .venv/bin/python benchmarks/soak_kill.py --trials 200

Each trial resumes the same checkpoint directory (as a job that is preempted
again and again), runs until it is killed, then a fresh process loads the
newest committed step and compares a digest of model, optimizer and data
position with the uninterrupted reference run at that step. Every committed
step must verify and load. Kills come at random times and at every named kill
point in turn (see ``shardckpt._failpoints.POINTS``). Prints a table and exits
non-zero on any failure.
"""

from __future__ import annotations

import argparse
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
sys.path.insert(0, str(ROOT / "tests" / "programs"))
sys.path.insert(0, str(ROOT / "tests"))

from helpers import kill_job  # noqa: E402

PROGRAM = ROOT / "tests" / "programs" / "soak_train.py"
TOTAL = 400  # steps before a run finishes and the directory starts over


def env(**extra):
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_NUM_THREADS"] = "1"
    e["SHARDCKPT_LOG_LEVEL"] = "WARNING"
    e.update(extra)
    return e


def reference(work: Path) -> dict[int, str]:
    out = work / "reference.txt"
    subprocess.run([sys.executable, str(PROGRAM), str(work / "unused"), str(out), str(TOTAL), "--no-save"],
                   env=env(), check=True, timeout=600)
    return {int(a): b for a, b in (line.split() for line in out.read_text().splitlines())}


def check(ckpt_dir: Path, ref: dict[int, str]) -> tuple[int | None, list[str]]:
    """Load every committed step in a fresh process; compare with the reference."""
    code = f"""
import sys, json
sys.path.insert(0, {str(PROGRAM.parent)!r})
import soak_train, shardckpt
ckpt = shardckpt.Checkpointer(local_dir={str(ckpt_dir)!r}, preemption_signals=())
out = {{}}
for step in ckpt.steps():
    model, optim, sampler = soak_train.build()
    state = {{"model": model, "optimizer": optim, "sampler": sampler}}
    try:
        got = ckpt.load(state, step=step)
        out[step] = soak_train.digest(model, optim, sampler) if got == step else "wrong step %s" % got
    except Exception as exc:
        out[step] = "error: %s" % exc
newest = None
model, optim, sampler = soak_train.build()
newest = ckpt.load({{"model": model, "optimizer": optim, "sampler": sampler}})
print(json.dumps({{"steps": out, "newest": newest}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return None, [f"checker crashed: {proc.stderr[-1500:]}"]
    import json

    report = json.loads(proc.stdout.strip().splitlines()[-1])
    failures = []
    for step, got in report["steps"].items():
        if got != ref.get(int(step)):
            failures.append(f"step {step}: {got} != reference {ref.get(int(step))}")
    newest = report["newest"]
    steps = sorted(map(int, report["steps"]))
    if steps and newest != steps[-1]:
        failures.append(f"load() chose {newest}, newest committed is {steps[-1]}")
    return newest, failures


def _lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def run_trials(trials: int, seed: int, work: Path, torchrun_every: int = 0) -> dict:
    from shardckpt import _failpoints

    rng = random.Random(seed)
    ref = reference(work)
    ref2: dict[int, str] | None = None
    ckpt_dir = work / "ckpt"
    stats = {"trials": 0, "failures": [], "points": {}, "max_step": 0, "lost_committed": 0}
    last_newest = 0
    points = list(_failpoints.POINTS)
    for trial in range(trials):
        use_torchrun = torchrun_every and trial % torchrun_every == torchrun_every - 1
        if trial % 2 == 0:
            point = points[(trial // 2) % len(points)]
            spec = f"{point}@{rng.randint(1, 4)}"
            kind = point
        else:
            spec, kind = "", "random"
        digests = work / "digests.txt"
        args = [str(PROGRAM), str(ckpt_dir), str(digests), str(TOTAL), "--sleep", "0.01"]
        if use_torchrun:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   "--max-restarts=0"] + args
            kind += " (2 ranks)"
        else:
            cmd = [sys.executable] + args
        proc = subprocess.Popen(cmd, env=env(SHARDCKPT_FAILPOINTS=spec), start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # Kill once training is under way: after the run has made progress
        # past where it resumed, at a random moment (or at the kill point).
        start_lines = _lines(digests)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and _lines(digests) <= start_lines + 1:
            time.sleep(0.01)
        if spec:
            proc_deadline = time.monotonic() + 60
            while time.monotonic() < proc_deadline and proc.poll() is None:
                time.sleep(0.01)
        else:
            pause = time.monotonic() + rng.uniform(0.0, 1.5)
            while time.monotonic() < pause and proc.poll() is None:
                time.sleep(0.005)
        hit_point = proc.poll() == -signal.SIGKILL
        kill_job(proc)  # the launcher and every worker (torchrun gives workers their own sessions)
        if spec and not hit_point:
            kind += " (not reached)"
        stats["points"][kind] = stats["points"].get(kind, 0) + 1
        if use_torchrun:
            # A 2-rank run trains differently: compare against its own reference.
            if ref2 is None:
                out2 = work / "reference2.txt"
                subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                str(PROGRAM), str(work / "unused2"), str(out2), str(TOTAL), "--no-save"],
                               env=env(), check=True, timeout=600, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
                ref2 = {int(a): b for a, b in (line.split() for line in out2.read_text().splitlines())}
            newest, failures = check(ckpt_dir, {**ref, **ref2} if False else ref2)
        else:
            newest, failures = check(ckpt_dir, ref)
        stats["trials"] += 1
        if newest is not None and newest < last_newest:
            stats["lost_committed"] += 1
            failures.append(f"newest committed step went back from {last_newest} to {newest}")
        for failure in failures:
            stats["failures"].append(f"trial {trial} ({kind}): {failure}")
        last_newest = newest or 0
        stats["max_step"] = max(stats["max_step"], last_newest)
        # Each mode has its own reference, so a mode switch (or a finished run) starts over.
        next_torchrun = torchrun_every and (trial + 1) % torchrun_every == torchrun_every - 1
        if use_torchrun or next_torchrun or (newest or 0) >= TOTAL - 5:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
            last_newest = 0
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torchrun-every", type=int, default=10, help="every N-th trial runs 2 ranks under torchrun (0: never)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="soak-kill-"))
    t0 = time.monotonic()
    try:
        stats = run_trials(args.trials, args.seed, work, args.torchrun_every)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\ntrials: {stats['trials']}, wall time {time.monotonic() - t0:.0f} s, newest step reached {stats['max_step']}")
    print(f"| {'kill point':<34} | {'trials':>6} |")
    print(f"|{'-' * 36}|{'-' * 8}|")
    for name, count in sorted(stats["points"].items()):
        print(f"| {name:<34} | {count:>6} |")
    print(f"failures: {len(stats['failures'])}; committed steps lost: {stats['lost_committed']}")
    for failure in stats["failures"][:20]:
        print("  " + failure)
    sys.exit(1 if stats["failures"] else 0)


if __name__ == "__main__":
    main()
