#!/usr/bin/env python3
"""Reads `bench_layer --fp8` output: the step times and, from each CUPTI breakdown, every GEMM launch of the step
and the GEMMs / everything else, keyed by layer shape and precision.

  layer_breakdown.py FILE                 the figures of one output, one per line
  layer_breakdown.py --compare DIR ROUNDS medians over DIR/layer_{base,this}_{1..ROUNDS}.txt side by side
"""
import re
import statistics
import sys

SHAPE = re.compile(r"^bench_layer: H=(\d+) I=(\d+)")
STEPS = re.compile(r"steps back to back [^:]*: bf16 ([\d.]+) ms, fp8 ([\d.]+) ms")
HEADING = re.compile(r"^kernel time per (.+) \(CUPTI")
TOTAL = re.compile(r"^(GEMMs|everything else)\s+([\d.]+)$")
GEMM_ROW = re.compile(r"^(\S.*?)\s+([\d.]+)\s+([\d.]+)$")


def parse(path):
    """{key: value}: '<H>/<I> step <precision>' (ms), '<H>/<I> <precision>: <kernel or total>' (ms)."""
    figures, shape, label, kind, in_gemms = {}, "?", None, None, False
    for line in open(path, errors="replace"):
        text = line.strip()
        m = SHAPE.match(text)
        if m:
            shape, label, kind, in_gemms = f"{m.group(1)}/{m.group(2)}", None, None, False
            continue
        m = STEPS.search(text)
        if m:
            figures.setdefault(f"{shape} step bf16", float(m.group(1)))
            figures.setdefault(f"{shape} step fp8", float(m.group(2)))
            continue
        if text == "fp8 forward + backward:":  # the label bench_layer prints before the FP8 step's breakdown
            label = "fp8"
            continue
        m = HEADING.match(text)
        if m:
            kind = "fp8 forward" if m.group(1) == "FP8 forward" else (label or "bf16")
            label, in_gemms = None, False
            continue
        if kind is None:
            continue
        m = TOTAL.match(text)
        if m:
            figures.setdefault(f"{shape} {kind}: {m.group(1)}", float(m.group(2)))
            continue
        if re.match(r"^GEMM\s+ms\s+TFLOP/s$", text):
            in_gemms = True
            continue
        if in_gemms:
            m = GEMM_ROW.match(text)
            if m:
                figures.setdefault(f"{shape} {kind}: {m.group(1)}", float(m.group(2)))
            else:
                kind, in_gemms = None, False  # the breakdown ends with its GEMM table
    return figures


def compare(out, rounds):
    runs = {w: [parse(f"{out}/layer_{w}_{r}.txt") for r in range(1, rounds + 1)] for w in ("base", "this")}
    keys = [k for k in runs["base"][0] if all(k in d for w in runs for d in runs[w])]
    print(f"\nbench_layer --fp8: median over {rounds} rounds (ms; this / base)")
    for k in keys:
        b = statistics.median(d[k] for d in runs["base"])
        t = statistics.median(d[k] for d in runs["this"])
        print(f"  {k[:76]:76s} base {b:8.3f}  this {t:8.3f}  x {t / b:.3f}")
    if not keys:
        print("  nothing to compare (a build or a run failed: see the layer_*.txt files)")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--compare":
        compare(sys.argv[2], int(sys.argv[3]))
    elif len(sys.argv) == 2:
        for key, value in parse(sys.argv[1]).items():
            print(f"{key}: {value}")
    else:
        sys.exit(__doc__)
