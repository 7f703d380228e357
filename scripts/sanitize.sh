#!/usr/bin/env bash
# The GPU test binary under NVIDIA compute-sanitizer (memcheck, racecheck, synccheck) at small shapes; logs
# in OUTDIR, a short table last. Exit 0 only when every tool ran to the end with 0 sanitizer errors and
# 0 failed tests.
#   scripts/sanitize.sh OUTDIR [BUILD_DIR]
# BUILD_DIR defaults to ${MEGAMOE_BUILD_DIR:-build-gpu}, normally built already by scripts/gpu-check.sh;
# when BUILD_DIR/megamoe_gpu_tests is missing it is built here the same way.
# Environment:
#   MEGAMOE_SANITIZE_TOOLS              tools to run, default "memcheck racecheck synccheck"
#   MEGAMOE_SANITIZE_FILTER             gtest filter for every tool (replaces the defaults below)
#   MEGAMOE_SANITIZE_FILTER_<TOOL>      filter for one tool, e.g. MEGAMOE_SANITIZE_FILTER_RACECHECK (wins)
#   MEGAMOE_SANITIZE_TIMEOUT            seconds per tool, default 240 (three tools: up to ~12 min in all;
#                                       split across device calls with MEGAMOE_SANITIZE_TOOLS if needed)
#   MEGAMOE_SANITIZE_ARGS               extra compute-sanitizer options for every tool (word-split)
#
# Why the filters look as they do. The layer's kernels spin-wait on flags written by other kernels: virtual
# ranks share one GPU, each rank its own stream, and a rank's barrier kernel only finishes once its peers'
# kernels (other streams) have run. That needs the kernels of all virtual ranks resident at the same time.
# compute-sanitizer does not serialise launches by default (this script never passes
# --force-blocking-launches, which would turn every cross-rank wait into a wait_timeout_seconds timeout),
# but instrumented kernels are 10-100x slower and use more resources; racecheck and synccheck are the
# heaviest, and a peer that cannot become resident, or arrives later than the layer's wait timeout (20 s by
# default, 0.2-2 s in some error tests), turns into a kTimeout failure that is no bug of the code. So:
#   memcheck  - every small test: building blocks (the deliberate-timeout ones too: their waits are bounded
#               by the wall clock, not by instruction counts), the layer error tests (R = 2) of both forward
#               paths, options, the CUDA-graph capture tests, the FP8 layer (R = 1 and 2: the test of
#               all five scenarios, up to R = 8, outlived a 200 s limit, docs/PERF.md run 39), route_rows, fp8 quantize, all
#               grouped-GEMM and simple grouped-GEMM tests, and three layer scenarios: Qwen30B_R1,
#               Qwen30B_R4_AllToOneExpert (the cheapest multi-rank one, a rank with T = 0) and
#               Narrow_R2_ManyTokens (several layout CTAs). No DeepSeek-V3, no R = 8 scenario.
#   synccheck - one layer scenario, Qwen30B_R1 (R = 1: the barriers count the rank itself, no peer to wait
#               for; synccheck not tried on R = 2);
#   racecheck - one layer scenario, Narrow_R2_ManyTokens: small, its two ranks stay co-resident under the
#               tool (about 53 s on the H200, docs/PERF.md run 29), and its CTAs run several SwiGLU-backward
#               tiles each, so stages are refilled after their h was read (Qwen30B_R1 took 239 s, run 26).
#               Both tools: no test that waits for a timeout on purpose (SignalWait, ReadinessGated,
#               the EpLayerErrorsTest timeouts), no other R >= 2 test, no CUDA-graph capture, no NCCL; the
#               pipeline ring, the device schedulers, route_rows, fp8 quantize, the FP8 GEMM, the simple
#               grouped GEMM and the grouped GEMM minus its two longest tests (MGroupedKMajorPlain and
#               KGroupedFp32: the same kernel configurations are launched by the others).
# NCCL's own kernels are never instrumented (--kernel-name-exclude kns=nccl): their reports are not ours.
# racecheck does not follow an mbarrier arrival one thread makes for the plain shared-memory accesses of
# others (ordered by the PTX memory model, but reported as hazards); it does follow arrivals each thread
# makes for its own (docs/PERF.md, runs 21-33). So the rings it sees use that form where plain accesses are
# handed over: BuildingBlocks.PipelineEveryDepthManyLaps fills its ring through TMA and every consumer
# thread arrives for its reads; the SwiGLU backward's h stages, read with plain loads and refilled by the
# producer's cp.async gathers, are handed back through a read barrier every reader arrives on
# (src/device/epilogue/epilogue_stages.cuh).
# The layer scenarios also run the fused kernels (every forward / backward path combination); their waits
# cover whole GEMM phases, which the tools slow past the default 20 s, so this script sets
# MEGAMOE_TEST_WAIT_TIMEOUT_S=600 for them.
# The process-group tests are left out altogether: on the H200 memcheck reported 4 API errors in them, all
# cudaFuncGetAttributes calls made by libnccl itself (host backtraces entirely inside libnccl.so) probing
# kernel images it was not built with; the API-error report cannot be limited to our calls.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
out=${1:?usage: scripts/sanitize.sh OUTDIR [BUILD_DIR]}
build_dir=${2:-${MEGAMOE_BUILD_DIR:-build-gpu}}
mkdir -p "$out"
out=$(cd "$out" && pwd) || exit 2
export PATH=/usr/local/cuda/bin:$PATH
start=$(date +%s)
note() { printf '[sanitize %4ss] %s\n' "$(( $(date +%s) - start ))" "$*"; }

