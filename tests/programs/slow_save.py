"""Single process: commit step 1, then start saving a large step 2 and wait to be killed.

usage: slow_save.py CKPT_DIR MARKER
"""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

import torch  # noqa: E402

import shardckpt  # noqa: E402


def main() -> None:
    ckpt_dir, marker = sys.argv[1:3]
    torch.manual_seed(0)
    state = {"weights": [torch.randn(8 << 20) for _ in range(6)], "step_note": 1}  # 6 x 32 MiB
    ckpt = shardckpt.Checkpointer(local_dir=ckpt_dir, io_threads=1)
    ckpt.save(state, 1).wait()
    torch.save([t.clone() for t in state["weights"]], marker + ".expected")
    for t in state["weights"]:
        t.add_(1.0)
    state["step_note"] = 2
    ckpt.save(state, 2)
    open(marker, "w").close()
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
