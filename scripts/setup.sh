#!/usr/bin/env bash
# Create .venv with torch 2.13.0 (CPU wheel) and shardckpt installed editable.
# Idempotent: a second run only checks that everything is in place.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${SHARDCKPT_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.shardckpt-setup"
WANT="$(cat pyproject.toml deploy/constraints.txt | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first and pinned: letting pip choose pulls a multi-GB CUDA build.
# --no-compile: pip byte-compiles file by file on one core; compileall below does it on every core (116 s of
# setup became 88 s here). The suite needs the .pyc files: its ~500 Python processes would compile torch again.
"$VENV/bin/python" -m pip install -q --no-compile "torch==2.13.0"
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# Byte-compiling, in the background while pip installs the extras (pip leaves a core idle): transformers' 560
# model packages but the GPT-2 the tests train (and the auto classes) are left out. A file pip is still writing
# gets a .pyc that no import uses (Python checks a .pyc against its source); the pass at the end compiles it.
SKIP='/transformers/models/(?!gpt2/|auto/|__init__[.]py)'
compile_site() { "$VENV/bin/python" -m compileall -q -j 0 -x "$SKIP" "$SITE" >/dev/null 2>&1 || true; }
compile_site &
COMPILING=$!
trap 'wait 2>/dev/null || true' EXIT  # a failed install leaves no compiler running behind it
# test: the suite's servers and tools; docs: MkDocs, which tests/jobs/test_docs.py runs; hf and lightning:
# the frameworks of tests/jobs/test_hf.py and tests/jobs/test_lightning.py (torch stays pinned by the constraints)
"$VENV/bin/python" -m pip install -q --no-compile -c deploy/constraints.txt -e ".[test,docs,hf,lightning]"
# torchtitan goes in without pip's resolver (below): out of the way of the check, reinstalled after it.
"$VENV/bin/python" -m pip uninstall -q -y torchtitan >/dev/null 2>&1 || true
"$VENV/bin/python" -m pip check
# The "torchtitan" extra, for tests/jobs/test_torchtitan.py.
# torchtitan 0.3.0 declares datasets<4.8, which needs fsspec<=2026.2 while s3fs 2026.9 needs fsspec 2026.9:
# pip would fall back to torchtitan 0.2 (no BaseCheckpointManager). Installed without its dependencies, with
# what its checkpointer, optimizer and dataloader components import (18 MB in all; its full dependency set
# would add ~320 MB, and its Trainer also needs triton and a GPU).
"$VENV/bin/python" -m pip install -q --no-compile --no-deps -c deploy/constraints.txt torchtitan spmd_types tyro \
    docstring-parser typeguard
# (a file no Python 3.11 compiles, a package's test data, is left as pip would leave it: not compiled)
wait "$COMPILING" || true
compile_site
echo "$WANT" > "$STAMP"
echo "setup: $("$VENV/bin/python" -c 'import torch, shardckpt; print("torch", torch.__version__, "shardckpt", shardckpt.__version__)')"
