#!/usr/bin/env bash
# Nsight Compute on the blockwise FP8 GEMM, dense 8192^3 (bench_fp8_gemm --dense-only: its first launch, a
# single-CTA one), next to cuBLASLt's FP8 GEMM on the same shape (the bench's third contender): duration,
# speed-of-light throughputs, the tensor pipe's share, issue activity and the warps' top stall reasons, so
# that the gap between the two can be traced to what limits ours.
#   scripts/profile-fp8-gemm.sh OUTDIR [BUILD_DIR]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
out=${1:?usage: scripts/profile-fp8-gemm.sh OUTDIR [BUILD_DIR]}
build_dir=${2:-${MEGAMOE_BUILD_DIR:-build-gpu}}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
bench="$build_dir/bench_fp8_gemm"
[ -x "$bench" ] || { echo "$bench missing: build it first"; exit 1; }
command -v ncu >/dev/null 2>&1 || { echo "ncu not found"; exit 1; }

# Launch order of one interleaved round: ours (single CTA), ours (pairs), cuBLASLt. The first round is a
# warm-up; profile its single-CTA launch and cuBLASLt's.
timeout "${MEGAMOE_PROFILE_TIMEOUT:-300}" ncu --kernel-name regex:gemm --launch-count 3 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis --csv --page details "$bench" --interleaved --dense-only >"$out/ncu.csv" 2>"$out/ncu.log"
rc=$?
echo "ncu rc $rc (raw: $out/ncu.csv, log: $out/ncu.log)"

python3 - "$out/ncu.csv" <<'PY'
import csv, sys
from collections import OrderedDict
# ncu writes its own ==PROF== lines into the same stream: the CSV starts at its header.
lines = open(sys.argv[1], errors="replace").read().splitlines()
start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), len(lines))
rows = list(csv.reader(lines[start:]))
if not rows:
    print("no ncu output"); sys.exit(0)
head = rows[0]
try:
    col = {k: head.index(k) for k in ("ID", "Kernel Name", "Section Name", "Metric Name", "Metric Unit", "Metric Value")}
except ValueError:
    print("unexpected ncu CSV header:", head[:12]); sys.exit(0)
kernels = OrderedDict()
for r in rows[1:]:
    if len(r) <= max(col.values()):
        continue
    k = kernels.setdefault(r[col["ID"]], {"name": r[col["Kernel Name"]][:60], "m": {}})
    k["m"][(r[col["Section Name"]], r[col["Metric Name"]])] = (r[col["Metric Value"]], r[col["Metric Unit"]])
keys = ("Duration", "Compute (SM) Throughput", "Memory Throughput", "L1/TEX Cache Throughput", "L2 Cache Throughput",
        "DRAM Throughput", "Issue Slots Busy", "Issued Warp Per Scheduler", "No Eligible", "Active Warps Per Scheduler",
        "Eligible Warps Per Scheduler")
for kid, k in kernels.items():
    m = k["m"]
    print(f"== {k['name']}")
    for (sec, met), (val, unit) in m.items():
        if met in keys or "Tensor" in met or "tensor" in met or "Pipe" in met and "Utilization" in met:
            print(f"   {met}: {val} {unit}")
    stalls = []
    for (sec, met), (val, unit) in m.items():
        if sec == "Warp State Statistics" and met.startswith("Stall"):
            try:
                stalls.append((float(val.replace(",", "")), met))
            except ValueError:
                pass
    stalls.sort(reverse=True)
    print("   top stalls (cycles per issued instruction): " +
          ", ".join(f"{met.replace('Stall ', '')} {v:.2f}" for v, met in stalls[:6]))
PY
exit $rc
