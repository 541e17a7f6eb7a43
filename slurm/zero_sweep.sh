#!/bin/bash
# ZeRO sweep: the same short run once per DeepSpeed config, one array task each, on 1 node x 8
# GPUs (configs/llama_1b.yaml, 50 steps); every finishing task rewrites the result table
# $SWEEP_DIR/sweep.md (and sweep.csv, sweep.png) with `pretrain sweep --aggregate`: median
# tokens/s and step time, peak memory of every rank, final loss per config.
#
#   sbatch slurm/zero_sweep.sh           # --array=0-6: ds_configs/*.json
#   DS_CONFIGS="ds_configs/zero1.json ds_configs/zero3.json" sbatch --array=0-1 slurm/zero_sweep.sh
#   DS_CONFIGS="ds_configs/zero2.json ds_configs/zero3.json" ENGINES="deepspeed fsdp2" \
#     sbatch --array=0-3 slurm/zero_sweep.sh   # DeepSpeed's ZeRO against PyTorch's FSDP2
#
# Overrides (besides slurm/common.sh's): DS_CONFIGS (the list, sorted), ENGINES (train.engine
# values: every config runs once per engine, in runs named <engine>_<config> as `pretrain sweep
# --engines` names them; unset: DeepSpeed's engine, runs named <config>); task i runs config
# i / (number of engines) under engine i % (number of engines). fsdp2 refuses ZeRO-0 and NVMe
# JSONs before launch (exit 2): leave them out of DS_CONFIGS when ENGINES has fsdp2.
# SWEEP_DIR (default runs/zero_sweep-<array job id>), SWEEP_STEPS (default 50). Each task's log:
# zero_sweep-<array id>_<task>.out where sbatch ran, copied to runs/slurm/ (slurm/job_log.sh).
#SBATCH --job-name=zero_sweep
#SBATCH --array=0-6
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --exclusive
#SBATCH --time=01:00:00
#SBATCH --output=%x-%A_%a.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
CONFIG="${CONFIG:-configs/llama_1b.yaml}"
cd "${PRETRAIN_ROOT:-${SLURM_SUBMIT_DIR:-.}}"  # DS_CONFIGS paths are relative to the repository
[[ -f slurm/job_log.sh ]] && source slurm/job_log.sh  # first: the errors below go to runs/slurm/ too
read -r -a SWEEP_CONFIGS <<< "$(printf '%s\n' ${DS_CONFIGS:-ds_configs/*.json} | sort | tr '\n' ' ')"
for ds in "${SWEEP_CONFIGS[@]}"; do
  [[ -f $ds ]] || { echo "error: DeepSpeed config $ds (from DS_CONFIGS) does not exist" >&2; exit 2; }
done
read -r -a SWEEP_ENGINES <<< "${ENGINES:-deepspeed}"
for engine in "${SWEEP_ENGINES[@]}"; do
  case $engine in
    deepspeed|fsdp2) ;;
    *) echo "error: engine $engine (from ENGINES) is not a train.engine: deepspeed or fsdp2" >&2
       exit 2 ;;
  esac
done
if (( $(printf '%s\n' "${SWEEP_ENGINES[@]}" | sort -u | wc -l) < ${#SWEEP_ENGINES[@]} )); then
  echo "error: ENGINES=\"$ENGINES\" names an engine twice: each once" >&2
  exit 2
fi
TASK="${SLURM_ARRAY_TASK_ID:-0}"
TASKS=$(( ${#SWEEP_CONFIGS[@]} * ${#SWEEP_ENGINES[@]} ))
if (( TASK >= TASKS )); then
  echo "error: array task $TASK but only ${#SWEEP_CONFIGS[@]} configs (${SWEEP_CONFIGS[*]})" \
       "x ${#SWEEP_ENGINES[@]} engines (${SWEEP_ENGINES[*]}):" \
       "submit with --array=0-$(( TASKS - 1 ))" >&2
  exit 2
fi
DS="${SWEEP_CONFIGS[$(( TASK / ${#SWEEP_ENGINES[@]} ))]}"
ENGINE="${SWEEP_ENGINES[$(( TASK % ${#SWEEP_ENGINES[@]} ))]}"
NAME="$(basename "$DS" .json)"
ENGINE_ARGS=()
if [[ -n ${ENGINES:-} ]]; then  # as `pretrain sweep --engines`: the engine names the run
  NAME="${ENGINE}_$NAME"
  ENGINE_ARGS=(--set "train.engine=$ENGINE")
fi
SWEEP_DIR="${SWEEP_DIR:-runs/zero_sweep-${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}}"
RUN_DIR="$SWEEP_DIR/$NAME"
LOG_DIR="$RUN_DIR/job"
set -- --deepspeed-config "$DS" --set "train.steps=${SWEEP_STEPS:-50}" "${ENGINE_ARGS[@]}" "$@"
source "${PRETRAIN_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
run_training
# flock: the last task to finish writes last, so the table ends with every run in it.
flock "$SWEEP_DIR/.results.lock" python -m pretrain sweep --aggregate "$SWEEP_DIR"
finish_job
