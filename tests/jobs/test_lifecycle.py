"""What a Checkpointer promises over its life: preemption, close(), status, signals, values.

Multi-rank behaviour (the preemption vote, side groups) runs at 2 ranks under
torchrun; the rest in one process.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

import pytest
import torch
import torch.nn as nn
from helpers import PROGRAMS, mount_tmpfs, run_torchrun

import shardckpt
from shardckpt import _failpoints

PROG = PROGRAMS / "lifecycle.py"


def results(out, world=2):
    return [json.loads((out / f"result.{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Both 2-rank jobs in one launch (one process group, one start): the preemption on a 2 MiB tmpfs
    (when this process may mount one) and the closed instances. Yields the output directory and, when
    the tmpfs could not be mounted, the skip (or failure) that says why."""
    base = tmp_path_factory.mktemp("lifecycle")
    mount = base / "small"
    mount.mkdir()
    try:
        mount_tmpfs(mount, "size=2m", "a save that does not fit a full disk")
        skipped = None
    except (pytest.skip.Exception, pytest.fail.Exception) as exc:  # raised again by the test that needs it
        skipped = exc
    jobs = [] if skipped else ["preempt-disk-full", mount, base / "preempt", "+"]
    jobs += ["instances", base / "ckpt", base / "instances"]
    for name in ("preempt", "instances"):
        (base / name).mkdir()
    try:
        run_torchrun(2, PROG, *jobs)
        yield base, skipped
    finally:
        if skipped is None:
            os.system(f"umount {mount}")


def test_preemption_save_skipped_for_space_is_retried_and_then_preempted(two_ranks):
    base, skipped = two_ranks
    if skipped is not None:
        raise skipped
    for got in results(base / "preempt"):
        # step 1: interval skip; 2: the vote carries rank 1's signal; 3: the preemption
        # save does not fit and is skipped; 4: it is retried and commits on both ranks.
        assert got["saved"] == [False, False, False, True], got
        assert got["preempted"] == [False, False, False, True], got
        assert got["steps"] == [4], got


def test_closed_instances_leave_no_file_descriptors_behind(two_ranks):
    base, _ = two_ranks
    for got in results(base / "instances"):
        # The first instance may warm up lazily created resources; later ones must not grow.
        assert [after - before for before, after in got["fds"][1:]] == [0, 0], got


def make_state():
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def ckpt_for(path, **kw):
    kw.setdefault("preemption_signals", ())
    return shardckpt.Checkpointer(local_dir=str(path), **kw)


def test_close_with_timeout_returns_while_a_write_is_stuck(tmp_path):
    ckpt = ckpt_for(tmp_path)
    release = threading.Event()
    _failpoints.arm("write.done", lambda: release.wait(120))  # a write stuck until released
    ckpt.save(make_state(), 1)
    try:
        with pytest.raises(TimeoutError, match="step 1"):
            ckpt.close(timeout=0.3)
        # close() came back while the write was still stuck: the step is not committed yet
        assert ckpt.steps() == []
    finally:
        release.set()
    deadline = time.monotonic() + 60
    while ckpt.steps() != [1] and time.monotonic() < deadline:  # the write still completes
        time.sleep(0.05)
    assert ckpt.steps() == [1]


def test_status_reports_the_last_failed_save(tmp_path):
    state = make_state()
    ckpt = ckpt_for(tmp_path)
    ckpt.save(state, 1).wait()
    assert ckpt.status()["last_error"] is None
    state["bad"] = {"fn": lambda: 0}  # staged, but the writer cannot serialise it
    ckpt.save(state, 2)
    with pytest.raises(shardckpt.SaveError, match="step 2"):
        ckpt.wait()
    assert "SaveError" in ckpt.status()["last_error"] and "step 2" in ckpt.status()["last_error"]
    del state["bad"]
    ckpt.save(state, 3).wait()
    ckpt.close()


