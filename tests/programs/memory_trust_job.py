"""One trainer process of the memory tier's trust tests: whose copies it resumes, and what a memory problem costs.

usage: memory_trust_job.py DIR OUT ACTION [ACTION ...]

  load         load(); OUT/load.json: the step, the weights' first value and every WARNING logged
  train=A-B    save() steps A..B (memory every step, disk every MEMJOB_EVERY, memory_keep MEMJOB_KEEP); the
               weights of step s are MEMJOB_TAG * 1000 + s; OUT/train.json: the steps whose save() returned
               and what each handle said, every WARNING, the steps on disk
  stall        the next disk write stalls (its writer thread sleeps) and never commits
  killcopy=N   SIGKILL during the copy of step N (after its bytes, before its record)
  fill         fill the shared memory directory (SHARDCKPT_SHM_DIR) up, leaving 64 KiB
  kill         SIGKILL now (right after the last save() returned)
  wait         wait() for the disk write in flight
  close        close()
"""

import json
import logging
import os
import signal
import sys
import time

import torch

import shardckpt
from shardckpt import _failpoints


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.said: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.said.append(record.getMessage())


def main() -> None:
    root, out, actions = sys.argv[1], sys.argv[2], sys.argv[3:]
    warned = _Warnings()
    logging.getLogger("shardckpt").addHandler(warned)
    tag = int(os.environ.get("MEMJOB_TAG", "1"))
    ckpt = shardckpt.Checkpointer(local_dir=root, memory_every_steps=1,
                                  memory_keep=int(os.environ.get("MEMJOB_KEEP", "1")),
                                  every_steps=int(os.environ.get("MEMJOB_EVERY", "10")), preemption_signals=())
    state = {"weights": torch.zeros(int(os.environ.get("MEMJOB_NUMEL", "4096"))), "meta": {"at": -1}}
    kill_at, saved = None, {}
    for action in actions:
        name, _, arg = action.partition("=")
        if name == "load":
            got = ckpt.load(state)
            _dump(out, "load", {"got": got, "value": float(state["weights"][0]), "meta": state["meta"],
                                "warnings": warned.said})
        elif name == "train":
            first, last = map(int, arg.split("-"))
            for step in range(first, last + 1):
                if step == kill_at:
                    _failpoints.arm("memory.copied", _failpoints.KILL)
                state["weights"].fill_(tag * 1000 + step)
                state["meta"] = {"at": step, "tag": tag}
                handle = ckpt.save(state, step)
                saved[step] = None if handle is None else handle.tier
                _dump(out, "train", {"saved": saved, "warnings": warned.said, "steps": ckpt.steps()})
        elif name == "stall":
            _failpoints.arm("write.done", lambda: time.sleep(120))
        elif name == "killcopy":
            kill_at = int(arg)
        elif name == "fill":
            where = os.environ["SHARDCKPT_SHM_DIR"]
            st = os.statvfs(where)
            with open(os.path.join(where, "filler"), "wb") as f:
                os.posix_fallocate(f.fileno(), 0, max(0, st.f_bavail * st.f_frsize - (64 << 10)))
        elif name == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif name == "wait":
            ckpt.wait()
            _dump(out, "train", {"saved": saved, "warnings": warned.said, "steps": ckpt.steps()})
        elif name == "close":
            ckpt.close()


def _dump(out: str, what: str, body: dict) -> None:
    tmp = os.path.join(out, f"{what}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(body, f)
    os.replace(tmp, os.path.join(out, f"{what}.json"))


if __name__ == "__main__":
    main()
