#!/usr/bin/env bash
# Several GPU-suite runs in one device call, each with its own settings, output and work folder:
#
#   bash benchmarks/tools/device_call.sh 'NAME:ENV=VALUE ENV2="A B"' ['NAME2:...' ...]
#
# runs `scripts/run_gpu_suite.sh` once per spec with the spec's variables exported, OUT=$OUT/NAME and
# WORK=/tmp/w_NAME (kept on a warm machine: a later call can resume from its checkpoints), prints
# each run's exit status and the tail of its console log, and at the end packs every NAME folder
# into $OUT/results.tgz: a device call brings back at most 8 files, so the folders travel as one.
# The suite samples the node's MemAvailable itself (memavailable_kib.log in each logs.tgz).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=${OUT:-/tmp/megatron_offload_gpu}
mkdir -p "$R"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$R/gpus.txt" 2>&1
git log -1 --format=%H > "$R/device_git_head.txt" 2>/dev/null  # (the last pushed commit: the tree travels, not it)
for spec in "$@"; do
  name=${spec%%:*}; envs=${spec#*:}
  echo "=== $name: $envs ($(date +%T))"
  ( eval "export $envs"; OUT=$R/$name WORK=/tmp/w_$name bash scripts/run_gpu_suite.sh ) > "$R/$name.console.log" 2>&1
  echo "=== $name rc=$? ($(date +%T))"
  tail -25 "$R/$name.console.log"
done
( cd "$R" && dirs=$(ls -d -- */ 2>/dev/null) && [ -n "$dirs" ] && tar czf results.tgz $dirs && rm -rf $dirs )
