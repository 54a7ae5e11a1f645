"""A memory copy's record in two files: the layout written once per slot layout, the record of each save (torch-free).

What describes a slot's copy barely changes from one save to the next: each
tensor's fqn, dtype, shapes and offset in the buffer, DCP's flattening, the
slot's layout, the files, most of the manifest. That constant part is the
**layout file** ``r<rank>-s<slot>-<16 hex>.lay`` (JSON, format
``shardckpt-memory-layout/1``), named by the SHA-256 of its bytes and written
(tmp + rename) only when the constant part changes, i.e. at the first save into
a slot laid out again or whose state changed. Each save then writes a **record**
of a few hundred bytes (format ``shardckpt-memory/3``)::

    rank, slot, step, save_id, created, boot_id, run   this save, this boot, this run
    layout       "sha256:<64 hex>": the digest of the layout file's bytes it completes
    values_size  the bytes of the values file
    manifest     [the manifest's fields that differ from the layout's, the fields the layout's has and it lacks]
    values       the values file's table, only when it differs from the layout's

Reading a record (:func:`merge`) needs its layout file: a regular file of this
user, mode 0600, whose bytes hash to the record's digest and which names the
record's rank, slot and run. The manifest is made again from the layout's and
the record's fields and must carry its own seal (``manifest_schema``: the
digest of its text), so it binds the two: a record completed by another
layout, or a layout or record changed after it was written, is refused. Then
every check of a complete record applies (:meth:`Record.check`): each tensor
of a known dtype inside its global size and its bytes inside the buffer, each
value inside the values file, the manifest naming the record's step and save.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from shardckpt.format import layout
from shardckpt.format.manifest_schema import same_json as _same

FORMAT = "shardckpt-memory/3"
LAYOUT_FORMAT = "shardckpt-memory-layout/1"
LAY = ".lay"

_OWN = ("rank", "slot", "step", "save_id", "created", "boot_id", "run", "values_size")
"""A record's own fields (the rest of a :class:`Record` comes from its layout file)."""
_CONSTANT = ("rank", "slot", "world_size", "local_dir", "host", "run", "buffer", "buffer_size", "values_file",
             "tensors", "planner_data", "layout")
"""What a layout file holds besides the base manifest and the values table (a change: a new layout file)."""


def layout_name(rank: int, slot: int, digest: str) -> str:
    """The layout file of ``rank``'s ``slot`` whose bytes hash to ``digest`` (``sha256:<hex>``)."""
    return f"r{rank}-s{slot}-{digest.rpartition(':')[2][:16]}{LAY}"


