"""Export one committed step to one file of full tensors (safetensors or torch).

For inference and for tools that do not speak DCP: the module saved under one
state key becomes a flat ``{fqn: tensor}`` file whose keys are exactly those
of ``model.state_dict()`` of the unwrapped module, each tensor whole, however
many ranks saved it and however it was sharded (FSDP2 / DTensor).

The order of the work, for a local directory and a remote URL alike::

    locate the step (default: the newest live step, see shardckpt.format.lineage)
      -> .metadata: verified (local) or fetched and verified (remote), then
         parsed with the restricted unpickler (no code from the checkpoint runs)
      -> plan: the module key (and the optimizer paired with it), the items to
         export, and the shard files that hold them (metadata.storage_data)
      -> those files only: verified against the manifest (local), or fetched
         into a temporary directory, each verified while downloading (remote)
      -> DCP's own loader reads each item whole into a tensor allocated from
         the saved size and dtype, and the file is written under a temporary
         name, checked, and renamed into place.

safetensors is written by streaming: the header (names, dtypes, shapes,
offsets) comes from the metadata alone, then tensors are read and written in
batches of at most ``batch_bytes`` (a larger tensor is a batch by itself), so
the memory held is one batch, never the model. The torch format is one
``torch.save`` of a dict: the model is in memory once.

With ``optimizer=True`` the optimizer's tensors are added under
``optimizer.<saved name without the optimizer key>`` (``optimizer.state.
fc1.weight.exp_avg``); its non-tensor values (param groups, counters saved as
plain numbers) go, as one nested structure of plain types, into the
safetensors header metadata as JSON under ``"optimizer"``, or into the torch
file under the key ``"optimizer"``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import shutil
import struct
import sys
import tempfile
import threading
import uuid
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from shardckpt import steps as steps_mod
from shardckpt import stores
from shardckpt._text import fmt_bytes
from shardckpt.dcp import planner as dcp_planner
from shardckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    ExportError,
    ExportIOError,
    ShardckptError,
)
from shardckpt.format import layout, lineage
from shardckpt.remote import commit as remote_commit
from shardckpt.remote import index as remote_index
from shardckpt.remote import listing as remote_listing
from shardckpt.state import capture as state_mod

log = logging.getLogger("shardckpt")

FORMATS = ("safetensors", "torch")
OPTIMIZER_PREFIX = "optimizer"
"""Output names of optimizer tensors start with ``optimizer.``; its plain values sit under this key."""
MODULE_VALUES_KEY = "module_values"
"""safetensors header key of the module's non-tensor entries (JSON), when it has any."""
DEFAULT_BATCH_BYTES = 64 << 20

_SAFETENSORS_DTYPES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.int64: "I64",
    torch.uint64: "U64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}


@dataclasses.dataclass
class ExportResult:
    """What :func:`export_step` wrote."""

    step: int
    path: str
    format: str
    tensors: int
    """Tensors in the file (module and optimizer)."""
    bytes: int
    """Size of the written file."""
    module_key: str
    optimizer_key: str | None = None
    """The state key of the exported optimizer (``optimizer=True``)."""
    optimizer_keys: list[str] = dataclasses.field(default_factory=list)
    """Names of the optimizer tensors in the file (``optimizer.state.<fqn>.<name>``)."""
    source: str = ""
    fetched_files: int | None = None
    """Remote sources: files downloaded (manifest not counted); ``None`` for a local directory."""
    fetched_bytes: int | None = None
    step_files: int = 0
    """Files of the whole step (manifest not counted), to compare with what was fetched or read."""
    step_bytes: int = 0


@dataclasses.dataclass
class _Item:
    name: str
    """Name in the output file."""
    fqn: str
    """Name in the checkpoint (DCP's flattened key)."""
    path: tuple
    """Path below the state key (to rebuild nested plain values)."""
    md: Any
    """TensorStorageMetadata or BytesStorageMetadata."""

    @property
    def is_tensor(self) -> bool:
        return isinstance(self.md, TensorStorageMetadata)

    @property
    def nbytes(self) -> int:
        return self.md.size.numel() * self.md.properties.dtype.itemsize if self.is_tensor else 0


@dataclasses.dataclass
class _Plan:
    module_key: str
    optimizer_key: str | None
    module: list[_Item]
    optimizer: list[_Item]
    files: list[str]

    @property
    def tensors(self) -> list[_Item]:
        return [i for i in self.module + self.optimizer if i.is_tensor]


