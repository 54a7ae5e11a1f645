"""Crash-consistency soak: SIGKILL the trainer at random moments and at named kill points.

    .venv/bin/python benchmarks/soak_kill.py --trials 200
    .venv/bin/python benchmarks/soak_kill.py --trials 50 --nodes 2     # 2 nodes x 2 ranks, shared directory
    .venv/bin/python benchmarks/soak_kill.py --trials 200 --remote   # with the remote tier (file://)
    .venv/bin/python benchmarks/soak_kill.py --trials 50 --remote --store s3   # against moto's S3 server
    .venv/bin/python benchmarks/soak_kill.py --trials 50 --peer    # the peer tier: 2 nodes, kill daemons too

Each trial resumes the same checkpoint directory (as a job that is preempted
again and again), runs until it is killed, then the checker (a process of
its own, kept across the trials so that torch is imported once; a new
Checkpointer per check) loads every committed step and compares a digest of model, optimizer and data
position with the uninterrupted reference run at that step. Every committed
step must verify and load. Kills come at random times and at every named kill
point in turn (see ``shardckpt._failpoints.POINTS``). Prints a table and exits
non-zero on any failure.

``--nodes 2``: every trial is a job of two nodes with two ranks each (two
torchrun launchers on this machine, as in the multi-node tests) writing one
shared directory; all four ranks are killed at a kill point (every rank
that reaches it dies there) or at a random moment.

``--peer``: every trial is 2 nodes x 2 ranks with node-local directories (the
peer tier on), killed at a random moment: the trainers, one node's peer daemon
and then the trainers, or the trainers and both daemons. Node 1 is then taken
as lost: every step node 0 holds node 1's replica of must load, bitwise, from
node 0's directory alone at world size 1, the newest of them no older than
the newest step node 1's daemon reported replicated before the kill.

``--remote``: the trainer also uploads every committed step to a ``file://``
remote (``--store s3``: an S3 bucket on moto's server, started here on
127.0.0.1) through its uploader process (``uploader="auto"``, remote retention
keeping 2 steps). Trials SIGKILL the trainer at its kill points, the uploader
at its kill points (``shardckpt._failpoints.UPLOADER_POINTS``: after the
files, after the node marker, after the manifest, inside remote retention),
or both at random moments. After every trial, besides the local check, a
Checkpointer with an empty ``local_dir`` and ``uploader="off"`` loads every
step committed on the remote and compares it with the reference; the newest
remote step never goes backwards, and no step ever seen committed remotely
(listed there, or marked uploaded locally) disappears unless remote retention
was entitled to remove it.
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


_CHECKER_LOOP = r"""
import contextlib, io, json, sys, traceback
for line in sys.stdin:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(json.loads(line), "<check>", "exec"), {"__name__": "__check__"})
        reply = {"returncode": 0, "stdout": out.getvalue(), "stderr": ""}
    except BaseException:
        reply = {"returncode": 1, "stdout": out.getvalue(), "stderr": traceback.format_exc()}
    sys.__stdout__.write(json.dumps(reply) + "\n")
    sys.__stdout__.flush()
"""


class Checker:
    """The process that checks what a trial left, kept across the trials of a soak.

    Each check builds its own Checkpointers (nothing of one check is left for
    the next: they are closed), but torch and DCP are imported once per soak,
    not once per trial. A check that kills the process, or runs past its
    timeout, is reported as a crash and the next check starts a new one.
    """

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] | None = None
        self.log: Path | None = None

    def run(self, code: str, timeout: float = 300) -> subprocess.CompletedProcess:
        import json
        import selectors
        import tempfile

        environ = env()
        if self.proc is None or self.proc.poll() is not None or environ != self.env:
            self.stop()
            self.log = Path(tempfile.mkstemp(prefix="soak-checker-", suffix=".log")[1])
            with open(self.log, "wb") as log:
                self.proc = subprocess.Popen([sys.executable, "-c", _CHECKER_LOOP], env=environ, text=True,
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
            self.env = environ
        proc = self.proc
        try:
            proc.stdin.write(json.dumps(code) + "\n")
            proc.stdin.flush()
            with selectors.DefaultSelector() as sel:
                sel.register(proc.stdout, selectors.EVENT_READ)
                line = proc.stdout.readline() if sel.select(timeout) else ""
        except OSError:
            line = ""
        if not line:
            self.stop()
            tail = self.log.read_text(errors="replace")[-1500:] if self.log and self.log.exists() else ""
            return subprocess.CompletedProcess(code, 1, "", f"the checker died or ran past {timeout:.0f} s: {tail}")
        reply = json.loads(line)
        return subprocess.CompletedProcess(code, reply["returncode"], reply["stdout"], reply["stderr"])

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            for stream in (self.proc.stdin, self.proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
            self.proc = None
        if self.log is not None:
            self.log.unlink(missing_ok=True)
            self.log = None


CHECKER = Checker()


def _ends_checker(soak):
    """A soak's entry point: its checker process ends with it."""
    import functools

    @functools.wraps(soak)
    def run(*args, **kwargs):
        try:
            return soak(*args, **kwargs)
        finally:
            CHECKER.stop()

    return run


