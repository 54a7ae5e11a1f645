"""save() called on rank 0 only, as in scripts that kept `if master_process: torch.save(...)`.

usage: one_rank_save.py DIR OUT [last-dies]  (2 ranks; SHARDCKPT_SAVE_AGREE_TIMEOUT_S set by the test)

Both ranks save step 1; then only rank 0 calls save(step 2) and must get a
SaveError naming rank 1 within the bound, while rank 1 goes on to the final
barrier. Every rank writes OUT/result.<rank>.json.

last-dies: both ranks call save(step 2), rank 1 a second later, and rank 1
dies (SIGKILL) right after its check-in made it the last rank to arrive,
before it told rank 0 to go on. Rank 0 writes OUT/result.0.json with what
its save() raised and when (torchrun ends rank 0 soon after: SIGTERM, then
SIGKILL after its grace).
"""

import logging
import os
import sys
import time

import common
import torch

import shardckpt


def main() -> None:
    root, out = sys.argv[1], sys.argv[2]
    rank, _world = common.init()
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("shardckpt").addHandler(Keep())
    model = torch.nn.Linear(4, 2)
    state = {"model": model, "extra": {"at": 0}}
    ckpt = shardckpt.Checkpointer(local_dir=root, mode="sync")  # the timeout comes from SHARDCKPT_*
    ckpt.save(state, 1)
    result = {"timeout": ckpt.config.save_agree_timeout_s}
    if sys.argv[3:] == ["last-dies"]:
        last_dies(rank, ckpt, state, result, out)
    if rank == 0:
        t0 = time.monotonic()
        try:
            ckpt.save(state, 2)
            result["error"] = None
        except shardckpt.SaveError as exc:
            result["error"] = str(exc)
        result["seconds"] = time.monotonic() - t0
        result["logged"] = [m for m in records if "waits for" in m]
    result["steps"] = ckpt.steps()
    common.write_json(os.path.join(out, f"result.{rank}.json"), result)
    ckpt.close()
    common.finish()


def last_dies(rank, ckpt, state, result, out) -> None:
    from shardckpt import _failpoints

    if rank == 1:
        time.sleep(1.0)  # rank 0 checks in first
        _failpoints.arm("checkin.arrived", _failpoints.KILL)
    t0 = time.monotonic()
    try:
        ckpt.save(state, 2)
        result["error"] = None
    except Exception as exc:  # noqa: BLE001 - whatever the failed save raised, recorded
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["seconds"] = time.monotonic() - t0
    common.write_json(os.path.join(out, f"result.{rank}.json"), result)
    os._exit(0)  # no teardown with a dead peer


if __name__ == "__main__":
    main()
