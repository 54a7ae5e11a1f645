#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite.
# Three pytest-xdist workers on two cores: multi-rank tests spend much of their time waiting (process
# start-ups, polls, lingers), which one worker leaves a core idle for. Each test file runs on one worker, so a
# module-scoped fixture that launches jobs still runs once; the slowest files start first (tests/conftest.py).
# Arguments go to pytest after these: `-n 0` runs the tests one after the other.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The package, the tests and the programs they start, byte-compiled once (0.4 s): where
# PYTHONDONTWRITEBYTECODE is set, as on the machines this runs on, Python writes no .pyc of its own, and
# each of the suite's ~400 Python processes would compile what it imports of them again (0.2-0.4 s of CPU
# each). Python checks a .pyc against its source, so a stale one is never used.
.venv/bin/python -m compileall -q -j 0 src tests examples benchmarks >/dev/null
exec .venv/bin/python -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder "$@"
