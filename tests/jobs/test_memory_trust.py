"""The memory tier can be trusted: a copy belongs to its run, nobody else can stop a save, a returned save
survives the next copy, and a copy that does not check out is never read.

Each test runs real trainer processes (``programs/memory_trust_job.py``) killed with SIGKILL where a crash
is the point, over the real /dev/shm (or a small tmpfs mounted in a mount namespace of its own).
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from helpers import PROGRAMS, child_env, wait_for

import shardckpt
from shardckpt import _failpoints
from shardckpt.format import shm

JOB = PROGRAMS / "memory_trust_job.py"


def _job(root, out, *actions, prefix=(), **env):
    """One trainer process; returns its exit code (-9: it killed itself, as planned)."""
    os.makedirs(out, exist_ok=True)
    proc = subprocess.run([*prefix, sys.executable, str(JOB), str(root), str(out), *actions],
                          env=child_env(SHARDCKPT_MEMORY_LINGER_S="600", **env), capture_output=True, text=True,
                          timeout=240)
    return proc.returncode, proc.stdout + proc.stderr


def _read(out, what):
    with open(os.path.join(out, f"{what}.json")) as f:
        return json.load(f)


def _namespaces(root) -> list[str]:
    """This user's namespaces of ``root``'s path, whatever their run."""
    probe = shm.namespace(str(root), "0" * 32)
    return sorted(glob.glob(probe[: -32] + "*"))


def _cleanup(root) -> None:
    for ns in _namespaces(root):
        shm.purge(str(root), ns)


# ------------------------------------------------------------------ 1. a copy belongs to its run


def test_a_removed_and_recreated_directory_never_resumes_the_old_runs_memory(tmp_path):
    root, out = tmp_path / "run1", tmp_path / "out"
    try:
        code, log = _job(root, out / "a", "train=1-3", "kill", MEMJOB_TAG="1")  # 3 only in memory (disk every 10)
        assert code == -9, log
        old = shm.namespace(str(root))
        assert _read(out / "a", "train")["saved"] == {"1": "memory", "2": "memory", "3": "memory"}
        # The user removes the directory and starts a new experiment on the same path, within the linger.
        for _ in range(20):  # (the dead run's keeper may be writing its log there meanwhile)
            shutil.rmtree(root, ignore_errors=True)
            if not (root / shm.RUN_FILE).exists() and not any(root.glob("step_*")):
                break
        code, log = _job(root, out / "b", "load", "train=1-1", "close", MEMJOB_TAG="2")
        assert code == 0, log
        got = _read(out / "b", "load")
        assert got["got"] is None and got["value"] == 0.0, got  # nothing resumed: not the dead run's step 3
        said = [w for w in got["warnings"] if old in w]
        assert len(said) == 1 and "another run" in said[0] and "[2, 3]" in said[0], got["warnings"]
        # The old run's memory is freed: its keeper stopped holding it when the directory changed, the new job frees it.
        assert "freed" in said[0] and not os.path.exists(old), said
    finally:
        _cleanup(root)


def test_start_fresh_covers_the_memory_tier(tmp_path):
    root, out = tmp_path / "run1", tmp_path / "out"
    try:
        code, log = _job(root, out / "a", "train=1-3", "kill")
        assert code == -9, log
        code, log = _job(root, out / "b", "load", "close", SHARDCKPT_START_FRESH="1")
        assert code == 0, log
        got = _read(out / "b", "load")
        assert got["got"] is None and got["value"] == 0.0, got
        said = [w for w in got["warnings"] if "start_fresh" in w]
        assert len(said) == 1 and "[2, 3]" in said[0], got["warnings"]  # (memory_keep=1: 1 was overwritten)
        # and what it did not resume is gone: a later launch without START_FRESH does not resume it either
        code, log = _job(root, out / "c", "load", "close")
        assert code == 0 and _read(out / "c", "load")["got"] is None, log
    finally:
        _cleanup(root)


def _unshare() -> list[str]:
    if os.geteuid() != 0:
        pytest.skip("two containers (mount and UTS namespaces) need root")
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--mount", "--uts", "true"]).returncode != 0:
        pytest.skip("unshare --mount --uts is not available here")
    return ["unshare", "--mount", "--uts", "--propagation", "private"]


def test_two_containers_sharing_dev_shm_each_resume_only_their_own_steps(tmp_path):
    """``--ipc=host``: one /dev/shm, each container its own disk mounted at the same path."""
    unshare = _unshare()
    path, out = tmp_path / "ck", tmp_path / "out"
    disks = {c: tmp_path / f"disk-{c}" for c in "ab"}
    for d in disks.values():
        d.mkdir()
    path.mkdir()

    def in_container(c, *actions, **env):
        wrapper = ["sh", "-c", f'mount --bind "{disks[c]}" "{path}" && hostname container-{c} && exec "$@"', "sh"]
        return _job(path, out / f"{c}{len(os.listdir(out)) if out.exists() else 0}", *actions,
                    prefix=unshare + wrapper, MEMJOB_TAG="1" if c == "a" else "2", **env)

    try:
        code, log = in_container("a", "train=1-3", "kill")  # container a: 3 only in memory, killed
        assert code == -9, log
        code, log = in_container("b", "load", "train=1-2", "kill")  # container b: a new run at the same path
        assert code == -9, log
        first_b = out / "b1"
        got = _read(first_b, "load")
        assert got["got"] is None and got["value"] == 0.0, got  # not container a's step 3
        said = [w for w in got["warnings"] if "another run" in w]
        assert len(said) == 1 and "left to that run" in said[0], got["warnings"]  # a's keeper holds it: not freed
        # Each resumes its own step from memory, bitwise, the other's copies untouched.
        code, log = in_container("a", "load", "close")
        assert code == 0, log
        got = _read(out / "a2", "load")
        assert (got["got"], got["value"], got["meta"]) == (3, 1003.0, {"at": 3, "tag": 1}), got
        code, log = in_container("b", "load", "close")
        assert code == 0, log
        got = _read(out / "b3", "load")
        assert (got["got"], got["value"], got["meta"]) == (2, 2002.0, {"at": 2, "tag": 2}), got
    finally:
        for c in "ab":
            subprocess.run(unshare + ["sh", "-c", f'mount --bind "{disks[c]}" "{path}" && '
                                      f'"{sys.executable}" -c "import sys; sys.path.insert(0, sys.argv[2]); '
                                      f'from shardckpt.format import shm; shm.purge(sys.argv[1])" "{path}" '
                                      f'"{PROGRAMS.parent.parent / "src"}"'], timeout=60)


# ------------------------------------------------------------------ 2. nobody else can stop a save


def test_a_namespace_planted_by_another_user_never_stops_a_save(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("planting a directory as another user needs root")
    import hashlib

    root, out = tmp_path / "ck", tmp_path / "out"
    root.mkdir()
    run = shm.run_id(str(root), create=True)  # the attacker learned the run id (worst case), and plants both
    key = hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:16]
    planted = [shm.namespace(str(root), run), os.path.join(shm.shm_root(), f"shardckpt-{os.getuid()}-{key}")]
    try:
        for ns in planted:
            os.mkdir(ns, 0o700)
            os.chown(ns, 65534, 65534)
        code, log = _job(root, out, "train=1-4", "wait", "close", MEMJOB_EVERY="2")
        assert code == 0, log
        got = _read(out, "train")
        assert got["steps"] == [2, 4], got  # the disk saves went on
        assert got["saved"] == {"1": None, "2": "disk", "3": None, "4": "disk"}, got
        said = [w for w in got["warnings"] if "steps aside" in w]
        assert len(said) == 1 and planted[0] in said[0] and "uid 65534" in said[0], got["warnings"]
    finally:
        for ns in planted:
            if os.path.isdir(ns):
                os.rmdir(ns)


def _tmpfs(size: str) -> list[str]:
    unshare = _unshare()
    return unshare + ["sh", "-c", f'mount -t tmpfs -o size={size},mode=1777 tmpfs "$SHARDCKPT_SHM_DIR" && exec "$@"',
                      "sh"]


def test_a_shared_memory_too_small_or_full_never_costs_a_disk_step(tmp_path):
    root, out, small = tmp_path / "ck", tmp_path / "out", tmp_path / "shm"
    small.mkdir()
    # Too small at the start: 1 MiB for 3 copies of 256 KiB staged... of 1 MiB (memory_keep=1 and its spare).
    code, log = _job(root, out / "small", "train=1-4", "wait", "close", prefix=_tmpfs("1m"),
                     SHARDCKPT_SHM_DIR=str(small), MEMJOB_EVERY="2", MEMJOB_NUMEL=str(1 << 18))
    assert code == 0, log
    got = _read(out / "small", "train")
    assert got["steps"] == [2, 4] and got["saved"] == {"1": None, "2": "disk", "3": None, "4": "disk"}, got
    said = [w for w in got["warnings"] if "steps aside" in w]
    assert len(said) == 1 and "free" in said[0], got["warnings"]
    # Full later: room at the start, then filled up by something else; the copy that finds no room steps aside.
    code, log = _job(tmp_path / "ck2", out / "full", "train=1-1", "fill", "train=2-4", "wait", "close",
                     prefix=_tmpfs("8m"), SHARDCKPT_SHM_DIR=str(small), MEMJOB_EVERY="2", MEMJOB_NUMEL=str(1 << 18))
    assert code == 0, log
    got = _read(out / "full", "train")
    assert got["steps"] == [2, 4] and got["saved"] == {"1": "memory", "2": "disk", "3": None, "4": "disk"}, got
    said = [w for w in got["warnings"] if "steps aside" in w]
    assert len(said) == 1 and "could not be reserved" in said[0], got["warnings"]


# ------------------------------------------------------------------ 3. a returned save survives the next copy


def test_memory_keep_1_a_kill_during_the_next_copy_with_a_disk_write_in_flight_keeps_the_newest_save(tmp_path):
    root, out = tmp_path / "ck", tmp_path / "out"
    try:
        # disk every 3: 3's disk write stalls; 4 returns (memory only); the process dies copying 5.
        code, log = _job(root, out / "a", "stall", "killcopy=5", "train=1-5", MEMJOB_EVERY="3")
        assert code == -9, log
        assert _read(out / "a", "train")["saved"] == {"1": "memory", "2": "memory", "3": "disk", "4": "memory"}
        code, log = _job(root, out / "b", "load", "close", MEMJOB_EVERY="3")
        assert code == 0, log
        got = _read(out / "b", "load")
        assert (got["got"], got["value"], got["meta"]) == (4, 1004.0, {"at": 4, "tag": 1}), got
    finally:
        _cleanup(root)


# ------------------------------------------------------------------ 4. integrity


def _saved(root, steps=(1, 2, 3), **options):
    """Steps 1..3 (2 on disk, 3 only in memory), each copy's checksum taken; the trainer left running."""
    ckpt = shardckpt.Checkpointer(local_dir=str(root), every_steps=2, memory_every_steps=1, preemption_signals=(),
                                  **options)
    state = {"weights": torch.zeros(4096), "meta": {"at": 0}}
    for step in steps:
        state["weights"].fill_(step)
        state["meta"] = {"at": step}
        handle = ckpt.save(state, step)
        if handle is not None:
            handle.wait()
    ns = shm.namespace(str(root))
    wait_for(lambda: len(glob.glob(os.path.join(ns, "*.sum"))) == 2, 30, "the copies' checksums")
    return ckpt, ns