# ---------------------------------------------------------------- entry point


def export_step(
    src: str,
    out: str,
    *,
    step: int | None = None,
    fmt: str = "safetensors",
    optimizer: bool = False,
    key: str | None = None,
    trust_pickles: bool = False,
    endpoint_url: str | None = None,
    transfer: stores.TransferOptions | None = None,
    progress: Callable[[int], None] | None = None,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
) -> ExportResult:
    """Write step ``step`` of ``src`` (default: the newest live step) to the file ``out``.

    ``src``: a checkpoint directory (a Checkpointer's ``local_dir``, or one
    ``step_<N>`` directory in it) or a remote URL (``s3://bucket/prefix``,
    ``file:///path``); from a remote only the files holding exported items are
    downloaded. ``key`` chooses the module when the step holds several.
    ``progress(n)`` is called (from any thread) with each increment of bytes
    downloaded and of tensor bytes exported. Tensors are read and written in
    batches of at most ``batch_bytes`` (safetensors). ``trust_pickles`` lifts
    the restricted unpickling of the metadata and of non-tensor items, only for
    checkpoints whose origin you trust. Raises a :class:`ShardckptError`.
    """
    if fmt not in FORMATS:
        raise ConfigError(
            f"unknown export format {fmt!r} for {out}; choose one of: {', '.join(FORMATS)} (--format)"
        )
    if batch_bytes < 1:
        raise ConfigError(f"batch_bytes must be >= 1, got {batch_bytes!r}")
    out = os.path.abspath(out)
    out_dir = os.path.dirname(out)
    if not os.path.isdir(out_dir):
        raise ConfigError(f"cannot export to {out}: the directory {out_dir} does not exist. Remedy: create it first.")
    if os.path.isdir(out):
        raise ConfigError(f"cannot export to {out}: it is a directory. Remedy: name the file to write, e.g. {out}/model.{_suffix(fmt)}.")
    report = _locked(progress)
    job = _Job(out=out, fmt=fmt, optimizer=optimizer, key=key, trust=trust_pickles, progress=report, batch_bytes=batch_bytes)
    try:
        if "://" not in src:
            return _export_local(src, step, job)
        options = transfer or stores.TransferOptions()
        if endpoint_url is not None:
            options = dataclasses.replace(options, endpoint_url=endpoint_url)
        return _export_remote(src, step, job, options)
    except ShardckptError:
        raise
    except OSError as exc:
        which = f"step {step}" if step is not None else "the newest step"
        raise ExportIOError(
            f"export of {which} of {stores.safe_url(src)} to {out} failed: {stores.redact(str(exc))}. "
            f"Remedy: check the free space and permissions of {out_dir} (and that {stores.safe_url(src)} is readable)."
        ) from exc


def _suffix(fmt: str) -> str:
    return "safetensors" if fmt == "safetensors" else "pt"


def _locked(progress: Callable[[int], None] | None) -> Callable[[int], None]:
    """``progress`` called under a lock (downloads report from several threads)."""
    if progress is None:
        return lambda _n: None
    lock = threading.Lock()

    def report(n: int) -> None:
        with lock:
            progress(n)

    return report


@dataclasses.dataclass
class _Job:
    out: str
    fmt: str
    optimizer: bool
    key: str | None
    trust: bool
    progress: Callable[[int], None]
    batch_bytes: int


# ---------------------------------------------------------------- locating the step


def _not_committed(step: int, where: str, committed: Iterable[int]) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(
        f"step {step} is not committed in {where}; committed: {sorted(committed) or 'none'}. "
        f"Remedy: pick a committed step (shardckpt ls), or leave out --step for the newest live one."
    )


def _choose_step(infos: dict[int, lineage.StepInfo], step: int | None, where: str) -> int:
    """``step`` if committed, else the newest live step."""
    if step is not None:
        if step not in infos:
            raise _not_committed(step, where, infos)
        return step
    live, _abandoned = lineage.classify(infos)
    if not live:
        raise CheckpointNotFoundError(
            f"no committed step in {where}. Remedy: check the path or URL (it must hold step_<N> directories "
            f"with a manifest, {layout.MANIFEST_NAME})."
        )
    return live[-1]


