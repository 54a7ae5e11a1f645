"""Helpers for multi-process tests: real torchrun launches on CPU with gloo."""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import launcher

from shardckpt._proc import descendants, kill_tree  # noqa: F401 - descendants: for the tests and benchmarks

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = Path(__file__).resolve().parent / "programs"


# Ports for the servers and launchers the tests start: a block of PORT_BLOCK per pytest-xdist worker
# (gw0, gw1, ...; a run without workers uses block 0) below the kernel's ephemeral range (32768+), so two
# workers never hand out the same port and no connection's ephemeral port takes one between the pick and
# its use. The walk starts at a random offset, so two runs side by side rarely meet either.
PORT_BASE, PORT_BLOCK = 20000, 1500
_port_next: list[int] = []


def worker_index() -> int:
    """This pytest-xdist worker's number (0 without workers)."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0


def free_port() -> int:
    """A port on 127.0.0.1 that nothing is bound to, from this worker's own block."""
    first = PORT_BASE + (worker_index() % 8) * PORT_BLOCK
    if not _port_next:
        _port_next.append(first + int.from_bytes(os.urandom(2), "big") % PORT_BLOCK)
    for _ in range(PORT_BLOCK):
        port = _port_next[0]
        _port_next[0] = first + (port + 1 - first) % PORT_BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {first}..{first + PORT_BLOCK - 1}")


def torchrun_cmd(nproc: int, script: str | Path, *args: str, nnodes: int = 1, node_rank: int = 0,
                 port: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes == 1 and port is None:
        cmd += ["--standalone"]
    else:
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=static",
                "--master-addr=127.0.0.1", f"--master-port={port}"]
    cmd += ["--max-restarts=0", "--monitor-interval=0.2", str(script), *map(str, args)]
    return cmd


def skip_module_unless_installed(*modules: str, reason: str = "") -> None:
    """Skip the calling test module unless every one of ``modules`` is installed.

    Found, not imported (``pytest.importorskip`` imports it): every pytest-xdist worker collects every
    module, and importing a framework the tests only run in their subprocesses costs each worker
    seconds of CPU for nothing (lightning: about 3 s).
    """
    import pytest

    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:  # a parent package is missing
            found = False
        if not found:
            missing.append(name)
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed{': ' + reason if reason else ''}", allow_module_level=True)


