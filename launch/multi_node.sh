#!/usr/bin/env bash
# Train on several nodes through the deepspeed launcher, GPUS_PER_NODE ranks per node.
#
#   NODES="gpu[01-04]" bash launch/multi_node.sh --config configs/llama_7b.yaml   # pdsh (ssh) from here
#   HOSTFILE=my_hosts  bash launch/multi_node.sh --config ...                       # your hostfile
#   LAUNCHER=slurm     bash launch/multi_node.sh --config ...    # inside salloc/sbatch: DeepSpeed runs srun
#   srun --ntasks-per-node 1 env LAUNCHER=no_ssh bash launch/multi_node.sh ...   # one launcher per node
#
# Arguments go to `pretrain train`. Environment:
#   LAUNCHER       pdsh (default: ssh to every node), slurm, or no_ssh (this script runs on every
#                  node, e.g. under srun; node rank from SLURM_NODEID or NODE_RANK)
#   NODES          host list in Slurm syntax; default: the Slurm allocation ($SLURM_JOB_NODELIST)
#   HOSTFILE       use this DeepSpeed hostfile instead of writing one from NODES
#   GPUS_PER_NODE  ranks per node (default: this node's GPU count, else 1 CPU rank)
#   MASTER_ADDR / MASTER_PORT  rendezvous (default: the first node; 20000 + job id % 20000 in a
#                  Slurm job, else 29500)
# The hostfile and the environment every rank gets (DeepSpeed's .deepspeed_env: PYTHON*, NCCL_*,
# TORCH_*, OMP_NUM_THREADS, DS_ACCELERATOR, PATH, ...) are written to $LAUNCH_DIR
# (default runs/launch/<job id or pid>).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source launch/env.sh  # venv, TORCH_EXTENSIONS_DIR, DS_ACCELERATOR, OMP_NUM_THREADS
activate_venv
LAUNCHER="${LAUNCHER:-pdsh}"
GPUS="$(gpu_count)"
GPUS_PER_NODE="${GPUS_PER_NODE:-$(( GPUS > 0 ? GPUS : 1 ))}"
rank_env "$GPUS" "$GPUS_PER_NODE"
LAUNCH_DIR="${LAUNCH_DIR:-runs/launch/${SLURM_JOB_ID:-$$}}"
mkdir -p "$LAUNCH_DIR" && LAUNCH_DIR="$(cd "$LAUNCH_DIR" && pwd)"

if [[ -z ${HOSTFILE:-} ]]; then
  HOSTFILE="$LAUNCH_DIR/hostfile"
  python -m pretrain launch hostfile ${NODES:+--nodes "$NODES"} --slots "$GPUS_PER_NODE" --output "$HOSTFILE"
fi
FIRST_NODE="$(awk 'NF && $1 !~ /^#/ {print $1; exit}' "$HOSTFILE")"
export MASTER_ADDR="${MASTER_ADDR:-$FIRST_NODE}"
export MASTER_PORT="${MASTER_PORT:-$( [[ -n ${SLURM_JOB_ID:-} ]] && echo $(( 20000 + SLURM_JOB_ID % 20000 )) || echo 29500)}"
# DeepSpeed reads os.path.join(dir, DS_ENV_FILE) for dir in (~, .): an absolute path wins.
export DS_ENV_FILE="$LAUNCH_DIR/deepspeed_env"
python -m pretrain launch env-file --output "$DS_ENV_FILE"

DS_ARGS=(--hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
case $LAUNCHER in
  pdsh)   exec deepspeed "${DS_ARGS[@]}" --launcher pdsh --no_local_rank --module pretrain train "$@" ;;
  slurm)  exec deepspeed "${DS_ARGS[@]}" --launcher slurm --no_ssh_check launch/run_pretrain.py train "$@" ;;
  no_ssh) exec deepspeed "${DS_ARGS[@]}" --no_ssh --node_rank "${NODE_RANK:-${SLURM_NODEID:?set NODE_RANK}}" \
            --no_local_rank --module pretrain train "$@" ;;
  *) echo "error: LAUNCHER=$LAUNCHER: use pdsh, slurm or no_ssh" >&2; exit 2 ;;
esac
