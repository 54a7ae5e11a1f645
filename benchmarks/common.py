"""What every benchmark shares: results, medians and ratios, tables, memory, page cache, moto.

A benchmark script measures one state size and describes it as a *result*
(``--json PATH`` writes it; ``benchmarks/run.py`` merges them, one file per
case)::

    {"case": "durable", "size_bytes": 1073741824, "unit": "s", "better": "lower",
     "rows": [{"tool": "dd conv=fdatasync (floor)", "group": "", "floor": true,
               "values": [0.61, 0.58, 0.60], "extra": {"gb_per_s": 1.8}}, ...],
     "skipped": [{"tool": "dd oflag=direct (floor)", "group": "", "reason": "dd: ...: Invalid argument"}],
     "notes": ["..."]}

``summarize`` adds to every row the median of its values and the ratio of
that median to the median of the first floor row of the same group: the
baselines are always measured in the same run, on the same machine, since
absolute times on shared machines drift.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import json
import math
import mmap
import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30

# DCP in one process without a process group is what the single-process cases mean to do.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class Skip(Exception):
    """A tool that cannot run here (refused, not enough memory): recorded with its reason."""


# ---------------------------------------------------------------- results

def new_result(case: str, size_bytes: int, *, unit: str = "s", better: str = "lower",
               ratio_label: str = "floor", **info: Any) -> dict[str, Any]:
    """An empty result for one case at one state size. ``info`` is kept as is (repeats, world size, ...)."""
    return {"case": case, "size_bytes": int(size_bytes), "unit": unit, "better": better,
            "ratio_label": ratio_label, "info": info, "rows": [], "skipped": [], "notes": []}


def add_row(result: dict, tool: str, values: Iterable[float], *, group: str = "", floor: bool = False,
            **extra: Any) -> dict[str, Any]:
    row = {"tool": tool, "group": group, "floor": floor, "values": [float(v) for v in values], "extra": extra}
    result["rows"].append(row)
    return row


def add_skip(result: dict, tool: str, reason: str, *, group: str = "") -> None:
    result["skipped"].append({"tool": tool, "group": group, "reason": reason})
    print(f"skipped {tool}{f' ({group})' if group else ''}: {reason}", flush=True)


def error_text(exc: BaseException) -> str:
    """``Type: message`` on one line (the exact error a skipped tool reports)."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ").strip()
    return text if len(text) <= 600 else text[:597] + "..."


class Measured(NamedTuple):
    """What a tool measured itself (e.g. until an object appeared), with extra columns."""

    value: float
    extra: dict[str, float] = {}


@dataclasses.dataclass
class Tool:
    """One contender of a single-process comparison.

    ``run`` is what is timed; where the wall time of the call is not the
    measure it returns a :class:`Measured`. ``before`` / ``after`` run
    untimed around every call (cleanup, eviction from the page cache, a
    check of what was restored).
    """

    label: str
    run: Callable[[], Any]
    before: Callable[[], Any] | None = None
    after: Callable[[], Any] | None = None
    floor: bool = False


def before_each(tool: Tool, fn: Callable[[], Any]) -> Tool:
    """The tool with ``fn`` run (untimed) before every call, ahead of its own ``before``."""
    def before() -> None:
        fn()
        if tool.before is not None:
            tool.before()

    return dataclasses.replace(tool, before=before)


def _call(tool: Tool) -> tuple[float, dict]:
    if tool.before is not None:
        tool.before()
    t0 = time.perf_counter()
    got = tool.run()
    took = time.perf_counter() - t0
    if tool.after is not None:
        tool.after()
    return (float(got.value), got.extra) if isinstance(got, Measured) else (took, {})


