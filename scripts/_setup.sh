# Shared by scripts/demo and scripts/test: make .venv and install what is needed.
# Sourced, not run. Leaves $PY pointing at the venv's python.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $PYTHON"
  "$PYTHON" -m venv .venv
fi
PY="$ROOT/.venv/bin/python"
# torch, when none is installed: torch==2.13.0 (setup.cfg itself accepts any recent torch).
# Which build comes is the package index's choice: on PyPI for Linux that is the CUDA build
# (several GB). DISTBATCH_TORCH_INDEX picks the index, e.g. https://download.pytorch.org/whl/cpu
# for the CPU-only build; or install the torch you want into .venv before running this.
TORCH_SPEC="torch==2.13.0"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  if [ -n "${DISTBATCH_TORCH_INDEX:-}" ]; then
    echo "[setup] installing $TORCH_SPEC from $DISTBATCH_TORCH_INDEX"
    "$PY" -m pip install -q --index-url "$DISTBATCH_TORCH_INDEX" "$TORCH_SPEC"
  else
    echo "[setup] installing $TORCH_SPEC from your package index (on PyPI for Linux: the CUDA build," \
      "several GB; DISTBATCH_TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the CPU build)"
    "$PY" -m pip install -q "$TORCH_SPEC"
  fi
fi
EXTRAS="${DISTBATCH_EXTRAS:-dev}"
stamp=".venv/.distbatch-installed-$EXTRAS"
if [ ! -f "$stamp" ] || [ setup.cfg -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[setup] installing distbatch[$EXTRAS] (editable)"
  "$PY" -m pip install -q --disable-pip-version-check -e ".[$EXTRAS]"
  touch "$stamp"
fi
