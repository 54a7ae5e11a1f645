"""The tests' torchrun (``tests/launcher.py``: the launcher forked from the test process) against the command
itself (``python -m torch.distributed.run``, a new interpreter), on the same jobs: the exit status, the ranks'
output and torchrun's report when a rank fails, and a SIGTERM to the launcher reaching every rank. The ranks
are plain Python programs (no torch): what differs between the two is the launcher alone."""

from __future__ import annotations

import signal
import subprocess
import time

import launcher
from helpers import ROOT, child_env, torchrun_cmd, wait_for

RANK = '''
import os, signal, sys, time
rank, out = int(os.environ["RANK"]), sys.argv[2]
print(f"rank {rank} of {os.environ['WORLD_SIZE']} says hello", flush=True)
if sys.argv[1] == "fail" and rank == 1:
    sys.exit(3)
if sys.argv[1] == "term":
    def stop(signum, frame):
        open(os.path.join(out, f"term{rank}"), "w").close()
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    open(os.path.join(out, f"ready{rank}"), "w").close()
    time.sleep(60)
'''


def start(forked: bool, cmd: list[str], log) -> subprocess.Popen:
    kw = dict(env=child_env(), stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT), start_new_session=True)
    proc = launcher.popen(cmd, **kw) if forked else subprocess.Popen(cmd, **kw)
    assert isinstance(proc, launcher.ForkedTorchrun) == forked
    return proc


def test_a_forked_launcher_exits_reports_and_forwards_sigterm_as_the_command(tmp_path):
    program = tmp_path / "rank.py"
    program.write_text(RANK)
    seen = {}
    for forked in (True, False):
        out = tmp_path / f"forked-{forked}"
        out.mkdir()
        with open(out / "fail.log", "w") as log:
            failed = start(forked, torchrun_cmd(2, program, "fail", out), log).wait(timeout=120)
        text = (out / "fail.log").read_text()
        with open(out / "term.log", "w") as log:
            proc = start(forked, torchrun_cmd(2, program, "term", out), log)
            try:
                wait_for(lambda: all((out / f"ready{r}").exists() for r in (0, 1)), 60, "both ranks ready", proc,
                         out / "term.log")
                proc.send_signal(signal.SIGTERM)
                stopped = proc.wait(timeout=60)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all((out / f"term{r}").exists() for r in (0, 1)):
            time.sleep(0.1)
        seen[forked] = {
            "fail exit": failed,
            "hello": sorted(line for line in text.splitlines() if "says hello" in line),
            "report": "ChildFailedError" in text and "exitcode  : 3" in text and "rank      : 1" in text,
            "term exit": stopped,
            "ranks got SIGTERM": sorted(p.name for p in out.glob("term*") if p.suffix == ""),
        }
    assert seen[False]["fail exit"] != 0 and seen[False]["report"], seen
    assert seen[False]["ranks got SIGTERM"] == ["term0", "term1"], seen
    assert seen[True] == seen[False], seen