def compare(result: dict, tools: list[Tool], repeats: int, *, group: str = "") -> list[dict]:
    """Time every tool ``repeats`` times, round-robin with the order rotating each round.

    One warm-up call per tool first (not counted): it also finds the tools
    that cannot run here, which are recorded as skipped with their error.
    A tool failing later is dropped the same way. Returns the rows added.
    """
    alive: list[Tool] = []
    for tool in tools:
        try:
            _call(tool)
            alive.append(tool)
        except Skip as exc:
            add_skip(result, tool.label, str(exc), group=group)
        except Exception as exc:  # one broken baseline must not cost the others
            add_skip(result, tool.label, error_text(exc), group=group)
    values: dict[str, list[float]] = {t.label: [] for t in alive}
    extras: dict[str, dict[str, list[float]]] = {t.label: {} for t in alive}
    for r in range(repeats):
        k = r % len(alive) if alive else 0
        for tool in alive[k:] + alive[:k]:
            if tool.label not in values:
                continue
            try:
                value, extra = _call(tool)
            except Exception as exc:
                add_skip(result, tool.label, f"failed in round {r + 1}: {error_text(exc)}", group=group)
                del values[tool.label]
                continue
            values[tool.label].append(value)
            for key, v in extra.items():
                extras[tool.label].setdefault(key, []).append(v)
        print(f"  round {r + 1}/{repeats}{f' ({group})' if group else ''}: "
              + ", ".join(f"{label} {v[-1]:.3f}" for label, v in values.items() if v), flush=True)
    rows = []
    for tool in alive:
        if tool.label in values:
            extra = {k: statistics.median(v) for k, v in extras[tool.label].items()}
            rows.append(add_row(result, tool.label, values[tool.label], group=group, floor=tool.floor, **extra))
    return rows


def add_rate(rows: list[dict], nbytes: int) -> None:
    """GB/s of each row's median (rows whose unit is seconds for ``nbytes``)."""
    for row in rows:
        median = statistics.median(row["values"])
        row["extra"]["gb_per_s"] = nbytes / 1e9 / median if median > 0 else None


def summarize(result: dict) -> dict:
    """Add ``median``, ``min`` and ``ratio`` (to the first floor row of the group) to every row."""
    reference: dict[str, float] = {}
    for row in result["rows"]:
        row["median"] = statistics.median(row["values"]) if row["values"] else math.nan
        row["min"] = min(row["values"]) if row["values"] else math.nan
        if row["floor"] and row["group"] not in reference:
            reference[row["group"]] = row["median"]
    for row in result["rows"]:
        ref = reference.get(row["group"])
        row["ratio"] = row["median"] / ref if ref else None
    return result


def merge(results: list[dict]) -> dict:
    """One result from the results of separate processes measuring the same case and size."""
    out = dict(results[0])
    out["rows"] = [r for res in results for r in res["rows"]]
    out["skipped"] = [s for res in results for s in res["skipped"]]
    out["notes"] = list(dict.fromkeys(n for res in results for n in res["notes"]))
    return summarize(out)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


def emit(result: dict, json_path: str | None) -> None:
    """Print the result's table and write it where ``--json`` said."""
    summarize(result)
    print("\n" + "\n".join(table([result])) + "\n", flush=True)
    if json_path:
        write_json(json_path, result)


# ----------------------------------------------------------------- tables

COLUMNS = {
    "gb_per_s": "GB/s",
    "first_s": "first (s)",
    "returned_s": "call returned (s)",
    "local_commit_s": "local commit (s)",
    "s_per_gib": "s / GiB",
    "cpu_s_per_gib": "CPU s / GiB",
    "fits_30s_gib": "fits a 30 s notice (GiB)",
    "fits_120s_gib": "fits a 120 s notice (GiB)",
    "peak_rss_rank_bytes": "RSS peak / rank",
    "rss_growth_rank_bytes": "RSS growth / rank",
    "rss_growth_x_staged": "RSS growth / staged bytes",
    "rss_growth_x_kept": "RSS growth / ((memory_keep + 1) x staged)",
    "step_s": "median step (s)",
    "host_peak_bytes": "host RAM peak (all processes)",
    "resident_after_evict": "cached after eviction",
    "paired_ratio": "paired ratio",
}


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit in ("B", "KiB") else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def fmt_size(n: int) -> str:
    return f"{n / GIB:.4g} GiB" if n >= GIB else f"{n / MIB:.4g} MiB"


