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
# torch: take the pinned CPU build when none is installed; a bare requirement
# would pull a multi-GB CUDA build.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing torch==2.13.0"
  "$PY" -m pip install -q "torch==2.13.0"
fi
EXTRAS="${DISTBATCH_EXTRAS:-dev}"
stamp=".venv/.distbatch-installed-$EXTRAS"
if [ ! -f "$stamp" ] || [ setup.cfg -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[setup] installing distbatch[$EXTRAS] (editable)"
  "$PY" -m pip install -q --disable-pip-version-check -e ".[$EXTRAS]"
  touch "$stamp"
fi
