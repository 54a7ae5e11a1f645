"""A read-only look at one committed step: its manifest, ``run_config`` and plain values.

A script that resumes "from the checkpoint's model config" needs the saved
configuration before the model exists, and often before the process group
does. :func:`peek` reads, from one tier, only the manifest, DCP's
``.metadata`` (through the restricted unpickler) and the files that hold the
step's plain values (each checked against its manifest entry); the values
themselves load with ``torch.load(weights_only=True)``, so nothing from the
checkpoint can run code. Model and optimizer tensors are never read. No
collective is issued: every rank may call it on its own.

The step chosen by default is the one ``load()`` would choose: the newest
live step (``lineage.py``), full steps before light ones, complete in the
local directory or committed on the remote.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import pickle
from typing import Any

import torch

from shardckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, UntrustedCheckpointError
from shardckpt.format import layout, lineage
from shardckpt.format.safe_pickle import safe_load_metadata
from shardckpt.state import capture as state_mod
from shardckpt.state import keys as keys_mod
from shardckpt.steps import LocalSteps, Steps

log = logging.getLogger("shardckpt")

VALUE_TENSOR_LIMIT = 1 << 20
"""Tensors among the plain values up to this many bytes are read; larger ones are only described."""


@dataclasses.dataclass(frozen=True)
class StepPeek:
    """What :meth:`Checkpointer.peek` found for one step."""

    step: int
    source: str
    """Where it was read: the local step directory or the remote step's URL."""
    kind: str
    """``full`` or ``light``."""
    created: float
    world_size: int
    run_config: Any
    """``run_config`` recorded when the step was saved (``None`` when none was given)."""
    values: dict[str, Any]
    """The plain values of the state (its ``value`` keys) as saved: numbers, strings,
    containers, small tensors (larger ones are in :attr:`tensors` only)."""
    tensors: dict[str, dict[str, Any]]
    """Tensors among the plain values that were not read: ``{key: {"shape", "dtype"}}``."""
    keys: dict[str, str]
    """Every top-level state key saved, with its kind (module, optimizer, value, ...)."""
    metadata: dict[str, Any]
    metrics: dict[str, float]
    run: dict[str, Any]
    """The whole run record: config, command line, world size, device, versions."""

    def to_json(self) -> dict[str, Any]:
        body = dataclasses.asdict(self)
        body["values"] = _jsonable(self.values)
        return body


def choose(manifests: dict[int, layout.Manifest], loadable: set[int]) -> int | None:
    """The step ``load()`` resumes by default: newest live, full before light, among ``loadable``
    (a step whose lineage contradicts the others' is never live: ``lineage.conflicts``)."""
    live, _abandoned = lineage.classify({s: lineage.info_of(m) for s, m in manifests.items()})
    pool = [s for s in live if s in loadable]
    if not pool:
        return None
    return max(pool, key=lambda s: (manifests[s].kind == "full", s))


def peek_tiers(
    tiers: list[Steps], step: int | None, *, trust_pickles: bool = False, fallback: bool = False
) -> StepPeek | None:
    """Look at ``step`` (``None``: the default choice) on the first of ``tiers`` that holds it whole.

    Returns ``None`` when there is no step to resume (``step=None``); a step
    asked for that no tier holds raises :class:`CheckpointNotFoundError`. A
    committed step newer than the default choice that cannot be used (its
    manifest unreadable everywhere, or its lineage contradicting the others')
    raises :class:`CorruptCheckpointError` naming it, as ``load()`` would;
    with ``fallback`` (``on_corrupt="fallback"``) a WARNING names it instead.
    """
    found: dict[int, tuple[layout.Manifest, Steps]] = {}
    for tier in tiers:
        for s, manifest in tier.manifests().items():
            complete = not isinstance(tier, LocalSteps) or not layout.absent_files(tier.step_where(s), manifest)
            if complete and (s not in found or manifest.created > found[s][0].created):
                found[s] = (manifest, tier)
    if step is None:
        chosen = choose({s: m for s, (m, _t) in found.items()}, set(found))
        _unusable_newer(tiers, found, -1 if chosen is None else chosen, fallback)
        if chosen is None:
            return None
        step = chosen
    if step not in found:
        where = " or ".join(t.where for t in tiers)
        raise CheckpointNotFoundError(
            f"step {step} is not committed (complete) in {where}; committed: {sorted(found) or 'none'}. "
            f"Remedy: pass one of those steps, or step=None for the newest live one."
        )
    manifest, tier = found[step]
    return read_step(tier, manifest, trust_pickles=trust_pickles)