def fmt_number(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if v == 0 or abs(v) >= 100:
        return f"{v:.0f}"
    return f"{v:.3g}" if abs(v) < 1 else f"{v:.3f}" if abs(v) < 10 else f"{v:.2f}"


def fmt_extra(key: str, v: Any) -> str:
    if key.endswith("_bytes") and isinstance(v, (int, float)):
        return fmt_bytes(v)
    if key == "resident_after_evict" and isinstance(v, float):
        return f"{100 * v:.0f} %"
    return fmt_number(v)


def table(results: list[dict]) -> list[str]:
    """One markdown table for the results of one case (one block of rows per size)."""
    results = [summarize(r) for r in results]
    grouped = any(row["group"] for r in results for row in r["rows"])
    extras: list[str] = []
    for r in results:
        for row in r["rows"]:
            extras += [k for k in row["extra"] if k not in extras]
    unit = results[0]["unit"] if results else "s"
    label = results[0].get("ratio_label", "floor") if results else "floor"
    groups = {row["group"] for r in results for row in r["rows"]} - {""}
    head = ["state", *([("cache" if groups <= {"warm", "cold"} else "on")] if grouped else []), "tool",
            f"median ({unit})", f"min ({unit})", f"× {label}",
            *(COLUMNS.get(k, k) for k in extras)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        for row in r["rows"]:
            ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "–"
            name = f"**{row['tool']}**" if row["tool"].startswith("shardckpt") else row["tool"]
            cells = [fmt_size(r["size_bytes"]), *([row["group"]] if grouped else []), name,
                     fmt_number(row["median"]), fmt_number(row["min"]), ratio,
                     *(fmt_extra(k, row["extra"].get(k)) for k in extras)]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


# --------------------------------------------------------- memory and time

def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * KIB
    return 0


def require_memory(nbytes: float, what: str, margin: int = GIB) -> None:
    """Raise :class:`Skip` unless ``nbytes`` (plus a margin) are available now."""
    have = mem_available()
    if have < nbytes + margin:
        raise Skip(f"{what} needs about {fmt_bytes(nbytes)} more host memory (+{fmt_bytes(margin)} margin); "
                   f"{fmt_bytes(have)} available")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """High-water mark of this process's RSS (``VmHWM``; ``ru_maxrss`` where /proc lacks it)."""
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * KIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB


def reset_peak_rss() -> bool:
    """Restart the high-water mark from the current RSS (Linux >= 4.0: ``5 > /proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# -------------------------------------------------------------- page cache

def files_under(path: str | os.PathLike) -> list[str]:
    return sorted(str(p) for p in Path(path).rglob("*") if p.is_file())


def read_files(paths: Iterable[str], chunk: int = 16 * MIB) -> int:
    """Read every file through one reused buffer (``cat files > /dev/null``); returns the bytes read."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_fraction(paths: Iterable[str]) -> float:
    """Fraction of the files' pages in the page cache (``mincore``, as ``fincore`` shows it)."""
    page = os.sysconf("SC_PAGE_SIZE")
    resident = total = 0
    for path in paths:
        size = os.path.getsize(path)
        if size == 0:
            continue
        pages = (size + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), "mmap failed", path)
            try:
                if _libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), "mincore failed", path)
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
        import numpy as np

        resident += int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())
        total += pages
    return resident / total if total else 0.0


def evict(paths: list[str]) -> str:
    """Evict the files from the page cache; returns how (the method that left them uncached).

    First ``os.sync()`` then ``posix_fadvise(DONTNEED)`` on every file (touches
    nothing else on the machine); where pages stay cached and this runs as
    root, ``echo 1 > /proc/sys/vm/drop_caches`` (the whole page cache).
    Raises :class:`Skip` when neither works.
    """
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    left = resident_fraction(paths)
    if left <= 0.02:
        return "posix_fadvise(DONTNEED)"
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError as exc:
        raise Skip(f"posix_fadvise left {100 * left:.0f} % of the files cached and drop_caches failed: "
                   f"{error_text(exc)}") from exc
    left = resident_fraction(paths)
    if left > 0.02:
        raise Skip(f"{100 * left:.0f} % of the files stay cached after posix_fadvise and drop_caches")
    return "drop_caches"


