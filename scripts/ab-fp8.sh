#!/usr/bin/env bash
# The FP8 kernels of this tree against those of an earlier commit, built and timed in the same device call:
# rounds that alternate the two builds (base, this, base, this, ...) of bench_fp8_gemm (interleaved with
# cuBLASLt) and of bench_layer's FP8 per-kernel breakdown (CUPTI), then a table of the medians over rounds.
# A change to a main loop is kept only if it wins here, where both builds see the same machine and clocks.
#   scripts/ab-fp8.sh BASE_COMMIT OUTDIR [ROUNDS]
set -uo pipefail
cd "$(dirname "$0")/.."
base=${1:?usage: scripts/ab-fp8.sh BASE_COMMIT OUTDIR [ROUNDS]}
out=${2:?usage: scripts/ab-fp8.sh BASE_COMMIT OUTDIR [ROUNDS]}
rounds=${3:-3}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PATH=/usr/local/cuda/bin:$PATH
start=$(date +%s)
note() { printf '[ab-fp8 %4ss] %s\n' "$(( $(date +%s) - start ))" "$*"; }
gtest=()
[ -f .deps/googletest/CMakeLists.txt ] && gtest=(-DMEGAMOE_GTEST_SOURCE="$PWD/.deps/googletest")
jobs=$(nproc)

build() {  # source dir, build dir
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_WERROR=OFF -DMEGAMOE_BUILD_TESTS=OFF \
    "${gtest[@]}" >"$2.log" 2>&1 && cmake --build "$2" -j "$jobs" --target bench_fp8_gemm bench_layer >>"$2.log" 2>&1
}

base_tree=$(mktemp -d /tmp/ab-fp8-base.XXXXXX)
git worktree add -f --detach "$base_tree" "$base" >"$out/worktree.log" 2>&1 || { echo "no commit $base"; exit 2; }
trap 'git worktree remove --force "$base_tree" >/dev/null 2>&1' EXIT
build . build-ab-this || { note "build of this tree failed (build-ab-this.log)"; exit 1; }
build "$base_tree" "$base_tree/build" || { note "build of $base failed"; cp "$base_tree/build.log" "$out/"; exit 1; }
note "built this tree and $base"

for r in $(seq 1 "$rounds"); do
  for which in base this; do
    dir=build-ab-this
    [ "$which" = base ] && dir="$base_tree/build"
    timeout 120 "$dir/bench_fp8_gemm" --interleaved >"$out/gemm_${which}_$r.txt" 2>&1
    timeout 200 "$dir/bench_layer" --no-ep --iters 10 >"$out/layer_${which}_$r.txt" 2>&1
  done
  note "round $r"
done

python3 - "$out" "$rounds" <<'PY'
import re, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])

def gemm(path):
    # "<shape> <ms> ms <TFLOP/s> TFLOP/s | ..." : ours in single CTAs, the first figure of each row.
    rows = {}
    for line in open(path, errors="replace"):
        m = re.match(r"^((?:dense|grouped)\S*(?: \S+)*?)\s+([\d.]+) ms\s+([\d.]+) TFLOP/s", line)
        if m:
            rows.setdefault(m.group(1), float(m.group(3)))
    return rows

def layer(path):
    # The FP8 forward + backward breakdowns, one per layer shape in the bench's order: "<kernel> <calls> <ms>"
    # lines from the heading to the kernel count.
    rows, section, inside = {}, 0, False
    for line in open(path, errors="replace"):
        text = line.strip()
        if text.startswith("fp8 forward + backward:"):
            section, inside = section + 1, True
            continue
        if inside and text.startswith("kernels "):
            inside = False
        m = re.match(r"^\s+(\S.*?)\s+(?:[\d.]+\s+)?([\d.]+)$", line)
        if inside and m and ("gemm" in m.group(1) or "wgrad" in m.group(1) or m.group(1) in ("GEMMs", "everything else")):
            rows.setdefault(f"shape {section}: {m.group(1)}", float(m.group(2)))
    return rows

for name, parse, unit in (("gemm", gemm, "TFLOP/s"), ("layer", layer, "ms")):
    runs = {w: [parse(f"{out}/{name}_{w}_{r}.txt") for r in range(1, rounds + 1)] for w in ("base", "this")}
    keys = [k for k in runs["base"][0] if all(k in d for w in runs for d in runs[w])]
    print(f"\n{name}: median over {rounds} rounds ({unit}; this / base)")
    for k in keys:
        b = statistics.median(d[k] for d in runs["base"])
        t = statistics.median(d[k] for d in runs["this"])
        print(f"  {k[:70]:70s} base {b:9.3f}  this {t:9.3f}  x {t / b:.3f}")
PY
