"""One committed step's saved values, read whole, and how two of them differ, for ``shardckpt diff``.

:func:`read_step` locates a committed step (a ``local_dir``, one ``step_<N>``
directory, or a remote URL: the newest live step unless one is named), makes
its files present and verified (locally against the manifest; from a remote
fetched into a temporary directory, each verified while downloading), and
reads every saved item through DCP's loader in one process, non-tensor items
with the restricted unpickler (``torch.load(weights_only=True)``) unless
``trust_pickles``. :func:`compare_keys` then compares two of them per
top-level key with the fingerprints of ``shardckpt check-resume``
(:func:`shardckpt.check_resume.digest.entry`): a key equal by its digest is
equal bit for bit (NaN equal to NaN); in a key that differs, every leaf that
differs is listed with, for tensors, the largest absolute difference and both
norms, and for plain values both values.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from shardckpt import steps as steps_mod
from shardckpt import stores
from shardckpt.check_resume import digest
from shardckpt.dcp import planner as dcp_planner
from shardckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from shardckpt.format import layout, lineage


@dataclasses.dataclass
class Step:
    source: str
    step: int
    kinds: dict[str, str]
    values: dict[str, Any]
    """Top-level key -> its saved value (nested dicts and lists of tensors and plain values)."""


def _remedy(where: str) -> str:
    return f"Remedy: pick a committed step (shardckpt ls {where})."


def _pick(infos: dict[int, Any], step: int | None, where: str) -> int:
    return steps_mod.choose_step(infos, step, where, _remedy(where))


def _load(step_dir: str, manifest: layout.Manifest, where: str, trust: bool) -> Step:
    metadata = dcp_planner.read_metadata(step_dir, manifest.step, trust_pickles=trust)
    target: dict[str, Any] = {}
    planner = dcp_planner.RestorePlanner(lambda _path: True, allow_partial_load=False, trust_pickles=trust)
    try:
        _load_state_dict(target, storage_reader=dcp_planner.TrustingReader(step_dir, metadata), planner=planner,
                         no_dist=True)
    except CheckpointException as exc:
        raise dcp_planner.unwrap_failure(exc, f"reading step {manifest.step} of {where}") from exc
    return Step(where, manifest.step, dict(manifest.keys), target)


def read_step(src: str, step: int | None, *, trust_pickles: bool = False,
              options: stores.TransferOptions | None = None) -> Step:
    """Step ``step`` (default: the newest live one) of ``src``, every saved value read whole."""
    if "://" in src:
        return _read_remote(src, step, trust_pickles, options or stores.TransferOptions())
    if os.path.isfile(os.path.join(src, layout.MANIFEST_NAME)):  # one step directory
        manifest = layout.read_manifest(src)
        _pick({manifest.step: lineage.info_of(manifest)}, step, src)
        view = steps_mod.StepView(stores.LocalDirStore(src), manifest, prefix="")
        step_dir = src
    else:
        if not os.path.isdir(src):
            raise CheckpointNotFoundError(f"{src} is not a directory. Remedy: give a checkpoint directory (a "
                                          f"local_dir), one step_<N> directory of it, or a remote URL.")
        chosen = _pick(lineage.local_infos(src), step, src)
        step_dir = os.path.join(src, layout.step_dirname(chosen))
        manifest = layout.read_manifest(step_dir)
        if manifest is None:
            raise CheckpointNotFoundError(f"step {chosen} is no longer committed in {src}. Remedy: run the diff again.")
        view = steps_mod.StepView(stores.LocalDirStore(src), manifest)
    try:
        view.verify(sorted(manifest.files))
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"cannot compare step {manifest.step} of {src}: {exc}") from exc
    return _load(step_dir, manifest, src, trust_pickles)


def _read_remote(src: str, step: int | None, trust: bool, options: stores.TransferOptions) -> Step:
    store = stores.open_store(src, options)
    where = stores.safe_url(src)
    try:
        step, manifest = steps_mod.remote_step(store, step, where, _remedy(where),
                                               stores.Deadline(options.step_deadline_s))
        tmp = tempfile.mkdtemp(prefix=f".shardckpt-diff-{step}-")
        try:
            steps_mod.StepView(store, manifest).fetch_into(tmp, sorted(manifest.files))
            return _load(tmp, manifest, where, trust)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        store.close()


# ------------------------------------------------------------------ comparing


def _leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k in sorted(value, key=str):
            out.update(_leaves(value[k], f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list, tuple, torch.Tensor)) for v in value):
        out = {}
        for i, v in enumerate(value):
            out.update(_leaves(v, f"{prefix}.{i}" if prefix else str(i)))
        return out
    return {prefix: value}


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float, str)) or v is None for v in value):
        return list(value)
    return repr(value)[:200]


def _tensor_diff(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    out: dict[str, Any] = {"shape": list(a.shape), "dtype": str(a.dtype).replace("torch.", "")}
    if a.shape != b.shape or a.dtype != b.dtype:
        out.update(shape_b=list(b.shape), dtype_b=str(b.dtype).replace("torch.", ""))
        return out
    if a.numel() == 1:
        out.update(a=a.item(), b=b.item())
    fa, fb = a.double(), b.double()
    differs = ~((fa == fb) | (fa.isnan() & fb.isnan()))
    out["differing"] = int(differs.sum())
    delta = (fa - fb).abs()[differs]
    out["max_abs_diff"] = float(delta.max()) if delta.numel() else 0.0
    out["norm_a"], out["norm_b"] = float(fa.norm()), float(fb.norm())
    return out


def _same_leaf(a: Any, b: Any) -> bool:
    h = [digest.fingerprint(v) for v in (a, b)]
    return h[0] == h[1]


def compare_keys(a: Step, b: Step) -> dict[str, dict[str, Any]]:
    """Key -> ``{"kind", "status": equal | differs | only in A | only in B, "entries": {leaf: detail}}``."""
    out: dict[str, dict[str, Any]] = {}
    for key in sorted(set(a.values) | set(b.values)):
        kind = a.kinds.get(key) or b.kinds.get(key) or "value"
        if key not in b.values or key not in a.values:
            out[key] = {"kind": kind, "status": "only in A" if key in a.values else "only in B", "entries": {}}
            continue
        ea, eb = (digest.entry(side.values[key], kind, kind) for side in (a, b))
        if ea["d"] == eb["d"]:
            out[key] = {"kind": kind, "status": "equal", "entries": {}}
            continue
        la, lb = _leaves(a.values[key]), _leaves(b.values[key])
        entries: dict[str, Any] = {}
        for name in sorted(set(la) | set(lb)):
            va, vb = la.get(name), lb.get(name)
            if name not in la or name not in lb:
                entries[name] = {"only in": "A" if name in la else "B"}
            elif _same_leaf(va, vb):
                continue
            elif isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.numel() > 1:
                entries[name] = _tensor_diff(va, vb)
            else:
                entries[name] = {"a": _plain(va), "b": _plain(vb)}
        out[key] = {"kind": kind, "status": "differs", "entries": entries, "leaves": len(set(la) | set(lb))}
    return out
