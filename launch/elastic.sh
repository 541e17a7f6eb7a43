#!/usr/bin/env bash
# Elastic training: start this on each node of a job that may shrink or grow. torchrun's agents
# meet at a c10d rendezvous; when a node dies or a new one starts this script, every agent
# restarts its workers, and `pretrain train` resumes from the newest complete checkpoint of
# run_dir on the new world size (resharded: same global batch, same data stream).
#
#   RDZV_ENDPOINT=node01:29400 MIN_NODES=1 MAX_NODES=4 bash launch/elastic.sh \
#       --config configs/llama_1b.yaml --set train.global_batch_size=512
#
# Set train.global_batch_size: without it the first start's world size would fix the batch.
# run_dir must be on a filesystem every node sees. Arguments go to `pretrain train`.
# Environment:
#   RDZV_ENDPOINT   host:port of the rendezvous store, on a node that stays (default
#                   127.0.0.1:29400); the agent on that host serves it
#   MIN_NODES / MAX_NODES  the job runs with any node count in between (default 1 / 2); MIN_NODES
#                   is raised to the nodes one model replica needs (`pretrain launch nodes`)
#   NPROC_PER_NODE  ranks per node (default: the GPU count, else 1 CPU rank)
#   MAX_RESTARTS    worker-group restarts before an agent gives up (default 10)
#   RDZV_ID         the job's name at the rendezvous (default: $SLURM_JOB_ID, else pretrain)
#   RDZV_CONF       torchrun --rdzv-conf, e.g. last_call_timeout=30 (how long a restart waits
#                   for more nodes once MIN_NODES are there; torch's default: 30 s)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source launch/env.sh  # venv, TORCH_EXTENSIONS_DIR, DS_ACCELERATOR, OMP_NUM_THREADS
activate_venv
GPUS="$(gpu_count)"
NPROC_PER_NODE="${NPROC_PER_NODE:-$(( GPUS > 0 ? GPUS : 1 ))}"
rank_env "$GPUS" "$NPROC_PER_NODE"
# torch 2.13's shared rendezvous store deadlocks when an agent that was alone (rank 0) is joined:
# it keeps its first round's store address and never publishes it for the new round, where the
# joining agent waits for it. A store per round avoids that.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
# Start no world smaller than one model replica: raise MIN_NODES to the first count that holds
# one (any count from there on trains; ranks the layout or the batch cannot use sit idle).
CONFIG_ARGS=() REST=()
while (( $# )); do
  case $1 in
    --config|--set|--deepspeed-config) CONFIG_ARGS+=("$1" "$2"); REST+=("$1" "$2"); shift 2 ;;
    *) REST+=("$1"); shift ;;
  esac
done
set -- "${REST[@]}"
MIN_NODES="$(python -m pretrain launch nodes --ranks-per-node "$NPROC_PER_NODE" \
  --min-nodes "${MIN_NODES:-1}" --max-nodes "${MAX_NODES:-2}" "${CONFIG_ARGS[@]}")"
echo "[launch] elastic: $MIN_NODES:${MAX_NODES:-2} nodes x $NPROC_PER_NODE ranks, rendezvous ${RDZV_ENDPOINT:-127.0.0.1:29400}"
exec torchrun --nnodes "$MIN_NODES:${MAX_NODES:-2}" --nproc-per-node "$NPROC_PER_NODE" \
  --max-restarts "${MAX_RESTARTS:-10}" --rdzv-backend c10d \
  --rdzv-endpoint "${RDZV_ENDPOINT:-127.0.0.1:29400}" --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-pretrain}}" \
  ${RDZV_CONF:+--rdzv-conf "$RDZV_CONF"} -m pretrain train "$@"
