#!/usr/bin/env python3
"""Break one guarantee at a time on a throwaway copy of the repository and see whether its tests notice.

Each entry of the list (``scripts/breakit.toml``) names a file, an exact
snippet of it (unique in the file: matched by text, never by line number, so
that moving code around does not silently point a break elsewhere), the text
that replaces it, and the tests that claim the guarantee. For every entry
this script applies the break to a copy of the repository's files (its
tracked and untracked-but-not-ignored files, as they are in the working
tree), runs the named tests there (``pytest -x -n 0``, bounded by a timeout),
puts the file back, and reports:

- ``CAUGHT``: a named test failed with the break in place;
- ``MISSED``: every named test passed with the guarantee broken (a hole);
- ``ERROR``: the snippet is not found in the file (or found more than once),
  the broken file does not compile, pytest could not run the tests (none
  collected, a usage error), or the run timed out;

then a summary line. Exit status 0 when every entry run was CAUGHT, else 1.
It is slow (every entry runs real tests) and is not part of CI: run it
before a change lands on the entries that claim what the change touches.

    python scripts/breakit.py                      # every entry
    python scripts/breakit.py --only replica       # entries whose id matches a regular expression
    python scripts/breakit.py --check              # only check that every snippet is still found
    python scripts/breakit.py --python .venv/bin/python --timeout 300 --json out.json

Documented in docs/project/tests.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_LIST = os.path.join(ROOT, "scripts", "breakit.toml")


@dataclasses.dataclass
class Entry:
    id: str
    file: str
    find: str
    replace: str
    tests: list[str]
    guarantee: str = ""
    timeout: float | None = None


@dataclasses.dataclass
class Result:
    id: str
    verdict: str  # CAUGHT, MISSED, ERROR
    detail: str
    seconds: float


def load_entries(path: str) -> list[Entry]:
    with open(path, "rb") as f:
        body = tomllib.load(f)
    entries = []
    seen = set()
    for i, raw in enumerate(body.get("break", [])):
        missing = [k for k in ("id", "file", "find", "replace", "tests") if k not in raw]
        if missing:
            raise SystemExit(f"{path}: entry {i + 1} ({raw.get('id', '?')}) lacks {', '.join(missing)}")
        unknown = set(raw) - {f.name for f in dataclasses.fields(Entry)}
        if unknown:
            raise SystemExit(f"{path}: entry {raw['id']} has unknown keys {sorted(unknown)}")
        if raw["id"] in seen:
            raise SystemExit(f"{path}: entry id {raw['id']} appears twice")
        if raw["find"] == raw["replace"]:
            raise SystemExit(f"{path}: entry {raw['id']}: the replacement is the original text")
        seen.add(raw["id"])
        tests = raw["tests"]
        entries.append(Entry(**{**raw, "tests": [tests] if isinstance(tests, str) else list(tests)}))
    return entries


def snippet_problem(root: str, entry: Entry) -> str | None:
    """Why ``entry`` cannot be applied in ``root`` (``None``: its snippet is there exactly once)."""
    path = os.path.join(root, entry.file)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return f"file not found: {entry.file} (moved? update the entry)"
    count = text.count(entry.find)
    if count == 0:
        return f"snippet not found in {entry.file} (the code changed or moved: update the entry)"
    if count > 1:
        return f"snippet found {count} times in {entry.file} (make it unique: take more of the line around it)"
    return None


def repo_files(root: str) -> list[str]:
    """The repository's files as the working tree has them: tracked, and untracked but not ignored."""
    out = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         check=True, stdout=subprocess.PIPE).stdout.decode()
    return sorted({p for p in out.split("\0") if p and os.path.isfile(os.path.join(root, p))})


def make_copy(root: str, dest: str) -> None:
    for rel in repo_files(root):
        target = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(root, rel), target, follow_symlinks=False)


def drop_bytecode(path: str) -> None:
    """The cached bytecode of ``path``: a break and its undoing can keep size and mtime second alike."""
    stem = os.path.splitext(os.path.basename(path))[0]
    for pyc in glob.glob(os.path.join(os.path.dirname(path), "__pycache__", f"{stem}.*.pyc")):
        os.unlink(pyc)


