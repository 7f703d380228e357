#!/usr/bin/env bash
# The one command for the GPU machine: build with all cores, run the GPU and CPU test suites, run every
# benchmark, write logs and summary.json into OUTDIR, print a short table last.
#   scripts/gpu-check.sh OUTDIR [--skip-bench] [--gtest-filter PATTERN] [--with-python]
# --with-python also installs the Python package and runs its tests and benchmark
# (scripts/python-gpu-check.sh OUTDIR/python), so one device call covers everything.
# MEGAMOE_GPU_CHECK_CMAKE_ARGS: extra CMake arguments (split at whitespace), e.g. -DMEGAMOE_PTXAS_VERBOSE=OFF or a
# -DCMAKE_CUDA_FLAGS=-DSOME_MACRO=1 variant; the build directory is configured afresh on every call, so no
# earlier call's options stay in its cache.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-check.sh OUTDIR [--skip-bench] [--gtest-filter PATTERN] [--with-python]}
shift
skip_bench=0
with_python=0
gtest_filter='*'
while [ $# -gt 0 ]; do
  case "$1" in
    --skip-bench) skip_bench=1 ;;
    --with-python) with_python=1 ;;
    --gtest-filter) gtest_filter=$2; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
build_dir=${MEGAMOE_BUILD_DIR:-build-gpu}
export PATH=/usr/local/cuda/bin:$PATH
start=$(date +%s)
note() { printf '[gpu-check %4ss] %s\n' "$(( $(date +%s) - start ))" "$*"; }

gtest_args=()
[ -f .deps/googletest/CMakeLists.txt ] && gtest_args=(-DMEGAMOE_GTEST_SOURCE="$PWD/.deps/googletest")
read -r -a extra_cmake <<<"${MEGAMOE_GPU_CHECK_CMAKE_ARGS:-}"
note "configure + build ($(nproc) cores${extra_cmake[*]:+, ${extra_cmake[*]}}) -> $out/build.log"
rm -f "$build_dir/CMakeCache.txt"
# Warnings are errors in CI; here a newer host compiler's new warning must not cost a GPU run.
if ! { cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_WERROR=OFF \
         -DMEGAMOE_PTXAS_VERBOSE=ON "${gtest_args[@]}" "${extra_cmake[@]}" &&
       cmake --build "$build_dir" -j "$(nproc)"; } >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  echo "BUILD FAILED"
  printf '{"build": "failed"}\n' >"$out/summary.json"
  exit 1
fi
# Machine code of the GEMM kernels (the engine, the fused forward, FP8): wgmma must be there (HGMMA, or
# QGMMA for FP8), local memory must not (LDL/STL).
for obj in "$build_dir"/CMakeFiles/megamoe.dir/src/kernels/{grouped_gemm_*,fused_forward,fp8_gemm}.cu.o; do
  [ -f "$obj" ] || continue
  cuobjdump --dump-sass "$obj" >"$out/sass_$(basename "$obj" .cu.o).txt" 2>&1 || true
  note "SASS $(basename "$obj"): $(grep -cE "[HQ]GMMA" "$out/sass_$(basename "$obj" .cu.o).txt") HGMMA/QGMMA, $(grep -cE '\b(LDL|STL)\b' "$out/sass_$(basename "$obj" .cu.o).txt") LDL/STL"
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader \
  >"$out/gpu.txt" 2>&1 || true
note "GPU: $(cat "$out/gpu.txt")"