def start(layout: str, args: list[str], environ: dict[str, str]) -> list[subprocess.Popen]:
    """Start the trainer: ``1`` process, ``2`` ranks under torchrun, or ``2x2`` (two nodes of two ranks)."""
    if layout == "1":
        commands = [[sys.executable] + args]
    elif layout == "2":
        commands = [[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                     "--max-restarts=0"] + args]
    else:
        from helpers import free_port

        port = free_port()
        commands = [[sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
                     "--nproc-per-node=2", "--rdzv-backend=static", "--master-addr=127.0.0.1",
                     f"--master-port={port}", "--max-restarts=0"] + args for node in range(2)]
    return [subprocess.Popen(cmd, env=environ, start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL) for cmd in commands]


def running(procs: list[subprocess.Popen]) -> bool:
    return all(p.poll() is None for p in procs)


def reference(work: Path, layout: str = "1") -> dict[int, str]:
    """Digests of an uninterrupted run of the same layout (ranks train differently per world size)."""
    out = work / f"reference-{layout}.txt"
    procs = start(layout, [str(PROGRAM), str(work / f"unused-{layout}"), str(out), str(TOTAL), "--no-save"], env())
    for proc in procs:
        if proc.wait(timeout=900) != 0:
            raise RuntimeError(f"the reference run ({layout}) failed")
    return {int(a): b for a, b in (line.split() for line in out.read_text().splitlines())}