@dataclasses.dataclass
class Record:
    """One rank's complete copy of one save, as its record and layout file describe it."""

    rank: int
    slot: int
    step: int
    save_id: str
    world_size: int
    created: float
    boot_id: str
    local_dir: str
    buffer: str
    buffer_size: int
    values_file: str
    values_size: int
    manifest: str
    """The step's manifest text (sealed, without files): what a disk copy of the save would say."""
    tensors: list[list[Any]]
    """``[fqn, dtype, local shape, global size, chunk offsets, offset in the buffer]`` per tensor saved."""
    values: list[list[Any]]
    """``[fqn, offset, length]`` per non-tensor item in the values file."""
    planner_data: dict[str, list[Any]]
    """DCP's flattening: each fqn's path in the state dict."""
    layout: list[list[Any]]
    """The slot's buffers: ``[path, signature, offset, nbytes]`` (the copy reuses them when they fit)."""
    host: str = ""
    run: str = ""
    """The run of the ``local_dir`` that made the copy (``RUN_FILE``)."""
    name: str = ""
    """The record's file name (not stored)."""
    layout_file: str = ""
    """The name of the layout file completing the record (not stored: made of rank, slot and digest)."""

    @property
    def version(self) -> str:
        return f"id:{self.save_id}"

    @property
    def nbytes(self) -> int:
        return self.buffer_size + self.values_size

    def constant(self) -> tuple[Any, ...]:
        """What a layout file holds of this record besides its base manifest and values table."""
        return tuple(getattr(self, k) for k in _CONSTANT)

    def layout_text(self) -> tuple[str, str]:
        """The layout file of this record (this save's manifest as its base) and its digest."""
        body = {k: getattr(self, k) for k in _CONSTANT}
        body.update(values=self.values, manifest=json.loads(self.manifest), format=LAYOUT_FORMAT)
        text = json.dumps(body, separators=(",", ":"))
        return text, "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()

    def to_json(self, digest: str, base: dict[str, Any]) -> str:
        """The record's text, completed by the layout file of ``digest`` (``base``: that file's body)."""
        body = {k: getattr(self, k) for k in _OWN}
        manifest = json.loads(self.manifest)
        old = base["manifest"]
        body["layout"] = digest
        body["manifest"] = [{k: v for k, v in manifest.items() if k not in old or not _same(v, old[k])},
                            [k for k in old if k not in manifest]]
        if self.values != base["values"]:  # (this package's own str and int entries: == is exact here)
            body["values"] = self.values
        body["format"] = FORMAT
        return json.dumps(body, separators=(",", ":"))

    def check(self) -> Record:
        """Every field of its type, every table's entry in bounds, the manifest naming this step and save."""
        for key, kind in (("rank", int), ("slot", int), ("step", int), ("world_size", int), ("buffer_size", int),
                          ("values_size", int), ("save_id", str), ("boot_id", str), ("buffer", str),
                          ("values_file", str), ("manifest", str), ("local_dir", str), ("run", str)):
            if not isinstance(getattr(self, key), kind) or isinstance(getattr(self, key), bool):
                raise ValueError(f"{key} is not a {kind.__name__}")
        for key in ("buffer", "values_file"):
            if _slot_of(getattr(self, key)) != (self.rank, self.slot) or "/" in getattr(self, key):
                raise ValueError(f"{key} {getattr(self, key)!r} is not a file of this record's slot")
        shapes = (str, str, _INTS, _INTS, _INTS, int)
        for table, kinds in (("tensors", shapes), ("values", (str, int, int)), ("layout", (str, str, int, int))):
            entries = getattr(self, table)
            if not isinstance(entries, list):
                raise ValueError(f"{table} is not a table")
            for entry in entries:
                if not (isinstance(entry, list) and len(entry) == len(kinds) and all(map(_is, entry, kinds))):
                    raise ValueError(f"a malformed entry of {table}: {str(entry)[:80]}")
        if not (isinstance(self.planner_data, dict)
                and all(isinstance(p, list) for p in self.planner_data.values())):
            raise ValueError("planner_data is not a table of paths")
        _check_tables(self)
        manifest = self.manifest_obj(self.name)
        if manifest.step != self.step or manifest.save_id != self.save_id:
            raise ValueError(f"it names step {self.step} ({self.version}), its manifest step {manifest.step} "
                             f"(id:{manifest.save_id})")
        return self

    def manifest_obj(self, where: str) -> layout.Manifest:
        return layout.Manifest.from_json(self.manifest, where)


def parse(text: str | bytes) -> dict[str, Any]:
    """A record file's body (its format checked); :func:`merge` completes it."""
    body = json.loads(text)
    if not isinstance(body, dict) or body.pop("format", None) != FORMAT:
        raise ValueError("not a memory record of this format")
    for key in ("rank", "slot"):
        if not isinstance(body.get(key), int) or isinstance(body.get(key), bool):
            raise ValueError(f"{key} is not an int")
    if not (isinstance(body.get("layout"), str) and body["layout"].startswith("sha256:")
            and len(body["layout"]) == 71 and not body["layout"][7:].strip("0123456789abcdef")):
        raise ValueError("it names no layout digest")
    return body


