#!/usr/bin/env python3
"""Reads `bench_layer` output (any mode; `--fp8` is the short one): the step times and, from each CUPTI
breakdown, every GEMM launch of the step and the GEMMs / everything else, keyed by layer shape and breakdown.

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
GEMM_TABLE = re.compile(r"^GEMM\s+ms\s+TFLOP/s$")


def parse(path):
    """{key: value}: '<H>/<I> step <precision>' (ms), '<H>/<I> <breakdown>: <GEMM or total>' (ms). A breakdown is
    named by the label line bench_layer prints before it ('fp8 forward + backward:' -> 'fp8', 'fp8 forward +
    backward, plain loops:' -> 'fp8, plain loops', 'fused forward + fused backward:' ...), 'fp8 forward' for the
    FP8 forward's, and 'bf16' (the modular step) where no label comes first."""
    figures, shape, label, kind, in_gemms = {}, "?", None, None, False
    for line in open(path, errors="replace"):
        text = line.strip()
        if in_gemms:
            m = GEMM_ROW.match(text)
            if m:
                figures.setdefault(f"{shape} {kind}: {m.group(1)}", float(m.group(2)))
                continue
            kind, in_gemms = None, False  # the breakdown ends with its GEMM table; this line is read below
        m = SHAPE.match(text)
        if m:
            shape, label, kind = f"{m.group(1)}/{m.group(2)}", None, None
            continue
        m = STEPS.search(text)
        if m:
            figures.setdefault(f"{shape} step bf16", float(m.group(1)))
            figures.setdefault(f"{shape} step fp8", float(m.group(2)))
            continue
        m = HEADING.match(text)
        if m:
            kind = "fp8 forward" if m.group(1) == "FP8 forward" else (label or "bf16")
            label = None
            continue
        if kind is None:
            # Between breakdowns a line ending in ':' names the next one (inside one, such lines are its gaps).
            if text.endswith(":"):
                label = text[:-1].replace("fp8 forward + backward", "fp8")
            continue
        m = TOTAL.match(text)
        if m:
            figures.setdefault(f"{shape} {kind}: {m.group(1)}", float(m.group(2)))
            continue
        if GEMM_TABLE.match(text):
            in_gemms = True
    return figures


def compare_runs(out, name, rounds, read, unit):
    """Medians over the rounds of each figure that `read` finds in OUT/<name>_{base,this}_<round>.txt, base and
    this side by side; a figure missing from some rounds (a run that failed or timed out) is named with the
    rounds it has. Exit status 1 if nothing could be compared. scripts/ab-fp8.sh reads its GEMM runs with it."""
    runs = {w: [read(f"{out}/{name}_{w}_{r}.txt") for r in range(1, rounds + 1)] for w in ("base", "this")}
    keys = list(dict.fromkeys(k for w in ("base", "this") for d in runs[w] for k in d))
    print(f"\n{name}: median over {rounds} rounds ({unit}; this / base)")
    compared = 0
    for k in keys:
        b = [d[k] for d in runs["base"] if k in d]
        t = [d[k] for d in runs["this"] if k in d]
        note = "" if len(b) == len(t) == rounds else f"  (rounds with it: base {len(b)}, this {len(t)})"
        if b and t:
            mb, mt = statistics.median(b), statistics.median(t)
            print(f"  {k[:76]:76s} base {mb:8.3f}  this {mt:8.3f}  x {mt / mb:.3f}{note}")
            compared += 1
        else:
            print(f"  {k[:76]:76s} only in {'base' if b else 'this'}{note}")
    if compared == 0:
        print(f"  nothing to compare (a build or a run failed: see the {name}_*.txt files)")
    return 0 if compared else 1


def compare(out, rounds):
    return compare_runs(out, "layer", rounds, parse, "ms")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--compare":
        sys.exit(compare(sys.argv[2], int(sys.argv[3])))
    elif len(sys.argv) == 2:
        for key, value in parse(sys.argv[1]).items():
            print(f"{key}: {value}")
    else:
        sys.exit(__doc__)