def check(ckpt_dir: Path, ref: dict[int, str]) -> tuple[int | None, list[str]]:
    """Load every committed step in the checker (new Checkpointers); compare with the reference."""
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
ckpt.close()
print(json.dumps({{"steps": out, "newest": newest}}))
"""
    proc = CHECKER.run(code)
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


@_ends_checker
def run_trials(trials: int, seed: int, work: Path, torchrun_every: int = 0, remote: bool = False,
               progress: bool = False, nodes: int = 1, store: str = "file", cycle: str | None = None) -> dict:
    """``cycle``: the order of the one-process trials' kinds, repeated: ``p`` the next kill point, ``r`` a
    random kill (default ``pr``); with ``remote``, ``u`` the next uploader kill point, ``r`` random kills
    of both, ``t`` the next trainer kill point (default ``urt``)."""
    if remote:
        return run_remote_trials(trials, seed, work, progress, store, cycle or "urt")
    cycle = cycle or "pr"
    turns = 0
    from shardckpt import _failpoints

    rng = random.Random(seed)
    refs: dict[str, dict[int, str]] = {}
    ckpt_dir = work / "ckpt"
    stats = {"trials": 0, "failures": [], "points": {}, "max_step": 0, "lost_committed": 0}
    last_newest = 0
    points = list(_failpoints.POINTS)
    points_log = work / "failpoints.log"
    if nodes == 2:
        torchrun_every = 1  # every trial is multi-rank: kill points and random kills alternate
    for trial in range(trials):
        use_torchrun = torchrun_every and trial % torchrun_every == torchrun_every - 1
        # Kill points on even trials; 2-rank trials alternate between a kill point and a random kill.
        at_point = (trial // torchrun_every) % 2 == 0 if use_torchrun else cycle[trial % len(cycle)] == "p"
        if at_point:
            # Each sequence (1-rank kill-point trials, 2-rank ones) walks through every point.
            turn = trial // (2 * torchrun_every) if use_torchrun else turns
            turns += 0 if use_torchrun else 1
            point = points[turn % len(points)]
            spec = f"{point}@{rng.randint(1, 4)}"
            kind = point
        else:
            spec, kind = "", "random"
        points_log.unlink(missing_ok=True)
        digests = work / "digests.txt"
        args = [str(PROGRAM), str(ckpt_dir), str(digests), str(TOTAL), "--sleep", "0.01"]
        layout = "2x2" if nodes == 2 else "2" if use_torchrun else "1"
        kind += {"1": "", "2": " (2 ranks)", "2x2": " (2 nodes x 2 ranks)"}[layout]
        procs = start(layout, args, env(SHARDCKPT_FAILPOINTS=spec, SHARDCKPT_FAILPOINTS_LOG=str(points_log)))
        # Kill once training is under way: after the run has made progress
        # past where it resumed, at a random moment (or at the kill point).
        start_lines = _lines(digests)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and running(procs) and _lines(digests) <= start_lines + 1:
            time.sleep(0.01)
        if spec:
            # Until a rank reaches the kill point (under torchrun the launcher
            # outlives its killed worker, so its exit status does not tell).
            proc_deadline = time.monotonic() + 60
            while time.monotonic() < proc_deadline and running(procs) and not points_log.exists():
                time.sleep(0.01)
        else:
            pause = time.monotonic() + rng.uniform(0.0, 1.5)
            while time.monotonic() < pause and running(procs):
                time.sleep(0.005)
        for proc in procs:
            kill_job(proc)  # the launcher and every worker (torchrun gives workers their own sessions)
        fired = points_log.read_text().split()[:1] if points_log.exists() else []
        if spec and fired != [spec.split("@")[0]]:
            kind += " (not reached)"
        stats["points"][kind] = stats["points"].get(kind, 0) + 1
        if layout not in refs:
            refs[layout] = reference(work, layout)
        newest, failures = check(ckpt_dir, refs[layout])
        stats["trials"] += 1
        if newest is not None and newest < last_newest:
            stats["lost_committed"] += 1
            failures.append(f"newest committed step went back from {last_newest} to {newest}")
        for failure in failures:
            stats["failures"].append(f"trial {trial} ({kind}): {failure}")
        last_newest = newest or 0
        stats["max_step"] = max(stats["max_step"], last_newest)
        if progress:
            print(f"trial {trial}: {kind}; newest committed {newest}, failures so far {len(stats['failures'])}",
                  flush=True)
        # Each mode has its own reference, so a mode switch (or a finished run) starts over.
        next_torchrun = torchrun_every and (trial + 1) % torchrun_every == torchrun_every - 1
        if (use_torchrun and nodes == 1) or (next_torchrun and nodes == 1) or (newest or 0) >= TOTAL - 5:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
            last_newest = 0
    return stats

# ---------------------------------------------------------------- remote tier

REMOTE_KEEP_LAST = 2


_LOAD_EACH = """
def load_each(ckpt, steps):
    out = {}
    for step in steps:
        model, optim, sampler = soak_train.build()
        try:
            got = ckpt.load({"model": model, "optimizer": optim, "sampler": sampler}, step=step)
            out[step] = soak_train.digest(model, optim, sampler) if got == step else "wrong step %s" % got
        except Exception as exc:
            out[step] = "error: %s" % exc
    return out
"""
"""The checker processes' loop: each step loaded by itself, its digest or the error (``soak_train``)."""


