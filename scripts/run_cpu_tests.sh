#!/usr/bin/env bash
# The CPU test suite (what CI runs): a Python >= 3.12 virtual environment with torch and
# megatron-core from PyPI, this package installed editable, then pytest over tests/unit.
# GPU tests (marked `gpu`) skip themselves without CUDA; scripts/run_gpu_suite.sh runs them.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  local p v
  for p in "${PYTHON:-}" python3.12 python3.13 python3; do
    if [ -n "$p" ] && command -v "$p" >/dev/null 2>&1 &&
       "$p" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 12))' >/dev/null 2>&1; then
      echo "$p"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then  # pyenv interpreters: 3.12 (what the GPU machines run) first
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12' | sort -rV) \
             $(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[3-9]' | sort -V); do
      p="$(pyenv root)/versions/$v/bin/python3"
      if [ -x "$p" ]; then echo "$p"; return 0; fi
    done
  fi
  return 1
}

# An active virtualenv with Python >= 3.12 (the quick start's .venv) is used as it is, instead of
# building a second one; CI (CI=true) always builds its own .venv-ci.
if [ -z "${VENV:-}" ] && [ -n "${VIRTUAL_ENV:-}" ] && [ "${CI:-}" != true ] &&
   "$VIRTUAL_ENV/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 12))' 2>/dev/null; then
  VENV=$VIRTUAL_ENV
fi
VENV=${VENV:-.venv-ci}
if [ ! -x "$VENV/bin/python" ]; then
  PY=$(find_python) || { echo "error: megatron-core needs Python >= 3.12 and none was found" >&2; exit 1; }
  echo "creating $VENV with $PY; installing torch and megatron-core takes a few minutes the first time" >&2
  "$PY" -m venv "$VENV"
fi
echo "using $VENV" >&2
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch>=2.11,<2.12" "megatron-core==0.19.2" numpy packaging "pytest>=8"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
"$VENV/bin/python" -m pytest -q tests/unit "$@"
