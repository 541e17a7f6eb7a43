#!/usr/bin/env bash
# One command on one GPU: every CUDA-only path of the stack, whether it ran and whether it
# matched its reference (bench/gpu_check.py says what each row does). Exit 0 when every row holds.
#
#   bash bench/gpu_check.sh                 # on the GPU machine; JSON to $OUT/gpu_check.json
#   bash bench/gpu_check.sh --dry-run       # the same rows on the CPU, tiny shapes (~10 s)
#   bash bench/gpu_check.sh --prepare       # here, with a network: the wheelhouse below
#   bash bench/gpu_check.sh [--dry-run] PATH.json
#
# The GPU machine has its own python3 with torch and no network. What `import pretrain` needs
# and that python lacks (DeepSpeed and its pure-python dependencies) travels as a wheelhouse in
# .build/gpu_wheels (`--prepare` downloads exactly those packages; carry that folder), installed
# with `pip install --target` into a folder on PYTHONPATH. Not a `venv --system-site-packages`:
# that python is itself a virtual environment, and a venv made from one sees the base
# interpreter's site-packages, not the one that holds torch.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.build/gpu_wheels
SITE=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3; fi

# packages the GPU machine's image lacks (its package list: /work/.library/device/KINDS.md),
# pinned to the versions this repository is tested with; DeepSpeed as its source archive
# (torchao: train.fp8's float8 training, the fp8 rows)
PACKAGES=(hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
          typing-inspection==0.4.5 torchao==0.18.0)
DEEPSPEED=deepspeed==0.19.8

if [[ "${1:-}" == "--prepare" ]]; then
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    "$PY" -m pip download -q --no-deps --no-build-isolation --no-binary=:all: -d "$WHEELS" "$DEEPSPEED"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$WHEELS" "${PACKAGES[@]}"
    ls -l "$WHEELS"
    du -sh "$WHEELS"
    exit 0
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ "${1:-}" != "--dry-run" ]] && ! "$PY" -c "import deepspeed, hjson, pydantic, torchao" 2>/dev/null; then
    if [[ ! -d "$WHEELS" ]]; then
        echo "gpu_check: DeepSpeed is missing and there is no $WHEELS (run --prepare where pip" \
             "reaches an index, and carry the folder)" >&2
    else
        echo "gpu_check: installing $(ls "$WHEELS" | wc -l) packages from $WHEELS into $SITE" >&2
        DS_BUILD_OPS=0 DS_SKIP_CUDA_CHECK=1 "$PY" -m pip install -q --no-index --no-deps \
            --no-build-isolation --no-cache-dir --target "$SITE" "$WHEELS"/* >&2
        export PYTHONPATH="$PYTHONPATH:$SITE"
    fi
fi
export DS_BUILD_OPS=0
exec "$PY" bench/gpu_check.py "$@"
