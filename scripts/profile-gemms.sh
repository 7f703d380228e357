#!/usr/bin/env bash
# Nsight Compute on the six GEMMs of one modular forward + backward of the benchmark layer (bench_layer: R = 1,
# T = 16384, 16 experts, top-8, H = 2048, I = 768): GEMM1 (SwiGLU, gathered x), GEMM2 (rows home), dgrad1
# (SwiGLU backward), dgrad2, dW2 (gathered d_out as A), dW13 (gathered x as A, C stored transposed). For each:
# duration, the speed-of-light throughputs (SM, L1, L2, DRAM), the tensor pipe's share and the warps' top stall
# reasons, so that a GEMM's gap to its standalone rate can be traced to what limits it.
#   scripts/profile-gemms.sh OUTDIR [BUILD_DIR]
# BUILD_DIR defaults to ${MEGAMOE_BUILD_DIR:-build-gpu} and must hold bench_layer (scripts/gpu-check.sh builds
# it). bench_layer's first timed launches are one modular forward (2 GEMMs), then the fused forward (no engine
# GEMM), then one modular forward + backward: its 6 engine GEMMs are launches 3..8 of grouped_gemm_kernel.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
out=${1:?usage: scripts/profile-gemms.sh OUTDIR [BUILD_DIR]}
build_dir=${2:-${MEGAMOE_BUILD_DIR:-build-gpu}}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
bench="$build_dir/bench_layer"
[ -x "$bench" ] || { echo "$bench missing: build it first (scripts/gpu-check.sh)"; exit 1; }
command -v ncu >/dev/null 2>&1 || { echo "ncu not found"; exit 1; }

timeout "${MEGAMOE_PROFILE_TIMEOUT:-420}" ncu --kernel-name grouped_gemm_kernel --launch-skip 2 --launch-count 6 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --csv --page details \
  "$bench" --iters 1 --no-ep >"$out/ncu.csv" 2>"$out/ncu.log"
rc=$?
echo "ncu rc $rc (raw: $out/ncu.csv, log: $out/ncu.log)"

python3 - "$out/ncu.csv" <<'PY'
import csv, sys
from collections import OrderedDict
names = ["GEMM1 SwiGLU", "GEMM2 home", "dgrad1 SwiGLU bwd", "dgrad2 home", "wgrad dW2", "wgrad dW13"]
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
if not rows:
    print("no ncu output"); sys.exit(0)
head = rows[0]
try:
    col = {k: head.index(k) for k in ("ID", "Section Name", "Metric Name", "Metric Unit", "Metric Value")}
except ValueError:
    print("unexpected ncu CSV header:", head[:12]); sys.exit(0)
kernels = OrderedDict()
for r in rows[1:]:
    if len(r) <= max(col.values()):
        continue
    kernels.setdefault(r[col["ID"]], {})[(r[col["Section Name"]], r[col["Metric Name"]])] = (r[col["Metric Value"]], r[col["Metric Unit"]])
wanted = [("Duration", "dur"), ("Compute (SM) Throughput", "SM %"), ("L1/TEX Cache Throughput", "L1 %"),
          ("L2 Cache Throughput", "L2 %"), ("DRAM Throughput", "DRAM %")]
def find(m, name):
    for (sec, met), (val, unit) in m.items():
        if met == name:
            return f"{val} {unit}".strip()
    return "-"
def tensor(m):
    for (sec, met), (val, unit) in m.items():
        if "Tensor" in met or "tensor" in met:
            return f"{met}: {val}"
    return "-"
def stalls(m):
    s = []
    for (sec, met), (val, unit) in m.items():
        if sec == "Warp State Statistics" and met.startswith("Stall"):
            try:
                s.append((float(val.replace(",", "")), met))
            except ValueError:
                pass
    s.sort(reverse=True)
    return ", ".join(f"{met.replace('Stall ', '')} {v:.2f}" for v, met in s[:3]) or "-"
print(f"{'GEMM':<20} " + " ".join(f"{short:>12}" for _, short in wanted) + "  tensor pipe; top stalls (cycles per instruction)")
for i, (kid, m) in enumerate(kernels.items()):
    label = names[i] if i < len(names) else f"kernel {kid}"
    print(f"{label:<20} " + " ".join(f"{find(m, name):>12}" for name, _ in wanted) + f"  {tensor(m)}; {stalls(m)}")
PY
exit $rc
