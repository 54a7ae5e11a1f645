"""The manifest at the boundary: decode, check its digest, validate every field's type.

A manifest (``shardckpt.json``) comes from a disk, a bucket or another node:
it is untrusted input. :func:`decode` is the one way in. It turns the bytes
into a JSON object whose every field has the type the rest of the package
relies on, or raises :class:`~shardckpt.errors.CorruptCheckpointError` naming
the step, the file and the remedy — never a ``UnicodeDecodeError``,
``TypeError`` or ``KeyError`` from deep inside a load.

Every manifest written since the digest was introduced carries
``"digest": "sha256:<hex>"``, the SHA-256 of its own bytes (with those hex
digits written as zeros: :func:`seal`). It is checked before anything in the
manifest is used: an edit of any byte (a kinds table entry, a checksum, the
step number) that did not go through the writer is refused. Manifests written before it have no digest and are
validated field by field only. Like the file checksums, the digest detects damage, not a
forger: whoever can rewrite a manifest can recompute it (see
:data:`shardckpt.format.layout.CHECKSUM_ALGO`).

Stdlib only, no torch: a table of expected types per field is all it takes.
The cost on top of the ``json.loads``: one SHA-256 of the bytes and a pass
over the fields (docs/operations/damaged-checkpoints.md says what it measured).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any, Callable

from shardckpt.errors import CorruptCheckpointError

DIGEST_FIELD = "digest"
DIGEST_ALGO = "sha256"

KINDS = ("module", "optimizer", "stateful", "value", "rng", "stock")
"""The kinds a manifest's ``keys`` table may record (``shardckpt.state.capture``)."""

_HEX = re.compile(r"^[0-9a-f]+$")


PLACEHOLDER = f"{DIGEST_ALGO}:" + "0" * 64
_DIGEST_RE = re.compile(rb'\n "digest": "sha256:([0-9a-f]{64})"')
"""Where the writer puts the digest: a top-level key (indented by one space; a nested key is
indented further, and a newline inside a JSON string is always escaped)."""


def seal(body: dict[str, Any]) -> str:
    """The manifest text of ``body`` with its digest: what the writer stores.

    The text is ``json.dumps(indent=1, sort_keys=True)``; the digest is the
    SHA-256 of that text's bytes with the digest's 64 hex digits written as
    zeros. Checking it costs one hash of the bytes as read (no re-encoding).
    """
    content = {k: v for k, v in body.items() if k != DIGEST_FIELD}
    content[DIGEST_FIELD] = PLACEHOLDER
    text = json.dumps(content, indent=1, sort_keys=True)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    slot = f'\n "{DIGEST_FIELD}": "{PLACEHOLDER}"'
    return text.replace(slot, f'\n "{DIGEST_FIELD}": "{DIGEST_ALGO}:{digest}"', 1)


def seal_reusing(body: dict[str, Any], cache: dict[str, tuple[Any, str]]) -> str:
    """:func:`seal` of ``body``, the same text, each top-level field's text reused from ``cache`` (kept by the
    caller between manifests that differ in a few fields) when its value is the same as then, JSON-wise."""
    content = {k: v for k, v in body.items() if k != DIGEST_FIELD}
    content[DIGEST_FIELD] = PLACEHOLDER
    parts = []
    for key in sorted(content):
        value = content[key]
        hit = cache.get(key)
        if hit is None or not same_json(value, hit[0]):
            if type(value) in _SCALARS:  # (the step, the time, the save's id: their text alike without indent)
                hit = cache[key] = (value, f" {json.dumps(key)}: {json.dumps(value)}")
            else:
                text = json.dumps(value, indent=1, sort_keys=True).replace("\n", "\n ")  # one level in
                hit = cache[key] = (json.loads(json.dumps(value)), f" {json.dumps(key)}: {text}")
        parts.append(hit[1])
    text = "{\n" + ",\n".join(parts) + "\n}"
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    slot = f'\n "{DIGEST_FIELD}": "{PLACEHOLDER}"'
    return text.replace(slot, f'\n "{DIGEST_FIELD}": "{DIGEST_ALGO}:{digest}"', 1)


_SCALARS = (str, int, float, bool, type(None))
"""Values whose JSON text has no indent to make (``json.dumps`` alike with or without one) and that cannot change
after they are cached."""


