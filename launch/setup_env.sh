#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install the package into it.
#
#   bash launch/setup_env.sh            # runtime + test dependencies
#   bash launch/setup_env.sh --ops      # also compile the DeepSpeed ops the shipped configs need
#
# Idempotent: a second run only checks what is installed. torch is installed first and pinned
# (launch/constraints.txt) so that no other package can pull a multi-GB CUDA build.
# --ops: DeepSpeed's C++ ops that offloading configs load (CPU Adam; async I/O for NVMe, which
# needs libaio-dev) are compiled here, into $TORCH_EXTENSIONS_DIR (default .build/torch_extensions),
# instead of by every rank at its first step. Run it on a node like the compute nodes (same CPU
# model: the CPU ops are built with -march=native); Slurm jobs copy these builds to node-local
# scratch (or compile there when the CPU differs). An op that cannot be built here is reported.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PRETRAIN_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.pretrain-installed"
BUILD_OPS=0
for arg in "$@"; do
  case $arg in
    --ops) BUILD_OPS=1 ;;
    *) echo "error: unknown argument $arg (use --ops or nothing)" >&2; exit 2 ;;
  esac
done

build_ops() {  # compiled DeepSpeed ops of ds_configs/*.json, into TORCH_EXTENSIONS_DIR
  (( BUILD_OPS )) || return 0
  export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.build/torch_extensions}"
  echo "[setup] building DeepSpeed's compiled ops into $TORCH_EXTENSIONS_DIR ..."
  (cd "$ROOT" && "$VENV/bin/python" -m pretrain launch build-ops --shipped) \
    || echo "[setup] warning: not every op could be built here (above); configs that need it are refused by the pre-flight" >&2
}

# `bin/activate` is written last: without it a venv's creation was cut short (the launch scripts
# activate it, and would run the system's python), so it is made again
if [[ ! -x "$VENV/bin/python" || ! -f "$VENV/bin/activate" ]]; then
  echo "[setup] creating virtual environment $VENV"
  "$PY" -m venv --clear "$VENV"
fi
# The stamp records the constraints file it was installed from: edit it and the next run reinstalls.
want="$(cat "$ROOT/launch/constraints.txt" "$ROOT/setup.py" | { sha256sum 2>/dev/null || shasum -a 256; } | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  echo "[setup] environment up to date ($VENV)"
  build_ops
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
echo "[setup] installing torch (CPU build when no CUDA) ..."
"$VENV/bin/python" -m pip install -q -c "$ROOT/launch/constraints.txt" torch 2>&1 | grep -v "is ignored" || true
echo "[setup] installing deepspeed and the rest ..."
DS_BUILD_OPS=0 "$VENV/bin/python" -m pip install -q -c "$ROOT/launch/constraints.txt" \
  -e "$ROOT[test]" 2>&1 | grep -v "is ignored" || true
"$VENV/bin/python" -c "import torch, deepspeed, transformers, sentencepiece, pretrain" \
  || { echo "[setup] error: the environment did not install cleanly" >&2; exit 1; }
echo "$want" > "$STAMP"
echo "[setup] done: $("$VENV/bin/python" -c 'import torch, deepspeed; print("torch", torch.__version__, "deepspeed", deepspeed.__version__)')"
build_ops