def _record_of(ns, step):
    for path in glob.glob(os.path.join(ns, "*.rec")):
        with open(path) as f:
            body = json.load(f)
        if body["step"] == step:
            return path, body
    raise AssertionError(f"no record of step {step} in {ns}")


def _forge_manifest(body, **fields):
    body["manifest"][0].update(fields)  # the fields that differ from the layout file's manifest


def _layout_of(ns, body):
    return os.path.join(ns, shm.layout_name(body["rank"], body["slot"], body["layout"]))


def _forge_layout(ns, body, change):
    """A careful forgery of the layout file: changed, written under its new digest, the record pointing at it."""
    with open(_layout_of(ns, body)) as f:
        lay = json.load(f)
    change(lay)
    text = json.dumps(lay).encode()
    body["layout"] = "sha256:" + hashlib.sha256(text).hexdigest()
    fd = os.open(_layout_of(ns, body), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(text)


def _forge(ns, kind):
    path, body = _record_of(ns, 3)
    if kind == "garbage":
        with open(path, "w") as f:
            f.write('{"format": "shardckpt-memory/3", "rank": [')
        return
    if kind == "step 99":  # the record alone says 99
        body["step"] = 99
    elif kind == "step 99 and its manifest":  # a careful forgery: record and manifest agree; the checksum does not
        body["step"] = 99
        _forge_manifest(body, step=99)
    elif kind == "offset outside the buffer":
        _forge_layout(ns, body, lambda lay: lay["tensors"][0].__setitem__(5, lay["buffer_size"] * 4))
    elif kind == "unknown dtype":
        _forge_layout(ns, body, lambda lay: lay["tensors"][0].__setitem__(1, "torch.evil"))
    elif kind == "a shape larger than its bytes":
        def larger(lay):
            lay["tensors"][0][2] = [lay["tensors"][0][2][0] * 1000]
            lay["tensors"][0][3] = lay["tensors"][0][2]
        _forge_layout(ns, body, larger)
    elif kind == "layout of another run":
        _forge_layout(ns, body, lambda lay: lay.__setitem__("run", "f" * 32))
    elif kind == "layout bytes changed":  # in place: its bytes no longer hash to the record's digest
        with open(_layout_of(ns, body)) as f:
            lay = json.load(f)
        lay["host"] = "elsewhere"  # harmless in itself: only the digest refuses it
        with open(_layout_of(ns, body), "w") as f:
            json.dump(lay, f, separators=(",", ":"))
        return
    elif kind == "layout readable by others":
        os.chmod(_layout_of(ns, body), 0o644)
        return
    elif kind == "layout missing":
        os.unlink(_layout_of(ns, body))
        return
    elif kind == "another run":
        body["run"] = "f" * 32
    elif kind == "bytes changed":
        with open(_layout_of(ns, body)) as f:
            lay = json.load(f)
        with open(os.path.join(ns, lay["buffer"]), "r+b") as f:
            f.seek(lay["tensors"][0][5])
            f.write(torch.full((16,), 42.0).numpy().tobytes())
        return
    elif kind == "values cut short":
        with open(os.path.join(ns, shm.values_name(body["rank"], body["slot"])), "r+b") as f:
            f.truncate(max(0, body["values_size"] - 1))
        return
    elif kind == "checksum of another step":
        sum_path = path[: -len(".rec")] + ".sum"
        with open(sum_path) as f:
            found = json.load(f)
        found["step"] = 2
        with open(sum_path, "w") as f:
            json.dump(found, f)
        return
    with open(path, "w") as f:
        json.dump(body, f)


@pytest.mark.parametrize("kind", ["garbage", "step 99", "step 99 and its manifest", "offset outside the buffer",
                                  "unknown dtype", "a shape larger than its bytes", "another run", "bytes changed",
                                  "values cut short", "checksum of another step", "layout of another run",
                                  "layout bytes changed", "layout readable by others", "layout missing"])
def test_a_forged_or_damaged_copy_falls_to_the_disk_with_one_warning(tmp_path, kind, caplog):
    root = tmp_path / "ck"
    saver, ns = _saved(root)
    try:
        _forge(ns, kind)
        fresh = {"weights": torch.zeros(4096), "meta": {}}
        with caplog.at_level(logging.WARNING, logger="shardckpt"):
            reader = shardckpt.Checkpointer(local_dir=str(root), every_steps=2, memory_every_steps=1,
                                            preemption_signals=())
            got = reader.load(fresh)
        # never another step's bytes under this step's name, never a raw exception: the disk's 2
        assert got == 2 and fresh["meta"] == {"at": 2} and torch.equal(fresh["weights"], torch.full((4096,), 2.0))
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and ns in r.getMessage()]
        assert len(said) == 1, said  # (and one that the load went back to an older step: a rollback, if it did)
        reader.close()
    finally:
        saver.close()
        _cleanup(root)


