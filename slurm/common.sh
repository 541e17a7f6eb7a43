# Sourced by slurm/pretrain_*.sh and slurm/zero_sweep.sh inside the batch job, after they set
# their defaults: node discovery and environment here, then the scripts call `run_training`
# (pre-flight, one srun, USR1 forwarded to the ranks) and `finish_job` (requeue on exit 75, and
# on a fault a bounded number of times: slurm/faults.sh).
#
# Overrides (environment; the #SBATCH lines are overridden on the sbatch command line):
#   CONFIG        run config YAML                         (each script sets its preset)
#   RUN_DIR       run directory: checkpoints, metrics     (default: the config's run_dir)
#   LOG_DIR       job record: resolved config, ds_config.json, git commit, attempts
#                 (default runs/slurm/<job name>-<job id>)
#   JOB_LOG       copy of the job's output (default runs/slurm/<job name>-<job id>.out; sbatch
#                 writes <job name>-<job id>.out where it ran, see slurm/job_log.sh)
#   GPUS_PER_NODE ranks per node = GPUs per node; 0 runs CPU ranks (TASKS_PER_NODE of them)
#   TASKS_PER_NODE ranks per node (default: GPUS_PER_NODE, else SLURM_NTASKS_PER_NODE)
#   PRETRAIN_MASTER_PORT rendezvous port (default from the job id and attempt, the same on every
#                 node); MASTER_ADDR is the allocation's first node. A MASTER_ADDR/MASTER_PORT
#                 inherited from the submitting shell is ignored: it belongs to another run.
#   CPU_BIND      srun --cpu-bind of the ranks (default cores; none leaves binding to the site)
#   SRUN_WAIT     seconds the other ranks may run on after one rank exited (default 300): a
#                 crashed rank ends the step then, not after the collective timeout
#   PRETRAIN_ROOT the repository (default: the directory sbatch was run from)
#   VENV          virtual environment to activate (default $PRETRAIN_ROOT/.venv if present)
#   SLURM_FAULT_REQUEUES times a job whose ranks faulted (exit 3, or a rank killed by a signal)
#                 is requeued to resume from its newest checkpoint (default 2; 0: never); a
#                 fault at the step of the previous one is not requeued (slurm/faults.sh)
# Arguments of the script go to `pretrain train` (and to the pre-flight): --set K=V, --deepspeed-config.
set -euo pipefail
ROOT="${PRETRAIN_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}"
if [[ ! -f $ROOT/slurm/common.sh ]]; then
  echo "error: $ROOT is not the pretrain repository: run sbatch from it or set PRETRAIN_ROOT" >&2
  exit 2
fi
cd "$ROOT"
source "$ROOT/slurm/job_log.sh"  # creates runs/slurm/ and copies this job's output there
source "$ROOT/launch/env.sh"     # venv, TORCH_EXTENSIONS_DIR, DS_ACCELERATOR (rank_env below)
source "$ROOT/slurm/faults.sh"   # whether a fault is requeued (finish_job)
activate_venv "${VENV:-$ROOT/.venv}"

# ---- nodes and ranks -----------------------------------------------------------------------
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
NNODES=${#NODES[@]}
GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}"
if (( GPUS_PER_NODE > 0 )); then
  TASKS_PER_NODE="${TASKS_PER_NODE:-$GPUS_PER_NODE}"
else
  TASKS_PER_NODE="${TASKS_PER_NODE:-${SLURM_NTASKS_PER_NODE:-1}}"
fi
WORLD_SIZE=$(( NNODES * TASKS_PER_NODE ))
ATTEMPT="${SLURM_RESTART_COUNT:-0}"
# The allocation's rendezvous, always: sbatch hands the submitting shell's environment to the
# job, and a MASTER_ADDR / MASTER_PORT left there by another run would send the ranks to it.
# A requeued job keeps its id: a new port per attempt, as the last one may still be in TIME_WAIT.
export MASTER_ADDR="${NODES[0]}"
export MASTER_PORT="${PRETRAIN_MASTER_PORT:-$(( 20000 + (SLURM_JOB_ID * 10 + ATTEMPT % 10) % 20000 ))}"

# ---- environment of every rank (srun passes the batch shell's environment on) --------------
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"  # a failed collective ends the rank
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# No CUDA_DEVICE_MAX_CONNECTIONS=1: it orders kernels for Megatron's TP/SP communication overlap,
# which nothing here uses, and serialises ZeRO-3's communication and compute streams.
export PYTHONFAULTHANDLER=1          # Python stacks of every thread on a crash or a fatal signal
export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}"  # before rank_env's default
rank_env "$GPUS_PER_NODE" "$TASKS_PER_NODE"

RUN_ARGS=(--config "$CONFIG" "$@")
[[ -n ${RUN_DIR:-} ]] && RUN_ARGS+=(--set "run_dir=$RUN_DIR")
LOG_DIR="${LOG_DIR:-runs/slurm/${SLURM_JOB_NAME}-${SLURM_JOB_ID}}"
mkdir -p "$LOG_DIR"
echo "[slurm] job $SLURM_JOB_ID attempt $ATTEMPT: $NNODES nodes (${NODES[*]}) x $TASKS_PER_NODE ranks," \
     "master $MASTER_ADDR:$MASTER_PORT, accelerator $DS_ACCELERATOR, log dir $LOG_DIR"

