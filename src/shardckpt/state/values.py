"""One value for every rank: the plain values and stateful objects' state of a save compared across ranks.

DCP keeps one copy of an entry that several
ranks save under the same name, written by whichever rank its planner picks;
when the ranks' values differ (a metric computed on rank 0 only), that is an
arbitrary rank's value, and when their types differ (a 0-d tensor on one
rank, a float on another) the planner fails. :func:`agree` compares the plain
values and the stateful objects' state of every rank at save, **by content at
any size**, and keeps rank 0's where they differ (one WARNING per key): small
leaves by value, pickled leaves over 4 KiB by a digest of their bytes (one
``all_gather`` over the ``ctl`` side group, on the main thread), and tensors
over 64 elements by an xxh3-128 digest of their bytes, taken in the
background writer from the staged copy before anything is written
(:class:`Later`; ``save()`` does not wait for it). A plain value differing
by rank is left out by the other ranks; a stateful object's entry held by
several ranks is kept from the lowest of them (entries that only some ranks
hold, a state keyed by rank, are each rank's own). DTensor shards and the
state of modules and optimizers are DCP's to reconcile and are not compared.
Entries that belong to one rank (:mod:`shardckpt.state.keys`) are never compared.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import pickle
from typing import Any, Callable

import torch
import xxhash

from shardckpt import _dist
from shardckpt.errors import ConfigError, FailedElsewhere, SaveError
from shardckpt.state.keys import ABSENT, STATEFUL, VALUE, encode_keys, path_rank

log = logging.getLogger("shardckpt")

_SMALL_PICKLE = 4096  # plain leaves up to this size are compared by value, larger ones by digest
_SMALL_TENSOR = 64  # tensors with up to this many elements are compared by value, larger ones by digest


def _leaf(value: Any) -> tuple:
    """What is compared across ranks for one leaf DCP stores (a 3-tuple for a tensor: by digest, later)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):  # shards differ by rank by design: compare the global shape
        return ("dtensor", tuple(value.shape), str(value.dtype), "shards")
    if isinstance(value, torch.Tensor):
        if value.numel() <= _SMALL_TENSOR:
            return ("tensor", tuple(value.shape), str(value.dtype), value.detach().cpu().tolist())
        return ("tensor", tuple(value.shape), str(value.dtype))
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    try:
        blob = pickle.dumps(value, protocol=4)
    except Exception:  # noqa: BLE001 - the write reports it, naming the entry
        return (kind, "unpicklable")
    if len(blob) <= _SMALL_PICKLE:
        return (kind, "value", value)
    return (kind, "digest", len(blob), xxhash.xxh3_128_hexdigest(blob))


def _later(leaf: tuple | None) -> bool:
    return leaf is not None and leaf[0] == "tensor" and len(leaf) == 3


def _same(a: tuple | None, b: tuple | None) -> bool:
    if a is None or b is None:
        return a is b
    if len(a) != len(b) or a[:-1] != b[:-1]:
        return False
    x, y = a[-1], b[-1]
    try:
        if bool(x == y):
            return True
    except Exception:  # noqa: BLE001 - e.g. numpy arrays: compare their bytes below
        pass
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    try:
        return pickle.dumps(x, protocol=4) == pickle.dumps(y, protocol=4)
    except Exception:  # noqa: BLE001
        return False


def _show(leaf: tuple | None) -> str:
    if leaf is None:
        return "absent"
    if leaf[0] in ("tensor", "dtensor"):
        shape = "x".join(map(str, leaf[1])) or "0-d"
        body = f" {leaf[3]!r}" if len(leaf) > 3 and leaf[0] == "tensor" else ""
        return f"{leaf[0]} {shape} {leaf[2].replace('torch.', '')}{body}"[:100]
    kind = leaf[0].rpartition(".")[2]
    if leaf[1] == "value":
        return f"{kind} {leaf[2]!r}"[:80]
    if leaf[1] == "digest":
        return f"{kind} of {leaf[2]} bytes (digest {leaf[3][:12]})"
    return kind


