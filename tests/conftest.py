import os
import sys
import time

import pytest

# Test programs and helpers import from here and from src/ without installation.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "src"))

# The module-scoped ``s3`` fixture (moto's and rclone's S3 servers) for every test module that takes it.
pytest_plugins = ["s3server"]


def pytest_terminal_summary(terminalreporter):
    """Say loudly which guarantees were not checked here (a skip alone is easy to miss)."""
    from helpers import UNCHECKED

    if UNCHECKED:
        terminalreporter.section("guarantees NOT checked on this machine", sep="!", yellow=True, bold=True)
        for line in UNCHECKED:
            terminalreporter.write_line(line, yellow=True)
        terminalreporter.write_line("run as root (set SHARDCKPT_TEST_REQUIRE_MOUNT=1 to make these fail instead)")


# Under pytest-xdist (scripts/test.sh: ``-n 3 --dist loadfile --no-loadscope-reorder``) each test file runs on
# one worker, so a module-scoped fixture (a launch that several tests read) still runs once. The files that
# take longest start first, so that none is left running alone at the end: xdist hands each worker one
# file, then a second, then one more whenever it finishes one. Ordered by the files' total ``--durations=0``
# on three workers, slowest first, except that the first six are dealt so each worker's first two add up
# about evenly.
SLOW_FIRST = (
    "test_remote_faults.py", "test_check_resume_causes.py", "test_remote.py",
    "test_elastic.py", "test_hf.py", "test_deploy.py",
    "test_check_resume.py", "test_reliability.py", "test_memory_trust.py", "test_peer_restore.py",
    "test_peer_daemon.py", "test_peer_endpoint.py",
    "test_peer_flood.py", "test_demo.py", "test_multinode.py", "test_versions.py", "test_lightning.py",
    "test_gpt_example.py", "test_docs.py", "test_memory.py", "test_resume.py", "test_history.py", "test_cli.py",
    "test_export.py",
    "test_policies.py", "test_repairs.py", "test_local.py", "test_torchtitan.py", "test_roundtrip.py",
    "test_store_contract.py", "test_remote_index.py", "test_values.py", "test_lifecycle.py", "test_save_plan.py",
    "test_mixed_commit.py", "test_auto_decision.py", "test_diff.py",
)


JOBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs")
"""Tests that launch processes or start servers live here; tests/unit/ holds the fast ones (no process)."""


def pytest_collection_modifyitems(config, items):
    """The marker by folder: every test under tests/jobs/ is ``slow`` (``-m "not slow"`` runs tests/unit/
    alone). Under pytest-xdist (``-n``): the slow files first, the tests of each in their own order."""
    for item in items:
        if str(item.path).startswith(JOBS + os.sep):
            item.add_marker(pytest.mark.slow)
    if not getattr(config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        return
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    order = {id(item): (rank.get(item.path.name, len(rank)), i) for i, item in enumerate(items)}
    items.sort(key=lambda item: order[id(item)])


def _peer_daemons(base: str) -> list[tuple[int, str]]:
    """(pid, local_dir) of the peer daemons running on a ``local_dir`` under ``base``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(a.endswith(":peer_main") for a in argv) and "--local" in argv:
            local = argv[argv.index("--local") + 1] if argv.index("--local") + 1 < len(argv) else ""
            if os.path.abspath(local).startswith(base + os.sep):
                found.append((int(pid), local))
    return found


@pytest.fixture(scope="session", autouse=True)
def no_daemon_left_behind(tmp_path_factory):
    """The suite leaves no peer daemon running: a daemon learns that its job is over (its trainers gone,
    nothing to deliver, a relaunch without the tier) and exits after its linger, short under test
    (SHARDCKPT_PEER_LINGER_S). One still running at the end of the run fails it, and is ended."""
    os.environ["SHARDCKPT_PEER_LINGER_S"] = "3"
    base = str(tmp_path_factory.getbasetemp().resolve())
    yield
    deadline = time.monotonic() + 30
    while _peer_daemons(base) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _peer_daemons(base)
    for pid, _local in left:
        try:
            os.kill(pid, 15)
        except OSError:
            pass
    if left:
        pytest.fail(f"peer daemon(s) still running after the test run, their job long over: {left}", pytrace=False)
