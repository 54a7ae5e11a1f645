"""Writing an export: the planned tensors read in batches, written as one safetensors or torch file, checked.

The plan comes from :mod:`shardckpt.convert.export_plan`; the output is written under a temporary name,
read back and checked, and only then renamed into place.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import struct
import sys
import uuid
from typing import Any, Callable, Iterable, Iterator

import torch

from shardckpt.convert.export_plan import (
    MODULE_VALUES_KEY,
    OPTIMIZER_PREFIX,
    SAFETENSORS_DTYPES,
    ExportItem,
    ExportJob,
    ExportPlan,
    ExportResult,
    ExportSource,
)
from shardckpt.dcp import planner as dcp_planner
from shardckpt.errors import (
    CorruptCheckpointError,
    ExportError,
)
from shardckpt.format import layout

log = logging.getLogger("shardckpt")


def _batches(items: Iterable[ExportItem], limit: int) -> Iterator[list[ExportItem]]:
    """Consecutive runs of ``items`` holding at most ``limit`` bytes (a larger item alone)."""
    batch: list[ExportItem] = []
    size = 0
    for item in items:
        if batch and size + item.nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += item.nbytes
    if batch:
        yield batch


def _plain_values(items: list[ExportItem], values: dict[str, Any]) -> dict[str, Any]:
    """Non-tensor items as one nested structure (their saved paths), e.g. ``{"param_groups": [{...}]}``."""
    out: dict[str, Any] = {}
    for item in items:
        dcp_planner.set_element(out, item.path, values[item.fqn])
    return out


def _json(value: Any) -> str:
    def default(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj.tolist()
        if isinstance(obj, (set, frozenset)):
            return sorted(obj, key=repr)
        return str(obj)

    return json.dumps(value, default=default)


def write_export(src: ExportSource, plan: ExportPlan, job: ExportJob) -> ExportResult:
    objects = [i for i in plan.module + plan.optimizer if not i.is_tensor]
    values = src.read(objects) if objects else {}
    module_values = {i.name: values[i.fqn] for i in plan.module if not i.is_tensor}
    optimizer_values = _plain_values([i for i in plan.optimizer if not i.is_tensor], values)

    def read(batch: list[ExportItem]) -> dict[str, Any]:
        got = src.read(batch)
        job.progress(sum(i.nbytes for i in batch))
        return got

    tmp = f"{job.out}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            if job.fmt == "safetensors":
                header = {"format": "pt", "shardckpt.step": str(src.step), "shardckpt.module_key": plan.module_key}
                if module_values:
                    header[MODULE_VALUES_KEY] = _json(module_values)
                if plan.optimizer_key is not None:
                    header[OPTIMIZER_PREFIX] = _json(optimizer_values)
                _write_safetensors(f, plan.tensors, header, read, job.batch_bytes)
            else:
                _write_torch(f, plan, module_values, optimizer_values, read, job.batch_bytes)
            f.flush()
            os.fsync(f.fileno())
        _check_written(tmp, job.fmt, plan, src.step)
        os.replace(tmp, job.out)
        layout.fsync_dir(os.path.dirname(job.out))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return ExportResult(
        step=src.step,
        path=job.out,
        format=job.fmt,
        tensors=len(plan.tensors),
        bytes=os.path.getsize(job.out),
        module_key=plan.module_key,
        optimizer_key=plan.optimizer_key,
        optimizer_keys=[i.name for i in plan.optimizer if i.is_tensor],
    )


def _safetensors_order(items: list[ExportItem]) -> list[ExportItem]:
    """Wider dtypes first, then by name: every tensor starts aligned to its element size (as safetensors does)."""
    return sorted(items, key=lambda i: (-i.md.properties.dtype.itemsize, i.name))


def _write_safetensors(
    f: Any,
    tensors: list[ExportItem],
    metadata: dict[str, str],
    read: Callable[[list[ExportItem]], dict[str, Any]],
    batch_bytes: int,
) -> None:
    """8-byte little-endian header length, the JSON header (padded to 8 bytes), then each tensor's bytes in order.

    The header needs only names, dtypes and shapes, known from the metadata;
    tensors are then read in batches of at most ``batch_bytes`` and written
    one by one, each dropped once written.
    """
    if sys.byteorder != "little":  # pragma: no cover - safetensors is little-endian, as torch is on x86 / ARM
        raise ExportError("safetensors export needs a little-endian machine. Remedy: export with --format torch.")
    order = _safetensors_order(tensors)
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for item in order:
        md = item.md
        header[item.name] = {
            "dtype": SAFETENSORS_DTYPES[md.properties.dtype],
            "shape": list(md.size),
            "data_offsets": [offset, offset + item.nbytes],
        }
        offset += item.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for batch in _batches(order, batch_bytes):
        values = read(batch)
        for item in batch:
            tensor = values.pop(item.fqn).contiguous()
            data = tensor.reshape(-1).view(torch.uint8).numpy()
            if data.nbytes != item.nbytes:
                raise CorruptCheckpointError(f"{item.fqn} read back as {data.nbytes} bytes, expected {item.nbytes}")
            f.write(memoryview(data))
            del tensor, data


def _write_torch(
    f: Any,
    plan: ExportPlan,
    module_values: dict[str, Any],
    optimizer_values: dict[str, Any],
    read: Callable[[list[ExportItem]], dict[str, Any]],
    batch_bytes: int,
) -> None:
    """One dict, in saved order (the module's own ``state_dict()`` order), ``torch.save``d once."""
    out: dict[str, Any] = {}
    tensors = plan.tensors
    for batch in _batches(tensors, batch_bytes):
        values = read(batch)
        for item in batch:
            out[item.name] = values.pop(item.fqn)
    ordered = {i.name: out[i.name] if i.is_tensor else module_values[i.name] for i in plan.module}
    ordered.update((i.name, out[i.name]) for i in plan.optimizer if i.is_tensor)
    if plan.optimizer_key is not None:
        ordered[OPTIMIZER_PREFIX] = optimizer_values
    out.clear()
    torch.save(ordered, f)


def _check_written(path: str, fmt: str, plan: ExportPlan, step: int) -> None:
    """The file opens with its format's own reader and lists every tensor with its shape and dtype."""
    expected = {i.name: (list(i.md.size), i.md.properties.dtype) for i in plan.tensors}
    if fmt == "safetensors":
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            got = {}
            for name in f.keys():
                view = f.get_slice(name)
                got[name] = (list(view.get_shape()), view.get_dtype())
        expected = {n: (shape, SAFETENSORS_DTYPES[dt]) for n, (shape, dt) in expected.items()}
    else:
        try:
            loaded = torch.load(path, weights_only=True, mmap=True)
        except pickle.UnpicklingError as exc:
            raise ExportError(
                f"the export of step {step} holds objects that torch.load(weights_only=True) refuses ({exc}); "
                f"they came in through trust_pickles. Remedy: export without --optimizer or with --format safetensors."
            ) from exc
        got = {n: (list(v.shape), v.dtype) for n, v in loaded.items() if isinstance(v, torch.Tensor)}
        del loaded
    wrong = sorted(n for n in set(got) | set(expected) if got.get(n) != expected.get(n))
    if wrong:
        raise ExportError(
            f"the export of step {step} did not read back as written ({len(wrong)} tensor(s) differ in name, "
            f"shape or dtype, e.g. {wrong[0]!r}); the output was not replaced. Remedy: report this as a bug."
        )
