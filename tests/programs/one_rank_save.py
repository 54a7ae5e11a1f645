"""save() called on rank 0 only, as in scripts that kept `if master_process: torch.save(...)`.

usage: one_rank_save.py DIR OUT  (2 ranks; SHARDCKPT_SAVE_AGREE_TIMEOUT_S set by the test)

Both ranks save step 1; then only rank 0 calls save(step 2) and must get a
SaveError naming rank 1 within the bound, while rank 1 goes on to the final
barrier. Every rank writes OUT/result.<rank>.json.
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


if __name__ == "__main__":
    main()
