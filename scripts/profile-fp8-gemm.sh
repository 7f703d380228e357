#!/usr/bin/env bash
# Nsight Compute on the blockwise FP8 GEMM, dense 8192^3 (bench_fp8_gemm --interleaved --dense-only), next to
# cuBLASLt's FP8 GEMM on the same shape (the bench's third contender, an `nvjet` kernel): duration, the tensor
# pipe's active share, issue activity and the warps' stall reasons per issued instruction (raw metrics), then
# the SASS lines of ours where the warps' stall samples fall, so that the gap between the two can be traced.
# MEGAMOE_PROFILE_GATHERED=1: instead the grouped GEMM with A's rows gathered by index (the layer's GEMM1
# form, N=3072 K=4096: bench_fp8_gemm --gathered-only), alone.
# MEGAMOE_PROFILE_WGRAD=1: instead the weight-gradient GEMM (bench_fp8_gemm --wgrad: dW13 at H = 2048,
# I = 768, plain and overlapped loops, single CTAs and cluster pairs) next to the data GEMM of the same FLOPs;
# the SASS lines of its plain loop in single CTAs.
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
limit=${MEGAMOE_PROFILE_TIMEOUT:-300}

# One interleaved round of the dense GEMM launches ours (single CTAs, 2-CTA pairs; the overlapped loop in
# both), then cuBLASLt per-tensor and blockwise: the first round's six.
which=(--dense-only)
launches=6
kernels='fp8_gemm_kernel|nvjet'
ours=fp8_gemm_kernel
if [ "${MEGAMOE_PROFILE_GATHERED:-0}" = 1 ]; then
  which=(--gathered-only)  # its first launches are the gathered call's
  launches=1
elif [ "${MEGAMOE_PROFILE_WGRAD:-0}" = 1 ]; then
  which=(--wgrad)  # its first round: the four forms (wgrad_shapes), the data GEMM of the same FLOPs (overlapped, plain)
  launches=6
  kernels='fp8_wgrad_kernel|fp8_gemm_kernel'
  ours=fp8_wgrad_kernel
fi
timeout "$limit" ncu --kernel-name regex:"$kernels" --launch-count "$launches" --section WarpStateStats \
  --section ComputeWorkloadAnalysis --section SpeedOfLight --page raw --csv "$bench" --interleaved "${which[@]}" \
  >"$out/raw.csv" 2>"$out/raw.log"
echo "ncu (raw metrics) rc $?"
# Stall samples per SASS instruction of ours (single CTAs; the weight gradient's plain loop).
timeout "$limit" ncu --kernel-name regex:"$ours" --launch-count 1 --section SourceCounters --page source \
  --print-source sass --csv "$bench" --interleaved "${which[@]}" >"$out/source.csv" 2>"$out/source.log"
echo "ncu (source) rc $?"

python3 - "$out/raw.csv" "$out/source.csv" <<'PY'
import csv, sys

def table(path, first):
    # ncu writes its own ==PROF== lines into the same stream: the CSV starts at its header.
    lines = open(path, errors="replace").read().splitlines()
    start = next((i for i, line in enumerate(lines) if first(line)), None)
    return list(csv.reader(lines[start:])) if start is not None else []

def number(v):
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return None

rows = table(sys.argv[1], lambda line: line.startswith('"ID"'))
if not rows:
    print("no raw metrics")
head = rows[0] if rows else []
for r in rows[1:]:
    d = dict(zip(head, r))
    if number(d.get("gpu__time_duration.sum", "")) is None:
        continue  # the units row
    print(f"== {d.get('Kernel Name', '')[:90]}")
    print(f"   duration {d.get('gpu__time_duration.sum')} ns; tensor pipe active "
          f"{d.get('sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active', '-')}%; issue active "
          f"{d.get('smsp__issue_active.sum.per_cycle_active', '-')} per SM cycle; L2 "
          f"{d.get('lts__throughput.avg.pct_of_peak_sustained_elapsed', '-')}%, DRAM "
          f"{d.get('gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed', '-')}% of peak")
    stalls = [(number(v), k) for k, v in d.items() if "issue_stalled" in k and k.endswith("per_issue_active.ratio")]
    stalls = sorted((s for s in stalls if s[0] is not None), reverse=True)[:8]
    print("   stalls per issued instruction: " + ", ".join(
        f"{k.split('issue_stalled_')[1].replace('_per_issue_active.ratio', '')} {v:.2f}" for v, k in stalls))

src = table(sys.argv[2], lambda line: '"Source"' in line or line.startswith('"Address"'))
if src:
    head = src[0]
    sample_cols = [i for i, h in enumerate(head) if "Sampling" in h and "All" in h] or \
                  [i for i, h in enumerate(head) if "Sampling" in h]
    text = head.index("Source") if "Source" in head else 1
    if sample_cols:
        c = sample_cols[0]
        lines = [(number(r[c]) or 0.0, r[text]) for r in src[1:] if len(r) > max(c, text)]
        total = sum(v for v, _ in lines) or 1.0
        print(f"== stall samples of ours by SASS instruction ({head[c]}; top 20 of {int(total)})")
        for v, t in sorted(lines, reverse=True)[:20]:
            print(f"   {100 * v / total:5.1f}%  {t.strip()[:100]}")
    else:
        print("no sampling column in the source page:", head[:10])
else:
    print("no source page")
PY
