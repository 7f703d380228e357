#!/usr/bin/env bash
# Per-tile clock counts of the grouped-GEMM engine's consumers in the layer's step (src/device/tile_clocks.cuh):
# builds the library and bench_layer with MEGAMOE_TILE_CLOCKS=1 into BUILD_DIR (a directory of its own, whose
# CMake cache is replaced: the counts change the engine's kernels), runs bench_layer --iters 1 --no-ep (every
# mode it times, both layer shapes, warm-up launches included) and prints, per GEMM configuration and problem
# (N, K), the sums over all its launches: where a tile's cycles go before its first stage is waited for,
# waiting for it, the main loop (and its cycles per K stage), the epilogue.
#   scripts/tile-clocks.sh OUTDIR [BUILD_DIR]      BUILD_DIR defaults to build-tile-clocks
# MEGAMOE_TILE_CLOCKS_PREBUILT=1: BUILD_DIR already holds such a bench_layer and libmegamoe.so (built elsewhere).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
out=${1:?usage: scripts/tile-clocks.sh OUTDIR [BUILD_DIR]}
build_dir=${2:-build-tile-clocks}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
if [ "${MEGAMOE_TILE_CLOCKS_PREBUILT:-0}" != 1 ]; then
  source scripts/ab_builds.sh
  ab_gtest=()
  # The engine's objects compile every time, so that ptxas's report below is this build's.
  rm -f "$build_dir"/CMakeFiles/megamoe.dir/src/kernels/grouped_gemm_*.cu.o
  if ! ab_build . "$build_dir" bench_layer -DCMAKE_CUDA_FLAGS=-DMEGAMOE_TILE_CLOCKS=1; then
    tail -20 "$build_dir.log"; echo "build failed ($build_dir.log)"; exit 1
  fi
  cp "$build_dir.log" "$out/build.log"
  # A function call inside a wgmma kernel would serialise its wgmma and time another kernel.
  if grep -q C7510 "$out/build.log"; then echo "ptxas serialised wgmma in this build (C7510): counts not valid"; exit 1; fi
fi
dir=$(cd "$build_dir" && pwd)
LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout "${MEGAMOE_TILE_CLOCKS_TIMEOUT:-180}" \
  "$dir/bench_layer" --iters 1 --no-ep >"$out/bench.txt" 2>&1
rc=$?
echo "bench_layer rc $rc ($out/bench.txt)"
# A timeout's signal or an abort skips the exit handler that prints the records.
[ $rc -eq 0 ] || echo "bench_layer did not finish normally: records may be missing"
python3 scripts/tile_clocks.py "$out/bench.txt"
