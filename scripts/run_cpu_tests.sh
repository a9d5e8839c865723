#!/usr/bin/env bash
# The CPU test suite: pytest over tests/unit. GPU tests (marked `gpu`) skip themselves without CUDA;
# scripts/run_gpu_suite.sh runs them.
#
# Locally: in the active Python >= 3.12 virtualenv, else in .venv-ci (created), with this package
# installed editable with its `megatron` and `test` extras (what is already there in the supported
# ranges stays as it is).
#
# CI (CI=true, what .ci/run runs): the suite once per cell of a matrix of torch and megatron-core
# releases, the oldest and newest supported of each (megatron_offload/compat.py, SUPPORTED), one
# virtualenv per torch release, the wheels downloaded once into $CI_WHEEL_DIR for every cell.
#   CI_CELLS       "TORCH:MEGATRON_CORE ..." (default below; cells of one torch release adjacent)
#   CI_WHEEL_DIR   the wheel cache (default .ci-wheels; keep it between runs to download nothing)
#   CI_KEEP_VENVS  1: keep each cell's virtualenv (.venv-ci-torch*) instead of deleting it after use
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

pip_q() { local py=$1; shift; "$py" -m pip --disable-pip-version-check -q "$@"; }  # pip_q PYTHON ARGS...

if [ "${CI:-}" != true ]; then
  # An active virtualenv with Python >= 3.12 (the quick start's .venv) is used as it is, instead of
  # building a second one.
  if [ -z "${VENV:-}" ] && [ -n "${VIRTUAL_ENV:-}" ] &&
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
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[megatron,test]"
  exec "$VENV/bin/python" -m pytest -q tests/unit "$@"
fi

# --- CI: the matrix -----------------------------------------------------------------------------
CI_CELLS=${CI_CELLS:-"2.8.0:0.17.1 2.8.0:0.19.2 2.11.0:0.18.2 2.14.1:0.17.1 2.14.1:0.19.2"}
WHEELS=${CI_WHEEL_DIR:-.ci-wheels}
PY=$(find_python) || { echo "error: megatron-core needs Python >= 3.12 and none was found" >&2; exit 1; }
mkdir -p "$WHEELS"
read -r -a cells <<<"$CI_CELLS"
start_all=$SECONDS
summary=()
failed=0
venv=""
venv_torch=""
for i in "${!cells[@]}"; do
  torch_v=${cells[$i]%%:*}
  mcore_v=${cells[$i]#*:}
  n="$((i + 1))/${#cells[@]}"
  echo "=== cell $n: torch $torch_v, megatron-core $mcore_v" >&2
  t0=$SECONDS
  # Files already in $WHEELS are not downloaded again.
  pip_q "$PY" download --only-binary=:all: -d "$WHEELS" \
    "torch==$torch_v" "megatron-core==$mcore_v" numpy packaging pyyaml "pytest>=8"
  if [ "$torch_v" != "$venv_torch" ]; then
    if [ -n "$venv" ] && [ "${CI_KEEP_VENVS:-}" != 1 ]; then rm -rf "$venv"; fi
    venv=.venv-ci-torch$torch_v
    rm -rf "$venv"
    "$PY" -m venv "$venv"
    venv_torch=$torch_v
    pip_q "$venv/bin/python" install --no-index --find-links "$WHEELS" \
      "torch==$torch_v" "megatron-core==$mcore_v" numpy packaging pyyaml "pytest>=8"
    pip_q "$venv/bin/python" install --no-deps -e .
  else  # the same torch: only megatron-core changes
    pip_q "$venv/bin/python" install --no-index --find-links "$WHEELS" --no-deps "megatron-core==$mcore_v"
  fi
  found=$("$venv/bin/python" -c 'from importlib.metadata import version as v
print("megatron-core", v("megatron-core") + ", torch", v("torch"))')
  t1=$SECONDS
  log=$(mktemp)
  rc=0
  "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/unit "$@" 2>&1 | tee "$log" || rc=$?
  # pytest's last line: "238 passed, 2 skipped, 126 warnings in 52.84s"
  counts=$(grep -E '^(=+ )?[0-9]+ [a-z]+.* in [0-9.]+s' "$log" | tail -n 1 |
           sed -E 's/^=+ //; s/ in [0-9.]+s.*$//; s/, [0-9]+ warnings?//')
  rm -f "$log"
  [ "$rc" = 0 ] || failed=1
  line="cell $n: $found: ${counts:-no result} (exit $rc); setup $((t1 - t0)) s, tests $((SECONDS - t1)) s"
  echo "$line" >&2
  summary+=("$line")
done
if [ -n "$venv" ] && [ "${CI_KEEP_VENVS:-}" != 1 ]; then rm -rf "$venv"; fi
echo "=== CPU suite, ${#cells[@]} cells, $((SECONDS - start_all)) s in all" >&2
printf '%s\n' "${summary[@]}" >&2
exit "$failed"
