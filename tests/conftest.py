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


# Test files that take minutes (multi-rank launches, soaks): on several workers they start first, so that
# none of them is left running alone at the end. The rest keep their collection order.
SLOW_FIRST = (
    "test_elastic.py", "test_remote_faults.py", "test_reliability.py", "test_hf.py", "test_peer.py",
    "test_remote.py", "test_deploy.py", "test_lightning.py", "test_gpt_example.py", "test_demo.py",
    "test_versions.py", "test_multinode.py", "test_resume.py", "test_lifecycle.py", "test_policies.py",
    "test_torchtitan.py", "test_roundtrip.py",
)


def xdist_group_of(item) -> str | None:
    """The pytest-xdist group that keeps ``item`` on the worker holding its module's fixtures.

    A module-scoped fixture is set up once per worker that runs a test taking it: the tests that take one
    stay together (one group per module), so a fixture that launches jobs runs once, as without workers.
    Tests that take only the shared ``s3`` server group per module and server kind (a server starts in a
    second); tests without module-scoped fixtures go wherever a worker is free.
    """
    module, s3_kind = False, None
    for name, defs in item._fixtureinfo.name2fixturedefs.items():
        if not defs or defs[-1].scope not in ("module", "package", "class"):
            continue
        if name == "s3" and defs[-1].func.__module__ == "s3server":
            s3_kind = item.callspec.params.get("s3") if hasattr(item, "callspec") else None
        else:
            module = True
    path = item.nodeid.split("::", 1)[0]
    if module:
        return path
    if s3_kind is not None:
        return f"{path}[{s3_kind}]"
    return None


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``-n``): group tests that share module fixtures, and start the slow files first."""
    if not getattr(config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        return
    for item in items:
        group = xdist_group_of(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
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
