#!/usr/bin/env bash
# The whole GPU suite in one call (for a lent multi-GPU machine with no package index):
#   1. install carried wheels from .whl/ (megatron-core) if present, and with TE=1 Transformer Engine
#      from te_carry/ (scripts/prepare_te.sh),
#   2. GPU unit tests (pytest -m gpu, 1 GPU, real DistributedOptimizer),
#   3. functional runs through torchrun (bit-exact losses/params, memory, checkpoint resume;
#      FUNCTIONAL_SETS runs them once per named set of arguments),
#   4. optionally the parallel-layout matrix (stage `matrix`, 2-4 GPUs),
#   5. optionally the side-by-side benchmark (BENCH=r1|small),
#   6. optionally `probe`: does a side-stream copy slow compute down, per CUDA_DEVICE_MAX_CONNECTIONS,
#   7. optionally `hostprobe` (benchmarks/tools/host_memory_probe.py: pinned memory and forked children),
#   8. optionally `sweep` (scripts/sweep.py, SWEEP_ARGS) and `maxfit` (scripts/max_fit.py, MAXFIT_ARGS),
#   8b. optionally `readprobe` (benchmarks/tools/read_behind_copy_probe.py: a read behind the copy-out),
#   9. optionally `phase` (benchmarks/tools/phase_switch_bench.py, PHASE_ARGS: phase switches, three ways)
#      and `demo` (scripts/demo.py, DEMO_ARGS),
#  10. optionally `asyncprobe` (benchmarks/tools/async_save_probe.py, ASYNCPROBE_ARGS: an async save's
#      blocked time by the form of the tensors it reads).
# Logs go to $OUT (or /tmp/megatron_offload_gpu): gpu_unit.log, functional.log, benchmark.log,
# *.json summaries and logs.tgz (every run log and record, benchmark plots; no checkpoints).
#
#   STAGES="unit functional bench" BENCH=r1 bash scripts/run_gpu_suite.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# Never let NCCL / PyTorch / NVSHMEM use NVLink multicast (shared machines).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/megatron_offload_gpu}
WORK=${WORK:-/tmp/megatron_offload_work}
STAGES=${STAGES:-"unit functional"}
NPROC=${NPROC:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
mkdir -p "$OUT" "$WORK"
# SUITE_BUDGET_S: stop any stage still running this many seconds after the start, so that the
# logs are still packed into $OUT before the caller's own time limit.
DEADLINE=$(( $(date +%s) + ${SUITE_BUDGET_S:-100000} ))
within_budget() { timeout $(( DEADLINE - $(date +%s) > 1 ? DEADLINE - $(date +%s) : 1 )) "$@"; }

# WHEELS: the folder of carried wheels (default .whl; e.g. WHEELS=.whl17 for megatron-core 0.17.1 + pyyaml),
# each folder installed into a site directory of its own.
WHEELS=${WHEELS:-.whl}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  SITE=/tmp/site; [ "$WHEELS" = .whl ] || SITE=/tmp/site_$(basename "$WHEELS")
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=$SITE:$PWD
  python3 -c 'import megatron.core as m; print("megatron-core", m.__version__)' > "$OUT/versions.txt" || exit 1
  cat "$OUT/versions.txt"
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
if [ "${TE:-0}" = 1 ]; then
  # Transformer Engine from the carried bundle (scripts/prepare_te.sh); megatron-core then uses
  # TE's FusedAdam, and TE layers with --transformer-impl transformer_engine.
  SP=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  T0=$(date +%s)
  bash te_carry/install_te.sh te_carry /tmp/te_site python3 > "$OUT/te_install.log" 2>&1 || { cat "$OUT/te_install.log"; exit 1; }
  export PYTHONPATH=/tmp/te_site:$PYTHONPATH
  export LD_LIBRARY_PATH=$SP/nvidia/nccl/lib:$SP/nvidia/cu13/lib:$SP/nvidia/cudnn/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  # TE=1 must never quietly run without TE (megatron-core would fall back to torch Adam).
  python3 -c 'import torch, transformer_engine.pytorch as te, transformer_engine; print("TE", transformer_engine.__version__)' \
    >> "$OUT/te_install.log" 2>&1 || { echo "TE=1 but Transformer Engine does not import:"; tail -5 "$OUT/te_install.log"; exit 1; }
  tail -1 "$OUT/te_install.log"
  echo "TE install: $(( $(date +%s) - T0 )) s" | tee -a "$OUT/te_install.log"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nvidia-smi topo -m; } | tee "$OUT/gpus.txt"
