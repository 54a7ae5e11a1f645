"""What a training process does while ``shardckpt check-resume`` runs it (torch-free).

``shardckpt check-resume`` runs the user's command with ``SHARDCKPT_CHECK_RESUME``
set to a JSON object::

    {"ckpt": "/tmp/w/ckpt",     every Checkpointer's local_dir and remote go under here
     "out": "/tmp/w/killed",    where each rank writes its records
     "stop": 7,                 the first save() call at or after this step is the run's last
     "commit": true}            (the kill run) that call waits for its save's commit first

While the variable is set:

* every :class:`~shardckpt.CheckpointConfig` is redirected (:func:`redirect`),
  explicit arguments included: ``local_dir`` becomes ``<ckpt>/<name>`` and a
  ``remote`` becomes ``file://<ckpt>/<name>.remote``, ``<name>`` made from the
  original (so that two checkpointers of one script stay apart and every run of
  the check sees the same paths); nothing of the user's own checkpoints is read
  or written;
* each ``save()`` call appends one record to ``<out>/rank<R>.<pid>.jsonl``: the
  step, whether it saved, a digest of the state it was given per top-level key
  (:mod:`shardckpt.check_resume.digest`) and the ``metrics`` passed; ``load()`` appends
  the step it restored;
* the call at or after ``stop`` writes ``<out>/stop.rank<R>`` and then waits to
  be SIGKILLed by the checker (which kills the job once every rank wrote one).

Unset (every normal run), :func:`recorder` returns ``None`` and ``save()`` does
nothing more than test that.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import sys
import time
from typing import Any, Callable

from shardckpt.errors import ConfigError

ENV = "SHARDCKPT_CHECK_RESUME"
"""The variable the checker sets for the runs it makes (a JSON object, see the module's docstring)."""

STOP_WAIT_S = 900.0
"""How long a stopped rank waits for the checker's SIGKILL before it leaves by itself."""


def settings(environ: Any = None) -> dict[str, Any] | None:
    """The check this process runs under, or ``None`` (the variable unset: a normal run)."""
    raw = (os.environ if environ is None else environ).get(ENV)
    if not raw:
        return None
    try:
        found = json.loads(raw)
        if not isinstance(found, dict) or not isinstance(found.get("ckpt"), str):
            raise ValueError("no 'ckpt' directory")
    except ValueError as exc:
        raise ConfigError(f"SHARDCKPT_CHECK_RESUME is set but is not the JSON object shardckpt check-resume "
                          f"writes ({exc}); unset it outside a check") from None
    return found


def _name(original: str) -> str:
    """A directory name for an original path or URL: readable, and distinct for distinct originals."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(original.rstrip("/")) or "root")[:40]
    return f"{base}-{hashlib.sha1(original.encode()).hexdigest()[:8]}"


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def redirect(local_dir: str, remote: str | None) -> tuple[str, str | None]:
    """``(local_dir, remote)`` as this process must use them: unchanged outside a check, under the
    check's directory inside one (whatever the script passed). Redirecting twice changes nothing."""
    found = settings()
    if found is None:
        return local_dir, remote
    root = os.path.abspath(found["ckpt"])
    local = os.path.abspath(os.fspath(local_dir))
    if not _inside(local, root):
        local = os.path.join(root, _name(local))
    if remote is not None and not remote.startswith("file://" + root.rstrip(os.sep) + os.sep):
        remote = "file://" + os.path.join(root, _name(remote) + ".remote")
    return local, remote


def recorder(root: str) -> "Recorder | None":
    """The recorder of the Checkpointer of ``root`` (its redirected ``local_dir``); ``None`` outside a check."""
    found = settings()
    return None if found is None else Recorder(found, os.path.basename(root))


class Recorder:
    """Appends one Checkpointer's records to this process's record file, and stops the run."""

    def __init__(self, found: dict[str, Any], tag: str) -> None:
        self.out = os.path.abspath(found.get("out") or found["ckpt"])
        self.stop = found.get("stop")
        self.commit = bool(found.get("commit"))
        self.tag = tag

    def _write(self, rank: int, record: dict[str, Any]) -> None:
        os.makedirs(self.out, exist_ok=True)
        record.update(tag=self.tag, rank=rank, pid=os.getpid())
        line = json.dumps(record, sort_keys=True, default=repr) + "\n"
        with open(os.path.join(self.out, f"rank{rank}.{os.getpid()}.jsonl"), "a") as f:
            f.write(line)

    def loaded(self, rank: int, step: int | None) -> None:
        self._write(rank, {"event": "load", "step": step})

    @staticmethod
    def digest(make: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], float]:
        """The digests of a ``save()`` call's state (``make()``), and the seconds they took."""
        t0 = time.perf_counter()
        keys = make()
        return keys, time.perf_counter() - t0

    def saved(self, rank: int, world: int, step: int, saved: bool, digests: tuple[dict[str, Any], float],
              metrics: dict[str, Any] | None, wait: Callable[[], None]) -> None:
        """A ``save()`` call returned: record it; the run's last call waits to be killed."""
        keys, took = digests
        self._write(rank, {"event": "save", "step": step, "world": world, "saved": saved, "keys": keys,
                           "metrics": _numbers(metrics), "digest_s": round(took, 6)})
        if self.stop is None or step < int(self.stop):
            return
        error = None
        if self.commit:
            try:
                wait()  # the kill comes right after this step's save is committed
            except Exception as exc:  # noqa: BLE001 - recorded: the checker reports what was committed
                error = f"{type(exc).__name__}: {exc}"
        body = json.dumps({"step": step, "world": world, "pid": os.getpid(), "tag": self.tag, "error": error})
        path = os.path.join(self.out, f"stop.rank{rank}")
        with open(path + ".tmp", "w") as f:
            f.write(body)
        os.replace(path + ".tmp", path)
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.5)
        sys.stderr.write(f"shardckpt check-resume: rank {rank} stopped after step {step} and was not killed "
                         f"within {STOP_WAIT_S:.0f} s (the checker is gone?); exiting\n")
        os._exit(3)


def _numbers(metrics: dict[str, Any] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in (metrics or {}).items():
        try:
            out[str(key)] = float(value)
        except (TypeError, ValueError):
            continue
    return out


# ------------------------------------------------------------------ the checker's side


def read_records(out: str) -> list[dict[str, Any]]:
    """Every record the ranks of one run wrote, in the order each process wrote them."""
    records = []
    for path in sorted(glob.glob(os.path.join(out, "rank*.jsonl"))):
        with open(path) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    continue  # the last line of a process killed while writing it
    return records


def read_stops(out: str) -> dict[int, dict[str, Any]]:
    """Rank -> its stop record, for the ranks that reached the run's last step."""
    found = {}
    for path in glob.glob(os.path.join(out, "stop.rank*")):
        suffix = os.path.basename(path)[len("stop.rank"):]
        if not suffix.isdigit():
            continue
        try:
            with open(path) as f:
                found[int(suffix)] = json.load(f)
        except (OSError, ValueError):
            continue
    return found