def _unusable_newer(tiers: list[Steps], found: dict[int, tuple[layout.Manifest, Steps]], chosen: int,
                   fallback: bool) -> None:
    bad = {s: why for tier in tiers for s, why in getattr(tier, "unreadable", {}).items() if s not in found}
    bad.update(lineage.conflicts({s: lineage.info_of(m) for s, (m, _t) in found.items()}))
    newer = sorted(s for s in bad if s > chosen)
    if not newer:
        return
    what = (f"step {newer[-1]}, newer than {f'step {chosen}' if chosen >= 0 else 'every usable step'}, cannot be "
            f"used: {bad[newer[-1]]}")
    if not fallback or chosen < 0:  # as load(): a fallback needs a step to fall back to
        raise CorruptCheckpointError(f"{what}. Remedy: pass the step to look at (peek(step=N)), or set "
                                     f"on_corrupt='fallback' to go on with the newest usable one.")
    log.warning("shardckpt: %s; on_corrupt='fallback': looking at step %d", what, chosen)


def read_step(tier: Steps, manifest: layout.Manifest, *, trust_pickles: bool = False) -> StepPeek:
    """The :class:`StepPeek` of one committed step of ``tier`` (reads only what holds plain values)."""
    values, tensors = read_values(tier, manifest, trust_pickles=trust_pickles)
    run = dict(manifest.run or {})
    return StepPeek(
        step=manifest.step, source=tier.step_where(manifest.step), kind=manifest.kind, created=manifest.created,
        world_size=manifest.world_size, run_config=run.get("config"), values=values, tensors=tensors,
        keys=dict(manifest.keys), metadata=dict(manifest.metadata), metrics=dict(manifest.metrics), run=run,
    )


def read_values(
    tier: Steps, manifest: layout.Manifest, *, trust_pickles: bool = False
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The plain values of a step, nested as saved, and the tensors among them left unread."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    step = manifest.step
    value_keys = {k for k, kind in manifest.keys.items() if kind == state_mod.VALUE}
    values: dict[str, Any] = {k: {} for k in sorted(value_keys)}  # an empty dict leaves no item in DCP's metadata
    tensors: dict[str, dict[str, Any]] = {}
    if not value_keys:
        return values, tensors
    where = f"{tier.step_where(step)}/{layout.METADATA_NAME}"
    data = tier.file_bytes(manifest, layout.METADATA_NAME) if layout.METADATA_NAME in manifest.files \
        else tier.metadata_bytes(step)
    metadata = pickle.loads(data) if trust_pickles else safe_load_metadata(data, where)
    wanted: list[tuple[tuple, Any, Any]] = []  # (path, storage info, tensor metadata or None)
    for fqn, md in metadata.state_dict_metadata.items():
        path = tuple((metadata.planner_data or {}).get(fqn, (fqn,)))
        if path[0] not in value_keys:
            continue
        if isinstance(md, BytesStorageMetadata):
            wanted.append((path, metadata.storage_data[MetadataIndex(fqn)], None))
        elif isinstance(md, TensorStorageMetadata):
            described = {"shape": list(md.size), "dtype": str(md.properties.dtype).replace("torch.", "")}
            chunks = md.chunks
            whole = (len(chunks) == 1 and all(o == 0 for o in chunks[0].offsets)
                     and tuple(chunks[0].sizes) == tuple(md.size))
            nbytes = md.size.numel() * md.properties.dtype.itemsize
            if whole and nbytes <= VALUE_TENSOR_LIMIT:
                wanted.append((path, metadata.storage_data[MetadataIndex(fqn, chunks[0].offsets)], md))
            else:
                tensors[fqn] = described
    files: dict[str, bytes] = {}
    for path, info, md in sorted(wanted, key=lambda w: (w[1].relative_path, w[1].offset)):
        name = str(info.relative_path)
        if name not in files:
            files[name] = tier.file_bytes(manifest, name)
        record = io.BytesIO(files[name][info.offset:info.offset + info.length])
        try:
            obj = torch.load(record, map_location="cpu", weights_only=not trust_pickles)
        except pickle.UnpicklingError as exc:
            raise UntrustedCheckpointError(
                f"step {step}: the saved value {'.'.join(map(str, path))!r} in {tier.step_where(step)}/{name} "
                f"holds objects outside the safe allow-list (loading it could run code from the checkpoint): "
                f"{exc}. Remedy: only if you trust this checkpoint's origin, pass trust_pickles=True."
            ) from exc
        set_element(values, path, obj)
    return keys_mod.decode_keys(values), tensors


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def saved_keys(tier: Steps, step: int, trust_pickles: bool) -> list[dict[str, Any]]:
    """Every saved item of the step with its shape and dtype (from DCP's metadata; no tensor is read)."""
    data = tier.metadata_bytes(step)
    where = f"{tier.step_where(step)}/.metadata"
    metadata = pickle.loads(data) if trust_pickles else safe_load_metadata(data, where)
    out = []
    for fqn, md in sorted(metadata.state_dict_metadata.items()):
        size = getattr(md, "size", None)
        dtype = getattr(getattr(md, "properties", None), "dtype", None)
        out.append({"key": fqn, "shape": list(size) if size is not None else None,
                    "dtype": str(dtype).replace("torch.", "") if dtype is not None else None})
    return out
