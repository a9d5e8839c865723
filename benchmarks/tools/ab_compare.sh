#!/usr/bin/env bash
# Old code against new, interleaved on one machine (a behaviour-preserving change must stay within
# the run-to-run spread): each repetition runs scripts/benchmark.py of this tree, then of OLD_TREE
# (e.g. `git archive <commit> | tar x -C .old`, carried), with the same arguments.
#
#   benchmarks/tools/ab_compare.sh OLD_TREE REPS OUT_DIR [benchmark.py arguments...]
#
# The first repetition runs the benchmark's --variants as given; later ones only its offload
# variants (VARIANTS_AGAIN, default "offload"). Prints one table of all runs (ms/iter, steady
# reserved and allocated, host drop, losses equal to the first baseline's).
set -uo pipefail
cd "$(dirname "$0")/../.."
OLD=$(realpath "$1") REPS=$2 DIR=$(realpath -m "$3"); shift 3
mkdir -p "$DIR"
for rep in $(seq 1 "$REPS"); do
  for tree in new old; do
    root=$PWD; [ "$tree" = old ] && root=$OLD
    args=("$@"); [ "$rep" -gt 1 ] && args+=(--variants "${VARIANTS_AGAIN:-offload}")
    (cd "$root" && python3 scripts/benchmark.py --out "$DIR/${tree}_$rep" "${args[@]}") > "$DIR/${tree}_$rep.log" 2>&1 \
      || { echo "$tree rep $rep failed:"; tail -20 "$DIR/${tree}_$rep.log"; }
    echo "$tree rep $rep done"
  done
done
python3 - "$DIR" "$REPS" <<'EOF'
import json, os, sys
d, reps = sys.argv[1], int(sys.argv[2])
first = None
# ms/iter: start to start where the tree records it (median_of), else train_step alone; compare the
# train_step column across trees from before and after start-to-start timing.
print("| run | ms/iter (of) | train_step ms | steady max reserved GiB | steady max allocated GiB | host drop GiB | losses = first baseline |")
print("|---|---|---|---|---|---|---|")
for rep in range(1, reps + 1):
    for tree in ("new", "old"):
        path = os.path.join(d, f"{tree}_{rep}", "benchmark.json")
        if not os.path.exists(path):
            print(f"| {tree} {rep} | missing | | | | |")
            continue
        for name, r in json.load(open(path))["results"].items():
            losses = r.get("losses")
            if first is None and name.startswith("baseline"):
                first = losses
            same = "" if losses is None or first is None else str(losses == first[:len(losses)])
            first_rank = lambda key: (r.get(key) or [float("nan")])[0]
            print(f"| {tree} {rep} {name} | {r.get('median_ms', float('nan')):.1f} ({r.get('median_of', 'train_step')}) | "
                  f"{r.get('median_train_step_ms', r.get('median_ms', float('nan'))):.1f} | "
                  f"{first_rank('steady_max_reserved_gib'):.2f} | {first_rank('steady_max_allocated_gib'):.2f} | "
                  f"{r.get('host_drop_gib', float('nan')):.2f} | {same} |")
EOF