def test_the_keepers_purge_during_a_restore_falls_back_to_the_disk_or_reads_the_open_copy(tmp_path, caplog):
    # purged before the copies are opened: the disk's step, one warning; once they are open: the copy, intact
    for point, expect in (("memory.complete", 2), ("memory.read", 3)):
        root = tmp_path / point
        saver, ns = _saved(root)
        try:
            _failpoints.arm(point, lambda root=root, ns=ns: shm.purge(str(root), ns))
            fresh = {"weights": torch.zeros(4096), "meta": {}}
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="shardckpt"):
                reader = shardckpt.Checkpointer(local_dir=str(root), every_steps=2, memory_every_steps=1,
                                                preemption_signals=())
                got = reader.load(fresh)
            assert not os.path.exists(ns), point  # the purge happened
            assert got == expect and torch.equal(fresh["weights"], torch.full((4096,), float(expect))), (point, got)
            said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and ns in r.getMessage()]
            assert len(said) == (1 if expect == 2 else 0), said
            reader.close()
        finally:
            saver.close()
            _cleanup(root)


# ------------------------------------------------------------------ rollback: the live save by version


@pytest.mark.parametrize("live_slot", [1, 0])
def test_a_rollback_restores_the_live_save_of_a_step_held_twice_whatever_its_slot(tmp_path, live_slot):
    """Step 3 held twice in memory (the abandoned branch's and the live one's): the live one, by version."""
    root = tmp_path / "ck"
    keep = 1 if live_slot == 1 else 2
    ckpt = shardckpt.Checkpointer(local_dir=str(root), every_steps=100, memory_every_steps=1, memory_keep=keep,
                                  preemption_signals=())
    state = {"weights": torch.zeros(256), "meta": {}}
    try:
        for step in (1, 2, 3):
            state["weights"].fill_(step)
            ckpt.save(state, step)
        assert ckpt.load(state, step=2) == 2  # a rollback: 3 stays held, on the abandoned branch
        state["weights"].fill_(33.0)
        ckpt.save(state, 3)  # the live branch's 3
        held = sorted((body["slot"], body["step"], _value(body))
                      for body in _bodies(shm.namespace(str(root))) if body["step"] == 3)
        assert [(slot, value) for slot, _s, value in held] == sorted([(live_slot, 33.0), (1 - live_slot if keep == 1
                                                                      else 2, 3.0)]), held
        fresh = {"weights": torch.zeros(256), "meta": {}}
        other = shardckpt.Checkpointer(local_dir=str(root), every_steps=100, memory_every_steps=1, memory_keep=keep,
                                       preemption_signals=())
        assert other.load(fresh) == 3 and float(fresh["weights"][0]) == 33.0
        other.close()
    finally:
        ckpt.close()
        _cleanup(root)


