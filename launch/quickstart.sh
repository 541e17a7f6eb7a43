#!/usr/bin/env bash
# The README's first command: set up, prepare the bundled corpus, train on 2 CPU ranks through
# the deepspeed launcher with ZeRO-2, then continue a prompt with the trained model.
#
#   bash launch/quickstart.sh                      # defaults from configs/quickstart.yaml
#   bash launch/quickstart.sh --set train.steps=50 # any `pretrain train` argument is passed on
#   NPROC=4 bash launch/quickstart.sh              # 1, 2, 4, 8 or 16 ranks (GPUs when present)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash launch/setup_env.sh
source launch/env.sh
activate_venv "$ROOT/.venv"
NPROC="${NPROC:-2}"
# Name DeepSpeed's accelerator (it warns when it has to guess the CPU); threads left to torch.
rank_env "$(gpu_count)"
# The global batch stays 16 samples: each rank's micro-batch shrinks as ranks are added.
if (( NPROC < 1 || 16 % NPROC )); then
  echo "error: NPROC=$NPROC: the quickstart's global batch of 16 must divide into NPROC ranks (1, 2, 4, 8 or 16)" >&2
  exit 2
fi
MICRO=$(( 16 / NPROC > 8 ? 8 : 16 / NPROC ))
PORT="${MASTER_PORT:-$((29500 + RANDOM % 1000))}"
DATA=runs/data
start=$(date +%s)

# 1. tokenizer and dataset from this interpreter's standard library (made once, then reused)
[[ -f $DATA/stdlib_bpe8k.model ]] || \
  pretrain tokenizer --corpus python-stdlib --vocab-size 8192 --output $DATA/stdlib_bpe8k.model
[[ -f $DATA/stdlib_bpe8k.idx ]] || \
  pretrain preprocess --corpus python-stdlib --tokenizer $DATA/stdlib_bpe8k.model \
    --output-prefix $DATA/stdlib_bpe8k --workers 2

# 2. train: NPROC ranks, ZeRO-2, precision auto (configs/quickstart.yaml); resumes if a
#    checkpoint exists
deepspeed --num_gpus "$NPROC" --master_port "$PORT" --no_local_rank --module pretrain \
  train --config configs/quickstart.yaml --set train.micro_batch_size="$MICRO" "$@"

# 3. use the model
echo "---- sample from runs/quickstart/final (temperature 0.8, top-k 40) ----"
pretrain generate --checkpoint runs/quickstart --prompt "def " --max-new-tokens 60 --temperature 0.8 --top-k 40
echo "---- quickstart finished in $(( $(date +%s) - start ))s ----"
