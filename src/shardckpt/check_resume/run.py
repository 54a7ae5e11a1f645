"""``shardckpt check-resume``: prove that a training script resumes exactly (torch-free).

::

    shardckpt check-resume [--steps N] [--kill-after STEP] [--workdir DIR] [--keep]
                           [--reference-twice] [--timeout S] -- COMMAND [ARG...]

Runs COMMAND (``python train.py ...``, ``torchrun ... train.py ...``) three times:

1. **reference**: from scratch to step N;
2. **killed**: from scratch; right after its ``save()`` call of step STEP has
   committed, every process of the job is SIGKILLed;
3. **resumed**: the same command again on the killed run's checkpoints, to step N.

Each run gets ``SHARDCKPT_CHECK_RESUME`` (:mod:`shardckpt.check_resume.probe`): every
Checkpointer's ``local_dir`` and ``remote`` point into the check's own
directory, every ``save()`` call records digests of the state it was given
(per rank, per top-level key), and the first call at or after the run's last
step waits there until the checker kills the job (a script that loops forever
is stopped the same way). The resumed run is then compared with the reference
at every step after the one it resumed (:mod:`shardckpt.check_resume.compare`).

Exit status: 0 equal at every step after the resume, on every rank; 1 a
difference (the first step, the ranks and keys, what it usually means), a
script that does not agree with itself, or a resume that did not resume
(started fresh, skipped a newer committed step, crashed); 2 the check could
not be made (COMMAND never called ``save()``, crashed or ended before step N,
nothing was committed before the kill).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from shardckpt._proc import kill_tree
from shardckpt.check_resume import compare, diagnose, isolate, probe
from shardckpt.format import layout
from shardckpt.format.retention import FULL

OK, BAD, ERROR = 0, 1, 2
PREFIX = "shardckpt check-resume"
FIRST_TIMEOUT_S = 1800.0
"""Default ``--timeout`` of a run from scratch (an import, a dataset, a compile before the first step)."""
LATER_TIMEOUT_S, LATER_FACTOR = 300.0, 3.0
"""Default ``--timeout`` of the later runs: the reference run's time to its last step times 3, at least 5 min."""
NOTICE_S = 60.0
"""A run that has not called save() after this long (or half its timeout) is said to be waiting."""


class NotChecked(Exception):
    """The check could not be made (exit status 2), or the resume failed before any comparison (1)."""

    def __init__(self, message: str, code: int = ERROR) -> None:
        super().__init__(message)
        self.code = code


@dataclasses.dataclass
class Run:
    name: str
    stop: int
    commit: bool = False
    out: str = ""
    log: str = ""
    outcome: str = ""  # stopped | exited | timeout
    rc: int | None = None
    wall_s: float = 0.0
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    stops: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)

    @property
    def last(self) -> int | None:
        return compare.last_step(self.records)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "check-resume", help="prove that a training script resumes exactly (run, kill, resume, compare)",
        description="Run COMMAND three times, each on an empty checkpoint directory of its own (every "
        "Checkpointer's local_dir and remote are redirected; the script's own checkpoints are neither read nor "
        "written): a reference to step N, a run SIGKILLed right after its save() of step STEP committed, and that "
        "run resumed to step N. Every save() call of every rank records digests of the state it was given, per "
        "top-level key (model, optimizer, scheduler, data position, random generators, values) and the metrics "
        "passed to it; the resumed run is compared with the reference at every step after the one it resumed. "
        "Exit status 0: equal on every rank; 1: the first step that differs, its ranks and keys and what that "
        "usually means (or a script that does not agree with itself, or a resume that did not happen); 2: the "
        "check could not be made (never saved, crashed or ended before step N), with the reason.",
    )
    p.add_argument("--steps", type=int, default=20, metavar="N",
                   help="each run stops after its first save() call at or after step N")
    p.add_argument("--kill-after", type=int, metavar="STEP",
                   help="the run to resume is SIGKILLed after its first save() call at or after STEP, once that "
                   "save is committed (default: N // 2; pick a step after an epoch boundary)")
    p.add_argument("--workdir", metavar="DIR", help="where the runs' checkpoints, logs and records go (default: a "
                   "new temporary directory); must be empty or absent")
    p.add_argument("--keep", action="store_true", help="keep the work directory (each run's log, records and "
                   "checkpoints) and print where it is")
    p.add_argument("--reference-twice", action="store_true", help="run the reference twice first: a script that "
                   "does not agree with itself is reported as nondeterministic, and the resume is not blamed")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="seconds each run may take (default: "
                   f"{FIRST_TIMEOUT_S:.0f} for a run from scratch, then {LATER_FACTOR:g}x the reference run's time, at "
                   f"least {LATER_TIMEOUT_S:.0f}); a run that has called no save() after {NOTICE_S:.0f} s is said to "
                   f"be waiting")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                   help="the training command and its arguments, after --")
    p.set_defaults(func=cmd_check_resume)


