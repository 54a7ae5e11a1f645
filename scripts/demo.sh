#!/usr/bin/env bash
# Set up (if needed), then run the demo: a 2-rank DDP job under torchrun on CPU
# saves every 5 steps, is preempted with SIGTERM part-way, and a second launch
# resumes from the newest committed step and finishes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
RUN=demo-run
rm -rf "$RUN"
mkdir -p "$RUN"
export OMP_NUM_THREADS=1 PYTHON="$PY" NPROC_PER_NODE=2 CKPT_DIR="$RUN/ckpt"
LAUNCH=(deploy/torchrun/launch.sh examples/train_ddp.py --steps 60 --every 5 --step-sleep 0.1)

echo "== 1. training; it will be preempted (SIGTERM) after step 20 is committed"
"${LAUNCH[@]}" > "$RUN/first.log" 2>&1 &
JOB=$!
for _ in $(seq 1 600); do
    if [ -f "$RUN/ckpt/step_0000000020/shardckpt.json" ]; then break; fi
    if ! kill -0 "$JOB" 2>/dev/null; then break; fi
    sleep 0.2
done
kill -TERM "$JOB" 2>/dev/null || true   # to the launcher, as a spot reclaim would
wait "$JOB" || true
grep -E "\[train_ddp\]|shardckpt:" "$RUN/first.log" | grep -v "waits for\|waited" | sed 's/^/   /'

echo "== 2. committed steps on disk"
.venv/bin/shardckpt ls "$RUN/ckpt" | sed 's/^/   /'
.venv/bin/shardckpt verify "$RUN/ckpt" --all | sed 's/^/   /'

echo "== 3. relaunching: resumes from the newest committed step"
"${LAUNCH[@]}" > "$RUN/second.log" 2>&1
grep -E "\[train_ddp\]|shardckpt:" "$RUN/second.log" | grep -v "waits for\|waited" | sed 's/^/   /'
grep -q "resuming from step" "$RUN/second.log" && grep -q "finished 60 steps" "$RUN/second.log"
echo "== demo OK: interrupted and resumed; checkpoints in $RUN/ckpt"