status=0
run_suite() {  # name binary
  local name=$1 binary=$2
  note "tests: $name"
  # Bounded: a kernel that hangs must cost this call minutes, not all of its time.
  if ! timeout "${MEGAMOE_SUITE_TIMEOUT:-300}" "$binary" --gtest_filter="$gtest_filter" \
       --gtest_output="json:$out/$name.json" >"$out/$name.log" 2>&1; then
    status=1
    grep -E '^\[  FAILED|Failure|error' "$out/$name.log" | head -30
  fi
}
# A sticky CUDA error (an illegal address, a trap) fails every later test of its process: each failed test
# runs again alone, so the report separates the test that broke from those that only inherited the error;
# the first that still fails with a device fault runs once more under compute-sanitizer memcheck.
isolate_failures() {  # name binary
  local name=$1 binary=$2 failed t log sanitized=0
  [ -f "$out/$name.json" ] || return 0
  failed=$(python3 - "$out/$name.json" <<'PY'
import json, sys
for s in json.load(open(sys.argv[1])).get("testsuites", []):
    for t in s.get("testsuite", []):
        if t.get("failures"): print(s["name"] + "." + t["name"])
PY
)
  [ -n "$failed" ] || return 0
  mkdir -p "$out/isolated"
  note "re-running $(echo "$failed" | wc -l) failed test(s) of $name one per process"
  for t in $(echo "$failed" | head -"${MEGAMOE_ISOLATE_MAX:-40}"); do
    log="$out/isolated/$(echo "$t" | tr '/' '_').log"
    if timeout "${MEGAMOE_ISOLATE_TIMEOUT:-120}" "$binary" --gtest_filter="$t" >"$log" 2>&1; then
      echo "alone: PASS $t" | tee -a "$out/isolated.txt"
    else
      echo "alone: FAIL $t" | tee -a "$out/isolated.txt"
      grep -E 'Failure|error|Expected|Which is' "$log" | head -8
      if [ $sanitized -eq 0 ] && grep -qE 'illegal|misaligned|unspecified launch|out of bounds|trap' "$log"; then
        sanitized=1
        note "memcheck: $t -> $out/isolated/memcheck.log"
        timeout 240 compute-sanitizer --tool memcheck --print-limit 20 "$binary" --gtest_filter="$t" \
          >"$out/isolated/memcheck.log" 2>&1
        grep -E '=========' "$out/isolated/memcheck.log" | head -30
      fi
    fi
  done
}
run_suite gpu_tests "$build_dir/megamoe_gpu_tests"
isolate_failures gpu_tests "$build_dir/megamoe_gpu_tests"
run_suite cpu_tests "$build_dir/megamoe_cpu_tests"

if [ $skip_bench -eq 0 ]; then
  : >"$out/bench.log"
  # PyTorch baselines first (benchmarks/bench_X_torch.py), then each of our benchmarks build-gpu/bench_X,
  # which reads its baseline's output (--baseline) and prints both side by side: one call, one machine.
  for script in benchmarks/bench_*.py; do
    [ -f "$script" ] || continue
    name=$(basename "$script" .py)
    note "baseline: $script"
    { echo "=== $script"; PYTHONUNBUFFERED=1 python3 "$script" --out "$out/$name.csv"; } >>"$out/bench.log" 2>&1 ||
      { status=1; echo "baseline $script failed"; }
  done
  for bench in "$build_dir"/bench_*; do
    [ -x "$bench" ] || continue
    name=$(basename "$bench")
    baseline="$out/${name}_torch.csv"  # absent: the benchmark prints its own figures only
    note "benchmark: $name"
    { echo "=== $name"; timeout "${MEGAMOE_BENCH_TIMEOUT:-240}" "$bench" --out "$out/$name.json" --baseline "$baseline"; } \
      >>"$out/bench.log" 2>&1 ||
      { status=1; echo "benchmark $name failed"; }
  done
  cp "$out/bench.log" "$out/bench_tables.txt"
fi

python3 - "$out" "$status" <<'PY'
import json, os, sys
out, status = sys.argv[1], int(sys.argv[2])
summary = {"gpu": open(os.path.join(out, "gpu.txt")).read().strip(), "suites": {}, "status": status}
rows = []
for suite in ("gpu_tests", "cpu_tests"):
    path = os.path.join(out, suite + ".json")
    if not os.path.exists(path):
        rows.append((suite, "-", "-", "-", "no report")); continue
    data = json.load(open(path))
    ran = skipped = failed = 0
    for s in data.get("testsuites", []):
        for t in s.get("testsuite", []):
            if t.get("result") == "SKIPPED" or t.get("status") == "NOTRUN": skipped += 1
            elif t.get("failures"): failed += 1
            else: ran += 1
    summary["suites"][suite] = {"passed": ran, "failed": failed, "skipped": skipped}
    rows.append((suite, ran, failed, skipped, ""))
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=2)
print()
print(f"{'suite':<12} {'passed':>7} {'failed':>7} {'skipped':>8}")
for r in rows: print(f"{r[0]:<12} {r[1]:>7} {r[2]:>7} {r[3]:>8} {r[4]}")
PY
if [ $skip_bench -eq 0 ] && [ -s "$out/bench.log" ]; then
  echo; echo "benchmark tables ($out/bench.log):"; grep -E '^(\||===|case|fwd|dgrad|wgrad|dense)' "$out/bench.log" | tail -70
fi
if [ $with_python -eq 1 ]; then
  echo
  bash scripts/python-gpu-check.sh "$out/python" || status=1
fi
note "done, status $status"
exit $status
