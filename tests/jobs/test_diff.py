"""``shardckpt diff``: two committed steps compared key by key, through ``cli.main`` on real checkpoints.

- Two steps of one run: the model and optimizer entries that differ (largest absolute difference, norms),
  the plain values side by side, the keys that did not change equal; exit 1.
- Two runs (another learning rate), one local and one remote (``file://``, pushed by ``shardckpt push``):
  exit 1, the learning rate side by side.
- A step against its own copy (a NaN value and a torch.Generator in it): equal, exit 0; ``--json`` says so.
- A step that is not committed: exit 2, naming the committed ones.
"""

from __future__ import annotations

import json
import shutil

import torch

import shardckpt
from shardckpt import cli
from shardckpt.format import layout


def _train(root, *, lr: float = 0.1, steps=(1, 2)) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    head = torch.nn.Linear(2, 2)  # never trained: equal at every step
    state = {"model": model, "optimizer": optimizer, "head": head, "seen": 0, "best": float("nan"),
             "gen": torch.Generator().manual_seed(5)}
    ckpt = shardckpt.Checkpointer(local_dir=str(root))
    try:
        for step in steps:
            model(torch.randn(8, 4)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            state["seen"] += 8
            ckpt.save(state, step)
        ckpt.wait()
    finally:
        ckpt.close()


def _diff(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(["diff", *map(str, argv)])
    found = capsys.readouterr()
    return code, found.out + found.err


def test_two_steps_of_one_run(tmp_path, capsys):
    _train(tmp_path / "a")
    code, out = _diff(capsys, tmp_path / "a", "--step", "1", "--step", "2")
    assert code == 1, out
    assert out.startswith(f"shardckpt diff: A = step 1 of {tmp_path / 'a'}\nshardckpt diff: B = step 2 of "), out
    assert "  head [module]: equal\n" in out and "  best [value]: equal\n" in out, out
    assert "  seen [value]: 1 of 1 entries differ\n    value: 8 (A) vs 16 (B)\n" in out, out
    assert "  model [module]: 4 of 4 entries differ\n    0.bias float32[3]: 3 element(s) differ, max |A-B| " in out, out
    assert ", norm " in out and " (A) vs " in out, out
    assert "  optimizer [optimizer]: " in out, out
    assert out.rstrip().splitlines()[-1].startswith("shardckpt diff: differ: "), out


def test_two_runs_local_and_remote(tmp_path, capsys):
    _train(tmp_path / "a")
    _train(tmp_path / "b", lr=0.05)
    remote = f"file://{tmp_path / 'remote'}"
    assert cli.main(["push", "--local", str(tmp_path / "b"), "--remote", remote]) == 0
    capsys.readouterr()
    code, out = _diff(capsys, tmp_path / "a", remote, "--step", "2")
    assert code == 1, out
    assert f"shardckpt diff: B = step 2 of {remote}" in out, out
    assert "    param_groups.0.lr: 0.1 (A) vs 0.05 (B)\n" in out, out
    assert "  head [module]: equal\n" in out and "  seen [value]: equal\n" in out, out


def test_a_step_against_its_own_copy_is_equal(tmp_path, capsys):
    _train(tmp_path / "a")
    name = layout.step_dirname(2)
    shutil.copytree(tmp_path / "a" / name, tmp_path / "copy" / name)
    code, out = _diff(capsys, tmp_path / "a", tmp_path / "copy" / name, "--step", "2")
    assert code == 0, out
    assert "  best [value]: equal\n" in out and "  gen [value]: equal\n" in out, out
    assert out.rstrip().splitlines()[-1].startswith("shardckpt diff: equal: "), out
    code, out = _diff(capsys, tmp_path / "a", tmp_path / "copy" / name, "--json")
    assert code == 0, out
    found = json.loads(out)
    assert found["equal"] is True and found["a"]["step"] == found["b"]["step"] == 2, found
    assert {"model", "optimizer", "head", "seen", "best", "gen"} <= set(found["keys"]), found


def test_a_step_not_committed_is_named(tmp_path, capsys):
    _train(tmp_path / "a")
    code, out = _diff(capsys, tmp_path / "a", "--step", "1", "--step", "7")
    assert code == 2, out
    assert "step 7 is not committed in" in out and "committed: [1, 2]" in out, out
