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
[[ -z ${VIRTUAL_ENV:-} && -f .venv/bin/activate ]] && source .venv/bin/activate
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.build/torch_extensions}"
read -r GPUS FREE_PORT < <(python -c 'import torch
from pretrain.dist import free_port
print(torch.cuda.device_count(), free_port())')
LAUNCHER="${LAUNCHER:-deepspeed}"
if (( GPUS > 0 )); then
  NPROC="${NPROC:-$GPUS}"
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cuda}"
else
  NPROC="${NPROC:-2}"
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
  # Oversubscribed intra-op threads made 2 ranks on 2 cores 2x slower.
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}"
fi
PORT="${MASTER_PORT:-$FREE_PORT}"
echo "[launch] $LAUNCHER: $NPROC ranks on $(hostname) ($DS_ACCELERATOR), port $PORT"
case $LAUNCHER in
  deepspeed) exec deepspeed --num_gpus "$NPROC" --master_port "$PORT" --no_local_rank \
               --module pretrain train "$@" ;;
  torchrun)  exec torchrun --nproc_per_node "$NPROC" --master_addr 127.0.0.1 --master_port "$PORT" \
               -m pretrain train "$@" ;;
  *) echo "error: LAUNCHER=$LAUNCHER: use deepspeed or torchrun" >&2; exit 2 ;;
esac
