# Shared by scripts/demo and scripts/test: make .venv and install what is needed.
# Sourced, not run. Leaves $PY pointing at the venv's python.
#
# Every package installs at the version pinned in scripts/constraints.txt (the one list, made
# by `uv pip compile`: see its first lines to make it again), so a fresh clone tests what was
# tested. uv installs them in seconds where pip takes a minute and a half; without uv (no
# network for it) pip does the same work with the same pins.
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
CONSTRAINTS="$ROOT/scripts/constraints.txt"
UV_VERSION="0.13.9"
if [ ! -x .venv/bin/uv ]; then
  "$PY" -m pip install -q --disable-pip-version-check "uv==$UV_VERSION" >/dev/null 2>&1 \
    || echo "[setup] uv could not be installed: installing with pip (slower)"
fi
# uv reads no pip configuration: hand it the local wheel folders pip is told about (where a
# machine keeps its torch build, say).
FIND_LINKS=()
for links in ${PIP_FIND_LINKS:-} $("$PY" -m pip config get global.find-links 2>/dev/null || true); do
  [ -d "$links" ] && FIND_LINKS+=(--find-links "$links")
done
# pip writes .pyc files at install, uv does not: after uv has installed anything,
# scripts/warm_bytecode.py imports what distbatch's processes import, once, which writes their
# .pyc files (17 CPU-s here; compileall of the whole install took 62).
INSTALLED_WITH_UV=0
install() {
  if [ -x .venv/bin/uv ]; then
    .venv/bin/uv pip install -q --python "$PY" "${FIND_LINKS[@]}" "$@"
    INSTALLED_WITH_UV=1
  else
    "$PY" -m pip install -q --disable-pip-version-check "$@"
  fi
}
# torch, when none is installed: torch==2.13.0 (setup.cfg itself accepts any recent torch).
# Which build comes is the package index's choice: on PyPI for Linux that is the CUDA build
# (several GB). DISTBATCH_TORCH_INDEX picks the index, e.g. https://download.pytorch.org/whl/cpu
# for the CPU-only build; or install the torch you want into .venv before running this.
TORCH_SPEC="torch==2.13.0"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  if [ -n "${DISTBATCH_TORCH_INDEX:-}" ]; then
    echo "[setup] installing $TORCH_SPEC from $DISTBATCH_TORCH_INDEX"
    install --index-url "$DISTBATCH_TORCH_INDEX" "$TORCH_SPEC"
  else
    echo "[setup] installing $TORCH_SPEC from your package index (on PyPI for Linux: the CUDA build," \
      "several GB; DISTBATCH_TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the CPU build)"
    install "$TORCH_SPEC"
  fi
fi
EXTRAS="${DISTBATCH_EXTRAS:-dev}"
stamp=".venv/.distbatch-installed-$EXTRAS"
if [ ! -f "$stamp" ] || [ setup.cfg -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ] \
  || [ "$CONSTRAINTS" -nt "$stamp" ]; then
  echo "[setup] installing distbatch[$EXTRAS] (editable), pinned by scripts/constraints.txt"
  install -c "$CONSTRAINTS" -e ".[$EXTRAS]"
  touch "$stamp"
fi
# AReaL, for the tests of distbatch.areal (extra areal-test: what `import areal` needs), without
# its own requirements: they pin torch below 2.11 and much that its RPC layer never imports.
AREAL_SPEC="areal==1.0.4"
case ",$EXTRAS," in
  *",areal-test,"*)
    if ! "$PY" -c "import importlib.metadata as m; assert m.version('areal') == '${AREAL_SPEC#*==}'" \
      >/dev/null 2>&1; then
      echo "[setup] installing $AREAL_SPEC (without its dependencies)"
      install --no-deps "$AREAL_SPEC"
    fi ;;
esac
if [ "$INSTALLED_WITH_UV" = 1 ]; then
  echo "[setup] writing the bytecode of what the processes import"
  "$PY" "$ROOT/scripts/warm_bytecode.py" || true
fi
