# Sourced by slurm/common.sh: whether a job whose ranks faulted is requeued. A dead rank, a
# failed or timed-out collective (exit 3) or a rank killed by a signal (exit > 128) is often the
# hardware's (a node, a link): the job is requeued and resumes from its newest complete
# checkpoint, as torchrun's --max-restarts and Kubernetes' backoffLimit restart a failed worker,
# a bounded number of times. A fault at the step of the job's previous fault is not requeued:
# the same step failing twice is the run's own (data, a bug), and would fail forever.
#
#   last_train_step RUN_DIR            the step of the newest "train" record of
#                                      RUN_DIR/metrics.jsonl (0: none yet)
#   requeue_fault FAULTS STEP [LIMIT]  record a fault at STEP in the file FAULTS (one "step=S"
#                                      line a fault of the job); status 0 when the job is to be
#                                      requeued (fewer than LIMIT faults before it, default
#                                      $SLURM_FAULT_REQUEUES or 2, and not at the previous
#                                      fault's step), else 1; the reason on stdout either way

last_train_step() {
  local metrics="$1/metrics.jsonl" line
  [[ -f $metrics ]] && line=$(grep '"kind": *"train"' "$metrics" | tail -n 1 || true)
  if [[ ${line:-} =~ \"step\":\ *([0-9]+) ]]; then
    echo "${BASH_REMATCH[1]}"
  else
    echo 0
  fi
}

requeue_fault() {
  local faults=$1 step=$2 limit=${3:-${SLURM_FAULT_REQUEUES:-2}} before=0 previous=""
  if [[ -f $faults ]]; then
    before=$(grep -c '^step=' "$faults" || true)
    previous=$(grep '^step=' "$faults" | tail -n 1 || true)
    previous=${previous#step=}
  fi
  echo "step=$step" >> "$faults"
  if (( before >= limit )); then
    echo "fault $(( before + 1 )) of this job, at step $step: not requeued" \
         "(SLURM_FAULT_REQUEUES=$limit faults are requeued; raise it to allow more)"
    return 1
  fi
  if [[ $previous == "$step" ]]; then
    echo "faulted at step $step again: not requeued (the same step failing twice is the run's" \
         "own fault, not a node's: read the log above)"
    return 1
  fi
  echo "fault $(( before + 1 )) of at most $limit requeued (SLURM_FAULT_REQUEUES), at step $step"
  return 0
}