read -r -a tools <<<"${MEGAMOE_SANITIZE_TOOLS:-memcheck racecheck synccheck}"
limit=${MEGAMOE_SANITIZE_TIMEOUT:-240}
export MEGAMOE_TEST_WAIT_TIMEOUT_S=${MEGAMOE_TEST_WAIT_TIMEOUT_S:-600}
read -r -a extra_args <<<"${MEGAMOE_SANITIZE_ARGS:-}"

layer='Layer/EpLayerTest.MatchesReferenceAndIsDeterministic'
filter_memcheck="BuildingBlocks.*:EpLayerErrorsTest.*:EpLayerOptionsTest.*:EpLayerGraphTest.*:FusedForward*"
filter_memcheck+=":FusedBackward*:EpLayerOrderTest.*:FusedForwardOrderTest.*"
filter_memcheck+=":EpLayerFp8Test.LayerMatchesTheFp8Reference:EpLayerFp8Test.WeightsVersion*:EpLayerFp8Test.Unsupported*"
filter_memcheck+=":EpLayerFp8Test.Prequantized*"
filter_memcheck+=":EpRouteRows.*:Fp8QuantizeGpuTest.*:Fp8TokenMajorGpuTest.*:Fp8WgradGemmGpuTest.*:GroupedGemm.*:SimpleGroupedGemmTest.*:Fp8Gemm.*:*Fp8GemmShapes*"
filter_memcheck+=":$layer/Qwen30B_R1:$layer/Qwen30B_R4_AllToOneExpert:$layer/Narrow_R2_ManyTokens"
blocks="BuildingBlocks.PipelineEveryDepthManyLaps:BuildingBlocks.SchedulersCoverEveryTileOnceInOneSequence"
blocks+=":Fp8Gemm.*:EpRouteRows.*:Fp8QuantizeGpuTest.*:Fp8TokenMajorGpuTest.*:Fp8WgradGemmGpuTest.*:GroupedGemm.*:SimpleGroupedGemmTest.*"
longest="-GroupedGemm.MGroupedKMajorPlain:GroupedGemm.KGroupedFp32"
filter_single_rank="$blocks:$layer/Qwen30B_R1:$longest"
filter_racecheck="$blocks:$layer/Narrow_R2_ManyTokens:$longest"
filter_for() {  # tool -> gtest filter
  local upper
  upper=$(printf '%s' "$1" | tr '[:lower:]' '[:upper:]')
  local specific="MEGAMOE_SANITIZE_FILTER_$upper"
  if [ -n "${!specific:-}" ]; then echo "${!specific}"; return; fi
  if [ -n "${MEGAMOE_SANITIZE_FILTER:-}" ]; then echo "$MEGAMOE_SANITIZE_FILTER"; return; fi
  case "$1" in
    memcheck) echo "$filter_memcheck" ;;
    racecheck) echo "$filter_racecheck" ;;
    *) echo "$filter_single_rank" ;;
  esac
}

