#!/bin/bash
# Llama-2-13B pretraining (configs/llama_13b.yaml) on 16 nodes x 8 GPUs (80 GB) = 128 GPUs:
#   tensor parallel 4 with sequence parallelism, no pipeline, data parallel 128 / 4 = 32 with
#   ZeRO-2 (ds_configs/zero2.json), bf16, sequence 4096, global batch 1024 sequences = 4.2M tokens
#   a step (micro-batch 4 x 8 accumulation steps x dp 32), no activation recomputation: the
#   planner's fastest layout with a 20% memory margin (`pretrain plan --config
#   configs/llama_13b.yaml --world-size 128 --search`).
#
#   sbatch slurm/pretrain_13b.sh [--set section.key=value ...]
#   # log: llama13b-<job id>.out here, copied to runs/slurm/llama13b-<job id>.out
#
# Same mechanics and overrides as slurm/pretrain_70b.sh (see slurm/common.sh).
#SBATCH --job-name=llama13b
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
CONFIG="${CONFIG:-configs/llama_13b.yaml}"
source "${PRETRAIN_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
run_training
finish_job
