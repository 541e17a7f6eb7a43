#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install the package into it.
#
#   bash launch/setup_env.sh            # runtime + test dependencies
#
# Idempotent: a second run only checks what is installed. torch is installed first and pinned
# (launch/constraints.txt) so that no other package can pull a multi-GB CUDA build.
# DeepSpeed's C++ ops are compiled just in time on first use into .build/torch_extensions.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PRETRAIN_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.pretrain-installed"

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup] creating virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi
# The stamp records the constraints file it was installed from: edit it and the next run reinstalls.
want="$(cat "$ROOT/launch/constraints.txt" "$ROOT/setup.py" | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  echo "[setup] environment up to date ($VENV)"
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