binary="$build_dir/megamoe_gpu_tests"
if [ ! -x "$binary" ]; then
  gtest_args=()
  [ -f .deps/googletest/CMakeLists.txt ] && gtest_args=(-DMEGAMOE_GTEST_SOURCE="$PWD/.deps/googletest")
  note "$binary missing: configure + build ($(nproc) cores) -> $out/sanitize_build.log"
  if ! { timeout "${MEGAMOE_BUILD_TIMEOUT:-1200}" cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
           -DMEGAMOE_WERROR=OFF "${gtest_args[@]}" &&
         timeout "${MEGAMOE_BUILD_TIMEOUT:-1200}" cmake --build "$build_dir" -j "$(nproc)" --target megamoe_gpu_tests; } \
       >"$out/sanitize_build.log" 2>&1; then
    tail -40 "$out/sanitize_build.log"
    echo "BUILD FAILED"
    exit 1
  fi
fi
binary=$(cd "$(dirname "$binary")" && pwd)/$(basename "$binary")

if ! command -v compute-sanitizer >/dev/null 2>&1; then
  echo "compute-sanitizer not found (looked in PATH and /usr/local/cuda/bin)"
  exit 1
fi
compute-sanitizer --version >"$out/sanitize_version.txt" 2>&1 || true
note "$(grep -m1 -iE 'version' "$out/sanitize_version.txt" || head -1 "$out/sanitize_version.txt")"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$out/sanitize_gpu.txt" 2>&1 || true
note "GPU: $(head -1 "$out/sanitize_gpu.txt")"