def _export_local(src: str, step: int | None, job: _Job) -> ExportResult:
    if os.path.isfile(os.path.join(src, layout.MANIFEST_NAME)):  # one step directory
        step_dir = src
        manifest = layout.read_manifest(step_dir)
        _choose_step({manifest.step: lineage.info_of(manifest)}, step, src)
        view = steps_mod.StepView(stores.LocalDirStore(step_dir), manifest, prefix="")
    else:
        step = _choose_step(lineage.local_infos(src), step, src)
        step_dir = os.path.join(src, layout.step_dirname(step))
        manifest = layout.read_manifest(step_dir)
        if manifest is None:  # deleted since it was listed
            raise CheckpointNotFoundError(f"step {step} is no longer committed in {src}. Remedy: run the export again.")
        view = steps_mod.StepView(stores.LocalDirStore(src), manifest)

    def verify(names: list[str]) -> None:
        try:
            view.verify(names)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(
                f"cannot export step {manifest.step} from {src}: {exc} Or export another step with --step."
            ) from exc

    result = _export_dir(step_dir, manifest, src, verify, job)
    result.source = src
    result.step_files, result.step_bytes = _step_size(manifest)
    return result


def _export_remote(src: str, step: int | None, job: _Job, options: stores.TransferOptions) -> ExportResult:
    store = stores.open_store(src, options)
    where = stores.safe_url(src)
    try:
        deadline = stores.Deadline(options.step_deadline_s)
        if step is None:
            infos, _unreadable = remote_index.survey(store, deadline)
            step = _choose_step(infos, None, where)
        manifest = remote_commit.remote_manifest(store, step, deadline)
        if manifest is None:
            raise _not_committed(step, where, remote_listing.remote_steps(store, deadline))
        view = steps_mod.StepView(store, manifest)
        tmp = tempfile.mkdtemp(prefix=f".shardckpt-export-{step}-", dir=os.path.dirname(job.out))
        fetched: list[str] = []
        try:
            def fetch(names: list[str]) -> None:
                total = sum(manifest.files[n].size for n in names)
                what = f"fetching {len(names)} file(s) of step {step} from {where} for export"
                with remote_commit.Progress(what, total, remote_commit.PROGRESS_S) as bar:
                    def report(n: int) -> None:
                        bar.add(n)
                        job.progress(n)

                    view.fetch_into(tmp, names, report)
                fetched.extend(names)

            result = _export_dir(tmp, manifest, where, fetch, job)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        store.close()
    result.source = where
    result.fetched_files = len(fetched)
    result.fetched_bytes = sum(manifest.files[n].size for n in fetched)
    result.step_files, result.step_bytes = _step_size(manifest)
    log.info(
        "shardckpt: export of step %d fetched %d of %d file(s) (%s of %s) from %s",
        result.step, result.fetched_files, result.step_files, fmt_bytes(result.fetched_bytes),
        fmt_bytes(result.step_bytes), where,
    )
    return result


def _step_size(manifest: layout.Manifest) -> tuple[int, int]:
    return len(manifest.files), sum(e.size for e in manifest.files.values())


# ---------------------------------------------------------------- planning


class _Source:
    """A step directory whose files are made present and verified on demand by ``obtain(names)``.

    Locally ``obtain`` verifies files against the manifest; for a remote it
    downloads them (each verified while downloading). Each file is obtained once.
    """

    def __init__(self, step_dir: str, manifest: layout.Manifest, where: str, obtain: Callable[[list[str]], None], trust: bool) -> None:
        self.step_dir, self.manifest, self.where, self.trust = step_dir, manifest, where, trust
        self.step = manifest.step
        self._obtain = obtain
        self._done: set[str] = set()
        if layout.METADATA_NAME not in manifest.files:
            raise CorruptCheckpointError(
                f"step {self.step} in {where}: the manifest lists no {layout.METADATA_NAME}; the step cannot be read. "
                f"Remedy: export another step with --step."
            )
        self.need([layout.METADATA_NAME])
        self.metadata = dcp_planner.read_metadata(step_dir, self.step, trust_pickles=trust)

    def need(self, names: Iterable[str]) -> None:
        todo = sorted(set(names) - self._done)
        if todo:
            self._obtain(todo)
            self._done.update(todo)

    def files_of(self, items: Iterable[_Item]) -> list[str]:
        """The shard files holding ``items`` (DCP's storage_data), each one the manifest lists."""
        wanted = {i.fqn for i in items}
        files = sorted({info.relative_path for idx, info in self.metadata.storage_data.items() if idx.fqn in wanted})
        for name in files:
            if name not in self.manifest.files:
                raise CorruptCheckpointError(
                    f"step {self.step} in {self.where}: {layout.METADATA_NAME} points at {name!r}, which the manifest "
                    f"does not list; the step cannot be trusted. Remedy: export another step with --step."
                )
        return files

    def read(self, items: list[_Item]) -> dict[str, Any]:
        self.need(self.files_of(items))
        return _read(self.step_dir, self.metadata, items, self.trust)


