# Sourced by slurm/common.sh (and first thing by slurm/zero_sweep.sh) in the repository: the job's
# log in runs/slurm/, which a fresh clone does not have. sbatch opens its --output file before the
# script runs, so the #SBATCH headers write `<job name>-<job id>.out` where sbatch was run (a
# directory that exists); from here on, the job's stdout and stderr also go to
#   JOB_LOG   default runs/slurm/<job name>-<job id>.out (array tasks: <name>-<array id>_<task>.out)
# through `tee -a` (a requeued job appends to it). tee ignores the job's signals (USR1 before the
# time limit, TERM on cancel) so the last lines still arrive, and the script waits for it at exit.
if [[ -z ${JOB_LOG_PID:-} ]]; then
  if [[ -n ${SLURM_ARRAY_JOB_ID:-} ]]; then  # the names of #SBATCH --output: %x-%A_%a, %x-%j
    JOB_LOG_ID="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID:-0}"
  else
    JOB_LOG_ID="${SLURM_JOB_ID:-$$}"
  fi
  JOB_LOG="${JOB_LOG:-runs/slurm/${SLURM_JOB_NAME:-job}-$JOB_LOG_ID.out}"
  mkdir -p "$(dirname "$JOB_LOG")"
  if [[ /dev/stdout -ef $JOB_LOG ]]; then  # sbatch --output is that file already
    JOB_LOG_PID=none
  else
    trap '' INT TERM HUP USR1  # ignored from its first instant on by the tee started here
    exec > >(exec tee -a "$JOB_LOG") 2>&1
    JOB_LOG_PID=$!
    trap - INT TERM HUP USR1
    # Close the pipe so that tee sees its end, and let it write the last lines before the job ends.
    trap 'JOB_LOG_RC=$?; exec >&- 2>&-; wait "$JOB_LOG_PID" || true; exit "$JOB_LOG_RC"' EXIT
  fi
fi