def same_json(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same JSON text (``1``, ``1.0`` and ``True`` are not; a tuple is its list)."""
    if a is b:
        return True
    if type(a) is tuple:
        a = list(a)
    if type(b) is tuple:
        b = list(b)
    if type(a) is not type(b):
        return isinstance(a, str) and isinstance(b, str) and str.__eq__(a, b)  # (a str subclass: its text)
    if type(a) is dict:
        return a.keys() == b.keys() and all(same_json(v, b[k]) for k, v in a.items())
    if type(a) is list:
        return len(a) == len(b) and all(map(same_json, a, b))
    return bool(a == b) and (type(a) is not float or math.copysign(1, a) == math.copysign(1, b))


def digest_matches(raw: bytes, recorded: Any) -> bool:
    """Whether the manifest bytes ``raw`` carry ``recorded`` as their one top-level digest and it
    is the digest of those bytes (see :func:`seal`)."""
    found = list(_DIGEST_RE.finditer(raw))
    if len(found) != 1 or recorded != f"{DIGEST_ALGO}:{found[0].group(1).decode()}":
        return False
    start, end = found[0].span(1)
    view = memoryview(raw)
    h = hashlib.sha256(view[:start])
    h.update(b"0" * 64)
    h.update(view[end:])
    return h.hexdigest() == found[0].group(1).decode()


def remedy(step: Any) -> str:
    which = f"step {step}" if isinstance(step, int) and not isinstance(step, bool) else "this step"
    return (
        f"Remedy: load an earlier step (load(state, step=N), or on_corrupt='fallback'), or restore {which} "
        f"from another copy (`shardckpt pull --remote URL --local DIR --step N` when it is on the remote); "
        f"`shardckpt verify` lists what else is damaged."
    )


class _Invalid(Exception):
    """One field of the manifest has the wrong type or value (internal: wrapped at the boundary)."""


def _int(value: Any, what: str, *, low: int | None = 0) -> int:
    if type(value) is not int:
        raise _Invalid(f"{what} must be an integer, found {_show(value)}")
    if low is not None and value < low:
        raise _Invalid(f"{what} must be >= {low}, found {value}")
    return value


def _num(value: Any, what: str) -> float:
    if type(value) not in (int, float):
        raise _Invalid(f"{what} must be a number, found {_show(value)}")
    return float(value)


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"{what} must be a string, found {_show(value)}")
    return value


def _bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise _Invalid(f"{what} must be true or false, found {_show(value)}")
    return value


def _dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Invalid(f"{what} must be an object, found {_show(value)}")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise _Invalid(f"{what} must be a list, found {_show(value)}")
    return value


def _show(value: Any) -> str:
    text = (json.dumps(value, allow_nan=True) if isinstance(value, (str, int, float, bool, type(None)))
            else type(value).__name__)
    kind = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )
    return f"{kind} ({text[:40]})" if kind not in ("an object", "a list") else kind


def _checksum(entry: dict[str, Any], what: str) -> None:
    if "checksum" in entry:
        value = _str(entry["checksum"], f"{what}.checksum")
        algo, _, hexdigest = value.partition(":")
        if algo not in ("xxh3-128", "sha256") or not hexdigest or not _HEX.match(hexdigest):
            raise _Invalid(f"{what}.checksum is of unknown kind ({value[:40]!r})")
    elif "sha256" in entry:  # manifests written before checksums named their algorithm
        value = _str(entry["sha256"], f"{what}.sha256")
        if not _HEX.match(value):
            raise _Invalid(f"{what}.sha256 is not a hex digest ({value[:40]!r})")
    else:
        raise _Invalid(f"{what} has no checksum")


_CHECKSUM_RE = re.compile(r"^(xxh3-128|sha256):[0-9a-f]+$")


def _file_ok(entry: Any) -> bool:
    """The common case, checked without building messages (a step of 1,000 ranks has 10,000 files)."""
    if type(entry) is not dict:
        return False
    size, rank, checksum, chunks = entry.get("size"), entry.get("rank"), entry.get("checksum"), entry.get("chunks")
    return (
        type(size) is int and size >= 0 and type(rank) is int and rank >= 0
        and type(checksum) is str and _CHECKSUM_RE.match(checksum) is not None
        and (chunks is None or type(chunks) is str)
    )


def _files(value: Any) -> None:
    for name, entry in _dict(value, "files").items():
        if _file_ok(entry):
            continue
        what = f"files[{name!r}]"
        entry = _dict(entry, what)
        _int(entry.get("size", None), f"{what}.size")
        _int(entry.get("rank", None), f"{what}.rank")
        _checksum(entry, what)
        if entry.get("chunks") is not None:
            _str(entry["chunks"], f"{what}.chunks")


def _keys(value: Any) -> None:
    for key, kind in _dict(value, "keys").items():
        if kind not in KINDS:
            raise _Invalid(f"keys[{key!r}] is {_show(kind)}, not one of the kinds {', '.join(KINDS)}")


def _copies(value: Any) -> None:
    for i, group in enumerate(_list(value, "copies")):
        for rank in _list(group, f"copies[{i}]"):
            _int(rank, f"copies[{i}] entry")


def _lineage(value: Any) -> None:
    if value is None:
        return
    body = _dict(value, "lineage")
    if "branch" in body:
        _str(body["branch"], "lineage.branch")
    for i, fork in enumerate(_list(body.get("forks", []), "lineage.forks")):
        pair = _list(fork, f"lineage.forks[{i}]")
        if len(pair) != 2:
            raise _Invalid(f"lineage.forks[{i}] must be [step, branch], found {len(pair)} item(s)")
        _int(pair[0], f"lineage.forks[{i}] step", low=-1)
        _str(pair[1], f"lineage.forks[{i}] branch")


def _lineage_fits(body: dict[str, Any]) -> None:
    """The lineage agrees with itself and with the step: the step is on the branch of its last fork (the
    first branch ``""`` without forks), every fork starts another branch, the step is not below the step
    its branch started from (``shardckpt.format.lineage``)."""
    lineage = body.get("lineage") or {}
    if not lineage:
        return  # manifests from before rollbacks were tracked: the first branch
    forks = lineage.get("forks", [])
    branch = lineage.get("branch", "")
    expected = forks[-1][1] if forks else ""
    if branch != expected:
        raise _Invalid(
            f"lineage.branch is {branch!r}, but its history says {expected!r} (the branch of its last fork, or the "
            f"first branch \"\" when it has none)"
        )
    names = [name for _step, name in forks]
    if "" in names or len(set(names)) != len(names):
        raise _Invalid(f"lineage.forks start the first branch \"\" or one branch twice ({names})")
    if forks and body["step"] < forks[-1][0]:
        raise _Invalid(f"the step is below step {forks[-1][0]}, where its branch {branch!r} started")


def _metrics(value: Any) -> None:
    if value is None:
        return
    for name, metric in _dict(value, "metrics").items():
        _num(metric, f"metrics[{name!r}]")


def _kind(value: Any) -> None:
    if value not in ("full", "light"):
        raise _Invalid(f"kind is {_show(value)}, not 'full' or 'light'")


def _frozen(value: Any) -> None:
    if value is None:
        return
    for key, entries in _dict(value, "frozen").items():
        for name, entry in _dict(entries, f"frozen[{key!r}]").items():
            what = f"frozen[{key!r}][{name!r}]"
            entry = _dict(entry, what)
            for dim in _list(entry.get("shape", []), f"{what}.shape"):
                _int(dim, f"{what}.shape entry")
            if "dtype" in entry:
                _str(entry["dtype"], f"{what}.dtype")
            if "fingerprint" in entry:
                prints = _list(entry["fingerprint"], f"{what}.fingerprint")
                if len(prints) != 2:
                    raise _Invalid(f"{what}.fingerprint must hold two numbers")
                for p in prints:
                    _num(p, f"{what}.fingerprint entry")


def _metadata(value: Any) -> None:
    for name, item in _dict(value, "metadata").items():
        # shardckpt's own entries (the elastic plan's micro-batch and accumulation) are integers
        if name.startswith("shardckpt.") and item is not None:
            _int(item, f"metadata[{name!r}]", low=1)


def _stored(value: Any) -> None:
    for name, form in _dict(value, "stored").items():
        what = f"stored[{name!r}]"
        form = _dict(form, what)
        _str(form.get("codec"), f"{what}.codec")
        _int(form.get("size"), f"{what}.size")
        _checksum(form, what)
        lengths = _list(form.get("lengths"), f"{what}.lengths")
        for i, length in enumerate(lengths):
            _int(length, f"{what}.lengths[{i}]")
        if "sums" in form:  # the stored chunks' checksums, 16 hex digits each (absent in older manifests)
            sums = _str(form["sums"], f"{what}.sums")
            if len(sums) != 16 * len(lengths) or (sums and not _HEX.match(sums)):
                raise _Invalid(f"{what}.sums must hold 16 hex digits for each of its {len(lengths)} chunks")


_FIELDS: dict[str, Callable[[Any], Any]] = {
    "step": lambda v: _int(v, "step"),
    "world_size": lambda v: _int(v, "world_size", low=1),
    "files": _files,
    "created": lambda v: _num(v, "created"),
    "torch_version": lambda v: _str(v, "torch_version"),
    "shardckpt_version": lambda v: _str(v, "shardckpt_version"),
    "keys": _keys,
    "metadata": _metadata,
    "total_bytes": lambda v: _int(v, "total_bytes"),
    "run_id": lambda v: None if v is None else _str(v, "run_id"),
    "copies": _copies,
    "lineage": _lineage,
    "kind": _kind,
    "metrics": _metrics,
    "upload": lambda v: _bool(v, "upload"),
    "frozen": _frozen,
    "run": lambda v: None if v is None else _dict(v, "run"),
    "save_id": lambda v: None if v is None else _str(v, "save_id"),
    "stored": _stored,
    "format": lambda v: _str(v, "format"),
    DIGEST_FIELD: lambda v: _str(v, DIGEST_FIELD),
}
_REQUIRED = ("step", "world_size", "files", "format")


def _step_of(body: Any) -> Any:
    return body.get("step") if isinstance(body, dict) else None


def decode(data: bytes | str, where: str, *, expected_format: str, step: int | None = None) -> dict[str, Any]:
    """The manifest object in ``data`` (read from ``where``), its digest and every field checked.

    Raises :class:`CorruptCheckpointError` naming the step (the manifest's
    own, else ``step``: the one its directory is named after), ``where`` and
    the remedy for anything that is not a manifest this version can use.
    """
    hint = step

    def refuse(problem: str, step: Any = None, cause: BaseException | None = None) -> CorruptCheckpointError:
        if not (isinstance(step, int) and not isinstance(step, bool)):
            step = hint
        named = f"step {step}: " if isinstance(step, int) and not isinstance(step, bool) else ""
        error = CorruptCheckpointError(
            f"{named}manifest {where} {problem}; the step cannot be trusted. {remedy(step)}"
        )
        error.__cause__ = cause
        return error

    if isinstance(data, (bytes, bytearray, memoryview)):
        raw = bytes(data)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise refuse(f"is not UTF-8 text (byte {exc.start} of {len(raw)})", cause=exc) from exc
    else:
        text, raw = data, data.encode("utf-8", errors="surrogatepass")
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise refuse(f"is not valid JSON ({str(exc)[:80]})", cause=exc) from exc
    if not isinstance(body, dict):
        raise refuse(f"holds {_show(body)}, not a manifest object")
    step = _step_of(body)
    if body.get("format") != expected_format:
        raise refuse(f"has the unknown format {body.get('format')!r} (expected {expected_format!r})", step)
    if DIGEST_FIELD in body:
        if not digest_matches(raw, body[DIGEST_FIELD]):
            raise refuse(
                "does not match its own digest (its content was changed after it was written: damaged or edited)",
                step,
            )
    for name in _REQUIRED:
        if name not in body:
            raise refuse(f"has no field {name!r}", step)
    try:
        for name, check in _FIELDS.items():
            if name in body:
                check(body[name])
        _lineage_fits(body)
    except _Invalid as exc:
        raise refuse(f"is invalid: {exc}", step) from None
    for name, value in body.items():
        if isinstance(value, float) and not math.isfinite(value) and name != "created":
            raise refuse(f"is invalid: {name} is not a finite number", step)
    return body
