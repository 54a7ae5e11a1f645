"""The code keeps the project's lint: ruff (pycodestyle, pyflakes, import order; lines of at most 120
characters), with the settings in ``pyproject.toml``, over the package, the tests, the benchmarks, the
examples, the scripts and the docs' code."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATHS = ["src", "tests", "benchmarks", "examples", "scripts", "docs"]


def _ruff() -> list[str]:
    beside = Path(sys.executable).with_name("ruff")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: scripts/setup.sh installs it (the test extra)")
    return [found]


def test_ruff_finds_nothing():
    proc = subprocess.run([*_ruff(), "check", "--no-cache", "--output-format", "concise", *PATHS], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
