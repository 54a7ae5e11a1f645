"""Random damage to a committed step's files: refused with CorruptCheckpointError, or harmless.

One step is saved (a module, its Adam state, a plain-value dict, a tensor
value, RNG state), then each case restores the pristine files, damages one
of them and loads into a fresh state. The guarantee: the load raises
:class:`shardckpt.CorruptCheckpointError` (a step, a file and a remedy in its
message), or it returns the step with every value bitwise as saved. Never a
raw exception, never a load that returns with wrong or stale values.

Damages (seeded, so every run tries the same ones): bit flips, truncation,
appended binary bytes, zeroed runs, empty files, a deleted data file, and
manifest edits: a field set to a value of the wrong type, a kinds-table entry
changed. A manifest edit that keeps the manifest's digest is refused by it;
the same edits on a manifest without a digest (as older versions wrote
them) are validated field by field, and a kinds-table entry changed to
another valid kind (or the table emptied) raises :class:`StateMismatchError`
naming the key, since the table then contradicts the state passed rather
than the manifest's form. Which fields are edited depends on the manifest's
shape, so the cases vary a little from run to run.

Run locally (``LOCAL_CASES`` damages) and from moto with an empty local
directory (``REMOTE_CASES``): the first through the checked DCP reader on a
complete copy, the second through the need-only fetch and its chunk sums.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s3server import BUCKET, reset_if_used  # noqa: E402
from test_remote import _opts  # noqa: E402

import shardckpt  # noqa: E402
from shardckpt import stores  # noqa: E402
from shardckpt.format import layout, manifest_schema  # noqa: E402
from shardckpt.node import uploader  # noqa: E402
from shardckpt.remote import commit as remote_commit  # noqa: E402

LOCAL_CASES = 128
REMOTE_CASES = 48
WRONG_VALUES = ([], None, "x", 5, {}, True, -1, 1.5, [1, "a"], {"a": []})


@pytest.fixture(autouse=True)
def fresh_bucket(request):
    reset_if_used(request)


def make_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    return {"model": model, "optimizer": optim, "meta": {"epoch": 0, "best": 9.0, "name": "fresh"},
            "blob": torch.zeros(64)}


def train_and_save(local_dir: Path) -> dict:
    state = make_state(0)
    model, optim = state["model"], state["optimizer"]
    for _ in range(2):
        model(torch.randn(4, 16)).sum().backward()
        optim.step()
        optim.zero_grad()
    state["meta"] = {"epoch": 7, "best": 0.125, "name": "run-a"}
    state["blob"] = torch.arange(64, dtype=torch.float32)
    with shardckpt.Checkpointer(local_dir=str(local_dir), preemption_signals=()) as ckpt:
        ckpt.save(state, 1).wait()
    return snapshot(state)


def snapshot(state: dict) -> dict:
    return {
        "model": {k: v.clone() for k, v in state["model"].state_dict().items()},
        "optimizer": copy.deepcopy(state["optimizer"].state_dict()["state"]),
        "meta": dict(state["meta"]),
        "blob": state["blob"].clone(),
    }


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


# ------------------------------------------------------------ damages


def _json_paths(body, prefix=()):
    """Every path into the manifest object (the digest left alone: it is what detects the rest)."""
    out = []
    if isinstance(body, dict):
        for k, v in body.items():
            if prefix == () and k == manifest_schema.DIGEST_FIELD:
                continue
            out.append(prefix + (k,))
            out += _json_paths(v, prefix + (k,))
    elif isinstance(body, list):
        for i, v in enumerate(body):
            out.append(prefix + (i,))
            out += _json_paths(v, prefix + (i,))
    return out


def _set(body, path, value):
    node = body
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value


def damage(rng: random.Random, files: dict[str, bytes], manifest_name: str) -> tuple[str, str, bytes | None]:
    """``(file, description, new bytes or None to delete)`` of one random damage."""
    names = sorted(files)
    name = manifest_name if rng.random() < 0.45 else rng.choice(names)
    data = files[name]
    kinds = ["flip", "truncate", "append", "zeros", "empty"]
    if name == manifest_name:
        kinds += ["field", "field", "field", "legacy-field", "legacy-field", "kinds", "legacy-kinds"]
    else:
        kinds += ["delete"]
    kind = rng.choice(kinds)
    if kind == "flip":
        pos = rng.randrange(len(data))
        bit = 1 << rng.randrange(8)
        return name, f"bit {bit} flipped at byte {pos}", data[:pos] + bytes([data[pos] ^ bit]) + data[pos + 1:]
    if kind == "truncate":
        cut = rng.randrange(len(data))
        return name, f"truncated to {cut} bytes", data[:cut]
    if kind == "append":
        extra = bytes(rng.randrange(256) for _ in range(rng.choice((1, 7, 64))))
        return name, f"{len(extra)} binary bytes appended", data + extra
    if kind == "zeros":
        start = rng.randrange(len(data))
        n = min(len(data) - start, rng.choice((1, 16, 512, 4096)))
        return name, f"{n} bytes zeroed at {start}", data[:start] + bytes(n) + data[start + n:]
    if kind == "empty":
        return name, "emptied", b""
    if kind == "delete":
        return name, "deleted", None
    body = json.loads(data)
    legacy = kind.startswith("legacy")
    if legacy:
        body.pop(manifest_schema.DIGEST_FIELD, None)
    if kind.endswith("kinds"):
        value = rng.choice([[], None, "x", "module", "optimizer", "stateful", 3])
        _set(body, ("keys", "meta"), value)
        what = f"keys.meta set to {value!r}"
    else:
        path = rng.choice(_json_paths(body))
        value = rng.choice(WRONG_VALUES)
        _set(body, path, copy.deepcopy(value))
        what = f"{'.'.join(map(str, path))} set to {value!r}"
    return name, f"{what}{' (no digest, as older versions wrote)' if legacy else ''}", json.dumps(body).encode()


def outcome(load, saved: dict, description: str) -> str:
    """``refused`` / ``harmless``; any other outcome fails the test, naming the damage."""
    state = make_state(1)
    try:
        step = load(state)
    except shardckpt.CorruptCheckpointError as exc:
        text = str(exc)
        assert "step" in text and "Remedy" in text or "remedy" in text.lower(), (description, text)
        return "refused"
    except shardckpt.StateMismatchError as exc:
        # Only the kinds table of a manifest without a digest (an entry changed to another valid kind, or the
        # table emptied): it then contradicts the state passed; the load says so, naming the key, and loads nothing.
        edited = description.split(": ", 1)[1]
        assert "(no digest" in description and edited.startswith("keys"), (description, repr(exc))
        assert "meta" in str(exc) and "step 1" in str(exc) and "Remedy" in str(exc), (description, str(exc))
        return "refused"
    except Exception as exc:  # noqa: BLE001 - the point of the test
        pytest.fail(f"damage {description!r}: raw {type(exc).__name__}: {exc}")
    assert step == 1, f"damage {description!r}: load returned {step!r}"
    now = snapshot(state)
    wrong = [k for k in saved if not same(saved[k], now[k])]
    assert not wrong, f"damage {description!r}: loaded wrong values for {wrong}"
    return "harmless"


def run_cases(count: int, seed: int, files: dict[str, bytes], put, load, saved, manifest_name: str) -> dict:
    rng = random.Random(seed)
    tally: dict[str, int] = {"refused": 0, "harmless": 0}
    name = None
    for _ in range(count):
        if name is not None:
            put(name, files[name])  # the pristine file back (a load writes nothing into the step)
        name, what, data = damage(rng, files, manifest_name)
        put(name, data)
        t0 = time.monotonic()
        got = outcome(load, saved, f"{name}: {what}")
        tally[got] += 1
        if os.environ.get("FUZZ_TIMES"):
            print(f"{time.monotonic() - t0:.2f}s {got} {name}: {what}")
    return tally


# ------------------------------------------------------------ the tests


def test_random_damage_of_a_local_step_is_refused_or_harmless(tmp_path, capsys):
    saved = train_and_save(tmp_path)
    step_dir = tmp_path / layout.step_dirname(1)
    files = {p.name: p.read_bytes() for p in step_dir.iterdir() if p.is_file()}
    assert layout.MANIFEST_NAME in files and layout.METADATA_NAME in files

    def put(name: str, data: bytes | None) -> None:
        path = step_dir / name
        if data is None:
            path.unlink()
        else:
            path.write_bytes(data)

    def load(state: dict):
        return shardckpt.Checkpointer(local_dir=str(tmp_path), preemption_signals=()).load(state)

    tally = run_cases(LOCAL_CASES, 25, files, put, load, saved, layout.MANIFEST_NAME)
    with capsys.disabled():
        print(f"\nlocal damage fuzz: {LOCAL_CASES} damages, {tally['refused']} refused, "
              f"{tally['harmless']} harmless, 0 wrong")
    assert tally["refused"] + tally["harmless"] == LOCAL_CASES and tally["refused"] > LOCAL_CASES // 2


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_random_damage_of_a_remote_step_is_refused_or_harmless(s3, tmp_path, capsys):
    local_dir = tmp_path / "saved"
    saved = train_and_save(local_dir)
    url = f"s3://{BUCKET}/fuzz"
    store = stores.open_store(url, _opts())
    assert uploader.Uploader(str(local_dir), store, node="n0", once=True, poll_s=0.05).run() == 0
    client = s3.client()
    prefix = f"fuzz/{layout.step_dirname(1)}/"
    files = {k[len("fuzz/"):]: client.get_object(Bucket=BUCKET, Key=k)["Body"].read()
             for k in s3.keys("fuzz/")}
    manifest_key = remote_commit.step_key(1, layout.MANIFEST_NAME)
    assert manifest_key in files and any(k.startswith(prefix[len("fuzz/"):]) for k in files)
    empty = tmp_path / "empty"
    # One restoring job (its S3 client made once), its local_dir emptied before every load.
    ckpt = shardckpt.Checkpointer(local_dir=str(empty), remote=url, uploader="off", preemption_signals=(),
                                  remote_max_attempts=2)

    def put(name: str, data: bytes | None) -> None:
        if data is None:
            client.delete_object(Bucket=BUCKET, Key=f"fuzz/{name}")
        else:
            client.put_object(Bucket=BUCKET, Key=f"fuzz/{name}", Body=data)

    def load(state: dict):
        for entry in list(empty.iterdir()) if empty.exists() else []:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        return ckpt.load(state)

    try:
        tally = run_cases(REMOTE_CASES, 26, files, put, load, saved, manifest_key)
    finally:
        ckpt.close()
        store.close()
    with capsys.disabled():
        print(f"\nremote damage fuzz: {REMOTE_CASES} damages, {tally['refused']} refused, "
              f"{tally['harmless']} harmless, 0 wrong")
    assert tally["refused"] + tally["harmless"] == REMOTE_CASES and tally["refused"] > REMOTE_CASES // 3
