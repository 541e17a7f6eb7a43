#!/bin/bash
# Llama-2-7B pretraining (configs/llama_7b.yaml) on 8 nodes x 8 GPUs (80 GB) = 64 GPUs:
#   tensor parallel 2 with sequence parallelism, no pipeline, data parallel 64 / 2 = 32 with
#   ZeRO-3 (ds_configs/zero3.json), bf16, sequence 4096, global batch 1024 sequences = 4.2M tokens
#   a step (micro-batch 4 x 8 accumulation steps x dp 32), no activation recomputation: the
#   planner's fastest layout with a 20% memory margin (`pretrain plan --config
#   configs/llama_7b.yaml --world-size 64 --search`).
#
#   sbatch slurm/pretrain_7b.sh [--set section.key=value ...]
#   # log: llama7b-<job id>.out here, copied to runs/slurm/llama7b-<job id>.out
#
# Same mechanics and overrides as slurm/pretrain_70b.sh (see slurm/common.sh).
#SBATCH --job-name=llama7b
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
CONFIG="${CONFIG:-configs/llama_7b.yaml}"
source "${PRETRAIN_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
run_training
finish_job
