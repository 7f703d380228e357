#!/usr/bin/env bash
# Configure, build everything (CUDA kernels included when nvcc is present) and run the test suite.
# GPU tests run where a GPU exists and report SKIPPED elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${MEGAMOE_BUILD_DIR:-build}
cuda=ON
if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "test.sh: nvcc not found: building without CUDA" >&2
  cuda=OFF
fi
export PATH=/usr/local/cuda/bin:$PATH
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_ENABLE_CUDA=$cuda
cmake --build "$build_dir" -j "$(nproc)"
# MEGAMOE_CTEST_JUNIT=PATH: also a JUnit report (CI reads each skip's reason from it).
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)" ${MEGAMOE_CTEST_JUNIT:+--output-junit "$MEGAMOE_CTEST_JUNIT"}
