#!/bin/bash
# Qwen3-30B-A3B pretraining (configs/qwen3_30b_a3b.yaml) on 4 nodes x 8 GPUs (80 GB) = 32 GPUs:
#   tensor parallel 2 with sequence parallelism (each of the 128 experts split over the two
#   ranks), pipeline parallel 4, data parallel 32 / (2 x 4) = 4 with ZeRO-1
#   (ds_configs/zero1.json), bf16, sequence 4096, global batch 1024 sequences = 4.2M tokens a
#   step (micro-batch 8 x 32 accumulation steps x dp 4), full activation recomputation: the
#   planner's fastest layout with a 20% memory margin (`pretrain plan --config
#   configs/qwen3_30b_a3b.yaml --world-size 32 --search`).
#
#   sbatch slurm/pretrain_qwen3_moe.sh [--set section.key=value ...]
#   # log: qwen3moe-<job id>.out here, copied to runs/slurm/qwen3moe-<job id>.out
#
# Same mechanics and overrides as slurm/pretrain_70b.sh (see slurm/common.sh).
#SBATCH --job-name=qwen3moe
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
CONFIG="${CONFIG:-configs/qwen3_30b_a3b.yaml}"
source "${PRETRAIN_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
run_training
finish_job
