#!/usr/bin/env bash
# The layer's step, this tree against an earlier commit, both built and timed in the same device call: rounds
# that alternate the two builds (base, this, base, this, ...) of `bench_layer --fp8` (the bf16 modular step and
# the FP8 step back to back, and each one's CUPTI breakdown), then a table of the medians over rounds: the step
# times, each GEMM launch of the step and the GEMMs / everything else, per layer shape and precision.
# A kernel change is kept only if it wins here, where both builds see the same machine and clocks.
#   scripts/ab-layer.sh BASE_COMMIT OUTDIR [ROUNDS]
# MEGAMOE_AB_CMAKE_ARGS: extra CMake arguments for this tree's build only (a compile-time variant, say; split at
# whitespace, so no argument may contain a space). With
# BASE_COMMIT "-" the base is this tree built without them: a build option against the default, e.g.
#   MEGAMOE_AB_CMAKE_ARGS=-DCMAKE_CUDA_FLAGS=-DSOME_MACRO=1 scripts/ab-layer.sh - OUTDIR
# MEGAMOE_AB_BENCH_ARGS: extra bench_layer arguments for both builds (e.g. --bf16-grads; split at whitespace).
# MEGAMOE_AB_PREBUILT=1 (with base "-"): no builds; build-ab-this/ and build-ab-base/ already hold bench_layer and
# libmegamoe.so (built elsewhere and carried: each bench_layer runs with its own directory's library).
# MEGAMOE_AB_THIS_DIR: this side's build directory instead of build-ab-this (several prebuilt variants, each in a
# directory of its own, timed one after another against the same base).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/ab_builds.sh
ab_init ab-layer "$@"
read -r -a extra <<<"${MEGAMOE_AB_CMAKE_ARGS:-}"
read -r -a bench_args <<<"${MEGAMOE_AB_BENCH_ARGS:-}"
prebuilt=${MEGAMOE_AB_PREBUILT:-0}
this_build=${MEGAMOE_AB_THIS_DIR:-build-ab-this}
[ "$prebuilt" = 1 ] && [ "$base" != - ] && { echo "MEGAMOE_AB_PREBUILT needs the base '-'"; exit 2; }
ab_base_tree
if [ "$prebuilt" = 1 ]; then
  for dir in "$this_build" "$base_build"; do
    [ -x "$dir/bench_layer" ] && [ -f "$dir/libmegamoe.so" ] ||
      { echo "no bench_layer and libmegamoe.so in $dir"; exit 2; }
  done
  note "prebuilt: $this_build and $base_build"
else
  ab_build . "$this_build" bench_layer "${extra[@]}" ||
    { note "build of this tree failed ($this_build.log)"; exit 1; }
  ab_build "$base_tree" "$base_build" bench_layer ||
    { note "build of the base failed"; cp "$base_build.log" "$out/"; exit 1; }
  note "built this tree (${MEGAMOE_AB_CMAKE_ARGS:-no extra arguments}) and the base ($base)"
fi

for r in $(seq 1 "$rounds"); do
  for which in base this; do
    dir=$this_build
    [ "$which" = base ] && dir="$base_build"
    dir=$(cd "$dir" && pwd)
    LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout 200 "$dir/bench_layer" --fp8 --iters 10 \
      "${bench_args[@]}" >"$out/layer_${which}_$r.txt" 2>&1
    rc=$?
    [ $rc -eq 0 ] || note "bench_layer ($which, round $r) exited with $rc: see $out/layer_${which}_$r.txt"
  done
  note "round $r"
done

python3 scripts/layer_breakdown.py --compare "$out" "$rounds"
