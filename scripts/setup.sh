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
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
# test: the suite's servers and tools; docs: MkDocs, which tests/test_docs.py runs;
# hf: transformers, accelerate, torchdata for tests/test_hf.py (torch stays pinned by the constraints)
"$VENV/bin/python" -m pip install -q -c deploy/constraints.txt -e ".[test,docs,hf]"
"$VENV/bin/python" -m pip check
echo "$WANT" > "$STAMP"
echo "setup: $("$VENV/bin/python" -c 'import torch, shardckpt; print("torch", torch.__version__, "shardckpt", shardckpt.__version__)')"
