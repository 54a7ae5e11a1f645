"""The shardckpt command on real checkpoints: local directories and the test S3 server.

Every command end to end through ``cli.main`` (and a few as real processes:
``python -m shardckpt``, the torch-free start, progress bars on a terminal).
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import ROOT, child_env  # noqa: E402
from s3server import BUCKET, reset_if_used, stop_uploaders  # noqa: E402

import shardckpt  # noqa: E402
from shardckpt import cli, stores
from shardckpt.format import layout
from shardckpt.node import uploader  # noqa: E402

LS_KEYS = {"step", "bytes", "files", "world_size", "created", "created_utc", "live", "abandoned", "branch",
           "run_id", "metadata", "kind", "metrics", "best", "tiers", "for_upload", "stored_bytes"}


@pytest.fixture(autouse=True)
def fresh_bucket(request, tmp_path):
    reset_if_used(request)
    yield
    stop_uploaders(tmp_path, grace_s=2.0)


def save_three_steps(local_dir: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    optim = torch.optim.AdamW(model.parameters())
    with shardckpt.Checkpointer(local_dir=str(local_dir), keep_last=None, preemption_signals=(),
                                metadata={"job": "cli-test"}) as ckpt:
        for step in (1, 2, 3):
            model(torch.randn(4, 16)).sum().backward()
            optim.step()
            ckpt.save({"model": model, "optimizer": optim}, step).wait()


@pytest.fixture
def local_steps(tmp_path):
    """Steps 1-3 of a small model in a local directory."""
    save_three_steps(tmp_path / "ckpt")
    return tmp_path / "ckpt", None


@pytest.fixture
def steps(s3, tmp_path):
    """Steps 1-3 of a small model, committed locally and on the S3 server."""
    local_dir, url = tmp_path / "ckpt", f"s3://{BUCKET}/cli"
    save_three_steps(local_dir)
    assert uploader.Uploader(str(local_dir), stores.open_store(url), node="n0", once=True, poll_s=0.05).run() == 0
    return local_dir, url


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("where", ["local", "remote"])
def test_ls_inspect_and_verify_on_both_tiers(steps, capsys, where):
    local_dir, url = steps
    src = str(local_dir) if where == "local" else url
    code, out, _ = run(capsys, "ls", src)
    assert code == 0 and "3 committed step(s)" in out, out
    assert [line.split()[0] for line in out.splitlines()[2:]] == ["1", "2", "3"]
    assert all(line.split()[6] == ("local+remote" if where == "local" else "remote") for line in out.splitlines()[2:])
    code, out, _ = run(capsys, "ls", src, "--json")
    body = json.loads(out)
    assert code == 0 and [r["step"] for r in body["steps"]] == [1, 2, 3]
    assert all(set(r) == LS_KEYS for r in body["steps"]) and body["steps"][0]["metadata"] == {"job": "cli-test"}
    assert all(r["live"] and r["abandoned"] is None and r["world_size"] == 1 for r in body["steps"])

    code, out, _ = run(capsys, "inspect", src, "--step", "2", "--keys", "--json")
    body = json.loads(out)
    assert code == 0 and body["step"] == 2 and body["keys"]["model"] == "module"
    saved = {k["key"]: k for k in body["saved_keys"]}
    assert saved["model.weight"]["shape"] == [8, 16] and saved["model.weight"]["dtype"] == "float32"
    assert "optimizer.state.weight.exp_avg" in saved
    code, out, _ = run(capsys, "inspect", src)
    assert code == 0 and out.startswith("step 3 in ") and "model (module)" in out

    code, out, _ = run(capsys, "verify", src, "--all")
    assert code == 0 and out.count("ok   step") == 3, out
    code, out, _ = run(capsys, "verify", src, "--json")
    body = json.loads(out)
    assert body["ok"] is True and body["steps"][0]["step"] == 3 and body["steps"][0]["problems"] == []


@pytest.mark.parametrize("where", ["local", "remote"])
def test_verify_names_every_bad_file_and_exits_1(steps, s3, capsys, where):
    local_dir, url = steps
    name = "__0_0.distcp"
    if where == "local":
        shard = local_dir / layout.step_dirname(2) / name
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 1
        shard.write_bytes(bytes(data))
        (local_dir / layout.step_dirname(2) / ".metadata").unlink()
        src = str(local_dir)
    else:
        key = f"cli/{layout.step_dirname(2)}/{name}"
        data = bytearray(s3.client().get_object(Bucket=BUCKET, Key=key)["Body"].read())
        data[len(data) // 2] ^= 1
        s3.client().put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
        s3.client().delete_object(Bucket=BUCKET, Key=f"cli/{layout.step_dirname(2)}/.metadata")
        src = url
    code, out, _ = run(capsys, "verify", src, "--all")
    assert code == 1, out
    assert "FAIL step 2" in out and f"{name}: fails its xxh3-128 checksum" in out and ".metadata: missing" in out, out
    assert out.count("ok   step") == 2 and "Remedy" in out
    code, out, _ = run(capsys, "verify", src, "--step", "2", "--json")
    body = json.loads(out)
    assert code == 1 and body["ok"] is False
    assert {p["file"] for p in body["steps"][0]["problems"]} == {name, ".metadata"}


def test_missing_directory_and_empty_remote_are_errors(s3, tmp_path, capsys):
    code, _, err = run(capsys, "ls", str(tmp_path / "nope"))
    assert code == 2 and "no checkpoint directory at" in err and "Remedy" in err
    assert err.count("\n") == 1  # one line
    code, _, err = run(capsys, "ls", f"s3://{BUCKET}/nothing-here")
    assert code == 1 and "no committed step in s3://" in err and "Remedy" in err
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "verify", str(tmp_path / "empty"))
    assert code == 1 and "no committed step" in err
    code, _, err = run(capsys, "ls", "s3://no-such-bucket-for-cli/x")
    assert code == 2 and "NoSuchBucket" in err and "Remedy" in err
    code, _, err = run(capsys, "inspect", str(tmp_path / "empty"), "--step", "4")
    assert code == 1


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(shardckpt.ShardckptError):
        cli.main(["--debug", "ls", str(tmp_path / "nope")])
    with pytest.raises(shardckpt.ShardckptError):
        cli.main(["ls", str(tmp_path / "nope"), "--debug"])


def test_gc_on_the_remote_and_locally(steps, capsys):
    local_dir, url = steps
    code, out, _ = run(capsys, "gc", url, "--keep-last", "1", "--dry-run")
    assert code == 0 and "would delete step 1" in out and "would delete step 2" in out
    code, out, _ = run(capsys, "gc", url, "--keep-last", "1")
    assert code == 0
    code, out, _ = run(capsys, "ls", url, "--json")
    assert [r["step"] for r in json.loads(out)["steps"]] == [3]
    code, out, _ = run(capsys, "gc", str(local_dir), "--keep-last", "2")
    assert code == 0 and layout.committed_steps(str(local_dir)) == [2, 3]


def test_status_reports_the_uploader(steps, tmp_path, capsys):
    local_dir, url = steps
    code, out, _ = run(capsys, "status", str(local_dir), "--json")
    body = json.loads(out)
    assert code == 0 and body["remote"] == url and body["latest_local"] == 3 and body["latest_remote"] == 3
    assert body["pending_steps"] == [] and body["uploader"]["running"] is False and body["last_error"] is None
    code, out, _ = run(capsys, "status", str(local_dir))
    assert code == 0 and f"-> {url}" in out and "pending: nothing" in out
    plain = tmp_path / "plain"
    with shardckpt.Checkpointer(local_dir=str(plain), preemption_signals=()) as ckpt:
        ckpt.save({"w": torch.zeros(2)}, 1)
    code, out, _ = run(capsys, "status", str(plain))
    assert code == 1 and "no uploader has run here" in out


def test_python_m_shardckpt_starts_without_torch(local_steps):
    local_dir, _url = local_steps
    probe = ("import sys; from shardckpt import cli; code = cli.main(sys.argv[1:]); "
             "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(code)")
    for argv, code in ((["ls", str(local_dir)], 0), (["verify", str(local_dir), "--all"], 0),
                       (["inspect", str(local_dir)], 0), (["gc", str(local_dir), "--keep-last", "3", "--dry-run"], 0),
                       (["status", str(local_dir)], 1)):  # status: no uploader has run here
        proc = subprocess.run([sys.executable, "-c", probe, *argv], env=child_env(), capture_output=True, text=True,
                              cwd=str(ROOT), timeout=120)
        assert proc.returncode == code, (argv, proc.stdout, proc.stderr)
    proc = subprocess.run([sys.executable, "-m", "shardckpt", "ls", str(local_dir), "--json"], env=child_env(),
                          capture_output=True, text=True, cwd=str(ROOT), timeout=120)
    assert proc.returncode == 0 and [r["step"] for r in json.loads(proc.stdout)["steps"]] == [1, 2, 3]


def test_progress_bar_on_a_terminal(local_steps):
    local_dir, _url = local_steps
    main_fd, child_fd = pty.openpty()
    seen = bytearray()

    def drain() -> None:
        while True:
            try:
                chunk = os.read(main_fd, 65536)
            except OSError:
                return
            if not chunk:
                return
            seen.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    proc = subprocess.run([sys.executable, "-m", "shardckpt", "verify", str(local_dir), "--all"], env=child_env(),
                          stdout=subprocess.PIPE, stderr=child_fd, cwd=str(ROOT), timeout=120)
    os.close(child_fd)
    reader.join(timeout=10)
    os.close(main_fd)
    assert proc.returncode == 0 and proc.stdout.decode().count("ok   step") == 3
    assert b"verifying" in seen and b"B/s" in seen, bytes(seen[-500:])


def test_settings_come_from_arguments_then_environment_then_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDCKPT_KEEP_LAST", "7")
    monkeypatch.setenv("SHARDCKPT_EVERY_STEPS", "50")
    ckpt = shardckpt.Checkpointer(local_dir=str(tmp_path), every_steps=10, preemption_signals=())
    assert ckpt.config.keep_last == 7 and ckpt.config.every_steps == 10 and ckpt.config.io_threads == 2
    ckpt.close()
    config = shardckpt.CheckpointConfig(local_dir=str(tmp_path))  # an object is taken as it is
    assert shardckpt.Checkpointer(config, ).config.keep_last == 3