def _bodies(ns):
    out = []
    for path in glob.glob(os.path.join(ns, "*.rec")):
        with open(path) as f:
            body = json.load(f)
        with open(_layout_of(ns, body)) as f:
            body.update({k: v for k, v in json.load(f).items() if k in ("buffer", "tensors")})
        body["_ns"] = ns
        out.append(body)
    return out


def _value(body) -> float:
    entry = next(t for t in body["tensors"] if t[0].endswith("weights"))
    with open(os.path.join(body["_ns"], body["buffer"]), "rb") as f:
        f.seek(entry[5])
        return float(torch.frombuffer(bytearray(f.read(4)), dtype=torch.float32)[0])


# ------------------------------------------------------------------ what the user sees


def test_ls_lists_memory_steps_with_the_others_by_step_and_status_names_no_memory_dir_when_off(tmp_path):
    root = tmp_path / "ck"
    ckpt = shardckpt.Checkpointer(local_dir=str(root), every_steps=2, memory_every_steps=1, preemption_signals=())
    try:
        for step in range(1, 6):  # disk: 2, 4; memory (memory_keep=1): 4, 5
            handle = ckpt.save({"weights": torch.full((64,), float(step))}, step)
            if handle is not None:
                handle.wait()
        listed = subprocess.run([sys.executable, "-m", "shardckpt", "ls", str(root), "--json"], env=child_env(),
                                capture_output=True, text=True, timeout=120)
        rows = json.loads(listed.stdout)["steps"]
        assert [(r["step"], r["tiers"]) for r in rows] == [
            (2, ["local"]), (4, ["local", "memory"]), (5, ["memory"])
        ], rows
        assert ckpt.status()["memory_dir"] == shm.namespace(str(root))
    finally:
        ckpt.close()
        _cleanup(root)
    off = shardckpt.Checkpointer(local_dir=str(tmp_path / "off"), preemption_signals=())
    assert "memory_dir" not in off.status()
    off.close()


