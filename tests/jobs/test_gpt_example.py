"""examples/train_gpt.py, a training script of the usual shape, and the traps such scripts hit.

Bitwise resume after the job is SIGKILLed under torchrun and started again,
against a run never interrupted; a 2 -> 1 resume on a fresh
directory from the S3 server, with the model built from the checkpoint's
config through peek(); save() called on rank 0 only; peek() and
``inspect --values`` on both tiers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import PROGRAMS, ROOT, child_env, kill_job, run_torchrun, start_torchrun, wait_for  # noqa: E402
from s3server import BUCKET, stop_uploaders  # noqa: E402

import shardckpt  # noqa: E402
from shardckpt import cli
from shardckpt.format import layout  # noqa: E402

EXAMPLE = ROOT / "examples" / "train_gpt.py"
ITERS = 16


@pytest.fixture
def bucket(s3, tmp_path):
    s3.reset()
    yield s3
    stop_uploaders(tmp_path, grace_s=30.0)


def losses(path: Path) -> dict[int, str]:
    """Iteration -> loss (float.hex); a resumed run logs the iterations after its step again: the last one counts."""
    out = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        out[row["iter"]] = row["loss"]
    return out


ONE_SERVER = pytest.mark.parametrize("s3", ["moto"], indirect=True)


@ONE_SERVER
def test_sigkill_resumes_bitwise_and_a_fresh_machine_resumes_2_to_1_from_the_bucket(bucket, tmp_path):
    env = child_env(**bucket.env(), SHARDCKPT_LOG_LEVEL="WARNING")
    # The reference: never interrupted.
    ref = tmp_path / "ref"
    ref.mkdir()
    run_torchrun(2, EXAMPLE, "--out-dir", ref, "--max-iters", ITERS, "--losses", ref / "losses.jsonl",
                 env=env, timeout=120)

    # The same run, uploading to the bucket, SIGKILLed mid-run (launcher and workers), then started again.
    url = f"s3://{BUCKET}/gpt"
    run = tmp_path / "run"
    run.mkdir()
    args = ("--out-dir", run, "--max-iters", ITERS, "--losses", run / "losses.jsonl", "--remote", url)
    log_path = tmp_path / "run.log"
    proc = start_torchrun(2, EXAMPLE, *args, "--iter-sleep", "0.15", env=env, log_path=log_path)
    try:
        ckpt_dir = str(run / "ckpt")
        wait_for(lambda: any(s >= 4 for s in layout.committed_steps(ckpt_dir)), 60, "step 4 committed", proc, log_path)
    finally:
        kill_job(proc)
    killed_at = len(losses(run / "losses.jsonl"))
    assert killed_at < ITERS, log_path.read_text()[-3000:]
    out = run_torchrun(2, EXAMPLE, *args, env=env, timeout=120).stdout
    assert "resumed iter" in out, out[-3000:]
    resumed_at = int(out.split("resumed iter ", 1)[1].split()[0])
    assert 4 <= resumed_at <= killed_at, out[-3000:]
    got, want = losses(run / "losses.jsonl"), losses(ref / "losses.jsonl")
    assert sorted(want) == list(range(1, ITERS + 1))
    assert got == want  # every loss, the iterations trained again after the kill included, bit for bit
    final, expected = torch.load(run / "final.pt"), torch.load(ref / "final.pt")
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) for k in expected)

    # A fresh machine: empty local dir, 1 rank, other model arguments on the command line. The model is
    # built from the config saved with the step (peek() before the process group), read from the bucket.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    proc1 = run_torchrun(1, EXAMPLE, "--out-dir", fresh, "--max-iters", ITERS + 2, "--remote", url,
                         "--n-embd", "12", "--losses", fresh / "losses.jsonl", timeout=120,
                         env=dict(env, SHARDCKPT_UPLOADER="off"))
    line = next(x for x in proc1.stdout.splitlines() if "resumed iter" in x)
    assert f"resumed iter {ITERS} (step {ITERS}) from s3://{BUCKET}/gpt/" in line, line
    assert '"n_embd": 8' in line and "world 1, 2 micro-batch(es) per step" in line, line
    assert sorted(losses(fresh / "losses.jsonl")) == [ITERS + 1, ITERS + 2]
    weights = torch.load(fresh / "final.pt")
    assert weights["wte.weight"].shape[1] == 8


def test_save_on_rank_0_only_raises_naming_the_rank_that_did_not_call(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run_torchrun(2, PROGRAMS / "one_rank_save.py", tmp_path / "ckpt", out,
                 env=child_env(SHARDCKPT_SAVE_AGREE_TIMEOUT_S="3"), timeout=120)
    r0 = json.loads((out / "result.0.json").read_text())
    r1 = json.loads((out / "result.1.json").read_text())
    assert r0["timeout"] == r1["timeout"] == 3.0  # set through SHARDCKPT_SAVE_AGREE_TIMEOUT_S
    assert r0["error"] is not None, r0
    assert "step 2 was not saved" in r0["error"] and "rank(s) 1 did not call save()" in r0["error"]
    assert "every rank calls save() at the same points" in r0["error"].lower()
    assert 2.5 <= r0["seconds"] < 30  # the bound, not collective_timeout_s (30 min)
    assert r0["logged"] and "waits for 1 of 2 ranks" in r0["logged"][0]
    assert r0["steps"] == r1["steps"] == [1]


def test_a_rank_dying_as_the_last_to_check_in_does_not_hold_the_others_for_the_whole_timeout(tmp_path):
    """Rank 1 dies right after its check-in to save() made it the last to arrive, before it said go: rank 0
    goes on (every rank arrived) and fails on the dead peer in seconds, not after save_agree_timeout_s, so it
    leaves before torchrun's grace ends (else torchrun SIGKILLs it, and a restart waits for that)."""
    out = tmp_path / "out"
    out.mkdir()
    proc = run_torchrun(2, PROGRAMS / "one_rank_save.py", tmp_path / "ckpt", out, "last-dies", check=False,
                        env=child_env(SHARDCKPT_SAVE_AGREE_TIMEOUT_S="120"), timeout=180)
    assert proc.returncode != 0  # rank 1 was killed
    assert (out / "result.0.json").exists(), f"rank 0 did not get past save(): {proc.stdout[-4000:]}"
    r0 = json.loads((out / "result.0.json").read_text())
    assert r0["timeout"] == 120.0 and r0["error"] is not None, r0
    assert r0["seconds"] < 25, r0  # the first short wait (10 s), then the failed collective
    assert "Unable to shutdown process" not in proc.stdout, proc.stdout[-4000:]


