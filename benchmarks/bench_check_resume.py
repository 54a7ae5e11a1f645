"""What ``shardckpt check-resume`` costs (case ``check_resume``).

    python benchmarks/bench_check_resume.py --gib 1 --repeats 5 [--dir DIR] [--json FILE]

One process, a module of ``--gib`` fp32 (tensors of 64 MiB) and AdamW-free
(the model only: the bytes a save copies are the bytes hashed).

Per save (group ``per save``): the time ``save()`` blocks in a normal run
(floor), and in a run under the check, where every call also records the
digests of the state (``state_digest.digest``: xxh3-64 over every tensor's
bytes, the structure, the RNG); the digest alone; and xxh3-64 over the same
tensors' bytes, the hash's own floor. Each save's write is committed
(untimed) before the next.

A check (group ``a check of a small script``): the wall time of
``shardckpt check-resume --steps 12 --kill-after 7`` on
``tests/programs/resume_script.py`` (three runs: reference, killed,
resumed), against one plain run of the same script to step 12 without the
check (floor).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import common  # noqa: E402  (puts src/ on sys.path)
import torch
import xxhash

import shardckpt  # noqa: E402
from shardckpt.check_resume import digest as state_digest
from shardckpt.check_resume import probe as resume_probe  # noqa: E402

SCRIPT = common.ROOT / "tests" / "programs" / "resume_script.py"


def raw_hash(model) -> None:
    for p in model.parameters():
        xxhash.xxh3_64(p.detach().reshape(-1).view(torch.uint8).numpy()).digest()


def per_save(result: dict, model, state: dict, root, repeats: int) -> None:
    plain = shardckpt.Checkpointer(local_dir=str(root / "plain"), keep_last=1, preemption_signals=())
    os.environ[resume_probe.ENV] = json.dumps({"ckpt": str(root / "checked"), "out": str(root / "records")})
    try:
        checked = shardckpt.Checkpointer(local_dir=str(root / "checked"), keep_last=1, preemption_signals=())
    finally:
        del os.environ[resume_probe.ENV]
    steps = iter(range(1, 1 << 30))
    tools = [
        common.Tool("save() blocks, normal run (floor)", lambda: plain.save(state, next(steps)), after=plain.wait,
                    floor=True),
        common.Tool("save() blocks, under check-resume", lambda: checked.save(state, next(steps)), after=checked.wait),
        common.Tool("the digest alone (state_digest.digest)", lambda: state_digest.digest(state, 0)),
        common.Tool("xxh3-64 of the tensors' bytes", lambda: raw_hash(model)),
    ]
    common.add_rate(common.compare(result, tools, repeats, group="per save"), common.nbytes_of(model))
    plain.close()
    checked.close()
    records = resume_probe.read_records(str(root / "records"))
    assert records and all(r["event"] == "save" and "model" in r["keys"] for r in records), records[:1]


def a_check(result: dict, root, repeats: int) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(common.SRC), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    script = [sys.executable, str(SCRIPT), str(root / "own")]
    check = [sys.executable, "-m", "shardckpt", "check-resume", "--steps", "12", "--kill-after", "7", "--", *script]

    def run(cmd: list[str]) -> None:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=str(root))
        if out.returncode != 0:
            raise RuntimeError(f"{cmd[2:4]} exit {out.returncode}: {out.stdout[-500:]} {out.stderr[-1500:]}")
        common.fresh_dir(root / "own")

    tools = [
        common.Tool("one run of the script to step 12 (floor)", lambda: run(script + ["--steps", "12"]), floor=True),
        common.Tool("shardckpt check-resume --steps 12 --kill-after 7", lambda: run(check)),
    ]
    common.compare(result, tools, repeats, group="a check of a small script")


def main() -> None:
    args = common.sized_args(__doc__, "timed calls per row")
    common.require_memory(2.2 * args.gib * common.GIB, "the state and its staging buffers")
    model = common.make_model(int(args.gib * common.GIB))
    state = {"model": model}
    nbytes = common.nbytes_of(model)
    result = common.new_result("check_resume", nbytes, repeats=args.repeats)
    with common.scratch("check-resume", args.dir) as root:
        t0 = time.perf_counter()
        per_save(result, model, state, root, args.repeats)
        a_check(result, root, max(1, min(args.repeats, 3)))
        result["notes"].append(f"measured in {time.perf_counter() - t0:.0f} s; not checking, a save() call only "
                               "tests that its recorder is None")
    common.emit(result, args.json)


if __name__ == "__main__":
    main()