def import_program(name: str):
    """The module ``tests/programs/<name>.py`` imported in this process, with the programs' own ``common``.

    ``benchmarks/`` has a ``common`` module too, and a pytest-xdist worker that ran the benchmark harness's tests
    already holds that one under the name: a plain ``import`` would hand the program the wrong module.
    """
    def load(module: str, path: Path):
        spec = importlib.util.spec_from_file_location(module, path)
        found = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(found)
        return found

    other = sys.modules.get("common")
    sys.modules["common"] = load("common", PROGRAMS / "common.py")
    try:
        return load(f"programs_{name}", PROGRAMS / f"{name}.py")
    finally:
        if other is None:
            del sys.modules["common"]
        else:
            sys.modules["common"] = other


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_torchrun(nproc: int, script: str | Path, *args: str, timeout: float = 300, env: dict | None = None,
                 check: bool = True, **kw) -> subprocess.CompletedProcess:
    """Run a program under torchrun; raise with its output when it fails (``check=False``: return it, for a
    job whose ranks may fail or be killed)."""
    proc = launcher.run(
        torchrun_cmd(nproc, script, *args, **kw),
        env=env or child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        cwd=str(ROOT),
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun {script} {args} failed with {proc.returncode}:\n{proc.stdout[-6000:]}")
    return proc


def start_torchrun(nproc: int, script: str | Path, *args: str, env: dict | None = None, log_path=None, **kw):
    """Start torchrun in its own process group (so the whole job can be SIGKILLed)."""
    out = open(log_path, "w") if log_path else subprocess.DEVNULL
    return launcher.popen(
        torchrun_cmd(nproc, script, *args, **kw),
        env=env or child_env(),
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=str(ROOT),
        start_new_session=True,
    )


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL a job started by start_torchrun: the launcher and every worker at once; returns once every one
    of them is gone (tests check right after that no trainer is alive)."""
    kill_tree(proc)


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, log_path=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            log = Path(log_path).read_text()[-4000:] if log_path else ""
            raise AssertionError(f"job exited ({proc.returncode}) before {what}:\n{log}")
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def run_two_nodes(nproc: int, script: str | Path, *args: str, timeout: float = 300, env: dict | None = None,
                  log_dir: Path | None = None) -> list[str]:
    """Run ``script`` as a 2-node job: two torchrun launchers (node ranks 0 and 1) on this machine.

    Each launcher sees its own ``GROUP_RANK``, as on two machines. Raises with
    both logs when either fails; returns their outputs.
    """
    return run_nodes(2, nproc, script, *args, timeout=timeout, env=env, log_dir=log_dir)


def run_nodes(nnodes: int, nproc: int, script: str | Path, *args: str, timeout: float = 300, env: dict | None = None,
              log_dir: Path | None = None, check: bool = True) -> list[str]:
    """Run ``script`` as an ``nnodes``-node job (one torchrun launcher per node rank); ``check=False``
    returns the outputs of a job whose ranks may fail (or kill themselves) without raising."""
    port = free_port()
    procs, logs = [], []
    for node in range(nnodes):
        log_path = (log_dir or Path("/tmp")) / f"node{node}-{port}.log"
        logs.append(log_path)
        procs.append(start_torchrun(nproc, script, *args, nnodes=nnodes, node_rank=node, port=port, env=env,
                                    log_path=log_path))
    try:
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_job(proc)
    outputs = [Path(p).read_text() for p in logs]
    if check and any(proc.returncode != 0 for proc in procs):
        # The node whose rank raised first, with its ranks' tracebacks: a report cut for length keeps them.
        order = sorted(range(nnodes), key=lambda i: (procs[i].returncode == 0, "[rank" not in outputs[i], i))
        raise AssertionError(
            f"{nnodes}-node job {script} {args} failed ({[p.returncode for p in procs]}):\n"
            + "\n".join(f"--- node {i}:\n{_failure_excerpt(outputs[i])}" for i in order)
        )
    return outputs


_LAUNCHER_EXIT = re.compile(
    r"torch/distributed/elastic/agent/server/api\.py:\d+\]|TCPStore\.cpp:\d+\]|^Exception raised from recvBytes |"
    r"^frame #\d+: |^<omitting python frames>$"
)


def job_output(log: str) -> str:
    """A launcher's log without the report torchrun's agent may print when the node hosting the rendezvous
    store leaves first at the end of a finished job ("Error waiting on exit barrier", with the store's
    C++ trace): the launcher's, never the job's (a rank that fails makes the launcher exit non-zero)."""
    return "\n".join(line for line in log.splitlines() if not _LAUNCHER_EXIT.search(line))


def _failure_excerpt(out: str, limit: int = 5000) -> str:
    """The ranks' traceback lines (torchrun prefixes them with ``[rankN]:``) first, then the log's end."""
    raised = [line for line in out.splitlines() if line.startswith("[rank")][:80]
    head = "\n".join(raised)[:limit // 2]
    return (head + "\n... the log's end:\n" if head else "") + out[-(limit - len(head)):]


UNCHECKED: list[str] = []
"""Guarantees a test could not check on this machine (printed in the run's summary by conftest.py)."""


class UncheckedGuarantee(UserWarning):
    """A test that checks a guarantee skipped: this machine lacks what it needs."""


def mount_tmpfs(mount: Path, options: str, why: str) -> None:
    """Mount a tmpfs at ``mount`` or skip loudly: a warning, a line in the run's summary, and with
    ``SHARDCKPT_TEST_REQUIRE_MOUNT=1`` (CI as root) a failure instead of a skip."""
    import warnings

    import pytest

    if os.geteuid() == 0 and os.system(f"mount -t tmpfs -o {options} tmpfs {mount} 2>/dev/null") == 0:
        return
    reason = f"{why} is NOT checked: it needs root to mount a tmpfs ({options}) and this process cannot"
    if os.environ.get("SHARDCKPT_TEST_REQUIRE_MOUNT") == "1":
        pytest.fail(reason + " (SHARDCKPT_TEST_REQUIRE_MOUNT=1)")
    UNCHECKED.append(reason)
    warnings.warn(UncheckedGuarantee(reason), stacklevel=2)
    pytest.skip(reason)


def flip_byte_in_tensor(path: str, info, mask: int = 0x01) -> None:
    """Flip one byte in the middle of the raw data of the stored tensor that ``info`` (a DCP
    storage record of ``path``) holds: a bit rot that leaves the record's structure intact."""
    from shardckpt.dcp.record_layout import stored_tensor

    with open(path, "r+b") as f:
        where = stored_tensor(f, info.offset, info.length)
        assert where is not None, f"no stored tensor at {path}:{info.offset}"
        f.seek(where.data_offset + where.nbytes // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ mask]))


def assert_plans_checked(out) -> int:
    """The save plans of a program run with ``tests/programs/plan_check.py`` installed (the integrations'
    programs) captured what DCP captures at every save they answered; returns how many were compared."""
    if str(PROGRAMS) not in sys.path:
        sys.path.insert(0, str(PROGRAMS))
    from plan_check import assert_checked

    return assert_checked(out)