def test_signal_handler_only_sets_a_flag_and_save_logs_it(tmp_path, caplog):
    previous = signal.getsignal(signal.SIGUSR2)
    ckpt = shardckpt.Checkpointer(local_dir=str(tmp_path), every_steps=100, preemption_signals=(signal.SIGUSR2,))
    try:
        with caplog.at_level(logging.INFO, logger="shardckpt"):
            os.kill(os.getpid(), signal.SIGUSR2)
            assert ckpt.preemption_requested
            assert "received signal" not in caplog.text  # nothing logged from inside the handler
            assert ckpt.save(make_state(), 1) is not None
        assert f"received signal {int(signal.SIGUSR2)}" in caplog.text and ckpt.preempted
    finally:
        ckpt.close()
        signal.signal(signal.SIGUSR2, previous)


def test_growing_plain_values_do_not_reallocate_staging_buffers(tmp_path):
    state = make_state()
    state["history"] = []
    with ckpt_for(tmp_path, keep_last=1) as ckpt:
        for step in range(1, 6):
            state["history"].append({"step": step, "loss": 1.0 / step})
            ckpt.save(state, step)
        ckpt.wait()
        assert ckpt._stager.allocations == 1
    restored = {"history": []}
    assert ckpt_for(tmp_path).load(restored, strict=False) == 5
    assert [h["step"] for h in restored["history"]] == [1, 2, 3, 4, 5]


def test_plain_values_come_back_into_the_callers_own_objects(tmp_path):
    state = make_state()
    state["meta"] = {"epoch": 7, "nested": {"seen": [1, 2, 3]}, "best": torch.tensor([0.5, 0.25])}
    state["order"] = [3, 1, 2]
    with ckpt_for(tmp_path) as ckpt:
        ckpt.save(state, 1)
    meta, order = {}, []
    best = torch.zeros(2)
    nested = {"seen": []}
    fresh = make_state()
    fresh.update(meta=meta, order=order)
    meta.update(best=best, nested=nested)
    assert ckpt_for(tmp_path).load(fresh) == 1
    assert fresh["meta"] is meta and fresh["order"] is order
    assert meta["epoch"] == 7 and meta.get("epoch", 0) == 7
    assert meta["nested"] is nested and nested["seen"] == [1, 2, 3]
    assert meta["best"] is best and torch.equal(best, torch.tensor([0.5, 0.25]))
    assert order == [3, 1, 2]


def test_unwritable_local_dir_is_refused_at_construction(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(shardckpt.ConfigError, match="not a writable directory") as err:
        shardckpt.Checkpointer(local_dir=str(blocker / "ckpt"), preemption_signals=())
    assert str(blocker / "ckpt") in str(err.value) and "Remedy" in str(err.value)


def test_read_only_local_dir_with_a_remote_is_a_shardckpt_error(tmp_path):
    mount = tmp_path / "ro"
    mount.mkdir()
    mount_tmpfs(mount, "ro,size=1m", "a read-only local_dir")
    try:
        with pytest.raises(shardckpt.ShardckptError, match="not a writable directory"):
            shardckpt.Checkpointer(local_dir=str(mount / "ckpt"), remote=f"file://{tmp_path / 'nfs'}",
                                   preemption_signals=())
    finally:
        os.system(f"umount {mount}")


@pytest.fixture
def slow_copies(monkeypatch):
    """Copies that finish late, as a GPU's do: on this CPU they run when the fence is waited for.

    The writer thread, before it waits for them, stops at the fault point
    ``stage.copies_pending`` until the test calls ``release()``: whatever the
    test does in between happens after save() returned and before the copies
    ended. Yields ``release``.
    """
    import threading

    from shardckpt.saving import stage

    monkeypatch.setattr(stage.HostStager, "defer_cpu_copies", True)
    monkeypatch.setattr(_failpoints, "_SPEC", {})
    monkeypatch.setattr(_failpoints, "_COUNTS", {})
    released = threading.Event()

    def arm():
        released.clear()
        _failpoints.arm("stage.copies_pending", lambda: released.wait(30))

    arm()
    yield lambda: (released.set(), arm())


def _overlap_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}


def _model_values(state: dict) -> dict:
    return {k: v.detach().clone() for k, v in state["model"].state_dict().items()}