def _summaries(key: str, value: Any) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """``({fqn: leaf}, {fqn: path})`` of ``value`` as DCP flattens it, per-rank entries left out."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, paths = flatten_state_dict({key: value})
    keep = [fqn for fqn in flat if path_rank(paths[fqn]) is None]
    return {fqn: _leaf(flat[fqn]) for fqn in keep}, {fqn: tuple(paths[fqn]) for fqn in keep}


def _without(value: Any, path: tuple) -> Any:
    """``value`` without the leaf at ``path`` (containers on the way copied; a list goes whole)."""
    if not path or not isinstance(value, dict) or path[0] not in value:
        return ABSENT
    rest = _without(value[path[0]], path[1:])
    out = dict(value)
    if rest is ABSENT:
        del out[path[0]]
    else:
        out[path[0]] = rest
    return out


def _at(value: Any, path: tuple) -> Any:
    """The leaf of ``value`` at ``path`` (dict keys, list and tuple indices), else ``ABSENT``."""
    for part in path:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif type(value) in (list, tuple) and isinstance(part, int) and 0 <= part < len(value):
            value = value[part]
        else:
            return ABSENT
    return value


def _replaced(value: Any, path: tuple, held: bool, leaf: Any) -> Any:
    """``value`` with its leaf at ``path`` (non-empty, present) set to ``leaf`` (``held``) or removed,
    containers on the way copied; ``ABSENT`` where that cannot be done (a path it lacks, a list item removed)."""
    part, rest = path[0], path[1:]
    if isinstance(value, dict) and part in value:
        out = dict(value)
        if rest:
            inner = _replaced(value[part], rest, held, leaf)
            if inner is ABSENT:
                return ABSENT
            out[part] = inner
        elif held:
            out[part] = leaf
        else:
            del out[part]
        return out
    if type(value) in (list, tuple) and isinstance(part, int) and 0 <= part < len(value) and (rest or held):
        items = list(value)
        items[part] = _replaced(value[part], rest, held, leaf) if rest else leaf
        return ABSENT if items[part] is ABSENT else type(value)(items)
    return ABSENT


def _on_cpu(value: Any) -> Any:
    """``value`` with its tensors on the CPU (what is sent to another rank)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_on_cpu(v) for v in value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_on_cpu(v) for v in value))
    return value


