# Sourced by demo.sh and test.sh: make .venv and install the project once (idempotent).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.shardtensor-installed
# a change to pyproject.toml (dependencies) reinstalls
want="$(sha256sum < pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setting up .venv (first run, or the build files changed) ..." >&2
  # torch first, pinned: a bare 'torch' would pull the multi-GB CUDA build.
  .venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e '.[dev,titan]'
  # torchtitan (PyTorch's trainer, run by tests/test_torchtitan.py) and the torch companions it
  # imports, without their dependencies: pip would otherwise resolve torch again
  .venv/bin/python -m pip install -q --no-deps "torchtitan==0.3.0" "torch_checkpointing==0.1.1" \
    "spmd_types==0.2.3" "torchdata==0.11.0"
  echo "$want" > "$stamp"
fi