status=0
rows=()
details=()
for tool in "${tools[@]}"; do
  case "$tool" in
    memcheck) tool_args=() ;;
    racecheck) tool_args=(--racecheck-report all) ;;
    synccheck) tool_args=() ;;
    *) echo "unknown tool $tool (memcheck, racecheck, synccheck)" >&2; exit 2 ;;
  esac
  filter=$(filter_for "$tool")
  log="$out/sanitize_$tool.log"
  note "$tool (limit ${limit}s) -> $log"
  printf '# compute-sanitizer --tool %s, gtest filter: %s\n' "$tool" "$filter" >"$out/sanitize_$tool.filter"
  t0=$(date +%s)
  # timeout signals the whole process group (sanitizer and test binary); -k: KILL if TERM is not enough.
  timeout -k 30 "$limit" compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 50 \
    --kernel-name-exclude kns=nccl "${tool_args[@]}" "${extra_args[@]}" \
    "$binary" --gtest_filter="$filter" --gtest_color=no >"$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - t0 ))

  # Sanitizer verdict.
  errors=$(grep -m1 -oE 'ERROR SUMMARY: [0-9]+ error' "$log" | grep -oE '[0-9]+')
  hazards=$(grep -m1 -E 'RACECHECK SUMMARY' "$log" | sed -E 's/.*RACECHECK SUMMARY: *//')
  # racecheck ends with its own summary instead ("N hazards displayed (E errors, W warnings)"): both kinds
  # of hazard count here.
  if [ -z "$errors" ] && [ -n "$hazards" ]; then
    errors=$(printf '%s' "$hazards" | sed -nE 's/.*\(([0-9]+) errors?, ([0-9]+) warnings?\).*/\1 + \2/p')
    [ -n "$errors" ] && errors=$(( errors ))
  fi
  # gtest counts: the final summary if the run got there, else what the log shows so far.
  ran=$(grep -m1 -oE '^\[==========\] [0-9]+ tests? from .* ran' "$log" | grep -m1 -oE '[0-9]+' | head -1)
  if [ -n "$ran" ]; then
    failed=$(grep -m1 -oE '^\[  FAILED  \] [0-9]+ tests?, listed below' "$log" | grep -oE '[0-9]+' | head -1)
    failed=${failed:-0}
    skipped=$(grep -m1 -oE '^\[  SKIPPED \] [0-9]+ tests?, listed below' "$log" | grep -oE '[0-9]+' | head -1)
    skipped=${skipped:-0}
  else
    ran="$(grep -cE '^\[ RUN      \]' "$log")+"  # "+": incomplete
    failed=$(grep -E '^\[  FAILED  \] [A-Za-z_]' "$log" | sed -E 's/ \(.*//' | sort -u | wc -l)
    skipped=$(grep -E '^\[  SKIPPED \] [A-Za-z_]' "$log" | sed -E 's/ \(.*//' | sort -u | wc -l)
  fi
  failed=$((failed)) skipped=$((skipped))

  verdict=ok
  why=""
  # The sanitizer's own complaints (its lines start with =========), e.g. a device or driver it refuses.
  refused=$(grep -m1 -iE '^=+ .*(not supported|unsupported|Internal Sanitizer Error|Error:|Unable to|could not)' "$log")
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    verdict=TIMEOUT
    last=$(grep -E '^\[ RUN      \]' "$log" | tail -1 | sed -E 's/^\[ RUN      \] //')
    why="timed out after ${limit}s; last test started: ${last:-none}"
  elif [ -z "$errors" ]; then
    verdict=REFUSED
    [ -n "$refused" ] || refused=$(grep -m1 -iE 'not supported' "$log")  # the runtime's own refusal
    why=${refused:-"no ERROR SUMMARY in the log; last line: $(grep -v '^[[:space:]]*$' "$log" | tail -1)"}
  elif [ "$errors" -ne 0 ]; then
    verdict=ERRORS
  elif [ "$failed" != 0 ] || [ "$rc" -ne 0 ]; then
    verdict=FAILED
  elif [ "${ran%+}" = 0 ]; then
    verdict=NO_TESTS
    why="the gtest filter matched no test"
  fi
  [ "$verdict" = ok ] || status=1
  # A "not supported" line is worth showing even when the tool finished (a feature it skipped).
  [ -z "$why" ] && [ -n "$refused" ] && why="$refused"
  why=$(printf '%s' "$why" | sed -E 's/^=+ +//')
  [ "$tool" = racecheck ] && [ -n "$hazards" ] && why="$hazards${why:+; $why}"
  rows+=("$(printf '%-10s %6s %7s %7s %8s %5s %6s  %s' "$tool" "$ran" "$failed" "$skipped" "${errors:--}" "$rc" \
    "$secs" "$verdict")")
  [ -n "$why" ] && details+=("$tool: $why")
  if [ "$verdict" != ok ]; then
    # The first findings, for a quick look (the log has them all).
    while IFS= read -r line; do details+=("$tool:   $line"); done < <(
      grep -E '^=+ +(Invalid|Race|Barrier|Error|Warning|Program hit|Uninitialized|Detected)|^\[  FAILED  \] [A-Za-z_]' \
        "$log" | sed -E 's/^=+ +//; s/^(\[  FAILED  \] [^ ,]+).*/\1/' | grep -vxF -- "$why" | awk '!seen[$0]++' |
        head -5)
  fi
  note "$tool: ${verdict}, rc $rc, ${secs}s"
done

{
  echo
  printf '%-10s %6s %7s %7s %8s %5s %6s  %s\n' tool tests failed skipped errors exit secs verdict
  for r in "${rows[@]}"; do echo "$r"; done
  for d in "${details[@]}"; do echo "$d"; done
  echo "status $status (logs: $out/sanitize_<tool>.log)"
} | tee "$out/sanitize_summary.txt"
exit $status