class _Keys:
    """The outcome of one comparison: which ranks leave out what, one warning per key.

    ``gather`` (a save kept in memory, whose copy on each machine is restored as it is): a rank whose
    value differs holds the reference rank's value instead of leaving it out, the differing leaves received
    over ``gather`` (collective: every rank resolves the same keys, in the same order, from the same
    ``differ``). An entry is ``(this rank's path to the leaf, description, reference rank, fqn)``.
    """

    def __init__(self, kinds: dict[str, str], step: int, warned: set[str], sharded: set[str],
                 gather: Callable[[Any], list[Any]] | None = None) -> None:
        self.kinds, self.step, self.warned, self.sharded = kinds, step, warned, sharded
        self.gather = gather

    def resolve(self, out: dict[str, Any], key: str, differ: dict[int, list[tuple[tuple, str, int, str]]]
                ) -> dict[str, Any]:
        """Apply the differences of ``key`` (``{rank: [entry]}``) to ``out``."""
        rank = _dist.rank()
        stateful = self.kinds.get(key) == STATEFUL
        first = next(iter(differ.values()))[0]
        message = (
            f"{'the state of' if stateful else 'the plain value'} {key!r} differs across ranks (rank(s) "
            f"{', '.join(map(str, sorted(differ)))} differ from rank {first[2]}; e.g. {first[1]})"
        )
        remedy = (
            "Remedy: wrap a value that belongs to each rank in shardckpt.PerRank(...), or make it the same on every "
            "rank before save() (e.g. torch.distributed.broadcast_object_list from rank 0)"
        )
        if not stateful and key in self.sharded:  # leaving the key out would leave out this rank's shards too
            raise ConfigError(f"step {self.step}: nothing was saved: {message}. {remedy}.")
        left = self._hand_over(out, key, differ) if self.gather is not None else differ.get(rank, [])
        if left and key in out:
            if stateful:
                for path, _text, _ref, _fqn in left:
                    pruned = _without({key: out[key]}, path)
                    out[key] = pruned[key] if pruned is not ABSENT and key in pruned else {}
            else:
                out.pop(key)
        if key not in self.warned:
            self.warned.add(key)
            if rank == 0:
                log.warning("shardckpt: step %d: %s; saving rank %d's value. %s", self.step, message, first[2], remedy)
        return out

    def _hand_over(self, out: dict[str, Any], key: str, differ: dict[int, list[tuple[tuple, str, int, str]]]
                   ) -> list[tuple[tuple, str, int, str]]:
        """The reference ranks send the differing leaves of ``key``; this rank takes them into ``out``.
        Returns the entries it could not take (a leaf it does not hold where the reference has it): left out."""
        rank = _dist.rank()
        sent: bytes | None = None
        error = None
        try:
            leaves = {fqn: _at({key: out[key]}, where) if key in out else ABSENT
                      for entries in differ.values() for where, _t, ref, fqn in entries if ref == rank}
            if leaves:
                sent = pickle.dumps({f: (v is not ABSENT, None if v is ABSENT else _on_cpu(v))
                                     for f, v in leaves.items()})
        except Exception as exc:  # noqa: BLE001 - every rank must reach the exchange, then all raise
            error = f"{type(exc).__name__}: {exc}"
        gathered = self.gather((sent, error))
        failed = [(r, e) for r, (_s, e) in enumerate(gathered) if e is not None]
        if failed:
            raise ConfigError(
                f"step {self.step}: nothing was saved; rank {failed[0][0]}'s value of {key!r}, which differs on other "
                f"ranks, could not be sent to them ({failed[0][1]}). Remedy: make it the same on every rank before "
                f"save(), or wrap a value that belongs to each rank in shardckpt.PerRank(...)"
            )
        left, theirs = [], {}
        for entry in differ.get(rank, []) if key in out else []:
            where, _text, ref, fqn = entry
            if ref not in theirs:
                theirs[ref] = pickle.loads(gathered[ref][0])
            held, leaf = theirs[ref].get(fqn, (False, None))
            if len(where) == 1:  # the whole value is the leaf
                changed = (leaf if held else ABSENT) if fqn == key else ABSENT
            else:
                changed = _replaced(out[key], where[1:], held, leaf)
            if changed is ABSENT:
                left.append(entry)
            else:
                out[key] = changed
        return left


class Known:
    """What every rank summarised at the last save (one per ``Checkpointer``), so that a save sends only the
    summaries that changed since (:func:`agree`).

    Why it cannot miss a difference: at every exchange each rank sends the summary of each key whose pickled
    bytes are not the ones it sent before (and the keys it no longer has), and every rank applies every
    rank's changes to the same view of the exchange before; a rank that sends nothing for a key has the
    same summary as in that view, byte for byte. So the view after the exchange is, on every rank, exactly
    what a full exchange of every summary would have given, and the comparison runs on it as before. The
    views hold only while every rank took part in every exchange: each rank sends how many it completed
    (``-1`` when its view was lost to a failure), and unless all agree, every summary is sent again.
    """

    def __init__(self) -> None:
        self.exchanges = 0
        self.sent: dict[str, bytes] = {}
        """This rank's summaries as it last sent them, pickled, per key."""
        self.views: list[dict[str, dict[str, tuple]]] | None = None
        """Every rank's summaries after the last exchange (``None``: unknown, the next exchange is full)."""

    def exchange(self, mine: dict[str, dict[str, tuple]], error: str | None, gather: Callable[[Any], list[Any]]
                 ) -> tuple[list[dict[str, dict[str, tuple]]], list[tuple[int, str]]]:
        """Every rank's summaries (collective), and the ranks' errors (then nothing is kept)."""
        blobs: dict[str, bytes] = {}
        for key, summary in mine.items():
            try:
                blobs[key] = pickle.dumps(summary, protocol=4)
            except Exception:  # noqa: BLE001 - not comparable by its bytes: sent every time
                blobs[key] = b""
        changed = {k: mine[k] for k, b in blobs.items() if not b or self.sent.get(k) != b}
        gone = [k for k in self.sent if k not in mine]
        done, views = (self.exchanges if self.views is not None else -1), self.views
        self.views = None  # until this exchange completes
        gathered = gather((done, changed, gone, error))
        errors = [(r, e) for r, (_d, _c, _g, e) in enumerate(gathered) if e is not None]
        if errors:
            return [], errors
        if views is not None and all(d == done for d, _c, _g, _e in gathered):
            summaries = [{k: v for k, v in view.items() if k not in g} | c
                         for view, (_d, c, g, _e) in zip(views, gathered)]
        else:
            summaries = gather(mine)
        self.exchanges, self.sent, self.views = self.exchanges + 1, blobs, summaries
        return summaries, []


