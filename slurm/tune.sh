#!/bin/bash
# Hyper-parameter search: one Optuna study (`pretrain tune`, "Hyper-parameter search" in
# docs/planning-and-telemetry.md), whose workers are the tasks of this array job. Each task is one
# node and runs `pretrain tune --workers 1` on the shared study directory: one trial at a time, each
# a short `pretrain train` of all the node's ranks (torchrun), until the study has TRIALS trials.
# Trials are pruned as their losses fall behind; $STUDY_DIR gets trials.csv and best.yaml as trials
# finish, plots when a task ends, and the log's last line is the best `pretrain train` command.
#
#   sbatch slurm/tune.sh --set data.dataset=... --set train.steps=500       # 4 workers
#   CONFIG=proxy.yaml SPACE=configs/tune/space.yaml TRIALS=64 sbatch --array=0-7 slurm/tune.sh
#
# Overrides (besides slurm/common.sh's): CONFIG (the proxy run config), SPACE (default
# configs/tune/space.yaml), TRIALS (default 32: the whole study, not per task), STUDY_DIR
# (default runs/tune-<array job id>; on a file system every node sees), RANKS_PER_TRIAL (default
# the node's ranks, TASKS_PER_NODE), LAUNCHER (torchrun, deepspeed), TUNE_ARGS (more
# `pretrain tune` options, e.g. "--pruner halving --storage postgresql://..."). The script's
# arguments go to every trial's `pretrain train` (--set K=V, --deepspeed-config).
# Resuming: a cancelled or timed-out task stops its trial's run and enqueues the trial again;
# submit again with the same STUDY_DIR (and TRIALS) and the study goes on where it stopped.
# Each task's log: tune-<array id>_<task>.out where sbatch ran, copied to runs/slurm/.
#SBATCH --job-name=tune
#SBATCH --array=0-3
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=%x-%A_%a.out
#SBATCH --open-mode=append
CONFIG="${CONFIG:-configs/llama_1b.yaml}"
SPACE="${SPACE:-configs/tune/space.yaml}"
TRIALS="${TRIALS:-32}"
STUDY_DIR="${STUDY_DIR:-runs/tune-${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}}"
LOG_DIR="${LOG_DIR:-$STUDY_DIR/job}"
source "${PRETRAIN_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
RANKS_PER_TRIAL="${RANKS_PER_TRIAL:-$TASKS_PER_NODE}"
read -r -a TUNE_EXTRA <<< "${TUNE_ARGS:-}"
echo "[slurm] tune worker ${SLURM_ARRAY_TASK_ID:-0} of study $STUDY_DIR: $TRIALS trials," \
     "$RANKS_PER_TRIAL ranks per trial"
JOB_RC=0
python -u -m pretrain tune --config "$CONFIG" --space "$SPACE" --trials "$TRIALS" --workers 1 \
  --study-dir "$STUDY_DIR" --nprocs "$RANKS_PER_TRIAL" --launcher "${LAUNCHER:-torchrun}" \
  "${TUNE_EXTRA[@]}" "$@" || JOB_RC=$?
case $JOB_RC in
  0) echo "[slurm] tune worker finished: the study has its trials (or others run the last)" ;;
  2) echo "[slurm] error in the tune's input (exit 2, see above): fix it and resubmit" ;;
  *) echo "[slurm] tune worker ended with exit $JOB_RC: resubmit with STUDY_DIR=$STUDY_DIR" \
          "to finish the study" ;;
esac
exit "$JOB_RC"