def _export_dir(
    step_dir: str, manifest: layout.Manifest, where: str, obtain: Callable[[list[str]], None], job: _Job
) -> ExportResult:
    """Export from ``step_dir`` once ``obtain(names)`` made each named file present and verified."""
    src = _Source(step_dir, manifest, where, obtain, job.trust)
    plan = _plan(src, job)
    src.need(plan.files)  # all at once: a remote fetches them concurrently
    return _write(src, plan, job)


def _items_of(metadata: Metadata, key: str, prefix: str) -> list[_Item]:
    """Every saved item under the top-level state key ``key``, in saved order."""
    items = []
    for fqn, md in metadata.state_dict_metadata.items():
        path = tuple((metadata.planner_data or {}).get(fqn) or fqn.split("."))
        if str(path[0]) != key:
            continue
        rest = path[1:] or (fqn[len(key) + 1:],)
        name = ".".join(str(p) for p in rest)
        items.append(_Item(f"{prefix}.{name}" if prefix else name, fqn, rest, md))
    return items


def _keys_line(manifest: layout.Manifest) -> str:
    return ", ".join(f"{k} ({v})" for k, v in sorted(manifest.keys.items()) if k != state_mod.RESERVED_KEY) or "none"


def _module_key(manifest: layout.Manifest, key: str | None, where: str) -> str:
    modules = sorted(k for k, kind in manifest.keys.items() if kind == state_mod.MODULE)
    saved = _keys_line(manifest)
    if key is not None:
        kind = manifest.keys.get(key)
        if kind in (state_mod.MODULE, state_mod.STOCK):  # stock: an adopted DCP checkpoint, kind unknown
            return key
        what = f"is a saved {kind}, not a module" if kind else "is not a saved state key"
        raise ExportError(
            f"step {manifest.step} in {where}: --key {key!r} {what}; saved keys: {saved}. "
            f"Remedy: name a module key with --key."
        )
    return _the_one(
        modules,
        several=f"step {manifest.step} in {where} holds several modules ({', '.join(modules)}); which one to export "
        f"is ambiguous. Remedy: choose one with --key (key=...).",
        none=f"step {manifest.step} in {where} holds no module (saved keys: {saved}); there is no model to export. "
        f"Remedy: export a step saved with an nn.Module in its state, or for a key of an adopted checkpoint "
        f"name it with --key.",
    )


def _the_one(found: list[str], *, several: str, none: str) -> str:
    """The only element of ``found``; an :class:`ExportError` saying ``several`` or ``none`` otherwise."""
    if len(found) == 1:
        return found[0]
    raise ExportError(several if found else none)


def _optimizer_params(src: _Source, key: str) -> set[str]:
    """The parameter names an optimizer's saved state refers to: its ``state.<fqn>`` entries and param groups."""
    items = _items_of(src.metadata, key, "")
    names = {str(i.path[1]) for i in items if len(i.path) > 2 and i.path[0] == "state"}
    groups = [i for i in items if i.path[0] == "param_groups" and i.path[-1] == "params" and not i.is_tensor]
    for value in src.read(groups).values() if groups else ():
        names.update(str(p) for p in value)
    return names


def _optimizer_key(src: _Source, module_key: str, module_names: set[str]) -> str:
    """The optimizer saved for the module: the one whose parameters are all the module's."""
    manifest = src.manifest
    optimizers = sorted(k for k, kind in manifest.keys.items() if kind == state_mod.OPTIMIZER)
    fits = [k for k in optimizers if (params := _optimizer_params(src, k)) and params <= module_names]
    found = f"its optimizers ({', '.join(optimizers)}) are for other parameters" if optimizers else "it holds no optimizer"
    return _the_one(
        fits,
        several=f"step {src.step} in {src.where}: several optimizers ({', '.join(fits)}) hold state for module "
        f"{module_key!r}; which one to export is ambiguous. Remedy: export without --optimizer.",
        none=f"step {src.step} in {src.where}: no optimizer state for module {module_key!r} to export ({found}; "
        f"saved keys: {_keys_line(manifest)}). Remedy: export without --optimizer.",
    )


