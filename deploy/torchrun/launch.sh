#!/usr/bin/env bash
# Launch a training script that checkpoints with shardckpt under torchrun:
# one node or many, with elastic restarts. Run it with --help for the details.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: launch.sh SCRIPT [SCRIPT ARGS...]

Runs SCRIPT under torchrun with c10d rendezvous and worker-group restarts.
When a worker dies, torchrun stops the others and restarts the group (up to
MAX_RESTARTS times); the script's Checkpointer.load() then resumes from the
newest committed step. The last command is `exec torchrun`: SIGTERM sent to
this script (kubectl delete, a spot reclaim, systemd) reaches torchrun, which
forwards it to every worker; shardckpt then saves once more and the script
exits its loop.

Configuration (environment variables; defaults in brackets):
  NNODES            nodes: N, or MIN:MAX for an elastic job             [1]
  NPROC_PER_NODE    workers per node                [gpu if nvidia-smi finds one, else 1]
  RDZV_ENDPOINT     host:port of the rendezvous, the same on every node:
                    a stable name of the first node (a headless Service).
                    Required when NNODES is not 1; falls back to
                    MASTER_ADDR:MASTER_PORT (set by the Kubeflow operator).
                    Unset with NNODES=1: --standalone (a free local port).
  RDZV_ID           job id, the same on every node                      [shardckpt]
  RDZV_BACKEND      torchrun rendezvous backend                         [c10d]
  MAX_RESTARTS      worker-group restarts before the job fails          [3]
  SHUTDOWN_TIMEOUT  seconds torchrun waits after forwarding SIGTERM before
                    it SIGKILLs the workers: must cover the emergency save
                    and the upload drain (see deploy/k8s/)              [120]
  CKPT_DIR          local checkpoint directory -> SHARDCKPT_LOCAL_DIR   [$SHARDCKPT_LOCAL_DIR, else checkpoints]
  REMOTE            remote tier URL (s3://bucket/prefix) -> SHARDCKPT_REMOTE   [$SHARDCKPT_REMOTE, else none]
  UPLOADER          auto | external | off -> SHARDCKPT_UPLOADER         [$SHARDCKPT_UPLOADER, else auto]
  PYTHON            interpreter that has torch and shardckpt            [python3]
  DRY_RUN=1         print the torchrun command instead of running it

TORCH_DISABLE_SHARE_RDZV_TCP_STORE defaults to 1 here: without it a restarted
worker group can fail to connect (pytorch/pytorch#135712).

Other SHARDCKPT_* variables (SHARDCKPT_DRAIN_TIMEOUT_S, SHARDCKPT_ENDPOINT_URL,
...) and AWS_* credentials pass through to the workers unchanged.

Examples:
  # one node, 8 GPUs, checkpoints on NVMe, uploads to S3
  CKPT_DIR=/nvme/ckpt/run1 REMOTE=s3://bucket/runs/run1 \
      deploy/torchrun/launch.sh examples/train_ddp.py --steps 10000

  # the same on each of 4 nodes (node0 hosts the rendezvous)
  NNODES=4 RDZV_ENDPOINT=node0:29400 RDZV_ID=run1 CKPT_DIR=/nvme/ckpt/run1 \
      REMOTE=s3://bucket/runs/run1 deploy/torchrun/launch.sh examples/train_ddp.py

  # elastic: start with 2 to 4 nodes, continue when some are lost
  NNODES=2:4 RDZV_ENDPOINT=node0:29400 ... deploy/torchrun/launch.sh train.py
EOF
}

die() {
    echo "launch.sh: $*" >&2
    exit 2
}

case "${1:-}" in
    -h | --help) usage; exit 0 ;;
    "") usage >&2; exit 2 ;;
esac

NNODES=${NNODES:-1}
if [ -z "${NPROC_PER_NODE:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        NPROC_PER_NODE=gpu
    else
        NPROC_PER_NODE=1
    fi
fi
if [ -z "${RDZV_ENDPOINT:-}" ] && [ -n "${MASTER_ADDR:-}" ]; then
    RDZV_ENDPOINT="$MASTER_ADDR:${MASTER_PORT:-29400}"
fi
RDZV_ENDPOINT=${RDZV_ENDPOINT:-}
RDZV_ID=${RDZV_ID:-shardckpt}
RDZV_BACKEND=${RDZV_BACKEND:-c10d}
MAX_RESTARTS=${MAX_RESTARTS:-3}
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-120}
PYTHON=${PYTHON:-python3}

[[ "$NNODES" =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]] || die "NNODES must be N or MIN:MAX, got '$NNODES'"
[[ "$NPROC_PER_NODE" =~ ^([1-9][0-9]*|gpu|cpu|auto)$ ]] || die "NPROC_PER_NODE must be a count, gpu, cpu or auto, got '$NPROC_PER_NODE'"
[[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || die "MAX_RESTARTS must be a non-negative integer, got '$MAX_RESTARTS'"
[[ "$SHUTDOWN_TIMEOUT" =~ ^[0-9]+$ ]] || die "SHUTDOWN_TIMEOUT must be whole seconds, got '$SHUTDOWN_TIMEOUT'"
if [ "$NNODES" != 1 ] && [ -z "$RDZV_ENDPOINT" ]; then
    die "NNODES=$NNODES needs RDZV_ENDPOINT=host:port (the same on every node)"
fi

# The training script reads these (examples/train_ddp.py passes them to
# Checkpointer); exporting them here keeps one place per setting.
export SHARDCKPT_LOCAL_DIR="${CKPT_DIR:-${SHARDCKPT_LOCAL_DIR:-checkpoints}}"
REMOTE=${REMOTE:-${SHARDCKPT_REMOTE:-}}
if [ -n "$REMOTE" ]; then
    export SHARDCKPT_REMOTE="$REMOTE"
elif [ "$NNODES" != 1 ]; then
    echo "launch.sh: warning: NNODES=$NNODES without REMOTE: with node-local CKPT_DIRs a job can resume only on" \
        "the same nodes (they exchange their files); put CKPT_DIR on a shared filesystem or set REMOTE" >&2
fi
if [ -n "${UPLOADER:-}" ]; then
    export SHARDCKPT_UPLOADER="$UPLOADER"
fi
# torchrun's agent shares its rendezvous TCPStore with the workers by default,
# and a restarted worker group can then read the previous group's addresses
# (gloo: "connectFullMesh failed ... Connection refused"; NCCL: a stale unique
# id), so the restart fails. pytorch/pytorch#135712, #167288.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}

args=(--nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE"
    --max-restarts="$MAX_RESTARTS"
    --shutdown-timeout="$SHUTDOWN_TIMEOUT")
if [ -n "$RDZV_ENDPOINT" ]; then
    args+=(--rdzv-backend="$RDZV_BACKEND" --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="$RDZV_ID")
else
    args+=(--standalone)
fi

if [ "${DRY_RUN:-0}" = 1 ]; then
    printf '%q ' "$PYTHON" -m torch.distributed.run "${args[@]}" "$@"
    echo
    exit 0
fi
exec "$PYTHON" -m torch.distributed.run "${args[@]}" "$@"