def child_env(copy: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(copy, "src") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("PYTEST_ADDOPTS", None)
    return env


def run_bounded(cmd: list[str], cwd: str, env: dict[str, str], timeout: float, nice: int, log_path: str) -> int | None:
    """Run ``cmd`` in a session of its own (its torchrun jobs and servers with it); ``None``: timed out,
    the whole session killed."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=(lambda: os.nice(nice)) if nice else None)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # anything it left behind in its session
            except ProcessLookupError:
                pass


def first_failure(log_path: str) -> str:
    with open(log_path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    found = re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", text, re.M)
    return found[0] if found else ""


def tail(log_path: str, n: int = 15) -> str:
    with open(log_path, encoding="utf-8", errors="replace") as f:
        return "".join(f.readlines()[-n:])


def run_entry(entry: Entry, copy: str, args: argparse.Namespace, logs: str) -> Result:
    t0 = time.monotonic()
    problem = snippet_problem(copy, entry)
    if problem is not None:
        return Result(entry.id, "ERROR", problem, 0.0)
    missing = [t for t in entry.tests if not os.path.exists(os.path.join(copy, t.split("::")[0]))]
    if missing:
        return Result(entry.id, "ERROR", f"test file not found: {', '.join(missing)} (update the entry)", 0.0)
    path = os.path.join(copy, entry.file)
    with open(path, encoding="utf-8") as f:
        original = f.read()
    log_path = os.path.join(logs, f"{entry.id}.log")
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(original.replace(entry.find, entry.replace, 1))
        drop_bytecode(path)
        if path.endswith(".py"):
            compiled = subprocess.run([args.python, "-m", "py_compile", path], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
            if compiled.returncode != 0:
                return Result(entry.id, "ERROR", "the broken file does not compile: " + compiled.stdout.strip()[-300:],
                              time.monotonic() - t0)
        cmd = [args.python, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider", "-p", "no:randomly",
               *entry.tests]
        timeout = entry.timeout or args.timeout
        rc = run_bounded(cmd, copy, child_env(copy), timeout, args.nice, log_path)
    finally:
        with open(path, "w", encoding="utf-8") as f:
            f.write(original)
        drop_bytecode(path)
    took = time.monotonic() - t0
    if rc is None:
        return Result(entry.id, "ERROR", f"timed out after {timeout:.0f} s:\n{tail(log_path)}", took)
    if rc == 1:
        return Result(entry.id, "CAUGHT", first_failure(log_path), took)
    if rc == 0:
        return Result(entry.id, "MISSED", "every named test passed with the break in place", took)
    return Result(entry.id, "ERROR", f"pytest exit status {rc}:\n{tail(log_path)}", took)


def check_import(copy: str, python: str) -> None:
    """The copy's package is the one its tests import (not the worktree's)."""
    got = subprocess.run([python, "-c", "import shardckpt, os; print(os.path.realpath(shardckpt.__file__))"],
                         cwd=copy, env=child_env(copy), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if got.returncode != 0 or not got.stdout.strip().startswith(os.path.realpath(copy)):
        raise SystemExit(f"breakit: {python} does not import shardckpt from the copy {copy}: {got.stdout.strip()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", dest="list_path", default=DEFAULT_LIST, help="the list of breaks (TOML)")
    parser.add_argument("--only", action="append", default=[], metavar="PATTERN",
                        help="run only the entries whose id (or file) matches this regular expression (repeatable)")
    parser.add_argument("--python", default=None,
                        help="the Python that runs the tests (default: the repository's .venv, else this one)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per break (an entry may set its own)")
    parser.add_argument("--nice", type=int, default=10, help="niceness of the test runs (0: as this process)")
    parser.add_argument("--check", action="store_true", help="only check that every snippet is found, run nothing")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--keep", action="store_true", help="keep the throwaway copy and the logs")
    args = parser.parse_args(argv)
    if args.python is None:
        venv = os.path.join(ROOT, ".venv", "bin", "python")
        args.python = venv if os.path.exists(venv) else sys.executable

    entries = load_entries(args.list_path)
    if args.only:
        entries = [e for e in entries if any(re.search(p, e.id) or re.search(p, e.file) for p in args.only)]
        if not entries:
            print(f"breakit: no entry matches {args.only}", file=sys.stderr)
            return 2
    if args.check:
        bad = [(e.id, snippet_problem(ROOT, e)) for e in entries]
        bad += [(e.id, f"test file not found: {t}") for e in entries for t in e.tests
                if not os.path.exists(os.path.join(ROOT, t.split("::")[0]))]
        for ident, problem in bad:
            if problem:
                print(f"ERROR   {ident}: {problem}")
        n_bad = sum(1 for _, p in bad if p)
        print(f"breakit --check: {len(entries)} entries, {n_bad} problem(s)")
        return 1 if n_bad else 0

    work = tempfile.mkdtemp(prefix="shardckpt-breakit-")
    copy, logs = os.path.join(work, "repo"), os.path.join(work, "logs")
    os.makedirs(logs)
    results: list[Result] = []
    try:
        make_copy(ROOT, copy)
        check_import(copy, args.python)
        print(f"breakit: {len(entries)} entries, tests run by {args.python} in {copy}", flush=True)
        for entry in entries:
            result = run_entry(entry, copy, args, logs)
            results.append(result)
            detail = result.detail.replace("\n", "\n        ")
            print(f"{result.verdict:7} {entry.id} ({result.seconds:.0f} s) {detail}", flush=True)
    except KeyboardInterrupt:
        print("breakit: interrupted", file=sys.stderr)
    finally:
        if args.keep:
            print(f"breakit: kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    counts = {v: sum(1 for r in results if r.verdict == v) for v in ("CAUGHT", "MISSED", "ERROR")}
    missed = [r.id for r in results if r.verdict == "MISSED"]
    errors = [r.id for r in results if r.verdict == "ERROR"]
    print(f"breakit: {len(results)} of {len(entries)} run: {counts['CAUGHT']} CAUGHT, {counts['MISSED']} MISSED"
          + (f" ({', '.join(missed)})" if missed else "") + f", {counts['ERROR']} ERROR"
          + (f" ({', '.join(errors)})" if errors else "") + f"; {sum(r.seconds for r in results):.0f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
    return 0 if results and counts["CAUGHT"] == len(entries) else 1


if __name__ == "__main__":
    sys.exit(main())
