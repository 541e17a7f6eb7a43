# Sourced by the launch/ scripts and slurm/common.sh, with ROOT set to the repository (unset: the
# repository this file is in): the environment every way of starting ranks shares.
#
#   activate_venv [DIR]   activate DIR's virtual environment; without DIR, the repository's .venv
#                         unless one is active already (a user's own environment is kept)
#   rank_env GPUS [RANKS] DS_ACCELERATOR (cuda with GPUS > 0, else cpu) and, given RANKS per
#                         node and CPU ranks, OMP_NUM_THREADS = this node's cores / RANKS
#                         (oversubscribed intra-op threads made 2 ranks on 2 cores 2x slower);
#                         values already set in the environment win
#   gpu_count             this node's GPUs, as torch sees them
#   cpu_cores             this machine's cores: GNU nproc, else macOS's sysctl, else getconf
# and, on sourcing: TORCH_EXTENSIONS_DIR (DeepSpeed's compiled ops) defaults to
# $ROOT/.build/torch_extensions, where `bash launch/setup_env.sh --ops` builds them.
ROOT="${ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.build/torch_extensions}"

activate_venv() {
  local venv="${1:-}"
  if [[ -z $venv ]]; then
    [[ -n ${VIRTUAL_ENV:-} ]] && return 0
    venv="$ROOT/.venv"
  fi
  if [[ -f $venv/bin/activate ]]; then
    source "$venv/bin/activate"
  fi
  return 0
}

rank_env() {
  local gpus=$1 ranks=${2:-}
  export DS_ACCELERATOR="${DS_ACCELERATOR:-$( (( gpus > 0 )) && echo cuda || echo cpu)}"
  if [[ $DS_ACCELERATOR == cpu && -n $ranks ]]; then
    local cores
    cores=$(cpu_cores)
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cores / ranks > 0 ? cores / ranks : 1 ))}"
  fi
}

cpu_cores() {
  nproc 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1
}

gpu_count() {
  python -c 'import torch; print(torch.cuda.device_count())'
}