def agree(
    captured: dict[str, Any], kinds: dict[str, str], groups: _dist.SideGroups, step: int, warned: set[str],
    own: set[str] | frozenset[str] = frozenset(), now: bool = False, *, known: Known,
) -> tuple[dict[str, Any], "Later | None"]:
    """Tag dict keys, then make every rank save one value per entry (collective over ``ctl``).

    Returns the state dict to write (``captured`` with tagged keys and
    per-rank entries; on the ranks whose plain values differ from rank 0's,
    without them, or with rank 0's when ``now``) and the tensors whose content is compared later, in the
    background (:class:`Later`; ``None`` when there are none). A key refused
    on any rank raises :class:`ConfigError` on every rank. ``warned`` holds the
    keys already warned about (one warning per key and instance); ``own``:
    keys each rank saves under keys of its own (``PerRank``), not compared.
    ``now``: the tensors' contents are compared here too, and a rank whose
    value differs takes the reference rank's (a save kept in memory: a
    restore, and the disk write, read each rank's copy as it is). ``known``: the summaries of the last save,
    kept by the caller; only those that changed since are sent (:class:`Known`).
    """
    out = dict(captured)
    rank = _dist.rank()
    error = None
    mine: dict[str, dict[str, tuple]] = {}
    paths: dict[str, dict[str, tuple]] = {}
    sharded: set[str] = set()
    alone = _dist.world_size() == 1  # (nothing to compare: no summaries)
    try:
        for key, kind in kinds.items():
            if kind in (VALUE, STATEFUL) and key in out:
                out[key] = encode_keys(out[key], repr(key), rank)
                if key not in own and not alone:
                    mine[key], paths[key] = _summaries(key, out[key])
    except ConfigError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - every rank must reach the exchange below, then all raise
        error = f"the plain values could not be compared ({type(exc).__name__}: {exc})"
    if alone:
        if error is not None:
            raise ConfigError(f"step {step}: {error}")
        return out, None
    summaries, errors = known.exchange(mine, error, groups.all_gather_ctl)
    if errors:
        ranks = ", ".join(str(r) for r, _e in errors)
        raise ConfigError(f"step {step}: nothing was saved; on rank(s) {ranks}: {errors[0][1]}")
    for key in set().union(*summaries):
        if any(leaf[0] == "dtensor" for m in summaries for leaf in m.get(key, {}).values()):
            sharded.add(key)
    keys = _Keys(kinds, step, warned, sharded, groups.all_gather_ctl if now else None)
    later: list[tuple[str, str, tuple, str]] = []
    for key in sorted(set().union(*summaries)):
        stateful = kinds.get(key) == STATEFUL
        leaves = [m.get(key, {}) for m in summaries]
        differ: dict[int, list[tuple[tuple, str, int]]] = {}
        for fqn in sorted(set().union(*leaves)):
            holders = [r for r, held in enumerate(leaves) if fqn in held]
            ref = holders[0] if stateful else 0
            a = leaves[ref].get(fqn)
            compare_later = False
            for r, held in enumerate(leaves):
                b = held.get(fqn)
                if r == ref or (b is None and (stateful or a is None)):
                    continue
                if _later(a) and _later(b) and a == b:
                    compare_later = True  # same shape and dtype: the bytes decide, in the background
                elif not _same(a, b):
                    where = paths.get(key, {}).get(fqn, (key,) + tuple(fqn.split(".")[1:]))
                    differ.setdefault(r, []).append(
                        (where, f"{fqn}: rank {ref} {_show(a)}, rank {r} {_show(b)}", ref, fqn))
            if compare_later:  # the path is empty where this rank does not hold it: it reports no digest
                later.append((key, fqn, paths.get(key, {}).get(fqn, ()), _show(a)))
        if differ:
            out = keys.resolve(out, key, differ)
    if later and now:
        return Later(keys, later).settle(out, groups.all_gather_ctl, failed=False), None
    return out, (Later(keys, later) if later else None)