# ------------------------------------------------------------------ the record's size: its layout written once


def _files(ns, suffix):
    return {os.path.basename(p): os.stat(p).st_ino for p in glob.glob(os.path.join(ns, f"*{suffix}"))}


def test_a_slots_layout_is_written_once_and_each_record_holds_only_what_changed(tmp_path):
    """Saves of one state write each slot's layout file once; each record stays a few hundred bytes whatever
    the state's size, and carries a plain value only when it changed; a new tensor writes a new layout (the
    old one goes); a restore in a new process reads the newest step bitwise."""
    root = tmp_path / "ck"
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(20)])  # 40 tensors
    ckpt = shardckpt.Checkpointer(local_dir=str(root), every_steps=10**9, memory_every_steps=1,
                                  preemption_signals=())
    ids = [0, 1]  # a list of scalars changed in place: never the bytes of its last value
    state = {"model": model, "meta": {"note": "same", "at": 0}, "ids": ids}
    try:
        ns = None
        for step in range(1, 7):
            with torch.no_grad():
                model[0].weight.fill_(step)
            state["meta"] = {"note": "same", "at": str(step)}  # its bytes change, not its length
            ckpt.save(state, step)
            ns = shm.namespace(str(root))
            if step == 2:
                layouts = _files(ns, ".lay")
            sizes = {n: os.path.getsize(os.path.join(ns, n)) for n in _files(ns, ".rec")}
            assert all(size < 700 for size in sizes.values()), sizes
        assert len(layouts) == 2 and _files(ns, ".lay") == layouts  # the same files: not written again
        assert min(os.path.getsize(os.path.join(ns, n)) for n in layouts) > 10 * max(sizes.values())
        assert "values" not in _record_of(ns, 6)[1]  # the values' table is the layout's
        model.append(nn.Linear(16, 16))  # a new tensor: each slot is laid out again at its next save
        ckpt.save(state, 7)
        ckpt.save(state, 8)
        assert len(_files(ns, ".lay")) == 2 and not set(_files(ns, ".lay")) & set(layouts)  # the old ones gone
        with torch.no_grad():
            model[0].weight.fill_(9)
        state["meta"] = {"note": "changed" * 100, "at": "y"}
        ckpt.save(state, 9)  # into step 7's slot
        assert "values" in _record_of(ns, 9)[1]  # values of another length: their table in the record
        ckpt.save(state, 10)
        state["meta"] = {"note": "changed" * 100, "at": "z"}  # of the same length as in step 9's slot
        ids[1] = 11
        ckpt.save(state, 11)
        fresh_model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(21)])
        fresh = {"model": fresh_model, "meta": {}, "ids": []}
        other = shardckpt.Checkpointer(local_dir=str(root), every_steps=10**9, memory_every_steps=1,
                                       preemption_signals=())
        assert other.load(fresh) == 11 and fresh["meta"] == {"note": "changed" * 100, "at": "z"}
        assert fresh["ids"] == [0, 11]
        for (name, a), b in zip(model.state_dict().items(), fresh_model.state_dict().values()):
            assert torch.equal(a, b), name
        other.close()
    finally:
        ckpt.close()
        _cleanup(root)


