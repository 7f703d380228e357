#!/usr/bin/env bash
# Build and run the main job: the MoE layer on its default configuration (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${MEGAMOE_BUILD_DIR:-build}
cuda=ON
if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then cuda=OFF; fi
export PATH=/usr/local/cuda/bin:$PATH
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_ENABLE_CUDA=$cuda >/dev/null
cmake --build "$build_dir" -j "$(nproc)" --target megamoe_run >/dev/null
exec "$build_dir/megamoe_run" "$@"
