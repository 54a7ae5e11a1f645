"""What an export writes: its result and plan types, and the planning (module key, optimizer, items, files).

:func:`make_plan` reads a step's DCP metadata (restricted unpickler) and decides which state key is the
module, which optimizer is paired with it, which items go into the file under which names, and which
shard files hold them. :mod:`shardckpt.convert.export` locates the step; :mod:`shardckpt.convert.export_write`
writes the file.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Iterable

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from shardckpt.dcp import planner as dcp_planner
from shardckpt.errors import (
    CorruptCheckpointError,
    ExportError,
)
from shardckpt.format import layout
from shardckpt.state import capture as state_mod

log = logging.getLogger("shardckpt")


FORMATS = ("safetensors", "torch")
OPTIMIZER_PREFIX = "optimizer"
"""Output names of optimizer tensors start with ``optimizer.``; its plain values sit under this key."""
MODULE_VALUES_KEY = "module_values"
"""safetensors header key of the module's non-tensor entries (JSON), when it has any."""
DEFAULT_BATCH_BYTES = 64 << 20

SAFETENSORS_DTYPES = {
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
class ExportItem:
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
class ExportPlan:
    module_key: str
    optimizer_key: str | None
    module: list[ExportItem]
    optimizer: list[ExportItem]
    files: list[str]

    @property
    def tensors(self) -> list[ExportItem]:
        return [i for i in self.module + self.optimizer if i.is_tensor]


@dataclasses.dataclass
class ExportJob:
    out: str
    fmt: str
    optimizer: bool
    key: str | None
    trust: bool
    progress: Callable[[int], None]
    batch_bytes: int


class ExportSource:
    """A step directory whose files are made present and verified on demand by ``obtain(names)``.

    Locally ``obtain`` verifies files against the manifest; for a remote it
    downloads them (each verified while downloading). Each file is obtained once.
    """

    def __init__(
        self, step_dir: str, manifest: layout.Manifest, where: str, obtain: Callable[[list[str]], None], trust: bool
    ) -> None:
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

    def files_of(self, items: Iterable[ExportItem]) -> list[str]:
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

    def read(self, items: list[ExportItem]) -> dict[str, Any]:
        self.need(self.files_of(items))
        return read_items(self.step_dir, self.metadata, items, self.trust)


def _items_of(metadata: Metadata, key: str, prefix: str) -> list[ExportItem]:
    """Every saved item under the top-level state key ``key``, in saved order."""
    items = []
    for fqn, md in metadata.state_dict_metadata.items():
        path = tuple((metadata.planner_data or {}).get(fqn) or fqn.split("."))
        if str(path[0]) != key:
            continue
        rest = path[1:] or (fqn[len(key) + 1:],)
        name = ".".join(str(p) for p in rest)
        items.append(ExportItem(f"{prefix}.{name}" if prefix else name, fqn, rest, md))
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


def _optimizer_params(src: ExportSource, key: str) -> set[str]:
    """The parameter names an optimizer's saved state refers to: its ``state.<fqn>`` entries and param groups."""
    items = _items_of(src.metadata, key, "")
    names = {str(i.path[1]) for i in items if len(i.path) > 2 and i.path[0] == "state"}
    groups = [i for i in items if i.path[0] == "param_groups" and i.path[-1] == "params" and not i.is_tensor]
    for value in src.read(groups).values() if groups else ():
        names.update(str(p) for p in value)
    return names


def _optimizer_key(src: ExportSource, module_key: str, module_names: set[str]) -> str:
    """The optimizer saved for the module: the one whose parameters are all the module's."""
    manifest = src.manifest
    optimizers = sorted(k for k, kind in manifest.keys.items() if kind == state_mod.OPTIMIZER)
    fits = [k for k in optimizers if (params := _optimizer_params(src, k)) and params <= module_names]
    found = (f"its optimizers ({', '.join(optimizers)}) are for other parameters" if optimizers
             else "it holds no optimizer")
    return _the_one(
        fits,
        several=f"step {src.step} in {src.where}: several optimizers ({', '.join(fits)}) hold state for module "
        f"{module_key!r}; which one to export is ambiguous. Remedy: export without --optimizer.",
        none=f"step {src.step} in {src.where}: no optimizer state for module {module_key!r} to export ({found}; "
        f"saved keys: {_keys_line(manifest)}). Remedy: export without --optimizer.",
    )


def make_plan(src: ExportSource, job: ExportJob) -> ExportPlan:
    step, where = src.step, src.where
    module_key = _module_key(src.manifest, job.key, where)
    module = _items_of(src.metadata, module_key, "")
    if not module:
        raise ExportError(
            f"step {step} in {where}: the module {module_key!r} has no saved entries. Remedy: choose another "
            f"key with --key; saved keys: {_keys_line(src.manifest)}."
        )
    optimizer_key = None
    opt_items: list[ExportItem] = []
    if job.optimizer:
        optimizer_key = _optimizer_key(src, module_key, {i.name for i in module})
        opt_items = _items_of(src.metadata, optimizer_key, OPTIMIZER_PREFIX)
        clash = sorted(i.name for i in module
                       if i.name == OPTIMIZER_PREFIX or i.name.startswith(OPTIMIZER_PREFIX + "."))
        if clash:
            raise ExportError(
                f"step {step} in {where}: the module has entries named {clash[0]!r}, which would collide with the "
                f"optimizer's names in the file. Remedy: export without --optimizer."
            )
    for item in module + opt_items:
        if item.is_tensor and job.fmt == "safetensors" and item.md.properties.dtype not in SAFETENSORS_DTYPES:
            raise ExportError(
                f"step {step} in {where}: {item.fqn} is {item.md.properties.dtype}, which safetensors cannot hold. "
                f"Remedy: export with --format torch."
            )
    return ExportPlan(module_key, optimizer_key, module, opt_items, src.files_of(module + opt_items))


def read_items(step_dir: str, metadata: Metadata, items: list[ExportItem], trust: bool) -> dict[str, Any]:
    """``{saved fqn: value}`` of ``items``, each whole, through DCP's loader (one process, no collectives)."""
    target: dict[str, Any] = {}
    for item in items:
        md = item.md
        target[item.fqn] = torch.empty(md.size, dtype=md.properties.dtype) if item.is_tensor else md
    planner = dcp_planner.RestorePlanner(lambda _path: False, allow_partial_load=False, trust_pickles=trust)
    try:
        _load_state_dict(target, storage_reader=dcp_planner.TrustingReader(step_dir, metadata), planner=planner,
                         no_dist=True)
    except CheckpointException as exc:
        raise dcp_planner.unwrap_failure(exc, f"reading {step_dir}") from exc
    return target