def test_a_slots_values_file_written_in_place_holds_each_saves_values_also_shorter_or_removed(tmp_path):
    """The values file is written in place through a descriptor the slot keeps (no O_TRUNC per save): a save
    whose values are shorter than the slot's last cuts the file to them, a file removed under the process is
    made again at the slot's next save, and a restore in another Checkpointer reads each step's own values."""
    root = tmp_path / "ck"
    model = nn.Linear(4, 4)
    ckpt = shardckpt.Checkpointer(local_dir=str(root), every_steps=10**9, memory_every_steps=1,
                                  preemption_signals=())
    notes = ["x" * 5000, "y" * 3000, "short", "s", "z" * 40, "t"]  # each slot: longer values, then shorter
    try:
        for step, note in enumerate(notes, start=1):
            if step == 5:  # both slots' values files removed under the process
                for name in glob.glob(os.path.join(shm.namespace(str(root)), "*.val")):
                    os.unlink(name)
            ckpt.save({"model": model, "meta": {"note": note}}, step)
            ns = shm.namespace(str(root))
            body = _record_of(ns, step)[1]
            assert os.path.getsize(os.path.join(ns, f"r0-s{body['slot']}.val")) == body["values_size"], step
        assert all(s.values_fd is not None for s in ckpt._saver._memory.slots if s.holds)
        other = shardckpt.Checkpointer(local_dir=str(root), every_steps=10**9, memory_every_steps=1,
                                       preemption_signals=())
        try:
            for step in (6, 5):  # "t" written over "s"; "z" * 40 into a file made again
                fresh = {"model": nn.Linear(4, 4), "meta": {}}
                assert other.load(fresh, step=step) == step and fresh["meta"] == {"note": notes[step - 1]}
        finally:
            other.close()
    finally:
        ckpt.close()
        _cleanup(root)
    assert all(s.values_fd is None for s in ckpt._saver._memory.slots)  # closed with the slots