# ------------------------------------------------------------ peek and inspect --values, one process


def _saved(tmp_path: Path, remote: str | None = None) -> dict:
    model = torch.nn.Linear(3, 2)
    state = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
             "train": {"iter_num": 7, "best": torch.tensor(2.5), "big": torch.zeros(300_000)},
             "model_args": {"n_embd": 8, "names": ["a", "b"]}, "empty": {}}
    with shardckpt.Checkpointer(local_dir=str(tmp_path / "ckpt"), remote=remote, mode="sync",
                                run_config={"lr": 0.1}, preemption_signals=()) as ckpt:
        ckpt.save(state, 3)
        state["train"]["iter_num"] = 9
        ckpt.save(state, 5, light=True)
    return state


def test_peek_reads_values_and_config_without_tensors_the_step_load_would_choose(tmp_path):
    _saved(tmp_path)
    ckpt = shardckpt.Checkpointer(local_dir=str(tmp_path / "ckpt"), preemption_signals=())
    looked = ckpt.peek()
    # Full steps first, as load(): step 5 is light.
    assert looked.step == 3 and looked.kind == "full"
    assert looked.run_config == {"lr": 0.1}
    assert looked.values["train"]["iter_num"] == 7 and torch.equal(looked.values["train"]["best"], torch.tensor(2.5))
    assert looked.values["model_args"] == {"n_embd": 8, "names": ["a", "b"]}
    assert looked.values["empty"] == {}
    assert ("big" not in looked.values["train"]
            and looked.tensors["train.big"] == {"shape": [300000], "dtype": "float32"})
    assert "model" not in looked.values and looked.keys["model"] == "module"
    assert ckpt.peek(5).values["train"]["iter_num"] == 9
    with pytest.raises(shardckpt.CheckpointNotFoundError, match="step 4 is not committed"):
        ckpt.peek(4)
    ckpt.close()


def test_peek_from_the_remote_alone_and_inspect_values_json(tmp_path, capsys):
    remote = (tmp_path / "bucket").as_uri()
    _saved(tmp_path, remote=remote)
    stop_uploaders(tmp_path, grace_s=30.0)
    # A new machine: nothing local, the remote only.
    ckpt = shardckpt.Checkpointer(local_dir=str(tmp_path / "new"), remote=remote, uploader="off", preemption_signals=())
    looked = ckpt.peek()
    ckpt.close()
    assert looked.step == 3 and looked.source.startswith(remote) and looked.values["train"]["iter_num"] == 7
    assert not layout.committed_steps(str(tmp_path / "new"))  # a look, not a download into the local tier

    assert cli.main(["inspect", remote, "--step", "3", "--values", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["values"]["train"] == {"iter_num": 7, "best": 2.5}
    assert body["value_tensors"] == {"train.big": {"dtype": "float32", "shape": [300000]}}
    assert body["run_config"] == {"lr": 0.1}


class Payload:
    """Not on the allow-list: unpickling it means importing and calling code named by the file."""


def test_peek_refuses_a_value_that_would_run_code(tmp_path):
    with shardckpt.Checkpointer(local_dir=str(tmp_path / "ckpt"), mode="sync", preemption_signals=()) as ckpt:
        ckpt.save({"extra": {"obj": Payload()}}, 1)
    with shardckpt.Checkpointer(local_dir=str(tmp_path / "ckpt"), preemption_signals=()) as ckpt:
        with pytest.raises(shardckpt.UntrustedCheckpointError, match="extra.obj"):
            ckpt.peek()


def test_strict_false_does_not_advise_strict_false(tmp_path, caplog):
    _saved(tmp_path)
    live = {"model": torch.nn.Linear(3, 2)}
    with shardckpt.Checkpointer(local_dir=str(tmp_path / "ckpt"), preemption_signals=()) as ckpt:
        assert ckpt.load(live, step=3, strict=False) == 3
    warned = [r.getMessage() for r in caplog.records if "strict=False" in r.getMessage()]
    assert warned and all("pass strict=False" not in m for m in warned), warned