def check_both(ckpt_dir: Path, url: str, scratch: Path, ref: dict[int, str]) -> dict:
    """In the checker: every local committed step, then the remote alone (empty local_dir, uploader off)."""
    code = f"""
import sys, json
sys.path.insert(0, {str(PROGRAM.parent)!r})
import soak_train, shardckpt
from shardckpt.node import node_registry, uploader
from shardckpt.remote import commit as remote_commit
from shardckpt.remote import listing as remote_listing
from shardckpt import stores

{_LOAD_EACH}
def load_all(ckpt, steps):
    out = load_each(ckpt, steps)
    model, optim, sampler = soak_train.build()
    newest = ckpt.load({{"model": model, "optimizer": optim, "sampler": sampler}})
    ckpt.close()
    return out, newest

ckpt = shardckpt.Checkpointer(local_dir={str(ckpt_dir)!r}, preemption_signals=())
local, local_newest = load_all(ckpt, ckpt.steps())
store = stores.open_store({url!r})
listed = remote_listing.remote_steps(store, stores.Deadline(60))
store.close()
ckpt = shardckpt.Checkpointer(local_dir={str(scratch)!r}, remote={url!r}, uploader="off", preemption_signals=())
rem, remote_newest = load_all(ckpt, listed)
print(json.dumps({{"local": local, "newest": local_newest, "remote": rem, "listed": listed,
                  "remote_newest": remote_newest}}))
"""
    shutil.rmtree(scratch, ignore_errors=True)
    proc = CHECKER.run(code)
    shutil.rmtree(scratch, ignore_errors=True)
    out = {"newest": None, "listed": [], "remote_newest": None, "failures": []}
    if proc.returncode != 0:
        out["failures"].append(f"checker crashed: {proc.stderr[-1500:]}")
        return out
    import json

    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for tier, steps, newest in (("local", report["local"], report["newest"]),
                                ("remote", report["remote"], report["remote_newest"])):
        for step, got in steps.items():
            if got != ref.get(int(step)):
                out["failures"].append(f"{tier} step {step}: {got} != reference {ref.get(int(step))}")
        ordered = sorted(map(int, steps))
        if ordered and newest != ordered[-1]:
            out["failures"].append(f"{tier}: load() chose {newest}, newest committed is {ordered[-1]}")
    out.update(newest=report["newest"], listed=sorted(report["listed"]), remote_newest=report["remote_newest"])
    return out


def _reported_remote(ckpt_dir: Path, url: str) -> set[int]:
    """Local steps marked as committed remotely (not merely superseded)."""
    import json

    from shardckpt.format import layout
    from shardckpt.remote import commit as remote_commit

    out = set()
    for step in layout.committed_steps(str(ckpt_dir)):
        try:
            body = json.loads((ckpt_dir / layout.step_dirname(step) / remote_commit.UPLOADED_NAME).read_text())
        except (OSError, ValueError):
            continue
        if body.get("remote") == url and "superseded_by" not in body:
            out.add(step)
    return out


def _uploader_pid(ckpt_dir: Path) -> int | None:
    """The uploader serving ``ckpt_dir`` (it holds its lock), else None; 0 when its pid is not known yet."""
    from shardckpt.node import node_registry

    return node_registry.uploader_running(str(ckpt_dir))


