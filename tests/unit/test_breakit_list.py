"""The break list (``scripts/breakit.toml``) stays true to the code: every snippet it breaks is found, once, in
its file, and every test it names exists. A module moved or a check rewritten without its entry updated fails
here, in a second, instead of turning into an ERROR the next time the list is run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_break_of_the_list_is_found_in_the_code_and_its_tests_exist():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "breakit.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 problem(s)" in proc.stdout, proc.stdout[-2000:]
