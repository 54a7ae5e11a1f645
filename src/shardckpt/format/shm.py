"""The memory tier's files in shared memory: where they live, the record that makes a copy usable, who trusts it.

A ``local_dir`` with the memory tier on keeps each rank's newest staged
copies in a tmpfs (``/dev/shm``, or ``SHARDCKPT_SHM_DIR``) that outlives the
trainer process, in one directory per run of a ``local_dir``::

    <local_dir>/.shardckpt-run            the directory's run: a random id, created once with O_EXCL (mode 0600)
    /dev/shm/shardckpt-<uid>-<key>-<run>/ mode 0700, owned by the job's user, created by the job and checked;
                                          <key>: a digest of the local_dir's path, <run>: the run id
        owner.lock                        held (shared flock) by every live trainer and keeper of the run
        r<rank>-s<slot>-<token>.buf       one rank's staged tensors of one slot, back to back (reused between saves;
                                          a new token when the layout changes)
        r<rank>-s<slot>.val               the non-tensor values of the save the slot holds (torch.save'd, back to back)
        r<rank>-s<slot>-<digest>.lay      what the records of one slot layout share (tensors, offsets, the base
                                          manifest): written once per layout, named by the SHA-256 of its bytes
        r<rank>-s<slot>.rec               the record of a few hundred bytes: written last, after the copy is
                                          complete (tmp + rename); removed first when the slot is written again
        r<rank>-s<slot>.sum               the copy's checksum (step, save id, xxh3-128), taken after the record
                                          off the training loop; checked by a restore when present

A slot holds a save only while its record exists, so a copy cut short (the
process killed while it copies) is never used: the record is gone before
the first byte is overwritten and comes back only after the last. The record
names the step, the save id, this machine's boot id (a record of another
boot is stale: nothing of it is trusted) and the digest of its layout file,
which holds the files and their sizes, the base of the step's manifest and
where each tensor lies in the buffer (``format/shm_record.py``: the two files
and how they bind each other).

A copy belongs to a run, never to a path: the namespace's name carries the
run id the directory holds (a removed and re-created directory, or another
container's directory mounted at the same path over a shared ``/dev/shm``,
has another id), and so does every record. The run id is read from the
directory (mode 0600): another local user cannot predict the name, and the
job checks what it created (its owner, mode 0700, not a link). Namespaces of
the same path and user but another run (:func:`foreign`) are never read; one
whose run is not alive (no process holds its ``owner.lock``) is freed.

Torch-free: read by ``shardckpt ls`` / ``status``, the node's memory keeper
(``node/memory_keeper.py``) and the trainer (``saving/memory.py``, ``restoring/memory.py``).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import socket
import stat
import uuid
from typing import Any

import xxhash

from shardckpt._text import fmt_bytes
from shardckpt.format.shm_record import ALIGN, FORMAT, LAY, Record, layout_name, merge, parse

__all__ = ["ALIGN", "FORMAT", "LAY", "Record", "layout_name"]

RUN_FILE = ".shardckpt-run"
"""The run identity of a ``local_dir`` (in the directory itself): whose copies a namespace holds."""
LOCK_NAME = "owner.lock"
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
REC, BUF, VAL, SUM = ".rec", ".buf", ".val", ".sum"


def shm_root() -> str:
    """Where the namespaces live: ``SHARDCKPT_SHM_DIR`` (a tmpfs), else ``/dev/shm``."""
    return os.environ.get("SHARDCKPT_SHM_DIR") or "/dev/shm"


@functools.lru_cache(maxsize=1)
def boot_id() -> str:
    """This boot of this machine (a record written before a reboot carries another one)."""
    try:
        with open(BOOT_ID_PATH, encoding="ascii") as f:
            return f.read().strip() or "unknown"
    except OSError:
        return "unknown"


def machine() -> str:
    """What ranks sharing this machine's shared memory have in common: host name and boot."""
    return f"{socket.gethostname()}/{boot_id()}"


def run_id(root: str, *, create: bool = False) -> str | None:
    """The run ``root`` (a ``local_dir``) holds: a random id written once into the directory (``create``:
    made now when absent; every rank racing here reads the same one). ``None``: none, or unreadable."""
    path = os.path.join(root, RUN_FILE)
    for _attempt in range(2):
        try:
            with open(path, encoding="ascii") as f:
                text = f.read().strip()
            return text if len(text) == 32 and all(c in "0123456789abcdef" for c in text) else None
        except FileNotFoundError:
            if not create:
                return None
        except (OSError, UnicodeDecodeError):
            return None
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(uuid.uuid4().hex + "\n")
            try:
                os.link(tmp, path)  # complete when visible; the first one wins
            except FileExistsError:
                pass
        except OSError:
            return None
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return None