def _kill_pid(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def _wait_uploader_gone(ckpt_dir: Path, timeout: float, settle: float = 1.5) -> bool:
    """True when no uploader serves ``ckpt_dir`` for ``settle`` seconds in a row, within ``timeout``.

    A trainer restarts a dead uploader (``save()`` watches it), so one may be
    starting right when the trainer is killed: it counts once it holds its lock.
    """
    end = time.monotonic() + timeout
    free_since = None
    while time.monotonic() < end:
        if _uploader_pid(ckpt_dir) is None:
            free_since = free_since or time.monotonic()
            if time.monotonic() - free_since >= settle:
                return True
        else:
            free_since = None
        time.sleep(0.05)
    return False


def run_remote_trials(trials: int, seed: int, work: Path, progress: bool = False, store: str = "file",
                      cycle: str = "urt") -> dict:
    if store == "s3":
        from s3server import BUCKET, S3Server, apply_env, restore_env

        server = S3Server()
        previous = apply_env(server)  # the trainers, their uploaders and the checker inherit it
        try:
            server.reset()
            return _remote_trials(trials, seed, work, progress, f"s3://{BUCKET}/soak", lambda: server.reset(), cycle)
        finally:
            restore_env(previous)
            server.stop()
    remote_dir = work / "remote"
    return _remote_trials(trials, seed, work, progress, f"file://{remote_dir}",
                          lambda: shutil.rmtree(remote_dir, ignore_errors=True), cycle)


@_ends_checker
def _remote_trials(trials: int, seed: int, work: Path, progress: bool, url: str, wipe_remote,
                   cycle: str = "urt") -> dict:
    from shardckpt import _failpoints

    rng = random.Random(seed)
    ref = reference(work)
    ckpt_dir = work / "ckpt"
    stats = {"trials": 0, "failures": [], "points": {}, "max_step": 0, "lost_committed": 0,
             "max_remote_step": 0, "uploader_kills": 0, "remote": url.split("://")[0]}
    last_newest = 0
    last_remote = 0
    ever_remote: set[int] = set()
    trainer_points = list(_failpoints.POINTS)
    uploader_points = list(_failpoints.UPLOADER_POINTS)
    points_log = work / "failpoints.log"
    for trial in range(trials):
        mode = "tur".index(cycle[trial % len(cycle)])  # 0 trainer kill point, 1 uploader kill point, 2 random kills
        turn = sum(1 for t in range(trial) if cycle[t % len(cycle)] == cycle[trial % len(cycle)])
        if mode == 0:
            point = trainer_points[turn % len(trainer_points)]
            spec, kind = f"{point}@{rng.randint(1, 4)}", point
        elif mode == 1:
            point = uploader_points[turn % len(uploader_points)]
            spec, kind = f"{point}@{rng.randint(1, 3)}", point
        else:
            spec, kind = "", "random (trainer + uploader)"
        points_log.unlink(missing_ok=True)
        digests = work / "digests.txt"
        args = [str(PROGRAM), str(ckpt_dir), str(digests), str(TOTAL), "--sleep", "0.01",
                "--remote", url, "--remote-keep-last", str(REMOTE_KEEP_LAST)]
        proc = subprocess.Popen([sys.executable] + args, start_new_session=True,
                                env=env(SHARDCKPT_FAILPOINTS=spec, SHARDCKPT_FAILPOINTS_LOG=str(points_log)),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        start_lines = _lines(digests)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and _lines(digests) <= start_lines + 1:
            time.sleep(0.01)
        uploader_killed = False
        if mode in (0, 1):
            # Until the kill point fires (the trainer's, or the uploader's: then the
            # trainer trains on a little, without an uploader, before its own kill).
            end = time.monotonic() + 60
            while time.monotonic() < end and proc.poll() is None and not points_log.exists():
                time.sleep(0.01)
            pause = time.monotonic() + (rng.uniform(0.0, 0.5) if mode == 1 else 0.0)
            while time.monotonic() < pause and proc.poll() is None:
                time.sleep(0.005)
        else:
            # Trainer and uploader each die at a random moment, in either order.
            t_trainer, t_uploader = rng.uniform(0.0, 1.5), rng.uniform(0.0, 2.5)
            t0 = time.monotonic()
            for victim, at in sorted((("trainer", t_trainer), ("uploader", t_uploader)), key=lambda v: v[1]):
                while time.monotonic() < t0 + at and proc.poll() is None:
                    time.sleep(0.005)
                if victim == "trainer":
                    kill_job(proc)
                else:
                    uploader_killed = _kill_pid(_uploader_pid(ckpt_dir))
        kill_job(proc)
        fired = points_log.read_text().split()[:1] if points_log.exists() else []
        if spec and fired != [spec.split("@")[0]]:
            kind += " (not reached)"
        stats["points"][kind] = stats["points"].get(kind, 0) + 1
        if uploader_killed or (mode == 1 and fired):
            stats["uploader_kills"] += 1
        # Let a surviving uploader drain (it exits once idle, its trainer gone);
        # one that does not finish in time is killed too (then counted).
        if not _wait_uploader_gone(ckpt_dir, 120):
            if _kill_pid(_uploader_pid(ckpt_dir)):
                stats["uploader_kills"] += 1
                stats["points"]["uploader not idle in 120 s (killed)"] = (
                    stats["points"].get("uploader not idle in 120 s (killed)", 0) + 1
                )
        reported = _reported_remote(ckpt_dir, url)
        result = check_both(ckpt_dir, url, work / "scratch", ref)
        newest, listed, remote_newest = result["newest"], result["listed"], result["remote_newest"]
        failures = list(result["failures"])
        ever_remote |= reported | set(listed)
        stats["trials"] += 1
        if newest is not None and newest < last_newest:
            stats["lost_committed"] += 1
            failures.append(f"newest committed step went back from {last_newest} to {newest}")
        if (remote_newest or 0) < last_remote:
            stats["lost_committed"] += 1
            failures.append(f"newest remotely committed step went back from {last_remote} to {remote_newest}")
        if ever_remote:
            # Remote retention may only have removed steps older than the newest REMOTE_KEEP_LAST it lists.
            kept_from = listed[-REMOTE_KEEP_LAST] if len(listed) >= REMOTE_KEEP_LAST else 0
            lost = sorted(s for s in ever_remote if s >= kept_from and s not in listed)
            if lost:
                stats["lost_committed"] += len(lost)
                failures.append(f"steps {lost} were committed remotely and are gone (remote now lists {listed})")
            if max(ever_remote) not in listed:
                failures.append(f"the newest step ever committed remotely, {max(ever_remote)}, is gone ({listed})")
        for failure in failures:
            stats["failures"].append(f"trial {trial} ({kind}): {failure}")
        last_newest = newest or 0
        last_remote = remote_newest or 0
        stats["max_step"] = max(stats["max_step"], last_newest)
        stats["max_remote_step"] = max(stats["max_remote_step"], last_remote)
        if progress:
            print(f"trial {trial}: {kind}; newest local {newest}, newest remote {remote_newest}, "
                  f"failures so far {len(stats['failures'])}", flush=True)
        if (newest or 0) >= TOTAL - 5:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
            wipe_remote()
            last_newest = last_remote = 0
            ever_remote = set()
    return stats



# ---------------------------------------------------------------- peer tier


def _peer_record(node_dir: Path) -> dict:
    from shardckpt.node import peer_daemon
    from shardckpt.node.node_registry import read_json, state_dir

    return read_json(os.path.join(state_dir(str(node_dir)), peer_daemon.STATUS_NAME))


def _kill_daemon(node_dir: Path) -> bool:
    """SIGKILL the node's peer daemon when its status names a live process (checked by its start time)."""
    from shardckpt.node.node_registry import pid_alive

    info = _peer_record(node_dir)
    pid = info.get("pid")
    if info.get("state") != "running" or not isinstance(pid, int) or not pid_alive(pid, info.get("pid_start")):
        return False
    return _kill_pid(pid)


def _peer_durable_on_holder(holder: Path, owner_dir: str) -> list[int]:
    """Steps of the holder's own directory whose owner's files it holds as a committed replica of the same save."""
    from shardckpt.format import layout, replicas

    held = replicas.committed_replicas(str(holder)).get(owner_dir, {})
    out = []
    for step, manifest in held.items():
        mine = layout.read_manifest(str(holder / layout.step_dirname(step))) \
            if (holder / layout.step_dirname(step)).is_dir() else None
        if mine is not None and layout.version_of(mine) == layout.version_of(manifest):
            out.append(step)
    return sorted(out)


def check_node_lost(holder: Path, steps: list[int], scratch: Path, ref: dict[int, str]) -> list[str]:
    """Node 1 is lost: the checker loads each of ``steps`` from a copy of node 0's directory alone
    (its own files and node 1's replica), at world size 1, and compares it with the reference."""
    copy = scratch / "node0-copy"
    shutil.rmtree(copy, ignore_errors=True)
    # a daemon left alive may be deleting a replica meanwhile: its trash and partial folders are not needed
    shutil.copytree(holder, copy, copy_function=os.link, ignore=shutil.ignore_patterns(".trash-*", ".partial-*"))
    code = f"""
import sys, json
sys.path.insert(0, {str(PROGRAM.parent)!r})
import soak_train, shardckpt
{_LOAD_EACH}
ckpt = shardckpt.Checkpointer(local_dir={str(copy)!r}, preemption_signals=())
print(json.dumps(load_each(ckpt, {steps!r})))
ckpt.close()
"""
    proc = CHECKER.run(code)
    shutil.rmtree(copy, ignore_errors=True)
    if proc.returncode != 0:
        return [f"checker crashed: {proc.stderr[-1500:]}"]
    import json

    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return [f"step {s}: {d} != reference {ref.get(int(s))}" for s, d in got.items() if d != ref.get(int(s))]


@_ends_checker
def run_peer_trials(trials: int, seed: int, work: Path, progress: bool = False) -> dict:
    """2 nodes x 2 ranks, node-local directories (the peer tier on); random SIGKILLs of the trainers, of a
    node's peer daemon during training, or of both at once. After each trial node 1 is taken as lost:
    node 0's directory alone must load, bitwise, every step it holds node 1's replica of (of the same
    save as its own copy), the newest of them no older than the newest step node 1's daemon reported
    replicated just before the kill."""
    import socket

    from shardckpt.format import replicas

    rng = random.Random(seed)
    base = work / "peer"
    node1_owner = replicas.owner_dirname(f"{socket.gethostname()}:1")
    ref = reference(work, "2x2")
    stats = {"trials": 0, "failures": [], "points": {}, "max_step": 0, "lost_committed": 0, "daemon_kills": 0}
    for trial in range(trials):
        kind = rng.choice(["trainers", "a daemon, then the trainers", "trainers and both daemons"])
        digests = work / "digests.txt"
        procs = start("2x2", [str(PROGRAM), str(base), str(digests), str(TOTAL), "--sleep", "0.01", "--node-local"],
                      env())
        start_lines = _lines(digests)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and running(procs) and _lines(digests) <= start_lines + 2:
            time.sleep(0.01)
        pause = time.monotonic() + rng.uniform(0.0, 2.0)
        while time.monotonic() < pause and running(procs):
            time.sleep(0.005)
        if kind == "a daemon, then the trainers":
            stats["daemon_kills"] += _kill_daemon(base / f"node{rng.randint(0, 1)}")
            time.sleep(rng.uniform(0.0, 1.0))
        durable = max((int(s) for s in (_peer_record(base / "node1").get("replicated") or {})), default=None)
        for proc in procs:
            kill_job(proc)
        if kind == "trainers and both daemons":
            for g in (0, 1):
                stats["daemon_kills"] += _kill_daemon(base / f"node{g}")
        stats["points"][kind] = stats["points"].get(kind, 0) + 1
        time.sleep(1.0)  # a daemon left alive finishes a replica it was sending
        steps = _peer_durable_on_holder(base / "node0", node1_owner)
        failures = []
        from shardckpt.format import layout

        # A newer step may have become peer-durable after the kill (a daemon left alive goes on);
        # a step newer than node 0's newest was never committed on every node: not a step to lose.
        if durable is not None and max(steps, default=-1) < durable <= max(
                layout.committed_steps(str(base / "node0")), default=-1):
            stats["lost_committed"] += 1
            failures.append(f"step {durable}, reported peer-durable by node 1, is not loadable from node 0 "
                            f"(it holds {steps})")
        failures += check_node_lost(base / "node0", steps, work, ref)
        stats["trials"] += 1
        stats["max_step"] = max(stats["max_step"], max(steps, default=0))
        for failure in failures:
            stats["failures"].append(f"trial {trial} ({kind}): {failure}")
        if progress:
            print(f"trial {trial}: {kind}; node 1 peer-durable {durable}, node 0 holds its replicas of {steps}; "
                  f"failures so far {len(stats['failures'])}", flush=True)
        if max(steps, default=0) >= TOTAL - 5:
            for g in (0, 1):
                _kill_daemon(base / f"node{g}")
            shutil.rmtree(base, ignore_errors=True)
    for g in (0, 1):
        _kill_daemon(base / f"node{g}")
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torchrun-every", type=int, default=10,
                        help="every N-th trial runs 2 ranks under torchrun (0: never)")
    parser.add_argument("--remote", action="store_true", help="also upload to a remote and kill the uploader")
    parser.add_argument("--store", choices=["file", "s3"], default="file",
                        help="with --remote: a file:// directory, or an S3 bucket on moto's server (127.0.0.1)")
    parser.add_argument("--nodes", type=int, choices=[1, 2], default=1,
                        help="2: every trial is 2 nodes x 2 ranks on one shared directory")
    parser.add_argument("--peer", action="store_true",
                        help="2 nodes x 2 ranks, node-local directories: kill trainers and peer daemons, lose node 1")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="soak-kill-"))
    t0 = time.monotonic()
    try:
        stats = run_peer_trials(args.trials, args.seed, work, progress=True) if args.peer else run_trials(
            args.trials, args.seed, work, args.torchrun_every, remote=args.remote, progress=True,
            nodes=args.nodes, store=args.store)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\ntrials: {stats['trials']}, wall time {time.monotonic() - t0:.0f} s, "
          f"newest step reached {stats['max_step']}")
    print(f"| {'kill point':<34} | {'trials':>6} |")
    print(f"|{'-' * 36}|{'-' * 8}|")
    for name, count in sorted(stats["points"].items()):
        print(f"| {name:<34} | {count:>6} |")
    if "daemon_kills" in stats:
        print(f"peer daemon SIGKILLs: {stats['daemon_kills']}")
    if stats.get("remote"):
        print(f"remote store {stats['remote']}: newest remote step reached {stats['max_remote_step']}; "
              f"uploader SIGKILLs: {stats['uploader_kills']}")
    print(f"failures: {len(stats['failures'])}; committed steps lost: {stats['lost_committed']}")
    for failure in stats["failures"][:20]:
        print("  " + failure)
    sys.exit(1 if stats["failures"] else 0)


if __name__ == "__main__":
    main()
