#!/usr/bin/env bash
# Train on this machine through a real launcher: one rank per GPU, or NPROC CPU ranks without GPUs.
#
#   bash launch/single_node.sh --config configs/llama_1b.yaml             # deepspeed, all GPUs
#   LAUNCHER=torchrun NPROC=4 bash launch/single_node.sh --config configs/tiny.yaml --set ...
#
# Arguments go to `pretrain train`. Environment: LAUNCHER (deepspeed | torchrun, default
# deepspeed), NPROC (default: the GPU count, else 2 CPU ranks), MASTER_PORT (default: a free
# port, so several runs can share a machine), OMP_NUM_THREADS (default on CPU: cores / NPROC).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source launch/env.sh  # venv, TORCH_EXTENSIONS_DIR, DS_ACCELERATOR, OMP_NUM_THREADS
activate_venv
read -r GPUS FREE_PORT < <(python -c 'import torch
from pretrain.dist import free_port
print(torch.cuda.device_count(), free_port())')
LAUNCHER="${LAUNCHER:-deepspeed}"
NPROC="${NPROC:-$(( GPUS > 0 ? GPUS : 2 ))}"
rank_env "$GPUS" "$NPROC"
PORT="${MASTER_PORT:-$FREE_PORT}"
echo "[launch] $LAUNCHER: $NPROC ranks on $(hostname) ($DS_ACCELERATOR), port $PORT"
case $LAUNCHER in
  deepspeed) exec deepspeed --num_gpus "$NPROC" --master_port "$PORT" --no_local_rank \
               --module pretrain train "$@" ;;
  torchrun)  exec torchrun --nproc_per_node "$NPROC" --master_addr 127.0.0.1 --master_port "$PORT" \
               -m pretrain train "$@" ;;
  *) echo "error: LAUNCHER=$LAUNCHER: use deepspeed or torchrun" >&2; exit 2 ;;
esac