# ---- pre-flight: fail in seconds, before any rank starts, with the reason in this log --------
preflight() {  # `pretrain plan` (layout, per-GPU memory), then the record in $LOG_DIR
  python -m pretrain launch preflight --world-size "$WORLD_SIZE" --accelerator "$DS_ACCELERATOR" \
    --ranks-per-node "$TASKS_PER_NODE" --log-dir "$LOG_DIR" "${RUN_ARGS[@]}"
}

# ---- compiled DeepSpeed ops: built once per node before the ranks start -----------------------
# The pre-flight wrote the ops the config needs (CPU Adam, async I/O; none for most configs) and
# the node-local folder for them to $LOG_DIR/ops.tsv. One task per node copies the set-up's
# builds there (`launch/setup_env.sh --ops`) or compiles them; the ranks then load them from it:
# no rank compiles, and no build lock is shared between nodes or left for a later job.
prepare_ops() {
  [[ -s $LOG_DIR/ops.tsv ]] || return 0
  local ops ops_dir
  IFS=$'\t' read -r ops ops_dir < "$LOG_DIR/ops.tsv"
  echo "[slurm] DeepSpeed ops $ops: built once per node in $ops_dir"
  srun --ntasks="$NNODES" --ntasks-per-node=1 --nodes="$NNODES" \
    --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    python -m pretrain launch build-ops --ops "$ops" --dir "$ops_dir" --seed "$TORCH_EXTENSIONS_DIR" \
    || return 1
  export TORCH_EXTENSIONS_DIR="$ops_dir"
}

# ---- train: one task per rank; discover_world maps SLURM_PROCID/NTASKS/LOCALID ---------------
# `--signal=B:USR1@N` signals only this shell: pass it to the ranks, which save a checkpoint and
# exit 75 (EXIT_REQUEUE). Sets JOB_RC (the pre-flight's status when it refused: 2 for the
# config, 75 for an allocation smaller than one model replica, which a requeue may cure).
# Ranks the layout or the batch cannot use sit idle and exit with the job (pretrain/resolve/world_fit.py).
forward_usr1() { echo "[slurm] USR1: asking the ranks to checkpoint and stop"; kill -USR1 "$SRUN_PID" 2>/dev/null || true; }
run_training() {
  JOB_RC=0
  preflight || { JOB_RC=$?; return 0; }
  prepare_ops || { echo "[slurm] building DeepSpeed's ops failed on a node (see above)"; JOB_RC=3; return 0; }
  trap forward_usr1 USR1
  # --cpus-per-task explicitly: srun of Slurm 22.05-23.02 does not inherit it from sbatch, and
  # every rank would get one core. Each rank bound to its own cores (CPU_BIND=none: off).
  # --ntasks explicitly: a job requeued onto fewer nodes keeps the first attempt's SLURM_NTASKS,
  # and srun would start that many ranks on the nodes it has.
  srun --ntasks="$WORLD_SIZE" --ntasks-per-node="$TASKS_PER_NODE" --nodes="$NNODES" \
    --wait="${SRUN_WAIT:-300}" \
    --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" --cpu-bind="${CPU_BIND:-cores}" \
    python -u -m pretrain train "${RUN_ARGS[@]}" &
  SRUN_PID=$!
  while :; do
    JOB_RC=0
    wait "$SRUN_PID" || JOB_RC=$?
    kill -0 "$SRUN_PID" 2>/dev/null || break  # wait returned for the trap, not for srun's end
  done
  trap - USR1
  echo "attempt=$ATTEMPT exit=$JOB_RC" >> "$LOG_DIR/attempts.txt"
}

# ---- act on pretrain's exit status (pretrain/errors.py) --------------------------------------
finish_job() {
  case $JOB_RC in
    0) echo "[slurm] training finished" ;;
    75) echo "[slurm] checkpoint saved after a stop request, a hung rank named (<run_dir>/hang/verdict.txt), or too few nodes for one model replica: requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"; exit 0 ;;
    2) echo "[slurm] error in the run's input (exit 2, see above): fix it and resubmit; not requeued" ;;
    *) echo "[slurm] training failed with exit $JOB_RC (3: a rank faulted or a collective timed out)"
       if (( JOB_RC == 3 || JOB_RC > 128 )); then
         local why
         if why=$(requeue_fault "$LOG_DIR/faults.txt" "$(last_train_step "$(job_run_dir)")"); then
           echo "[slurm] $why: requeueing job $SLURM_JOB_ID"
           scontrol requeue "$SLURM_JOB_ID"; exit 0
         fi
         echo "[slurm] $why"
       fi ;;
  esac
  exit "$JOB_RC"
}

job_run_dir() {  # the run directory: RUN_DIR, else the one the pre-flight recorded
  if [[ -n ${RUN_DIR:-} ]]; then
    echo "$RUN_DIR"
  else
    sed -n 's/^run_dir: *//p' "$LOG_DIR/config.yaml" 2>/dev/null | tr -d "'\""
  fi
}