def cmd_check_resume(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        return _print(ERROR, "not checked: no COMMAND. Usage: shardckpt check-resume [--steps N] "
                      "[--kill-after STEP] -- python train.py ...")
    steps = args.steps
    kill = args.kill_after if args.kill_after is not None else max(1, steps // 2)
    if steps < 2 or not 1 <= kill < steps:
        return _print(ERROR, f"not checked: --kill-after must be at least 1 and below --steps (got {kill} and "
                      f"{steps}). Remedy: e.g. --steps 20 --kill-after 12.")
    try:
        workdir = _workdir(args.workdir)
    except NotChecked as problem:
        return _print(problem.code, str(problem))
    t0 = time.monotonic()
    # SIGTERM to the checker ends its job too (the job runs in a session of its own, which a kill of the
    # checker's process group does not reach): the finally clauses below kill it and clean up.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    memory = None
    try:
        memory = isolate.MemoryDirs(workdir)
        code = _check(command, steps, kill, workdir, memory, args)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if memory is not None:
            memory.close()  # every memory copy of the check: the keepers exit, and settle() waits for them
        ended = isolate.settle(workdir)
        if ended:
            print(f"{PREFIX}: ended {', '.join(ended)}, still running {isolate.SETTLE_S:.0f} s after the runs",
                  file=sys.stderr)
        if args.keep:
            print(f"{PREFIX}: logs, records and checkpoints kept in {workdir}", file=sys.stderr)
        else:
            for name in os.listdir(workdir):  # what the check wrote; the directory too when it made it
                path = os.path.join(workdir, name)
                if os.path.isdir(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            if args.workdir is None:
                os.rmdir(workdir)
    print(f"{PREFIX}: {time.monotonic() - t0:.1f} s in all", file=sys.stderr)
    return code


def _print(code: int, text: str) -> int:
    print(f"{PREFIX}: {text}", flush=True)
    return code


def _workdir(given: str | None) -> str:
    if given is None:
        return tempfile.mkdtemp(prefix="shardckpt-check-resume-")
    path = os.path.abspath(given)
    os.makedirs(path, exist_ok=True)
    if os.listdir(path):
        raise NotChecked(f"not checked: the work directory {path} is not empty. Remedy: give an empty or absent "
                         f"--workdir (the check removes what it writes there unless --keep).")
    return path


# ------------------------------------------------------------------ the runs


def _check(command: list[str], steps: int, kill: int, workdir: str, memory: isolate.MemoryDirs,
           args: argparse.Namespace) -> int:
    refs = [Run("reference", steps)] + ([Run("reference-2", steps)] if args.reference_twice else [])
    killed, resumed = Run("killed", kill, commit=True), Run("resumed", steps)
    ckpt = os.path.join(workdir, "ckpt")  # the same path in every run: paths saved in the state compare equal
    try:
        for run in refs:
            _execute(run, command, workdir, ckpt, memory.of(run.name), args.timeout or FIRST_TIMEOUT_S)
            _usable(run, steps)
            isolate.set_aside(ckpt, run.name)
            memory.release(run.name)
        later = args.timeout or max(LATER_TIMEOUT_S, LATER_FACTOR * refs[0].wall_s)
        if len(refs) == 2:
            skip = compare.unseeded([r.records for r in refs])
            diff, equal = compare.first_difference(refs[1].records, refs[0].records, 0, steps, refs[1].name, skip)
            if diff is not None:
                return _nondeterministic(diff, "two runs from scratch", equal)
        _execute(killed, command, workdir, ckpt, memory.of("resume"), later)
        _usable(killed, kill)
        skip = compare.unseeded([r.records for r in refs + [killed]])
        diff, equal = compare.first_difference(killed.records, refs[0].records, 0, killed.last or 0, "killed", skip)
        if diff is not None:
            return _nondeterministic(diff, "the run to be killed and the reference (before any kill)", equal)
        committed = _committed(ckpt)
        if not any(committed.values()):
            saved = sorted({r["step"] for r in killed.records if r.get("event") == "save" and r.get("saved")})
            raise NotChecked(f"not checked: nothing was committed before the kill after step {killed.last} (save() "
                             f"saved at steps {saved or 'none'}). Remedy: a --kill-after at or past a step the "
                             f"script saves.")
        _execute(resumed, command, workdir, ckpt, memory.of("resume"), later)
        _usable(resumed, steps)
        isolate.set_aside(ckpt, "resume")
        memory.release("resume")
        return _verdict(refs, killed, resumed, committed, skip, args.reference_twice)
    except NotChecked as problem:
        return _print(problem.code, str(problem))


def _execute(run: Run, command: list[str], workdir: str, ckpt: str, shm_dir: str, timeout: float) -> None:
    """Run ``command`` until every rank stopped at the run's last step, it exits, or ``timeout``; then SIGKILL it.
    ``shm_dir``: its memory tier's place (``SHARDCKPT_SHM_DIR``), apart from the other lines of runs."""
    run.out = os.path.join(workdir, run.name)
    run.log = os.path.join(workdir, f"{run.name}.log")
    os.makedirs(run.out)
    env = dict(os.environ)
    env[probe.ENV] = json.dumps({"ckpt": ckpt, "out": run.out, "stop": run.stop, "commit": run.commit})
    env["SHARDCKPT_SHM_DIR"] = shm_dir
    print(f"{PREFIX}: {run.name} run, to step {run.stop}{' (then SIGKILL)' if run.commit else ''}, timeout "
          f"{timeout:.0f} s: {' '.join(command)}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with open(run.log, "wb") as log:
        try:
            proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        except OSError as exc:
            raise NotChecked(f"not checked: cannot start {command[0]!r}: {exc}") from None
    stops: dict[int, dict[str, Any]] = {}
    first, noticed = None, False
    try:
        while True:
            first, noticed = _progress(run, t0, timeout, first, noticed)
            stops = probe.read_stops(run.out)
            world = max((int(s.get("world", 1)) for s in stops.values()), default=0)
            if stops and all(rank in stops for rank in range(world)):
                run.outcome = "stopped"
                break
            if proc.poll() is not None:
                run.outcome, run.rc = "exited", proc.returncode
                break
            if time.monotonic() - t0 > timeout:
                run.outcome = "timeout"
                break
            time.sleep(0.1)
    finally:
        kill_tree(proc, [int(s["pid"]) for s in stops.values() if isinstance(s.get("pid"), int)])
    run.wall_s = time.monotonic() - t0
    run.records = probe.read_records(run.out)
    run.stops = probe.read_stops(run.out)
    print(f"{PREFIX}: {run.name} run: {_ended(run)} after {run.wall_s:.1f} s", file=sys.stderr, flush=True)


def _progress(run: Run, t0: float, timeout: float, first: int | None, noticed: bool) -> tuple[int | None, bool]:
    """Say when the run's first save() call happens, and once that it is still waiting for one."""
    waited = time.monotonic() - t0
    if first is None:
        steps = [int(r["step"]) for r in probe.read_records(run.out) if r.get("event") == "save"]
        if steps:
            first = min(steps)
            print(f"{PREFIX}: {run.name} run: first save() call, step {first}, after {waited:.1f} s",
                  file=sys.stderr, flush=True)
        elif not noticed and waited >= min(NOTICE_S, timeout / 2):
            noticed = True
            print(f"{PREFIX}: {run.name} run: no save() call yet after {waited:.0f} s; waiting up to --timeout "
                  f"{timeout:.0f} s (a script that never calls shardckpt's save() cannot be checked)",
                  file=sys.stderr, flush=True)
    return first, noticed


def _ended(run: Run) -> str:
    last = run.last
    at = f"last save() call at step {last}" if last is not None else "no save() call"
    if run.outcome == "stopped":
        return f"stopped at step {max(int(s['step']) for s in run.stops.values())}"
    if run.outcome == "timeout":
        return f"still running ({at}): killed"
    return f"exited with status {run.rc} ({at})"


def _tail(run: Run, lines: int = 15) -> str:
    try:
        with open(run.log, errors="replace") as f:
            text = f.read().rstrip().splitlines()[-lines:]
    except OSError:
        return ""
    return "\n  the end of its log:\n    " + "\n    ".join(text) if text else ""


def _usable(run: Run, target: int) -> None:
    """The run reached its last step: else why not (exit 2; the resumed run's failure is the resume's: 1)."""
    if run.outcome == "stopped":
        return
    code = BAD if run.name == "resumed" and run.outcome == "exited" and run.rc != 0 else ERROR
    last = run.last
    if last is None:
        if run.outcome == "timeout":
            raise NotChecked(f"not checked: the {run.name} run called no save() within --timeout "
                             f"{run.wall_s:.0f} s{_tail(run)}", code)
        if run.rc != 0:
            raise NotChecked(f"{'resume failed' if code == BAD else 'not checked'}: the {run.name} run crashed "
                             f"(exit status {run.rc}) before its first save() call.{_tail(run)}", code)
        raise NotChecked(f"not checked: the {run.name} run exited with status 0 without calling save(). "
                         f"check-resume compares what scripts pass to shardckpt's save() (Checkpointer.save, "
                         f"shardckpt.save or an integration); a script that never calls it cannot be checked."
                         f"{_tail(run)}")
    if run.outcome == "timeout":
        raise NotChecked(f"not checked: the {run.name} run did not reach step {target} within --timeout "
                         f"({run.wall_s:.0f} s; last save() call at step {last}). Remedy: raise --timeout or "
                         f"lower --steps.{_tail(run)}")
    if run.rc == 0:
        raise NotChecked(f"not checked: the {run.name} run ended by itself after step {last}, before step {target}. "
                         f"Remedy: --steps {last} at most (the script stops there), or let it train longer.")
    if code == BAD:
        raise NotChecked(f"resume failed: the resumed run crashed (exit status {run.rc}) after its save() call of "
                         f"step {last}: a resume that crashes is not exact.{_tail(run)}", BAD)
    raise NotChecked(f"not checked: the {run.name} run crashed on its own (exit status {run.rc}) after its save() "
                     f"call of step {last}, before step {target}.{_tail(run)}")


def _committed(ckpt: str) -> dict[str, dict[int, str]]:
    """Checkpointer tag -> its committed steps and their kinds (full, light), after the kill."""
    out = {}
    for name in sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []:
        root = os.path.join(ckpt, name)
        if os.path.isdir(root) and not name.endswith(".remote"):
            manifests = {s: layout.read_manifest(os.path.join(root, layout.step_dirname(s)))
                         for s in layout.committed_steps(root)}
            out[name] = {s: m.kind for s, m in manifests.items() if m is not None}
    return out


def _newer(committed: dict[str, dict[int, str]], tag: str, step: int | None, full: bool) -> list[int]:
    return sorted(s for s, kind in committed.get(tag, {}).items()
                  if step is not None and s > step and (kind == FULL) == full)


# ------------------------------------------------------------------ the verdict


def _nondeterministic(diff: compare.Difference, which: str, equal: list[int]) -> int:
    lines = [f"nondeterministic: {which} differ at step {diff.step} ({_equal_text(equal)}): "
             f"{', '.join(diff.keys()) or 'the metrics'} differ.", *diff.lines(),
             f"  what it means: {compare.NONDETERMINISM}"]
    return _print(BAD, "\n".join(lines))


def _said(*runs: Run) -> list[str]:
    """shardckpt's own WARNINGs in the runs' logs, quoted (they often name the fault)."""
    out = []
    for run in runs:
        quoted = diagnose.warnings(run.log)
        if quoted:
            out.append(f"  shardckpt said in the {run.name} run:")
            out += [f"    {line}" for line in quoted]
    return out


def _equal_text(equal: list[int]) -> str:
    return f"equal at steps {equal[0]}..{equal[-1]}" if equal else "no step before it compared"


def _resumed_from(resumed: Run, committed: dict[str, dict[int, str]], ref: Run) -> int:
    loaded = compare.loads(resumed.records)
    first = min((int(r["step"]) for r in resumed.records if r.get("event") == "save"), default=None)
    if not loaded:
        ref_first = min((int(r["step"]) for r in ref.records if r.get("event") == "save"), default=None)
        if first is None or ref_first is None or first <= ref_first:
            raise NotChecked("resume failed: the resumed run started from the beginning (its first save() call is "
                             f"step {first}, as in the reference) and never called load(). Remedy: call "
                             f"Checkpointer.load(state) before the training loop and start after the step it "
                             f"returns.", BAD)
        return first - 1
    steps = set(loaded.values())
    if steps == {None}:
        newest = max((max(s) for s in committed.values() if s), default=None)  # any kind
        raise NotChecked(f"resume failed: the resumed run's load() found nothing to resume, though step {newest} "
                         f"was committed by the killed run under the same local_dir (redirected). Does the script "
                         f"load from another Checkpointer than the one that saves?", BAD)
    if len(steps) > 1:
        raise NotChecked(f"resume failed: the ranks resumed different steps: "
                         f"{', '.join(f'rank {r}: {s}' for (_t, r), s in sorted(loaded.items()))}", BAD)
    step = steps.pop()
    for (tag, _rank), got in loaded.items():
        newer = _newer(committed, tag, got, full=True)
        if newer:
            raise NotChecked(f"resume failed: the resumed run restored step {got}, but step {max(newer)} was "
                             f"committed (a full step) when the job was killed: the resume skipped a newer step "
                             f"without a word.", BAD)
    return int(step)


def _verdict(refs: list[Run], killed: Run, resumed: Run, committed: dict[str, dict[int, str]],
             skip: frozenset[tuple[str, str]], twice: bool) -> int:
    ref = refs[0]
    start = _resumed_from(resumed, committed, ref)
    upto = min(ref.last or 0, resumed.last or 0)
    diff, equal = compare.first_difference(resumed.records, ref.records, start, upto, "resumed", skip)
    killed_at = max(int(s["step"]) for s in killed.stops.values())
    how = f"killed after step {killed_at}, resumed from step {start}"
    light = sorted({s for tag in committed for s in _newer(committed, tag, start, full=False)})
    notes = [f"  note: step{'s' if len(light) > 1 else ''} {', '.join(map(str, light))} committed too, light "
             f"(without optimizer state: full_every, save(light=True), torchtitan's last_save_model_only), which "
             f"load() does not resume by default; the resume took step {start}"] if light else []
    if diff is not None:
        causes = diagnose.causes(diff, start, resumed.records, ref.records, killed.records, twice)
        lines = [f"DIFFERS at step {diff.step}, "
                 + ("the first step after the resume" if diff.step == start + 1 or not equal
                    else f"after {len(equal)} equal step(s) ({_equal_text(equal)})")
                 + f" ({how}); differing: {', '.join(diff.keys()) or 'the reported metrics'}",
                 *diff.lines(), f"  what it usually means: {causes[0]}", *[f"  also: {c}" for c in causes[1:]],
                 *notes, *_said(killed, resumed)]
        return _print(BAD, "\n".join(lines))
    if not equal:
        raise NotChecked(f"not checked: no save() call after step {start} to compare ({how}; the runs stopped at "
                         f"{ref.last} and {resumed.last}). Remedy: a larger --steps.")
    lanes = sorted(compare.series(resumed.records))
    ranks = sorted({rank for _tag, rank in lanes})
    roles = compare.key_roles(resumed.records)
    keys = ", ".join(f"{compare.label(k)} [{compare.ROLE_NAMES.get(r, r)}]"
                     for k, r in sorted(roles.items(), key=lambda kr: compare.label(kr[0])))
    metrics = sorted({m for r in resumed.records for m in (r.get("metrics") or {})})
    lines = [f"equal: steps {equal[0]}..{equal[-1]} on every rank ({len(ranks)} rank{'s' if len(ranks) > 1 else ''}, "
             f"{len(equal)} save() calls compared; {how})", f"  compared: {keys}"
             + (f"; the reported {', '.join(metrics)}" if metrics else "")]
    if skip:
        lines.append(f"  not compared: {', '.join(sorted(f'{compare.label(k)}.{p}' for k, p in skip))} (never "
                     f"seeded: they differ "
                     f"between two runs from scratch; were they used, what they feed would differ)")
    return _print(OK, "\n".join(lines + notes))