# The node's MemAvailable every second for the whole suite (unix time, kB; in logs.tgz): host
# memory is measured in every GPU run, the processes' own figures miss pinned and shared pages.
( while true; do echo "$(date +%s) $(awk '/^MemAvailable/{print $2}' /proc/meminfo)"; sleep 1; done ) \
  > "$WORK/memavailable_kib.log" 2>/dev/null &
SAMPLER=$!
trap 'kill $SAMPLER 2>/dev/null' EXIT
# An allocator history (MEGATRON_OFFLOAD_MEMHIST) read with scripts/alloc_trace.py into $2, while
# SUITE_BUDGET_S lasts (the logs must still be packed after it). ALLOC_TRACE_ARGS: other options.
read_memhist() {
  # shellcheck disable=SC2086  # (a list of options)
  within_budget python3 scripts/alloc_trace.py "$1" ${ALLOC_TRACE_ARGS:---peaks --holes --layout-growths 3} > "$2" 2>&1 \
    || true
}
# Every run folder's histories under $1, read beside each one (alloc_rank<R>.txt, in logs.tgz).
read_memhists() {
  for f in "$1"/*/memhist_rank*.npz; do
    [ -e "$f" ] || continue
    [ "$(date +%s)" -lt "$DEADLINE" ] || { echo "allocator histories left unread: SUITE_BUDGET_S"; break; }
    read_memhist "$f" "$(dirname "$f")/alloc_$(basename "$f" .npz | sed 's/memhist_//').txt"
  done
}
status=0
for stage in $STAGES; do
  case $stage in
    unit)
      # UNIT_ARGS: other pytest arguments (e.g. -rP, or test files) instead of tests/unit.
      # shellcheck disable=SC2086
      within_budget python3 -m pytest -q -m gpu -p no:cacheprovider ${UNIT_ARGS:-tests/unit} 2>&1 | tee "$OUT/gpu_unit.log" || status=1 ;;
    functional)
      # FUNCTIONAL_SETS="name=ARGS|name2=ARGS2" runs the suite once per set (e.g. one per optimizer
      # configuration), each with its own directory, log and summary; else once with FUNCTIONAL_ARGS.
      IFS='|' read -r -a sets <<< "${FUNCTIONAL_SETS:-functional=${FUNCTIONAL_ARGS:-}}"
      for set in "${sets[@]}"; do
        name=${set%%=*}; args=${set#*=}
        echo "== functional set $name: $args"
        rm -f "$WORK/$name/functional_summary.json"  # (an earlier call's must not pass for this one's)
        # shellcheck disable=SC2086  # ARGS is a list of options
        within_budget python3 tests/functional/run_functional.py --out "$WORK/$name" --nproc "$NPROC" \
          $args 2>&1 | tee "$OUT/$name.log" || status=1
        summary=functional_summary.json; [ "$name" = functional ] || summary=${name}_summary.json
        if [ ! -e "$WORK/$name/functional_summary.json" ]; then
          # Cut short (SUITE_BUDGET_S): the checks on the runs that finished.
          # shellcheck disable=SC2086
          python3 tests/functional/run_functional.py --out "$WORK/$name" --nproc "$NPROC" $args --from-records \
            2>&1 | tee -a "$OUT/$name.log"
        fi
        cp "$WORK/$name/functional_summary.json" "$OUT/$summary" 2>/dev/null
        read_memhists "$WORK/$name"  # (MEGATRON_OFFLOAD_MEMHIST)
      done ;;
    matrix)
      rm -f "$WORK/matrix/matrix_summary.json"  # (rewritten after every case: a cut matrix keeps what finished)
      within_budget python3 tests/functional/run_matrix.py --out "$WORK/matrix" --gpus "$NPROC" \
        ${MATRIX_ARGS:-} 2>&1 | tee "$OUT/matrix.log"
      code=${PIPESTATUS[0]}
      [ "$code" = 0 ] || status=1
      if [ "$code" = 124 ]; then
        # Cut short (SUITE_BUDGET_S): every case's checks on the runs that finished (an unfinished
        # run fails its own checks); this summary replaces the one of the cases that completed.
        # shellcheck disable=SC2086
        python3 tests/functional/run_matrix.py --out "$WORK/matrix" --gpus "$NPROC" ${MATRIX_ARGS:-} --from-records \
          2>&1 | tee -a "$OUT/matrix.log"
      fi
      cp "$WORK/matrix/matrix_summary.json" "$OUT/" 2>/dev/null
      read_memhists "$WORK/matrix" ;;  # (MEGATRON_OFFLOAD_MEMHIST)
    bench)
      rm -f "$WORK/bench/benchmark.json"
      within_budget python3 scripts/benchmark.py --preset "${BENCH:-r1}" --nproc "$NPROC" --out "$WORK/bench" \
        ${BENCH_ARGS:-} 2>&1 | tee "$OUT/benchmark.log" || status=1
      cp "$WORK/bench/benchmark.json" "$OUT/" 2>/dev/null
      if grep -q '"partial": true' "$WORK/bench/benchmark.json" 2>/dev/null; then
        # Cut short (SUITE_BUDGET_S): the table and the planner's floors of the variants that finished.
        # shellcheck disable=SC2086  # (its --gbps / --both-gbps; the rest is parsed and ignored)
        python3 scripts/benchmark.py ${BENCH_ARGS:-} --replan "$WORK/bench/benchmark.json" 2>&1 | tee -a "$OUT/benchmark.log"
      fi
      # Plots go into logs.tgz (the device returns at most 8 files from $OUT).
      python3 scripts/plot_benchmark.py "$WORK/bench/benchmark.json" --out-prefix "$WORK/bench/benchmark" \
        >> "$OUT/benchmark.log" 2>&1 || true
      for f in "$WORK"/bench/*/memhist_rank*.npz; do
        [ -e "$f" ] || continue
        name="memhist_$(basename "$(dirname "$f")" | tr '@+' '__')_$(basename "$f" .npz | sed 's/memhist_//').npz"
        cp "$f" "$OUT/$name"
        read_memhist "$f" "$OUT/${name%.npz}.txt"
      done ;;
    sweep)
      within_budget python3 scripts/sweep.py --nproc "$NPROC" --out "$WORK/sweep" ${SWEEP_ARGS:-} 2>&1 \
        | tee "$OUT/sweep.log" || status=1
      cp "$WORK/sweep/sweep.json" "$OUT/" 2>/dev/null ;;
    maxfit)
      within_budget python3 scripts/max_fit.py --nproc "$NPROC" --out "$WORK/maxfit" ${MAXFIT_ARGS:---cap-gib 40} 2>&1 \
        | tee "$OUT/max_fit.log" || status=1 ;;
    demo)
      within_budget python3 scripts/demo.py --out "$WORK/demo" ${DEMO_ARGS:-} 2>&1 | tee "$OUT/demo.log" || status=1 ;;
    phase)
      # benchmarks/tools/phase_switch_bench.py: whole-state phase switches, three ways (PHASE_ARGS).
      within_budget python3 benchmarks/tools/phase_switch_bench.py --out "$WORK/phase" ${PHASE_ARGS:-} 2>&1 \
        | tee "$OUT/phase_switch.log" || status=1
      cp "$WORK/phase/phase_switch.json" "$OUT/" 2>/dev/null ;;
    readprobe)
      # benchmarks/tools/read_behind_copy_probe.py: does the read after the step wait behind the copy-out
      # (bulk, pieces, fed by a thread with READPROBE_ARGS' --depth in flight), per CUDA_DEVICE_MAX_CONNECTIONS.
      for conn in 1 8; do
        CUDA_DEVICE_MAX_CONNECTIONS=$conn within_budget python3 benchmarks/tools/read_behind_copy_probe.py \
          --out "$OUT/read_probe_conn$conn.json" ${READPROBE_ARGS:-} 2>&1 | tee -a "$OUT/read_probe.log" || status=1
      done ;;
    asyncprobe)
      # shellcheck disable=SC2086
      within_budget python3 benchmarks/tools/async_save_probe.py --out "$OUT/async_save_probe.json" ${ASYNCPROBE_ARGS:-} \
        2>&1 | tee "$OUT/async_save_probe.log" || status=1 ;;
    hostprobe)
      within_budget python3 benchmarks/tools/host_memory_probe.py --out "$OUT/host_probe.json" ${HOSTPROBE_ARGS:-} 2>&1 \
        | tee "$OUT/host_probe.log" || status=1 ;;
    probe)
      for conn in 1 8; do
        CUDA_DEVICE_MAX_CONNECTIONS=$conn within_budget python3 scripts/overlap_probe.py \
          --out "$WORK/probe_conn$conn.json" 2>&1 | tee -a "$OUT/probe.log" || status=1
      done ;;
  esac
done
tar czf "$OUT/logs.tgz" -C "$WORK" --exclude='ckpt_*' --exclude='*.npz' . 2>/dev/null
exit $status