def merge(body: dict[str, Any], raw: bytes, name: str) -> Record:
    """The record of ``body`` (:func:`parse`) completed by the layout file bytes ``raw``, every check made."""
    if "sha256:" + hashlib.sha256(raw).hexdigest() != body["layout"]:
        raise ValueError("its layout file is not the one it was written with (another digest)")
    base = json.loads(raw)
    if not isinstance(base, dict) or base.pop("format", None) != LAYOUT_FORMAT:
        raise ValueError("its layout file is not a memory layout of this format")
    for key in ("rank", "slot", "run"):
        if base.get(key) != body.get(key):
            raise ValueError(f"its layout file names another {key} ({base.get(key)!r})")
    delta = body.get("manifest")
    if not (isinstance(delta, list) and len(delta) == 2 and isinstance(delta[0], dict) and isinstance(delta[1], list)
            and isinstance(base.get("manifest"), dict)):
        raise ValueError("its manifest is not a change of its layout's")
    manifest = {k: v for k, v in base["manifest"].items() if k not in delta[1]}
    manifest.update(delta[0])
    fields = {f.name for f in dataclasses.fields(Record)} - {"name", "layout_file", "manifest", "values"}
    merged = {k: base[k] for k in fields if k in base}
    merged.update({k: body[k] for k in fields & set(_OWN) if k in body})
    try:
        record = Record(**merged, manifest=json.dumps(manifest, indent=1, sort_keys=True),
                        values=body.get("values", base.get("values")), name=name,
                        layout_file=layout_name(body["rank"], body["slot"], body["layout"]))
    except TypeError as exc:
        raise ValueError(f"a field is missing ({exc})") from exc
    return record.check()


def _slot_of(name: str) -> tuple[int, int] | None:
    if not name.startswith("r") or "-s" not in name:
        return None
    rank, _sep, rest = name[1:].partition("-s")
    slot = rest.split("-", 1)[0].split(".", 1)[0]
    return (int(rank), int(slot)) if rank.isdigit() and slot.isdigit() else None


_INTS = "ints"
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex128": 16, "complex64": 8, "int64": 8,
            "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1,
            "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1}
"""Bytes per element of each dtype a record may name (any other name: the record is refused)."""
ALIGN = 64
"""Byte alignment of every tensor in a buffer (any dtype's element size divides it)."""


def tensor_bytes(entry: list[Any]) -> int:
    """The bytes of a record's tensor entry ``[fqn, dtype, shape, size, offsets, offset]``."""
    n = ITEMSIZE[entry[1].rsplit(".", 1)[-1]]
    for d in entry[2]:
        n *= d
    return n


def _check_tables(record: Record) -> None:
    """Every tensor of a known dtype, its chunk inside its global size and its bytes inside the buffer;
    every value inside the values file (a record that says otherwise is refused, never read past its files)."""
    for entry in record.tensors:
        fqn, dtype, shape, size, offsets, offset = entry
        if dtype.rsplit(".", 1)[-1] not in ITEMSIZE:
            raise ValueError(f"{fqn}: unknown dtype {dtype!r}")
        if not (len(shape) == len(size) == len(offsets) and all(d >= 0 for d in shape + size + offsets)
                and all(o + d <= n for o, d, n in zip(offsets, shape, size))):
            raise ValueError(f"{fqn}: the chunk {offsets}+{shape} does not lie in its size {size}")
        if offset < 0 or offset % ALIGN or offset + tensor_bytes(entry) > record.buffer_size:
            raise ValueError(f"{fqn}: [{offset}, +{tensor_bytes(entry)}) does not lie in the buffer of "
                             f"{record.buffer_size} bytes")
    for fqn, offset, length in record.values:
        if offset < 0 or length < 0 or offset + length > record.values_size:
            raise ValueError(f"{fqn}: [{offset}, +{length}) does not lie in the values of {record.values_size} bytes")


def _is(value: Any, kind: Any) -> bool:
    if kind is _INTS:
        return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    return isinstance(value, kind) and not isinstance(value, bool)
