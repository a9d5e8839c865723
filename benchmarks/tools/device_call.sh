#!/usr/bin/env bash
# Several GPU-suite runs in one device call, each with its own settings, output and work folder:
#
#   bash benchmarks/tools/device_call.sh 'NAME:ENV=VALUE ENV2="A B"' ['NAME2:...' ...]
#
# runs `scripts/run_gpu_suite.sh` once per spec with the spec's variables exported, OUT=$OUT/NAME and
# WORK=/tmp/w_NAME (kept on a warm machine: a later call can resume from its checkpoints), prints
# each run's exit status and the tail of its console log, and at the end packs every NAME folder
# (console logs included) into $OUT/results.tgz: a device call brings back at most 8 files, so the
# folders travel as one.
# A lone '&' between specs runs the spec before it in the background, beside the ones after it
# (e.g. a functional suite on all GPUs beside a matrix: `'func:...' '&' 'moe:...' 'mx:...'`); the
# carried wheels are then installed once, before any spec starts (two suites installing into the
# same folder at once would race), and no spec may set TE=1 or WHEELS (Transformer Engine's
# installer empties its folder first: run those specs in a call without '&').
# The suite samples the node's MemAvailable itself (memavailable_kib.log in each logs.tgz).
# A spec's /tmp/w_NAME/ckpt_scratch is deleted when it ends (e.g. a benchmark's checkpoints:
# --extra=--save=/tmp/w_NAME/ckpt_scratch; logs.tgz never packs a WORK folder named ckpt_*), so
# that the next spec has the disk.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=${OUT:-/tmp/megatron_offload_gpu}
mkdir -p "$R"
# The call's own records go into a folder too, so that they travel inside results.tgz: a call
# then brings back one file however it was run (several device_call.sh runs in one command, each
# with OUT=$OUT/NAME, stay within the 8 files a command returns).
mkdir -p "$R/_call"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$R/_call/gpus.txt" 2>&1
git log -1 --format=%H > "$R/_call/device_git_head.txt" 2>/dev/null  # (the last pushed commit: the tree travels, not it)

if printf '%s\n' "$@" | grep -qx '&'; then
  if printf '%s\n' "$@" | grep -Eq '(^|[: ])(TE=1|WHEELS=)'; then
    echo "device_call.sh: with '&' no spec may set TE=1 or WHEELS (their installs would race)" >&2
    exit 2
  fi
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || exit 1
    export PYTHONPATH=/tmp/site:$PWD WHEELS=none  # (run_gpu_suite.sh keeps a PYTHONPATH it is given)
    python3 -c 'import megatron.core as m; print("megatron-core", m.__version__)' > "$R/_call/versions.txt" 2>&1
  fi
fi

# One spec; its exit status is the suite's.
run_spec() {
  local name=${1%%:*} envs=${1#*:} rc
  mkdir -p "$R/$name"
  echo "=== $name: $envs ($(date +%T))"
  ( eval "export $envs"; OUT=$R/$name WORK=/tmp/w_$name bash scripts/run_gpu_suite.sh ) > "$R/$name/console.log" 2>&1
  rc=$?
  rm -rf "/tmp/w_$name/ckpt_scratch"
  echo "=== $name rc=$rc ($(date +%T))"
  tail -25 "$R/$name/console.log"
  return $rc
}

status=0
background=()
specs=("$@")
for i in "${!specs[@]}"; do
  spec=${specs[$i]}
  [ "$spec" = "&" ] && continue
  if [ "${specs[$((i + 1))]:-}" = "&" ]; then
    run_spec "$spec" > "$R/.${spec%%:*}.tail" 2>&1 &
    background+=("$!:${spec%%:*}")
  else
    run_spec "$spec" || status=1
  fi
done
for entry in "${background[@]}"; do
  wait "${entry%%:*}" || status=1
  cat "$R/.${entry#*:}.tail" && rm -f "$R/.${entry#*:}.tail"
done
# A second run of this script with the same OUT packs into results_2.tgz (and so on), not over the first's.
pack=results.tgz n=2
while [ -e "$R/$pack" ]; do pack=results_$n.tgz; n=$((n + 1)); done
( cd "$R" && dirs=$(ls -d -- */ 2>/dev/null) && [ -n "$dirs" ] && tar czf "$pack" $dirs && rm -rf $dirs )
exit $status  # (non-zero where any spec's suite failed)
