"""The save plan against DCP's own capture, on the states the integrations save (imported by their programs).

:func:`install` makes every capture that a save plan answers from what it kept (every save after the one that
built it) also take DCP's capture of the same state (``state.capture``: ``get_model_state_dict`` /
``get_optimizer_state_dict``) and compare the two: the same keys in the same order, each tensor of the same
dtype, shape and values (a DTensor by its local shard), every other value equal (NaN equal to NaN). After each
comparison ``plan-check-<tag>-rank<r>-<pid>.json`` in the program's output directory holds how many captures were
compared and the first differences; a difference also fails the save (AssertionError).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

from shardckpt.saving import plan as plan_mod
from shardckpt.state import capture as state_mod


def differences(got: Any, want: Any, path: str = "") -> list[str]:
    """Where ``got`` and ``want`` differ (empty: the same keys in the same order and the same values)."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or list(got) != list(want):
            return [f"{path or '/'}: keys {list(got) if isinstance(got, dict) else type(got).__name__} "
                    f"!= {list(want)}"]
        return [d for k in want for d in differences(got[k], want[k], f"{path}/{k}")]
    if isinstance(want, (list, tuple)):
        if type(got) is not type(want) or len(got) != len(want):
            return [f"{path}: {type(got).__name__}[{len(got)}] != {type(want).__name__}[{len(want)}]"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in differences(g, w, f"{path}/{i}")]
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return [f"{path}: {type(got).__name__} is not a tensor"]
        g, w = (t.to_local() if hasattr(t, "to_local") else t for t in (got, want))
        if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(g, w):
            return [f"{path}: tensor {g.dtype}{list(g.shape)} differs from DCP's {w.dtype}{list(w.shape)}"]
        return []
    if isinstance(want, float) and isinstance(got, float) and math.isnan(want) and math.isnan(got):
        return []
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]


def install(out: str, tag: str) -> None:
    path = os.path.join(out, f"plan-check-{tag}-rank{os.environ.get('RANK', '0')}-{os.getpid()}.json")
    record: dict[str, Any] = {"compared": 0, "differences": []}
    capture = plan_mod.SavePlan.capture

    def checked(self: plan_mod.SavePlan, state: Any) -> Any:
        built_now = self.first is not None  # the build's own capture is DCP's: nothing to compare
        result = capture(self, state)
        if not built_now:
            want, kinds, _frozen = state_mod.capture(state, self.rank, self.capture_rng, light=self.light,
                                                     trainable_only=self.trainable_only)
            found = ([f"kinds {result[1]} != {kinds}"] if result[1] != kinds else []) + differences(result[0], want)
            record["compared"] += 1
            record["differences"] += found[:5]
            with open(path, "w") as f:
                json.dump(record, f)
            assert not found, f"the save plan's capture differs from DCP's: {found[:5]}"
        return result

    plan_mod.SavePlan.capture = checked  # type: ignore[method-assign]


def assert_checked(out: Any) -> int:
    """For the tests: the records under ``out`` compared some captures and found no difference. Returns how
    many captures were compared."""
    records = {name: json.loads(open(os.path.join(out, name)).read()) for name in sorted(os.listdir(out))
               if name.startswith("plan-check-")}
    compared = sum(r["compared"] for r in records.values())
    assert compared > 0, f"no save plan was compared with DCP's capture under {out}: {records}"
    assert all(not r["differences"] for r in records.values()), records
    return compared
