#!/bin/bash
# Ray inside a Slurm allocation: a Ray head on the job's first node and a Ray worker node on every
# other node (one srun task each), then `pretrain launch ray` on the head as the Ray Train job, one
# rank per GPU (or per CPU task) of the allocation. Ray restarts a failed worker group up to
# MAX_FAILURES times; each restart resumes from the run's newest complete checkpoint.
#
#   sbatch slurm/ray_cluster.sh --set data.dataset=...                    # CONFIG's preset
#   CONFIG=configs/llama_1b.yaml sbatch --nodes=4 slurm/ray_cluster.sh --set train.steps=1000
#
# Overrides (besides slurm/common.sh's): CONFIG (default configs/llama_1b.yaml), RAY_PORT (the
# head's port, default 6379 + job id % 1000), MAX_FAILURES (default 3), RAY_AUTH_TOKEN (the
# cluster's token; default a new random one per job). run_dir must be on a file system every node
# sees. The pre-flight of slurm/common.sh runs first; the Ray job's exit status is the job's
# (0 done, 2 bad input; Ray's own failure after MAX_FAILURES restarts: 1; a Ray node that could
# not start or join: 3).
# Ray 2.60 (the pinned version) requires a token from every process that joins or talks to a
# cluster started by `ray start`: the script makes one per job and srun hands it to every node in
# the environment.
# Tested on a local two-node Slurm cluster (tests/test_slurm.py): the Ray job's losses equal the
# `deepspeed` launcher's on the same allocation.
#SBATCH --job-name=pretrain-ray
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
CONFIG="${CONFIG:-configs/llama_1b.yaml}"
# slurm/common.sh counts ranks as tasks; Ray runs one task per node and its own workers in it
TASKS_PER_NODE="${TASKS_PER_NODE:-${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}}"
source "${PRETRAIN_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
RAY_PORT="${RAY_PORT:-$(( 6379 + SLURM_JOB_ID % 1000 ))}"
HEAD_ADDR="$(getent hosts "${NODES[0]}" | awk '{print $1; exit}')"
HEAD_ADDR="${HEAD_ADDR:-${NODES[0]}}"
RAY_RESOURCES=(--num-gpus "$GPUS_PER_NODE")
(( GPUS_PER_NODE > 0 )) || RAY_RESOURCES=(--num-gpus 0 --num-cpus "$TASKS_PER_NODE")

preflight || { JOB_RC=$?; finish_job; }
export RAY_AUTH_MODE=token RAY_DISABLE_USAGE_STATS=1
export RAY_AUTH_TOKEN="${RAY_AUTH_TOKEN:-$(python -c 'import secrets; print(secrets.token_hex(32))')}"
# Every process of this cluster (Ray's own actors too: Ray Train's placement-group cleaner calls
# the state API without an address) finds this job's head, not the cluster last started on its
# host (/tmp/ray/ray_current_cluster), whose token is another job's.
export RAY_ADDRESS="$HEAD_ADDR:$RAY_PORT"
echo "[slurm] Ray head on ${NODES[0]} ($HEAD_ADDR:$RAY_PORT), $NNODES nodes x $TASKS_PER_NODE ranks"
srun --nodes=1 --ntasks=1 -w "${NODES[0]}" ray start --head --block --port="$RAY_PORT" \
  --node-ip-address="$HEAD_ADDR" --include-dashboard=false "${RAY_RESOURCES[@]}" &
HEAD_PID=$!
if (( NNODES > 1 )); then
  srun --nodes=$(( NNODES - 1 )) --ntasks=$(( NNODES - 1 )) --ntasks-per-node=1 --exclude="${NODES[0]}" \
    ray start --block --address="$HEAD_ADDR:$RAY_PORT" "${RAY_RESOURCES[@]}" &
  WORKERS_PID=$!
fi
# the cluster is up when every node has joined (a state, not a delay: `ray status` lists them);
# a head or worker srun that ended has failed (`--block` keeps them running), so stop waiting then
starting="" up=0
for _ in $(seq 300); do
  up=$(ray status --address="$HEAD_ADDR:$RAY_PORT" 2>/dev/null | grep -c "node_" || true)
  (( up >= NNODES )) && break
  for pid in "$HEAD_PID" ${WORKERS_PID:+"$WORKERS_PID"}; do
    kill -0 "$pid" 2>/dev/null || starting="a Ray node failed to start (its error is above)"
  done
  [[ -n $starting ]] && break
  sleep 1
done
if (( ${up:-0} < NNODES )); then
  echo "[slurm] Ray: ${up:-0} of $NNODES nodes joined: ${starting:-timed out after 300 s}"; JOB_RC=3
else
  JOB_RC=0
  python -m pretrain launch ray --num-workers "$WORLD_SIZE" --address "$HEAD_ADDR:$RAY_PORT" \
    --max-failures "${MAX_FAILURES:-3}" \
    $( (( GPUS_PER_NODE > 0 )) && echo --gpus-per-worker 1 || echo --cpus-per-worker 1) \
    -- "${RUN_ARGS[@]}" || JOB_RC=$?
fi
kill "$HEAD_PID" ${WORKERS_PID:+"$WORKERS_PID"} 2>/dev/null || true
# by name: a bare `wait` also waits for the job log's `tee` (a process substitution), forever
wait "$HEAD_PID" ${WORKERS_PID:+"$WORKERS_PID"} || true
echo "attempt=$ATTEMPT exit=$JOB_RC" >> "$LOG_DIR/attempts.txt"
finish_job