def _plan(src: _Source, job: _Job) -> _Plan:
    step, where = src.step, src.where
    module_key = _module_key(src.manifest, job.key, where)
    module = _items_of(src.metadata, module_key, "")
    if not module:
        raise ExportError(
            f"step {step} in {where}: the module {module_key!r} has no saved entries. Remedy: choose another "
            f"key with --key; saved keys: {_keys_line(src.manifest)}."
        )
    optimizer_key = None
    opt_items: list[_Item] = []
    if job.optimizer:
        optimizer_key = _optimizer_key(src, module_key, {i.name for i in module})
        opt_items = _items_of(src.metadata, optimizer_key, OPTIMIZER_PREFIX)
        clash = sorted(i.name for i in module if i.name == OPTIMIZER_PREFIX or i.name.startswith(OPTIMIZER_PREFIX + "."))
        if clash:
            raise ExportError(
                f"step {step} in {where}: the module has entries named {clash[0]!r}, which would collide with the "
                f"optimizer's names in the file. Remedy: export without --optimizer."
            )
    for item in module + opt_items:
        if item.is_tensor and job.fmt == "safetensors" and item.md.properties.dtype not in _SAFETENSORS_DTYPES:
            raise ExportError(
                f"step {step} in {where}: {item.fqn} is {item.md.properties.dtype}, which safetensors cannot hold. "
                f"Remedy: export with --format torch."
            )
    return _Plan(module_key, optimizer_key, module, opt_items, src.files_of(module + opt_items))


# ---------------------------------------------------------------- reading and writing


def _read(step_dir: str, metadata: Metadata, items: list[_Item], trust: bool) -> dict[str, Any]:
    """``{saved fqn: value}`` of ``items``, each whole, through DCP's loader (one process, no collectives)."""
    target: dict[str, Any] = {}
    for item in items:
        md = item.md
        target[item.fqn] = torch.empty(md.size, dtype=md.properties.dtype) if item.is_tensor else md
    planner = dcp_planner.RestorePlanner(lambda _path: False, allow_partial_load=False, trust_pickles=trust)
    try:
        _load_state_dict(target, storage_reader=dcp_planner.TrustingReader(step_dir, metadata), planner=planner, no_dist=True)
    except CheckpointException as exc:
        raise dcp_planner.unwrap_failure(exc, f"reading {step_dir}") from exc
    return target


def _batches(items: Iterable[_Item], limit: int) -> Iterator[list[_Item]]:
    """Consecutive runs of ``items`` holding at most ``limit`` bytes (a larger item alone)."""
    batch: list[_Item] = []
    size = 0
    for item in items:
        if batch and size + item.nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += item.nbytes
    if batch:
        yield batch


def _plain_values(items: list[_Item], values: dict[str, Any]) -> dict[str, Any]:
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


def _write(src: _Source, plan: _Plan, job: _Job) -> ExportResult:
    objects = [i for i in plan.module + plan.optimizer if not i.is_tensor]
    values = src.read(objects) if objects else {}
    module_values = {i.name: values[i.fqn] for i in plan.module if not i.is_tensor}
    optimizer_values = _plain_values([i for i in plan.optimizer if not i.is_tensor], values)

    def read(batch: list[_Item]) -> dict[str, Any]:
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


def _safetensors_order(items: list[_Item]) -> list[_Item]:
    """Wider dtypes first, then by name: every tensor starts aligned to its element size (as safetensors does)."""
    return sorted(items, key=lambda i: (-i.md.properties.dtype.itemsize, i.name))


def _write_safetensors(
    f: Any, tensors: list[_Item], metadata: dict[str, str], read: Callable[[list[_Item]], dict[str, Any]], batch_bytes: int
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
            "dtype": _SAFETENSORS_DTYPES[md.properties.dtype],
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
    plan: _Plan,
    module_values: dict[str, Any],
    optimizer_values: dict[str, Any],
    read: Callable[[list[_Item]], dict[str, Any]],
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


def _check_written(path: str, fmt: str, plan: _Plan, step: int) -> None:
    """The file opens with its format's own reader and lists every tensor with its shape and dtype."""
    expected = {i.name: (list(i.md.size), i.md.properties.dtype) for i in plan.tensors}
    if fmt == "safetensors":
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            got = {}
            for name in f.keys():
                view = f.get_slice(name)
                got[name] = (list(view.get_shape()), view.get_dtype())
        expected = {n: (shape, _SAFETENSORS_DTYPES[dt]) for n, (shape, dt) in expected.items()}
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