@pytest.mark.parametrize("memory", [True, False], ids=["memory", "disk"])
def test_two_entries_of_one_flattened_name_are_refused_naming_the_key_and_the_remedy(tmp_path, memory):
    """``{"b.c": t, "b": {"c": t}}`` flattens to one name twice: the save is refused with the key and the
    remedy (rename one), a memory save keeps nothing of it (it used to keep one of the two tensors, silently),
    and the next save of a state without the collision is kept and restored."""
    root = tmp_path / "ck"
    options = dict(every_steps=10**9, memory_every_steps=1) if memory else dict(every_steps=1)
    ckpt = shardckpt.Checkpointer(local_dir=str(root), preemption_signals=(), **options)
    bad = {"meta": {"b.c": torch.ones(2), "b": {"c": torch.zeros(2)}}}
    try:
        with pytest.raises(shardckpt.SaveError, match=r"duplicated flatten key meta\.b\.c.*Remedy: rename one of"):
            handle = ckpt.save(bad, 1)
            if handle is not None:
                handle.wait()
        assert ckpt.steps() == []
        good = {"meta": {"b_c": torch.ones(2), "b": {"c": torch.zeros(2)}}}
        ckpt.save(good, 2)
        ckpt.wait()
    finally:
        ckpt.close()
        _cleanup(root)
    fresh = {"meta": {"b_c": torch.empty(2), "b": {"c": torch.empty(2)}}}
    other = shardckpt.Checkpointer(local_dir=str(root), preemption_signals=())
    try:
        assert other.load(fresh) == 2
    finally:
        other.close()
    assert torch.equal(fresh["meta"]["b_c"], torch.ones(2)) and torch.equal(fresh["meta"]["b"]["c"], torch.zeros(2))