@dataclasses.dataclass
class Later:
    """Tensors over 64 elements of plain values and stateful objects, of one shape and dtype on every
    rank that holds them: compared by an xxh3-128 digest of their staged bytes in the background writer,
    before the write (``save()`` does not wait for the digest)."""

    keys: _Keys
    leaves: list[tuple[str, str, tuple, str]]
    """``(key, fqn, path, shown)`` in the same order on every rank (the path empty where this rank has none)."""

    def digests(self, staged: dict[str, Any]) -> list[str | None]:
        out: list[str | None] = []
        for _key, _fqn, path, _shown in self.leaves:
            node = _at(staged, path) if path else None
            out.append(digest(node) if isinstance(node, torch.Tensor) else None)
        return out

    def settle(self, staged: dict[str, Any], gather: Callable[[Any], list[Any]], *, failed: bool) -> dict[str, Any]:
        """What this rank writes of ``staged`` once every rank's digests are known (collective: every
        rank calls it once per save, ``failed`` or not; a failure anywhere raises on every rank)."""
        error = None
        try:
            mine = None if failed else self.digests(staged)
        except Exception as exc:  # noqa: BLE001 - every rank must reach the exchange, then all raise
            mine, error = None, exc
        gathered = gather(mine)
        if error is not None:
            raise SaveError(f"step {self.keys.step}: the plain values could not be compared "
                            f"({type(error).__name__}: {error})") from error
        lost = [r for r, d in enumerate(gathered) if d is None]
        if lost:
            raise FailedElsewhere(f"step {self.keys.step}: rank(s) {', '.join(map(str, lost))} failed before writing")
        out = dict(staged)
        by_key: dict[str, dict[int, list[tuple[tuple, str, int, str]]]] = {}
        for i, (key, fqn, path, shown) in enumerate(self.leaves):
            values = [d[i] for d in gathered]
            holders = [r for r, v in enumerate(values) if v is not None]
            if not holders:
                continue
            ref = holders[0] if self.keys.kinds.get(key) == STATEFUL else 0
            if values[ref] is None:
                continue
            for r in holders:
                if values[r] != values[ref]:
                    text = (f"{fqn}: {shown} everywhere, content digest rank {ref} {values[ref][:12]}, "
                            f"rank {r} {values[r][:12]}")
                    by_key.setdefault(key, {}).setdefault(r, []).append((path or (key,), text, ref, fqn))
        for key in sorted(by_key):
            out = self.keys.resolve(out, key, by_key[key])
        return out


def digest(tensor: torch.Tensor) -> str:
    """xxh3-128 of a tensor's bytes (a contiguous CPU copy where it is not one)."""
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous()
    if data.dim() == 0:
        data = data.reshape(1)
    return xxhash.xxh3_128_hexdigest(data.view(torch.uint8).numpy())
