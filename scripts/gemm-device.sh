#!/usr/bin/env bash
# Grouped-GEMM engine on the GPU machine: build (all cores), SASS check, GPU tests, torch + engine/cuBLAS
# benchmark; logs under $OUT (or build-gemm-dev/out), a short table last.
#   scripts/gemm-device.sh [--no-bench] [--gtest-filter PATTERN]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/build-gemm-dev/out}
mkdir -p "$out"
bench=1
filter='GroupedGemm.*'
while [ $# -gt 0 ]; do
  case "$1" in
    --no-bench) bench=0 ;;
    --gtest-filter) filter=$2; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
export PATH=/usr/local/cuda/bin:$PATH
t0=$(date +%s)
note() { printf '[gemm-device %4ss] %s\n' "$(( $(date +%s) - t0 ))" "$*"; }
bd=build-gemm-dev
note "build"
if cmake -S . -B $bd -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_PTXAS_VERBOSE=ON \
     -DMEGAMOE_GTEST_SOURCE="$PWD/.deps/googletest" >"$out/build.log" 2>&1 &&
   cmake --build $bd -j "$(nproc)" --target megamoe_gpu_tests bench_gemm >>"$out/build.log" 2>&1; then
  tests=$bd/megamoe_gpu_tests
  benchbin=$bd/bench_gemm
  obj=$bd/CMakeFiles/megamoe.dir/src/kernels/grouped_gemm.cu.o
else
  # Another engineer's file may be mid-edit: build only the engine, its test and its benchmark.
  note "project build failed (tail in build.log); building the GEMM pieces alone"
  tail -15 "$out/build.log"
  fb=$bd-alone
  mkdir -p $fb
  G=.deps/googletest/googletest
  NV="nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -Iinclude -Isrc -Itests -I$G/include -I$G --expt-relaxed-constexpr"
  $NV -Xptxas=-v -c src/kernels/grouped_gemm.cu -o $fb/grouped_gemm.o >"$out/build-alone.log" 2>&1 &&
  $NV -c src/host/status.cpp -o $fb/status.o >>"$out/build-alone.log" 2>&1 &&
  $NV -c $G/src/gtest-all.cc -o $fb/gtest-all.o >>"$out/build-alone.log" 2>&1 &&
  $NV -c $G/src/gtest_main.cc -o $fb/gtest_main.o >>"$out/build-alone.log" 2>&1 &&
  $NV tests/gpu/gemm_test.cu $fb/grouped_gemm.o $fb/status.o $fb/gtest-all.o $fb/gtest_main.o -o $fb/gemm_tests >>"$out/build-alone.log" 2>&1 &&
  $NV benchmarks/bench_gemm.cu $fb/grouped_gemm.o $fb/status.o -lcublas -o $fb/bench_gemm >>"$out/build-alone.log" 2>&1 ||
    { tail -40 "$out/build-alone.log"; echo "BUILD FAILED"; exit 1; }
  tests=$fb/gemm_tests
  benchbin=$fb/bench_gemm
  obj=$fb/grouped_gemm.o
fi
grep -A2 "grouped_gemm_kernel" "$out/build.log" "$out/build-alone.log" 2>/dev/null | grep -E "registers|spill" | sort | uniq -c >"$out/ptxas.txt"
cuobjdump --dump-sass "$obj" >"$out/grouped_gemm.sass" 2>&1
note "SASS: HGMMA $(grep -c HGMMA "$out/grouped_gemm.sass"), LDL/STL $(grep -cE 'LDL|STL' "$out/grouped_gemm.sass"); ptxas: $(tr -s ' ' <"$out/ptxas.txt" | tr '\n' ';')"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader 2>&1 | tee "$out/gpu.txt"
note "tests ($filter)"
timeout 120 "$tests" --gtest_filter="$filter" >"$out/test.log" 2>&1
trc=$?
grep -E "^\[gemm_test\]|Failure|FAILED|error|Expected|Which is|rel err" "$out/test.log" | head -60
grep -E "^\[  PASSED|^\[  FAILED|tests ran" "$out/test.log"
note "tests rc=$trc"
if [ $bench = 1 ]; then
  note "torch baseline"
  PYTHONUNBUFFERED=1 timeout 150 python3 benchmarks/bench_gemm_torch.py "$out/torch.csv" >"$out/torch.log" 2>&1 || tail -5 "$out/torch.log"
  grep "^#" "$out/torch.csv" 2>/dev/null
  note "engine vs cuBLAS vs torch"
  timeout 150 "$benchbin" "$out/torch.csv" >"$out/bench.log" 2>&1
  echo "bench rc=$?"
  nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader 2>&1
  cat "$out/bench.log"
fi
note "done"
