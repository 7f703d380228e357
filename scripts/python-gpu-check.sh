#!/usr/bin/env bash
# The Python package on the GPU machine: install, run the pytest suite with every crash aid on, run the
# benchmark, print a short summary last. Everything lands in OUTDIR:
#   install.log          pip install (scikit-build-core build of libmegamoe)
#   env.txt              interpreter, torch, GPU, which libcudart/libstdc++/libnccl the process maps
#   isolated.log         test_c_abi.py + test_bad_config_raises alone, in a fresh interpreter (is the crash
#                        in the library's host path itself, or a consequence of earlier GPU work?)
#   pytest.log           the whole suite, -v -x, faulthandler on (fatal-signal kind and all thread stacks)
#   pytest.xml           JUnit report of that run (absent when the interpreter died)
#   sanitizer.log        optional (MEGAMOE_SANITIZER=1): a few GPU tests under compute-sanitizer memcheck
#   megamoe_bench.json   python -m megamoe.bench --json PATH --plot (bench.log: its table and progress)
#   megamoe_bench.png    its picture: megamoe vs PyTorch per config, GEMM kernels and the rest
#   megamoe_bench_fp8.json  the same with --precision fp8 (bench_fp8.log)
#   summary.txt          what is printed last
# Usage: scripts/python-gpu-check.sh OUTDIR        (MEGAMOE_SKIP_INSTALL=1 reuses the installed package)
# Budget: about 8 minutes once libmegamoe is built (a cold CUDA build adds its own minutes to the install).
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
out=${1:?usage: scripts/python-gpu-check.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PATH=/usr/local/cuda/bin:$PATH
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
py=${PYTHON:-python3}
start=$(date +%s)
note() { printf '[python-gpu-check %4ss] %s\n' "$(( $(date +%s) - start ))" "$*"; }
# rc of a command killed by a signal is 128+N; name it (139 SIGSEGV, 134 SIGABRT, 135 SIGBUS, ...).
rc_name() { local rc=$1; if [ "$rc" -gt 128 ]; then echo "$rc ($(kill -l $((rc - 128)) 2>/dev/null || echo signal))"; else echo "$rc"; fi; }

if [ "${MEGAMOE_SKIP_INSTALL:-0}" != 1 ]; then
  note "pip install -> $out/install.log"
  if ! CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$py" -m pip install --no-build-isolation --no-deps -v . \
       >"$out/install.log" 2>&1; then
    tail -30 "$out/install.log"
    echo "INSTALL FAILED (see $out/install.log)" | tee "$out/summary.txt"
    exit 1
  fi
fi

# Run from outside the checkout: the installed package is what gets imported, not python/megamoe.
cd /tmp
"$py" - >"$out/env.txt" 2>&1 <<'PY'
import os, sys
print("python", sys.version.replace("\n", " "), sys.executable)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
import megamoe
from megamoe import _lib
lib = _lib.lib()
print("megamoe", megamoe.__file__, "library", lib._name, "built_with_cuda", _lib.built_with_cuda())
# Every copy of the runtimes the process maps: two libcudart/libstdc++ here would be a finding.
maps = {line.split()[-1] for line in open("/proc/self/maps") if "/" in line.split()[-1]}
for key in ("cudart", "libstdc++", "nccl", "libcuda.so", "megamoe"):
    for path in sorted(p for p in maps if key in os.path.basename(p)):
        print("mapped", path)
PY
note "env: $(grep -E '^(torch|gpu|megamoe)' "$out/env.txt" | tr '\n' ' ')"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >>"$out/env.txt" 2>&1 || true
ldd "$(sed -n 's/.* library \([^ ]*\) .*/\1/p' "$out/env.txt" | head -1)" >>"$out/env.txt" 2>&1 || true

timeout_opt=()
"$py" -c "import pytest_timeout" 2>/dev/null && timeout_opt=(--timeout 200)
tests=$repo/python/tests

# 1. The crashing call on its own, in a fresh interpreter (seconds).
note "isolated: test_c_abi.py + test_bad_config_raises -> $out/isolated.log"
timeout 120 "$py" -X faulthandler -m pytest -v -p no:cacheprovider "${timeout_opt[@]}" \
  "$tests/test_c_abi.py" "$tests/test_ops_gpu.py::test_bad_config_raises" >"$out/isolated.log" 2>&1
iso_rc=$?
note "isolated: rc $(rc_name $iso_rc); $(grep -E '[0-9]+ (passed|failed)' "$out/isolated.log" | tail -1)"

# 2. The whole suite, stop at the first failure, every test named as it starts (-v).
note "pytest (whole suite, -v -x) -> $out/pytest.log"
timeout 420 "$py" -X faulthandler -m pytest -v -x -p no:cacheprovider -ra "${timeout_opt[@]}" \
  --junitxml="$out/pytest.xml" "$tests" >"$out/pytest.log" 2>&1
pytest_rc=$?
note "pytest: rc $(rc_name $pytest_rc)"

# 3. Optional: a few GPU tests under compute-sanitizer (device out-of-bounds, including writes that would
#    otherwise land in host memory through HMM/ATS).
if [ "${MEGAMOE_SANITIZER:-0}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  note "compute-sanitizer memcheck (subset) -> $out/sanitizer.log"
  timeout 180 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
    "$py" -m pytest -q -x -p no:cacheprovider "$tests/test_ops_gpu.py" \
    -k "(test_matches_fp32_reference and random) or test_module_matches or test_bad_config" \
    >"$out/sanitizer.log" 2>&1
  note "sanitizer: rc $(rc_name $?); $(grep -E 'ERROR SUMMARY' "$out/sanitizer.log" | tail -1)"
fi

# 4. The benchmark (JSON to a file, table to bench.log, the picture where matplotlib is installed).
plot_opt=()
"$py" -c "import matplotlib" 2>/dev/null && plot_opt=(--plot "$out/megamoe_bench.png")
note "python -m megamoe.bench --json $out/megamoe_bench.json ${plot_opt[*]}"
timeout 200 "$py" -m megamoe.bench --json "$out/megamoe_bench.json" "${plot_opt[@]}" --warmup 3 --iters 10 \
  >"$out/bench.log" 2>&1
bench_rc=$?
note "bench: rc $(rc_name $bench_rc)"
note "python -m megamoe.bench --precision fp8 --json $out/megamoe_bench_fp8.json"
timeout 200 "$py" -m megamoe.bench --precision fp8 --json "$out/megamoe_bench_fp8.json" --warmup 3 --iters 10 \
  >"$out/bench_fp8.log" 2>&1
bench_fp8_rc=$?
note "bench fp8: rc $(rc_name $bench_fp8_rc)"

# Summary, last.
"$py" - "$out" "$iso_rc" "$pytest_rc" "$bench_rc" "$bench_fp8_rc" >"$out/summary.txt" 2>&1 <<'PY'
import json, os, re, sys
out, iso_rc, pytest_rc, bench_rc, bench_fp8_rc = sys.argv[1], *map(int, sys.argv[2:])
log = open(os.path.join(out, "pytest.log"), errors="replace").read()
counts = {k: 0 for k in ("passed", "failed", "skipped", "error")}
for m in re.finditer(r"::.*? (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", log):
    key = m.group(1).lower()
    counts[key if key in counts else "passed"] += 1
print(f"pytest rc {pytest_rc}: {counts['passed']} passed, {counts['failed']} failed, "
      f"{counts['error']} errors, {counts['skipped']} skipped (isolated run rc {iso_rc})")
# pytest -v writes "path::test " before running it, so a fatal error's text follows on that same line.
fatal = re.search(r"Fatal Python error: [^\n]*", log)
if fatal or pytest_rc > 128 or pytest_rc == 124:
    before = log[:fatal.start()] if fatal else log
    started = re.findall(r"^(\S[^\n]*?::[^\n]*?)(?: (?:PASSED|FAILED|SKIPPED|ERROR)\b[^\n]*)?$", before, re.M)
    what = fatal.group(0) if fatal else ("timed out" if pytest_rc == 124 else f"killed by signal {pytest_rc - 128}")
    print("CRASH:", what, "| running:", started[-1].strip() if started else "?")
    if fatal:
        print("\n".join("  " + line for line in log[fatal.start():].splitlines()[1:16]))
first = re.search(r"^_{3,} (\S.*?) _{3,}$(.*?)(?=^_{3,} |^=+ )", log, re.M | re.S)
if first:
    errors = [line for line in first.group(2).splitlines() if line.startswith("E ")]
    print("first failure:", first.group(1), "|", " ".join(e[1:].strip() for e in errors[:3])[:400])
short = [m.group(0) for m in re.finditer(r"^(?:FAILED|ERROR) .*$", log, re.M)]
for line in short[:5]:
    print(" ", line[:200])
runs = (("megamoe_bench.json", bench_rc, "bench"), ("megamoe_bench_fp8.json", bench_fp8_rc, "bench fp8"))
for name, rc, label in runs:
    path = os.path.join(out, name)
    if not os.path.exists(path):
        print(f"{label} rc {rc}: no JSON (see its log)")
        continue
    for row in json.load(open(path))["rows"]:
        m = row.get("megamoe")
        print(f"{label} {row['config']}: pytorch {row['pytorch']['total_ms']:.3f} ms, " +
              (f"megamoe {m['total_ms']:.3f} ms ({row['speedup'].get('total', 0):.2f}x)" if m
               else f"megamoe error: {row.get('megamoe_error')}"))
png = os.path.join(out, "megamoe_bench.png")
print(f"bench plot: {png}" if os.path.exists(png) else "bench plot: none (matplotlib missing or the run failed)")
PY
cat "$out/summary.txt"
[ $pytest_rc -eq 0 ] && [ $bench_rc -eq 0 ] && [ $bench_fp8_rc -eq 0 ]