def _loaded(path, step: int) -> dict:
    fresh = _overlap_state(seed=1)
    with ckpt_for(path) as c:
        assert c.load({"model": fresh["model"]}, step=step, strict=False) == step
    return _model_values(fresh)


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), [
        k for k in a if not torch.equal(a[k], b[k])
    ]


def test_overlap_orders_the_optimizer_step_and_buffer_forwards_after_the_copies(tmp_path, slow_copies):
    # overlap_copies=True: save() returns before the copies end; the two fenced writes
    # (an optimizer's step, the forward of a module owning buffers) wait for them.
    release = slow_copies
    state = _overlap_state()
    state["model"](torch.randn(5, 6)).pow(2).mean().backward()
    ckpt = ckpt_for(tmp_path, overlap_copies=True)
    before = _model_values(state)
    handle = ckpt.save(state, 1)
    state["optimizer"].step()  # writes every parameter: fenced by the step pre-hook
    release()
    handle.wait()
    _assert_same(before, _loaded(tmp_path, 1))

    before = _model_values(state)
    handle = ckpt.save(state, 2)
    state["model"](torch.randn(5, 6))  # BatchNorm updates its running statistics: fenced by the forward pre-hook
    release()
    handle.wait()
    _assert_same(before, _loaded(tmp_path, 2))
    ckpt.close()
    assert not state["optimizer"]._optimizer_step_pre_hooks  # the hooks leave with the Checkpointer


def test_overlap_fails_a_step_that_an_unfenced_write_reached(tmp_path, slow_copies):
    # A write the option does not fence (here a copy_ under no_grad before step(), as
    # load_state_dict does) lands before the copy: the step fails, naming the tensor.
    release = slow_copies
    state = _overlap_state()
    ckpt = ckpt_for(tmp_path, overlap_copies=True)
    handle = ckpt.save(state, 1)
    with torch.no_grad():
        state["model"][0].weight.copy_(torch.zeros(4, 6))
    release()
    with pytest.raises(shardckpt.SaveError) as err:
        handle.wait()
    message = str(err.value)
    assert "step 1" in message and "'model.0.weight'" in message and "overlap_copies=False" in message
    assert "wait_for_copies()" in message and "check the disk" not in message
    assert ckpt.steps() == [] and not [n for n in os.listdir(tmp_path) if n.startswith(".partial")]

    # Fenced by hand, the same write is safe and the next save commits what it saw.
    before = _model_values(state)
    handle = ckpt.save(state, 2)
    ckpt.wait_for_copies()
    with torch.no_grad():
        state["model"][0].weight.copy_(torch.ones(4, 6))
    release()
    handle.wait()
    ckpt.close()
    _assert_same(before, _loaded(tmp_path, 2))


def test_by_default_save_returns_with_the_copies_done(tmp_path, slow_copies):
    # Without overlap no write after save() can reach the copies, fenced or not.
    release = slow_copies
    state = _overlap_state()
    ckpt = ckpt_for(tmp_path)
    before = _model_values(state)
    handle = ckpt.save(state, 1)
    with torch.no_grad():
        state["model"][0].weight.copy_(torch.zeros(4, 6))  # load_state_dict-like
        state["model"][1].running_mean.add_(5.0)  # an unhooked buffer write
    release()
    handle.wait()
    ckpt.close()
    _assert_same(before, _loaded(tmp_path, 1))
    assert not state["optimizer"]._optimizer_step_pre_hooks  # nothing to fence: no hooks


def test_pinned_memory_cap_pins_up_to_the_limit():
    from shardckpt.saving.stage import HostStager

    stager = HostStager(pin_memory=True, max_pinned_bytes=1000)
    assert stager._pin(torch.zeros(200)) is True  # 800 bytes
    assert stager._pin(torch.zeros(100)) is False  # 400 more would pass the cap: pageable
    assert stager._pin(torch.zeros(50)) is True and stager.pinned_bytes == 1000
    assert HostStager(pin_memory=False)._pin(torch.zeros(1)) is False