def _prefix(root: str) -> str:
    key = hashlib.sha256(os.path.realpath(root).encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"shardckpt-{os.getuid()}-{key}-"


def namespace(root: str, run: str | None = None) -> str | None:
    """The directory holding the memory tier of ``root``'s run (``run``, else the one the directory holds)
    for this user; ``None`` when the directory holds no run (nothing of it can be in memory)."""
    run = run or run_id(root)
    return os.path.join(shm_root(), _prefix(root) + run) if run else None


def hold(ns: str) -> int | None:
    """Mark the run of ``ns`` alive while the returned descriptor is open (a shared lock on its ``owner.lock``)."""
    try:
        fd = os.open(os.path.join(ns, LOCK_NAME), os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError:
        os.close(fd)
        return None
    return fd


def alive(ns: str) -> bool:
    """A live process (trainer or keeper, in any container sharing this memory) holds the run of ``ns``."""
    try:
        fd = os.open(os.path.join(ns, LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def foreign(root: str) -> list[dict[str, Any]]:
    """This user's namespaces of ``root``'s path that belong to another run than the directory's: each
    with its run, the steps its records name, and whether a live process holds it."""
    prefix, mine = _prefix(root), namespace(root)
    try:
        names = sorted(os.listdir(shm_root()))
    except OSError:
        return []
    out = []
    for name in names:
        path = os.path.join(shm_root(), name)
        run = name[len(prefix):]
        if (not name.startswith(prefix) or path == mine or len(run) != 32 or run.strip("0123456789abcdef")
                or namespace_problem(path) is not None):
            continue
        steps = set()
        for rec in _listed(path, records_only=True):
            try:
                with open(os.path.join(path, rec), "rb") as f:
                    steps.add(int(json.loads(f.read()).get("step")))
            except (OSError, ValueError, TypeError, AttributeError):
                pass
        out.append({"dir": path, "run": run, "steps": sorted(steps), "alive": alive(path)})
    return out


def _listed(ns: str, *, records_only: bool = False) -> list[str]:
    try:
        names = sorted(os.listdir(ns))
    except OSError:
        return []
    return [n for n in names if n.endswith(REC)] if records_only else names


def record_name(rank: int, slot: int) -> str:
    return f"r{rank}-s{slot}{REC}"


def values_name(rank: int, slot: int) -> str:
    return f"r{rank}-s{slot}{VAL}"


def sum_name(rank: int, slot: int) -> str:
    return f"r{rank}-s{slot}{SUM}"


def buffer_name(rank: int, slot: int) -> str:
    """A fresh name for a slot's buffer (a new token each time the slot is laid out again)."""
    return f"r{rank}-s{slot}-{uuid.uuid4().hex[:10]}{BUF}"


def parse_name(name: str) -> tuple[int, int] | None:
    """``(rank, slot)`` of a file of the namespace, ``None`` for any other name."""
    if not name.startswith("r") or "-s" not in name:
        return None
    rank, _sep, rest = name[1:].partition("-s")
    slot = rest.split("-", 1)[0].split(".", 1)[0]
    return (int(rank), int(slot)) if rank.isdigit() and slot.isdigit() else None


def namespace_problem(path: str) -> str | None:
    """Why the namespace directory ``path`` cannot be trusted (``None``: it can, or it does not exist).

    Anyone can create a directory in ``/dev/shm``: one of another user, a link,
    or one others may write into would let them plant a record.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != os.getuid():
        return f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    if st.st_mode & 0o077:
        return f"{path} has mode {oct(st.st_mode & 0o777)}: others may write or read it (0700 expected)"
    return None


def ensure_namespace(root: str) -> str:
    """The namespace of ``root``'s run (the run created when the directory holds none), created (mode 0700)
    when absent; raises :class:`OSError` when it cannot be made or what is there cannot be trusted."""
    run = run_id(root, create=True)
    if run is None:
        raise OSError(f"{os.path.join(root, RUN_FILE)} cannot be created or read")
    path = namespace(root, run)
    assert path is not None
    if not os.path.isdir(shm_root()):
        raise OSError(f"{shm_root()} is not a directory")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    problem = namespace_problem(path)
    if problem is not None:
        raise OSError(f"{problem}")
    return path


def write_record(ns: str, record: Record, cache: dict[str, Any] | None = None) -> None:
    """Make ``record`` the slot's: after every byte it describes is in place (tmp + rename). Its layout file
    (:mod:`~shardckpt.format.shm_record`) is written first when its constant part is not the one written
    last for this slot (``cache``, kept by the caller between saves of one slot), the slot's others removed."""
    cache = {} if cache is None else cache
    known = cache.get("layout")
    constant = record.constant()
    # (== at C speed: the constant part is made of this package's own str and int values, and its large
    # tables are mostly the very objects of the last save)
    if known is None or constant != known[0] or not os.path.exists(os.path.join(ns, known[1])):
        text, digest = record.layout_text()
        name = layout_name(record.rank, record.slot, digest)
        _replace(os.path.join(ns, name), text)
        remove(ns, [n for n in _listed(ns) if n.endswith(LAY) and n != name
                    and parse_name(n) == (record.rank, record.slot)])
        known = cache["layout"] = (constant, name, digest, json.loads(text))
    record.layout_file = known[1]
    _replace(os.path.join(ns, record_name(record.rank, record.slot)), record.to_json(known[2], known[3]))


def _replace(final: str, text: str) -> None:
    tmp = f"{final}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, final)


HASH_CHUNK = 8 << 20


def digest(parts: Any, stop: Any = None) -> str | None:
    """xxh3-128 over ``parts`` (buffers, in order), ``None`` when ``stop()`` turns true between chunks."""
    h = xxhash.xxh3_128()
    for part in parts:
        view = memoryview(part).cast("B")
        for i in range(0, len(view), HASH_CHUNK):
            if stop is not None and stop():
                return None
            h.update(view[i:i + HASH_CHUNK])  # releases the GIL
    return f"xxh3-128:{h.hexdigest()}"


def write_sum(ns: str, record: Record, value: str) -> None:
    """The checksum of ``record``'s copy, bound to its step and save (tmp + rename)."""
    final = os.path.join(ns, sum_name(record.rank, record.slot))
    fd = os.open(f"{final}.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"step": record.step, "save_id": record.save_id, "digest": value}, f)
    os.replace(f"{final}.tmp", final)


def read_sum(ns: str, record: Record) -> dict[str, Any] | None:
    """The checksum file of ``record``'s slot (``None``: none, e.g. killed before it was taken)."""
    try:
        with open(os.path.join(ns, sum_name(record.rank, record.slot)), "rb") as f:
            body = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return {"error": f"unreadable ({type(exc).__name__})"}
    return body if isinstance(body, dict) else {"error": "not a checksum"}


def drop_record(ns: str, rank: int, slot: int) -> None:
    """The slot holds no save from here on (before anything of it is overwritten)."""
    remove(ns, [record_name(rank, slot), sum_name(rank, slot)])


def read_records(root: str) -> tuple[list[Record], dict[str, str]]:
    """The usable records of ``root``'s namespace on this machine, and why each other record is not.

    Usable: written by this boot for this ``local_dir``, in a namespace this user
    owns alone, its buffer and values files present and at least as long as it says.
    """
    run = run_id(root)
    ns = namespace(root, run)
    if ns is None:
        return [], {}
    problem = namespace_problem(ns)
    if problem is not None:
        return [], {ns: problem}
    try:
        names = sorted(os.listdir(ns))
    except FileNotFoundError:
        return [], {}
    sizes = {}
    for name in names:
        try:
            st = os.lstat(os.path.join(ns, name))
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
            sizes[name] = st.st_size
    good: list[Record] = []
    bad: dict[str, str] = {}
    here, real = boot_id(), os.path.realpath(root)
    layouts: dict[str, bytes | str] = {}
    for name in names:
        if not name.endswith(REC) or name not in sizes:
            continue
        try:
            with open(os.path.join(ns, name), "rb") as f:
                body = parse(f.read())
            lay = layout_name(body["rank"], body["slot"], body["layout"])
            if lay not in layouts:
                layouts[lay] = _layout_bytes(ns, lay)
            if isinstance(layouts[lay], str):
                raise ValueError(layouts[lay])
            record = merge(body, layouts[lay], name)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - whatever a forged record holds: refused, never raised
            bad[name] = f"unreadable ({type(exc).__name__}: {exc})"
            continue
        if (record.rank, record.slot) != parse_name(name):
            bad[name] = "names another rank or slot than its file"
        elif record.boot_id != here:
            bad[name] = f"written before this machine restarted (boot {record.boot_id}, now {here})"
        elif os.path.realpath(record.local_dir) != real:
            bad[name] = f"belongs to {record.local_dir}, not {root}"
        elif record.run != run:
            bad[name] = f"belongs to run {record.run or '(none)'}, not this directory's run {run}"
        elif (sizes.get(record.buffer, -1) < record.buffer_size
              or sizes.get(record.values_file, -1) < record.values_size):
            bad[name] = "its buffer or values file is missing or shorter than it says"
        else:
            good.append(record)
    return good, bad


def _layout_bytes(ns: str, name: str) -> bytes | str:
    """The bytes of the layout file ``name``, or why it cannot be trusted (not a regular file of this user's
    alone, or missing)."""
    try:
        fd = os.open(os.path.join(ns, name), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        return f"its layout file {name} cannot be read ({exc.strerror or exc})"
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            return f"its layout file {name} is not a file of this user's alone (mode {oct(st.st_mode & 0o777)})"
        return f.read()


def remove(ns: str, names: list[str]) -> None:
    for name in names:
        try:
            os.unlink(os.path.join(ns, name))
        except FileNotFoundError:
            pass


def remove_if_empty(ns: str) -> None:
    """Remove the namespace when it holds no rank's file any more (its lock goes too: a holder keeps its own)."""
    if any(parse_name(n) is not None for n in _listed(ns)):
        return
    remove(ns, [LOCK_NAME])
    try:
        os.rmdir(ns)
    except OSError:
        pass


def purge(root: str, ns: str | None = None) -> int:
    """Remove the namespace ``ns`` (default: that of ``root``'s run) with everything in it; returns the bytes freed."""
    ns = ns or namespace(root)
    if ns is None or namespace_problem(ns) is not None:
        return 0
    freed = 0
    try:
        names = os.listdir(ns)
    except FileNotFoundError:
        return 0
    for name in names:
        try:
            freed += os.lstat(os.path.join(ns, name)).st_size
        except FileNotFoundError:
            pass
    remove(ns, names)
    try:
        os.rmdir(ns)
    except OSError:
        pass
    return freed


def held_bytes(root: str) -> int:
    ns = namespace(root)
    if ns is None:
        return 0
    try:
        return sum(os.lstat(os.path.join(ns, n)).st_size for n in os.listdir(ns))
    except OSError:
        return 0


def steps(root: str) -> dict[str, Any]:
    """What ``shardckpt ls`` / ``status`` show of the memory tier on this machine: per save held here, its
    step, the ranks whose copies are complete here and the saving world size (and its manifest's text)."""
    records, bad = read_records(root)
    saves: dict[str, dict[str, Any]] = {}
    for r in records:
        entry = saves.setdefault(r.version, {"step": r.step, "version": r.version, "world_size": r.world_size,
                                             "ranks": [], "bytes": 0, "created": r.created, "manifest": r.manifest})
        entry["ranks"].append(r.rank)
        entry["bytes"] += r.nbytes
        entry["created"] = max(entry["created"], r.created)
    for entry in saves.values():
        entry["ranks"].sort()
        entry["complete_here"] = entry["ranks"] == list(range(entry["world_size"]))
    return {"dir": namespace(root), "saves": sorted(saves.values(), key=lambda e: (e["step"], e["created"])),
            "held_bytes": held_bytes(root), "stale": bad}


def status(root: str) -> tuple[dict[str, Any], str | None]:
    """``shardckpt status``: the memory tier of ``root`` on this machine, and its line (None: it holds nothing)."""
    found = steps(root)
    body = {"dir": found["dir"], "held_bytes": found["held_bytes"], "stale": found["stale"],
            "saves": [{k: v for k, v in e.items() if k != "manifest"} for e in found["saves"]]}
    if not body["saves"] and not body["held_bytes"]:
        return body, None
    shown = ", ".join(f"{e['step']}"
                      + ("" if e["complete_here"] else f" (ranks {e['ranks']} of {e['world_size']} here)")
                      for e in body["saves"]) or "none complete"
    return body, f"  memory: steps {shown} in {body['dir']} ({fmt_bytes(body['held_bytes'])} held)"
