#!/usr/bin/env bash
# Nsight Compute on the six GEMMs of one modular forward + backward of the benchmark layer (bench_layer: R = 1,
# T = 16384, 16 experts, top-8, H = 2048, I = 768): GEMM1 (SwiGLU, gathered x), GEMM2 (rows home), dgrad1
# (SwiGLU backward), dgrad2, dW2 (gathered d_out as A), dW13 (gathered x as A, C stored transposed). For each:
# duration, the tensor pipe's share, issue activity, L2 and DRAM throughput, the SM clock and the warps' top
# stall reasons, so that a GEMM's gap to its standalone rate can be traced to what limits it.
#   scripts/profile-gemms.sh OUTDIR [BUILD_DIR]
# MEGAMOE_PROFILE_SOURCE=N (0..5, the order above): also the SASS view of GEMM N with each instruction's share of
# the warps' stall samples (what its stalls wait on).
# BUILD_DIR defaults to ${MEGAMOE_BUILD_DIR:-build-gpu} and must hold bench_layer (scripts/gpu-check.sh builds
# it). bench_layer's first launches of the engine's kernel are one modular forward (2 GEMMs), then (after the
# FP8 forward, whose GEMMs are other kernels) one modular forward + backward: its 6 GEMMs are launches 3..8.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
out=${1:?usage: scripts/profile-gemms.sh OUTDIR [BUILD_DIR]}
build_dir=${2:-${MEGAMOE_BUILD_DIR:-build-gpu}}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
bench="$build_dir/bench_layer"
[ -x "$bench" ] || { echo "$bench missing: build it first (scripts/gpu-check.sh)"; exit 1; }
command -v ncu >/dev/null 2>&1 || { echo "ncu not found"; exit 1; }

timeout "${MEGAMOE_PROFILE_TIMEOUT:-420}" ncu --kernel-name regex:'(^|::)grouped_gemm_kernel' \
  --launch-skip 2 --launch-count 6 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section MemoryWorkloadAnalysis \
  --page raw --print-units base --csv "$bench" --iters 1 --no-ep >"$out/ncu.csv" 2>"$out/ncu.log"
rc=$?
echo "ncu rc $rc (raw: $out/ncu.csv, log: $out/ncu.log)"

python3 - "$out/ncu.csv" <<'PY'
import csv, sys
names = ["GEMM1 SwiGLU", "GEMM2 home", "dgrad1 SwiGLU bwd", "dgrad2 home", "wgrad dW2", "wgrad dW13"]
# ncu's own lines (==PROF==) and the bench's output share the file: the CSV starts at its header.
lines = open(sys.argv[1], errors="replace").read().splitlines()
start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
rows = list(csv.reader(lines[start:])) if start is not None else []
if not rows:
    print("no ncu metrics"); sys.exit(0)
def number(v):
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return None
head = rows[0]
metrics = [("gpu__time_duration.sum", "us", 1e-3),
           ("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active", "tensor %", 1),
           ("sm__issue_active.avg.pct_of_peak_sustained_elapsed", "issue %", 1),
           ("lts__throughput.avg.pct_of_peak_sustained_elapsed", "L2 %", 1),
           ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", "DRAM %", 1),
           ("gpc__cycles_elapsed.avg.per_second", "GHz", 1e-9)]
labels = "".join(f"{label:>10}" for _, label, _ in metrics)
print(f"{'GEMM':<18}{labels}  top stalls (cycles per issued instruction)")
n = 0
for r in rows[1:]:
    d = dict(zip(head, r))
    if number(d.get("gpu__time_duration.sum", "")) is None:
        continue  # the units row
    cells = []
    for key, _, scale in metrics:
        v = number(d.get(key, ""))
        cells.append(f"{v * scale:10.2f}" if v is not None else f"{'-':>10}")
    # "selected" is the cycle an instruction issues in, not a stall.
    stalls = [(number(v), k) for k, v in d.items() if "issue_stalled" in k and k.endswith("per_issue_active.ratio")
              and "_stalled_selected_" not in k]
    stalls = sorted((x for x in stalls if x[0] is not None), reverse=True)[:5]
    top = ", ".join(f"{k.split('issue_stalled_')[1].replace('_per_issue_active.ratio', '')} {v:.2f}" for v, k in stalls)
    print(f"{names[n] if n < len(names) else 'kernel':<18}" + "".join(cells) + "  " + top)
    n += 1
PY

if [ -n "${MEGAMOE_PROFILE_SOURCE:-}" ]; then
  case "$MEGAMOE_PROFILE_SOURCE" in [0-5]) ;; *) echo "MEGAMOE_PROFILE_SOURCE must be 0..5"; exit 2 ;; esac
  timeout "${MEGAMOE_PROFILE_TIMEOUT:-420}" ncu --kernel-name regex:'(^|::)grouped_gemm_kernel' \
    --launch-skip $((2 + MEGAMOE_PROFILE_SOURCE)) --launch-count 1 --section SourceCounters --page source \
    --print-source sass --csv "$bench" --iters 1 --no-ep >"$out/source.csv" 2>"$out/source.log"
  source_rc=$?
  echo "ncu (source of GEMM $MEGAMOE_PROFILE_SOURCE) rc $source_rc"
  [ $rc -eq 0 ] && rc=$source_rc
  python3 - "$out/source.csv" <<'PY'
import csv, sys
lines = open(sys.argv[1], errors="replace").read().splitlines()
start = next((i for i, line in enumerate(lines) if '"Source"' in line or line.startswith('"Address"')), None)
rows = list(csv.reader(lines[start:])) if start is not None else []
if not rows:
    print("no source page"); sys.exit(0)
head = rows[0]
def number(v):
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return None
cols = [i for i, h in enumerate(head) if "Sampling" in h and "All" in h]
cols = cols or [i for i, h in enumerate(head) if "Sampling" in h]
if not cols:
    print("no sampling column:", head[:12]); sys.exit(0)
c, text = cols[0], head.index("Source") if "Source" in head else 1
samples = [(number(r[c]) or 0.0, i, r[text]) for i, r in enumerate(rows[1:]) if len(r) > max(c, text)]
total = sum(v for v, _, _ in samples) or 1.0
print(f"stall samples by SASS instruction ({head[c]}; top 25 of {int(total)}; index = instruction's position)")
for v, i, t in sorted(samples, reverse=True)[:25]:
    print(f"  {100 * v / total:5.1f}%  #{i:<5} {t.strip()[:100]}")
PY
fi
exit $rc
