#!/usr/bin/env bash
# The README's second command (and what CI runs): set up the environment, run the whole suite.
#
#   bash launch/test.sh                  # everything, 2 pytest workers (what CI runs)
#   bash launch/test.sh --quick          # the quick tier: no training runs or Slurm (pytest -m "not slow")
#   bash launch/test.sh -k zero -x       # extra arguments go to pytest
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source launch/env.sh
rank_env 0  # the suite runs CPU ranks: DS_ACCELERATOR=cpu unless set
TIER=()
if [[ "${1:-}" == "--quick" ]]; then
  shift
  TIER=(-m "not slow")
  bash launch/setup_env.sh
else
  # The full suite trains with DeepSpeed's compiled ops (CPU Adam, async I/O against libaio-dev):
  # built once here, on every core, not inside the first test that loads each while the other
  # pytest worker competes for the CPU.
  if [[ ! -f /usr/include/libaio.h && $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
    echo "[test] installing libaio-dev (NVMe offload) ..."
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev >/dev/null
  fi
  bash launch/setup_env.sh --ops
fi
# loadfile: each test file runs on one worker, so the local Slurm cluster of tests/test_slurm.py is
# started once (pytest-xdist 3.8's loadgroup is a no-op under pytest 9: see that file).
exec .venv/bin/python -m pytest "${TIER[@]}" -n "${PYTEST_WORKERS:-2}" --dist loadfile --durations=15 "$@" tests
