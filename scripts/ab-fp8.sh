#!/usr/bin/env bash
# The FP8 kernels of this tree against those of an earlier commit, built and timed in the same device call:
# rounds that alternate the two builds (base, this, base, this, ...) of bench_fp8_gemm (interleaved with
# cuBLASLt) and of bench_layer's per-kernel breakdowns (CUPTI; read by scripts/layer_breakdown.py), then tables of
# the medians over rounds.
# A change to a main loop is kept only if it wins here, where both builds see the same machine and clocks.
#   scripts/ab-fp8.sh BASE_COMMIT OUTDIR [ROUNDS]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/ab_builds.sh
ab_init ab-fp8 "$@"
ab_base_tree
targets="bench_fp8_gemm bench_layer"
ab_build . build-ab-this "$targets" || { note "build of this tree failed (build-ab-this.log)"; exit 1; }
ab_build "$base_tree" "$base_build" "$targets" ||
  { note "build of $base failed"; cp "$base_build.log" "$out/"; exit 1; }
note "built this tree and $base"

for r in $(seq 1 "$rounds"); do
  for which in base this; do
    dir=build-ab-this
    [ "$which" = base ] && dir="$base_build"
    timeout 120 "$dir/bench_fp8_gemm" --interleaved >"$out/gemm_${which}_$r.txt" 2>&1
    timeout 200 "$dir/bench_layer" --no-ep --iters 10 >"$out/layer_${which}_$r.txt" 2>&1
  done
  note "round $r"
done

python3 - "$out" "$rounds" <<'PY'
import re, sys
sys.path.insert(0, "scripts")
from layer_breakdown import compare_runs

def gemm(path):
    # "<shape> <ms> ms <TFLOP/s> TFLOP/s | ..." : ours in single CTAs, the first figure of each row.
    rows = {}
    for line in open(path, errors="replace"):
        m = re.match(r"^((?:dense|grouped)\S*(?: \S+)*?)\s+([\d.]+) ms\s+([\d.]+) TFLOP/s", line)
        if m:
            rows.setdefault(m.group(1), float(m.group(3)))
    return rows

compare_runs(sys.argv[1], "gemm", int(sys.argv[2]), gemm, "TFLOP/s")
PY
python3 scripts/layer_breakdown.py --compare "$out" "$rounds"
