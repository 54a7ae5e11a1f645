import os
import sys

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
