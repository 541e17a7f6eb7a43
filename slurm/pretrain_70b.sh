#!/bin/bash
# Llama-2-70B pretraining (configs/llama_70b.yaml) on 16 nodes x 8 GPUs (80 GB, e.g. H100) = 128 GPUs:
#   tensor parallel 4 with sequence parallelism inside a node (NVLink), pipeline parallel 8 across
#   nodes (1F1B, 10 layers a stage), data parallel 128 / (4 x 8) = 4 with ZeRO-1
#   (ds_configs/zero1.json), bf16 with fp32 master weights, sequence 4096, global batch 1024
#   sequences = 4.2M tokens a step (micro-batch 1 x 256 accumulation steps x dp 4), no activation
#   recomputation: the planner's fastest layout with a 20% memory margin (`pretrain plan --config
#   configs/llama_70b.yaml --world-size 128 --search`).
#
#   sbatch slurm/pretrain_70b.sh [--set section.key=value ...]
#   # log: llama70b-<job id>.out here, copied to runs/slurm/llama70b-<job id>.out
#
# One task per GPU; see slurm/common.sh for the environment overrides (CONFIG, RUN_DIR, LOG_DIR,
# GPUS_PER_NODE, ...). A tiny CPU run on 2 nodes (what tests/test_slurm.py submits):
#   CONFIG=configs/tiny.yaml sbatch --nodes 2 --ntasks-per-node 1 --gpus-per-node 0 --cpus-per-task 1 \
#     --time 10 slurm/pretrain_70b.sh --set data.dataset=... --set data.tokenizer=...
# USR1 arrives 10 minutes before the time limit (enough to write 70B's ~1 TB of ZeRO-1 state to
# a parallel file system): the ranks checkpoint, exit 75, and the job requeues itself and resumes.
#SBATCH --job-name=llama70b
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
CONFIG="${CONFIG:-configs/llama_70b.yaml}"
source "${PRETRAIN_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
run_training
finish_job