def dd_write(path: str, nbytes: int, *, direct: bool = False, block: int = 16 * MIB) -> float:
    """``dd if=/dev/zero of=path bs=16M count=N conv=fdatasync [oflag=direct]``: seconds, or Skip with dd's error."""
    cmd = ["dd", "if=/dev/zero", f"of={path}", f"bs={block}", f"count={-(-nbytes // block)}", "conv=fdatasync",
           "status=none"] + (["oflag=direct"] if direct else [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        shown = " ".join(c for c in cmd if c != "status=none")
        raise Skip(f"`{shown}` refused: {proc.stderr.strip()}")
    return took


# ------------------------------------------------------------ scratch space

@contextlib.contextmanager
def scratch(prefix: str, base: str | None = None) -> Iterator[Path]:
    """A temporary directory (under ``base``, default the system's), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix=f"shardckpt-bench-{prefix}-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def fresh_dir(path: str | os.PathLike) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    Path(path).mkdir(parents=True)
    return Path(path)


# ------------------------------------------------------------------ states

def sized_args(doc: str | None, repeats_help: str, switches: dict[str, str] | None = None,
               values: dict[str, str] | None = None) -> argparse.Namespace:
    """The options of a single-process case measuring one state size (``switches``: flag -> help, on/off;
    ``values``: option -> help, a string, default None)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, text in (switches or {}).items():
        parser.add_argument(flag, action="store_true", help=text)
    for flag, text in (values or {}).items():
        parser.add_argument(flag, default=None, help=text)
    parser.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1.0)")
    parser.add_argument("--repeats", type=int, default=3, help=repeats_help)
    parser.add_argument("--dir", default=None, help="where the scratch directory goes (default: the system's temp)")
    parser.add_argument("--json", help="write the result here")
    return parser.parse_args()



def make_model(nbytes: int, *, chunk: int = 64 * MIB, fill: bool = True):
    """A module holding ``nbytes`` of fp32 parameters in tensors of at most ``chunk`` bytes."""
    import torch

    left, sizes = nbytes // 4, []
    while left > 0:
        sizes.append(min(left, chunk // 4))
        left -= sizes[-1]
    gen = torch.Generator().manual_seed(0)
    params = []
    for n in sizes:
        t = torch.empty(n)
        if fill:
            t.uniform_(-1, 1, generator=gen)
        params.append(torch.nn.Parameter(t))
    return torch.nn.ParameterList(params)


def nbytes_of(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def sized_state(gib: float) -> tuple[Any, dict[str, Any], int]:
    """``(model, {"model": model}, bytes)``: the state the single-process cases save and restore."""
    model = make_model(int(gib * GIB))
    return model, {"model": model}, nbytes_of(model)


def saved_step(src: Path, state: dict[str, Any], io_threads: int) -> tuple[Path, list[str], int]:
    """Save ``state`` as step 1 in ``src`` (synchronously): ``(step directory, its file names, their bytes)``,
    what the upload cases send with shardckpt and with their baselines."""
    import shardckpt

    ckpt = shardckpt.Checkpointer(local_dir=str(src), mode="sync", io_threads=io_threads, keep_last=None,
                                  preemption_signals=())
    ckpt.save(state, 1)
    ckpt.close()
    (step_dir,) = src.glob("step_*")
    names = sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file())
    return step_dir, names, sum((step_dir / n).stat().st_size for n in names)


def fingerprint(module_or_tensors) -> list[float]:
    """Cheap content check of a module's parameters, or of tensors (one float64 sum each)."""
    import torch

    tensors = module_or_tensors.parameters() if hasattr(module_or_tensors, "parameters") else module_or_tensors
    with torch.no_grad():
        return [float(p.sum(dtype=torch.float64)) for p in tensors]


class RestoreCheck:
    """Proves each loader restores the saved values: before its first call the
    parameters are zeroed, after it they must match the fingerprint taken at save time.

    ``tensors`` (a callable returning the live tensors) checks other state than
    a module's parameters: it is called afresh each time, so a loader that
    replaces a tensor instead of filling it is checked on what it put there.
    """

    def __init__(self, module, tensors: Callable[[], Iterable[Any]] | None = None) -> None:
        self.tensors = tensors if tensors is not None else module.parameters
        self.expected = fingerprint(list(self.tensors()))
        self.checked: set[str] = set()

    def wrap(self, tool: Tool) -> Tool:
        import torch

        def before() -> None:
            if tool.label not in self.checked:
                with torch.no_grad():
                    for p in self.tensors():
                        p.zero_()
            if tool.before is not None:
                tool.before()

        def after() -> None:
            if tool.after is not None:
                tool.after()
            if tool.label not in self.checked:
                if fingerprint(list(self.tensors())) != self.expected:
                    raise RuntimeError(f"{tool.label} restored different values")
                self.checked.add(tool.label)

        return dataclasses.replace(tool, before=before, after=after)


def slowest(seconds: float) -> float:
    """The largest of every rank's value (the rank the training loop waits for)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


# -------------------------------------------------------------- provenance

def _run(cmd: list[str], cwd: str | os.PathLike | None = None) -> str:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def hardware(path: str | os.PathLike = ".") -> dict[str, Any]:
    """CPU, cores, RAM, the disk under ``path`` (``df``), kernel, torch and the load when asked."""
    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    total = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * KIB
    df = _run(["df", "-hT", str(path)]).splitlines()
    source = df[-1].split()[0] if len(df) > 1 else ""
    device = ""
    if (source.startswith("/dev/")
            and len(fields := _run(["lsblk", "-ndo", "NAME,ROTA,SIZE,MODEL", source]).split()) >= 3):
        model = " ".join(fields[3:])
        device = (f"{fields[0]}, {fields[2]}{', ' + model if model else ''}, "
                  f"{'rotational' if fields[1] == '1' else 'non-rotational'} as the kernel reports it")
    try:
        import torch

        torch_version = torch.__version__
        threads = torch.get_num_threads()
    except ImportError:
        torch_version, threads = "", 0
    return {
        "cpu": cpu or platform.processor(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "ram_bytes": total,
        "ram": fmt_bytes(total),
        "disk": _describe_df(df[-1]) if len(df) > 1 else "",
        "disk_df": "\n".join(df),
        "disk_device": device,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch_version,
        "torch_threads": threads,
        "gpu": _run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]) or None,
        "hostname": socket.gethostname(),
        "loadavg": os.getloadavg(),
    }


def _describe_df(line: str) -> str:
    fields = line.split()  # Filesystem Type Size Used Avail Use% Mounted-on
    if len(fields) < 7:
        return line
    return f"{fields[0]} ({fields[1]}, {fields[2]}, {fields[4]} free) mounted on {' '.join(fields[6:])}"


def git_info() -> dict[str, Any]:
    commit = _run(["git", "rev-parse", "HEAD"], cwd=ROOT)
    dirty = bool(_run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT))
    return {"commit": commit, "dirty": dirty, "branch": _run(["git", "rev-parse", "--abbrev-ref", "HEAD"], cwd=ROOT)}


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------------- S3

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "bench-key-id",
    "AWS_SECRET_ACCESS_KEY": "bench-secret-key",
    "AWS_DEFAULT_REGION": "us-east-1",
}
PART = 32 * MIB
CONCURRENCY = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server(bucket: str) -> Iterator[str]:
    """moto's S3 server in its own process on 127.0.0.1 (a free port), ``bucket`` created.

    Yields the endpoint URL; credentials and ``AWS_ENDPOINT_URL`` are set in
    ``os.environ`` meanwhile (child processes, the uploader included, see
    them). moto keeps objects in memory: keep states small (<= 512 MiB).
    """
    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    cmd = [str(exe), "-H", "127.0.0.1", "-p", str(port)] if exe.exists() else \
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    previous = {k: os.environ.get(k) for k in [*CREDENTIALS, "AWS_ENDPOINT_URL"]}
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start: {' '.join(cmd)} (exit {server.poll()})")
                time.sleep(0.1)
        os.environ.update(CREDENTIALS)
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        s3_client(endpoint).create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def s3_client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
                        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])


def transfer_config(part: int = PART, concurrency: int = CONCURRENCY):
    """The tuned boto3 transfer: ``part``-sized multipart parts, ``concurrency`` in flight."""
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=2 * part, multipart_chunksize=part, max_concurrency=concurrency,
                          use_threads=True)
