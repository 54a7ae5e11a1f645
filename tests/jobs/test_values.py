"""Plain values as training scripts hold them, and the small traps of a first conversion.

The multi-rank checks share one 2-rank launch (tests/programs/plain_values.py):
values that differ by rank, dicts with int keys, the DDP free-space estimate.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn as nn
from helpers import PROGRAMS, ROOT, child_env, import_program, run_torchrun

import shardckpt
from shardckpt import _failpoints


def ckpt_for(path, **kw):
    kw.setdefault("preemption_signals", ())
    return shardckpt.Checkpointer(local_dir=str(path), **kw)


def messages(caplog, text):
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


# ------------------------------------------------------------- 2 ranks, one launch


@pytest.fixture(scope="module")
def ddp_values(tmp_path_factory):
    """Run the program once; a 3 MiB tmpfs for the free-space check when this process may mount one."""
    base = tmp_path_factory.mktemp("values")
    small = base / "small"
    small.mkdir()
    mounted = os.geteuid() == 0 and os.system(f"mount -t tmpfs -o size=3m tmpfs {small} 2>/dev/null") == 0
    try:
        proc = run_torchrun(2, PROGRAMS / "plain_values.py", base, small if mounted else "-", timeout=240)
        ranks = [json.loads((base / f"rank{r}.json").read_text()) for r in range(2)]
    finally:
        if mounted:
            os.system(f"umount {small}")
    return proc.stdout, ranks, mounted, base / "own"



def test_values_that_differ_by_rank_save_rank_0s_with_one_warning(ddp_values):
    log, ranks, _mounted, _own = ddp_values
    assert "not in md" not in log and "SaveError" not in log, log[-3000:]
    in_memory = [line for line in log.splitlines() if "differs across ranks" in line and "step 6:" in line]
    assert sorted(line.split("'")[1] for line in in_memory) == ["meter", "notes", "stats"], in_memory
    warned = [line for line in log.splitlines()
              if "differs across ranks" in line and "step 6:" not in line and "step 7:" not in line]
    by_key = {key: [line for line in warned if f" {key!r} differs" in line]
              for key in ("meta", "stats", "notes", "meter")}
    assert all(len(lines) == 1 for lines in by_key.values()) and len(warned) == 4, warned  # two saves each
    assert "stats.big" in by_key["stats"][0] and "content digest" in by_key["stats"][0]
    assert "rank(s) 1" in by_key["meta"][0] and "rank 0" in by_key["meta"][0]
    for line in warned:
        assert "PerRank" in line and "broadcast" in line and "saving rank 0's value" in line
    for got in ranks:
        assert got["restored"] == 2
        assert got["best_val_loss"][0] == "Tensor" and abs(got["best_val_loss"][1] - 3.65) < 1e-6  # rank 0's
        assert got["lr"] == 0.5 and got["iter_num"] == 7
        own = got["own"]
        assert own["loaded"] == 5
        # A 1,000-element tensor (once compared by shape only) and a 5,000-character string (over 4 KiB, the
        # same length on both ranks): rank 0's on every rank, and the state of a stateful object too.
        assert own["big"] == [pytest.approx(3.65), pytest.approx(3.65), [1000]] and own["same"]
        assert own["text"] == ["aaa", 5000] and own["meter"] == [1.0, 1.0]
        # Kept in memory only and read back from there: rank 0's value on every rank, each from its own copy.
        assert own["memory"][:6] == ["memory", 6, "memory", pytest.approx(3.65), "aaa", [1.0, 1.0]], own["memory"]
        assert own["memory"][6] is False  # a save on disk too is not "newer in memory": close() freed it
    assert "newer in memory" not in log


def test_generators_and_samplers_come_back_to_the_rank_that_saved_them(ddp_values, caplog):
    """A per-rank shuffle generator and a sampler's per-rank position: each rank's own, never a warning."""
    log, ranks, _mounted, own_dir = ddp_values
    assert "'data' differs" not in log and "'sampler' differs" not in log
    for rank, got in enumerate(ranks):
        own = got["own"]
        assert own["shuffle_next"] == own["shuffle_expected"] and own["shuffle_same_object"], own
        assert own["epoch"] == 2
        assert own["sampler"][0] == 10 * rank + 3 and own["sampler"][1] == own["sampler"][2], own
    assert ranks[0]["own"]["shuffle_next"] != ranks[1]["own"]["shuffle_next"]
    # The same step at 1 rank: rank 0's generator comes back; the sampler's per-rank position belongs to
    # the 2-rank layout: it is left as it is, and one warning says so.
    program = import_program("plain_values")
    TinyNet, Meter, RankSampler = program.common.TinyNet, program.Meter, program.RankSampler

    shuffle, sampler = torch.Generator().manual_seed(999), RankSampler(7)
    before = sampler.order.clone()
    state = {"model": TinyNet(width=4), "stats": {}, "notes": [], "data": {"shuffle": shuffle, "epoch": 0},
             "sampler": sampler, "meter": Meter(-1.0)}
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        with ckpt_for(own_dir) as ckpt:
            assert ckpt.load(state) == 5
    assert torch.randn(4, generator=shuffle).tolist() == ranks[0]["own"]["shuffle_expected"]
    assert sampler.pos == 0 and torch.equal(sampler.order, before)
    assert float(state["stats"]["big"][0]) == pytest.approx(3.65) and state["data"]["epoch"] == 2
    note = messages(caplog, "saved by 2 ranks, restored by 1")
    assert len(note) == 1 and "'sampler'" in note[0] and "not restored" in note[0] and "ResumableSampler" in note[0]
    assert "'data'" in note[0] and "dropped" in note[0]


def test_int_keys_round_trip_under_ddp_and_save_again(ddp_values):
    _log, ranks, _mounted, _own = ddp_values
    for got in ranks:
        assert got["itos_keys"] == ["0", "1", "10"]  # reprs: ints, not '0'
        assert got["itos"] == {"0": "a", "1": "b", "10": "z"} and got["itos_same_object"]
        assert got["stoi"] == {"a": 0, "#": 3}
        assert got["steps"] == [1, 2, 3]  # the loaded dict saved again


def test_empty_dicts_and_a_lambda_schedulers_state_round_trip(ddp_values):
    """DCP writes nothing for an empty dict: without care the key is gone after a restore."""
    _log, ranks, _mounted, _own = ddp_values
    for got in ranks:
        assert got["empties"] == [{}, {"empty": {}, "lists": [{}, []]}]
        assert got["sched"]["last_epoch"] == 3
        assert got["sched"]["lr_lambdas"] == [{}]  # LambdaLR over a functools.partial


def test_ddp_replicas_count_once_in_the_free_space_estimate(ddp_values):
    log, ranks, mounted, _own = ddp_values
    if not mounted:
        pytest.skip("needs root to mount a small tmpfs")
    # 1.6 MB of parameters on a 3 MiB disk at 2 ranks: fits once, not once per rank.
    assert ranks[0].get("small_steps") == [1], ranks[0].get("small_error")
    assert "trainable parameters but no optimizer" in log


# ------------------------------------------------------------------ one process


def test_dict_keys_round_trip_with_their_types(tmp_path):
    keys = {0: "int", "0x": "str", 2.5: "float", True: "bool", None: "none", "#tag": "hash", -3: "neg"}
    state = {"vocab": {"itos": dict(keys), "nested": [{7: torch.ones(2)}, {8: "x"}]}}
    with ckpt_for(tmp_path) as ckpt:
        ckpt.save(state, 1).wait()
    live_itos = {0: "old", 99: "kept"}
    live = {"vocab": {"itos": live_itos}}
    with ckpt_for(tmp_path) as ckpt:
        assert ckpt.load(live) == 1
        assert live["vocab"]["itos"] is live_itos
        assert live_itos == {**keys, 99: "kept"}
        assert [type(k) for k in live_itos] == [int, int, str, float, bool, type(None), str, int]
        assert list(live["vocab"]["nested"][0]) == [7] and live["vocab"]["nested"][1] == {8: "x"}
        ckpt.save(live, 2).wait()  # no "duplicated flatten key"
        assert ckpt.steps() == [1, 2]


def test_unsupported_dict_keys_are_refused_naming_the_key(tmp_path):
    with ckpt_for(tmp_path) as ckpt:
        with pytest.raises(shardckpt.ConfigError, match=r"step 1.*\('a', 1\).*tuple"):
            ckpt.save({"meta": {"pairs": {("a", 1): 2}}}, 1)
        assert ckpt.steps() == []
        ckpt.save({"meta": {"pairs": {"a": 2}}}, 2).wait()  # the instance goes on
        assert ckpt.steps() == [2]


def test_a_generator_continues_in_the_live_one_and_a_tuple_holding_one_is_refused(tmp_path):
    shuffle = torch.Generator().manual_seed(4)
    torch.rand(2, generator=shuffle)
    with ckpt_for(tmp_path) as ckpt:
        with pytest.raises(shardckpt.ConfigError, match=r"step 1: 'pair' is a tuple holding a torch.Generator"):
            ckpt.save({"pair": (1, shuffle)}, 1)
        ckpt.save({"shuffle": shuffle, "order": [shuffle]}, 2).wait()
    expected = torch.rand(3, generator=shuffle)
    live = torch.Generator().manual_seed(99)
    state = {"shuffle": live, "order": []}
    with ckpt_for(tmp_path) as ckpt:
        assert ckpt.load(state) == 2
    assert state["shuffle"] is live and torch.equal(torch.rand(3, generator=live), expected)
    assert torch.equal(torch.rand(3, generator=state["order"][0]), expected)


def test_save_error_says_check_the_disk_only_when_the_disk_failed(tmp_path):
    with ckpt_for(tmp_path) as ckpt:
        ckpt.save({"bad": {"fn": lambda: 0}}, 1)  # cannot be pickled: not a disk problem
        with pytest.raises(shardckpt.SaveError) as err:
            ckpt.wait()
        text = str(err.value)
        assert "step 1" in text and "bad.fn" in text and "pickle" in text
        assert "check the disk" not in text and "not the cause" in text and "picklable" in text
        assert "Traceback" not in text  # DCP's per-rank report, reduced to its failure
        _failpoints.arm("write.done")  # an OSError while writing, as a failing disk gives
        ckpt.save({"w": torch.zeros(2)}, 2)
        with pytest.raises(shardckpt.SaveError, match="check the disk") as err:
            ckpt.wait()
        assert "InjectedFault" in str(err.value)


def test_same_step_saved_twice_warns_and_the_wait_says_why(tmp_path, caplog):
    release = threading.Event()
    state = {"w": torch.zeros(4)}
    with ckpt_for(tmp_path) as ckpt, caplog.at_level(logging.INFO, logger="shardckpt"):
        _failpoints.arm("write.done", lambda: release.wait(10))  # the first save is still writing
        ckpt.save(state, 5)
        timer = threading.Timer(0.5, release.set)
        timer.start()
        assert ckpt.save(state, 5) is None  # the same number again is skipped, unless forced
        ckpt.save(state, 5, force=True).wait()
        timer.join()
    twice = messages(caplog, "saved a second time")
    assert len(twice) == 1 and "step 5" in twice[0] and "replaces the earlier save" in twice[0]
    waits = messages(caplog, "waits for step 5")
    assert waits and "still writing" in waits[0]
    assert not messages(caplog, "interval shorter")


def test_shape_mismatch_names_the_run_config_change(tmp_path):
    def make(n_embd):
        torch.manual_seed(0)
        return {"model": nn.Linear(4, n_embd)}

    with ckpt_for(tmp_path, run_config={"n_embd": 64, "n_layer": 2}) as ckpt:
        ckpt.save(make(64), 1).wait()
    with ckpt_for(tmp_path, run_config={"n_embd": 96, "n_layer": 2}) as ckpt:
        with pytest.raises(shardckpt.StateMismatchError) as err:
            ckpt.load(make(96))
    text = str(err.value)
    assert "weight saved (64, 4), live (96, 4)" in text and "n_embd: 64 -> 96" in text and "n_layer" not in text


def test_module_without_optimizer_gets_one_info_line(tmp_path, caplog):
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with caplog.at_level(logging.INFO, logger="shardckpt"):
        with ckpt_for(tmp_path / "a") as ckpt:
            for step in (1, 2):
                ckpt.save({"model": nn.Linear(2, 2), "frozen": frozen}, step).wait()
        lines = messages(caplog, "no optimizer")
        assert len(lines) == 1 and "'model'" in lines[0] and "'frozen'" not in lines[0]
        model = nn.Linear(2, 2)
        with ckpt_for(tmp_path / "b") as ckpt:
            ckpt.save({"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}, 1).wait()
            ckpt.save({"frozen": frozen}, 2).wait()
        assert len(messages(caplog, "no optimizer")) == 1


def test_plan_line_without_rng_capture(tmp_path, caplog):
    with ckpt_for(tmp_path, capture_rng=False) as ckpt:
        ckpt.save({"w": torch.zeros(2)}, 1).wait()
    with ckpt_for(tmp_path, capture_rng=False) as ckpt, caplog.at_level(logging.INFO, logger="shardckpt"):
        ckpt.load({"w": torch.zeros(2)})
        summary = ckpt.last_plan.summary()
    assert "RNG restored" not in summary and "capture_rng=False" in summary
    assert messages(caplog, "elastic plan") and not messages(caplog, "RNG restored")
    with ckpt_for(tmp_path) as ckpt:
        ckpt.load({"w": torch.zeros(2)})
        assert "RNG" in ckpt.last_plan.summary() and "capture_rng" not in ckpt.last_plan.summary()


def test_close_logs_a_short_wait_for_uploads_at_debug_only(tmp_path, caplog, monkeypatch):
    from shardckpt.node import uploader_client

    monkeypatch.setattr(uploader_client, "ANNOUNCE_AFTER_S", 600.0)  # this wait never counts as long
    ckpt = ckpt_for(tmp_path / "local", remote=f"file://{tmp_path}/remote", drain_timeout_s=120.0)
    with caplog.at_level(logging.DEBUG, logger="shardckpt"):
        ckpt.save({"w": torch.zeros(2)}, 1).wait()
        ckpt.close()
    assert ckpt.status()["drain"]["pending_steps"] == []
    waits = [r for r in caplog.records if "close() waits up to" in r.getMessage()]
    assert waits and all(r.levelno == logging.DEBUG for r in waits), caplog.text


def test_dir_lists_the_public_names_without_importing_torch():
    probe = (
        "import sys, shardckpt; names = dir(shardckpt); "
        "assert 'torch' not in sys.modules, 'torch was imported'; "
        "assert {'Checkpointer', 'PerRank', 'ResumableSampler', 'save', 'load'} <= set(names), names; "
        "assert not {'os', 'threading', 'Any', 'logging'} & set(names), names; "
        "assert set(shardckpt.__all__) <= set(names); "
        "[getattr(shardckpt, n) for n in shardckpt.__all__]"
    )
    proc = subprocess.run([sys.executable, "-c", probe], env=child_env(), capture_output=True, text=True,
                          cwd=str(ROOT), timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_value_that_starts_to_differ_at_a_later_save_is_found_there_and_at_every_save_after(tmp_path):
    """Only the summaries that changed since the last save are exchanged: rank 1's value, the same as rank
    0's at steps 1-3, differs from step 4 (then stays as it is, so rank 1 sends nothing new at 5 and 6): the
    warning comes at step 4, and every save from 4 to 6 keeps rank 0's value, in memory and on disk."""
    proc = run_torchrun(2, PROGRAMS / "values_later.py", tmp_path, timeout=240)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    warned = [line for line in proc.stdout.splitlines() if "differs across ranks" in line]
    assert len(warned) == 1 and "step 4:" in warned[0] and "'meta'" in warned[0] and "rank(s) 1" in warned[0], warned
    assert ranks[1]["saved"] == {"1": 0.5, "2": 0.5, "3": 0.5, "4": 0.7, "5": 0.7, "6": 0.7, "7": 0.5}
    for got in ranks:
        assert got["memory"] == {str(s): [s, {"lr": 0.5}, {"at": s}] for s in (3, 5, 7)}, got["memory"]
        assert got["disk"] == {str(s): [s, {"lr": 0.5}, {"at": s}] for s in (4, 6)}, got["disk"]
