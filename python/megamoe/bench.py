"""python -m megamoe.bench: megamoe against the plain PyTorch layer (megamoe.reference: permute,
torch._grouped_mm, SwiGLU, index_add combine), measured in the same run on the same inputs.

Per config: forward, backward (fwd+bwd minus fwd), total; TFLOP/s with the convention of docs/MODEL.md
(forward 6*H*I per routed pair, backward 12*H*I); speed-up = PyTorch time / megamoe time. CUDA events around
each region, warm-up first, median of --iters runs. A progress line per config goes to stderr, the table to
stdout. --json prints the JSON to stdout instead of the table; --json PATH writes it to PATH and still prints
the table.

--precision fp8 runs megamoe's blockwise FP8 layer (docs/FP8.md) against the same bf16 PyTorch layer.

--plot FILE.png (needs matplotlib) also profiles a few forward+backward passes of each implementation with
torch.profiler and splits each total into the time of its GEMM kernels and everything else (other kernels,
gaps between them), and draws megamoe against PyTorch per config, with the time the layer's GEMMs alone
would take at the rate megamoe's GEMM kernels reached in the same profile. --plot-from JSON redraws the
picture from a saved --json file, on any machine.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys

import torch

from . import ops, reference

# The benchmark configuration of docs/MODEL.md: one GPU, T=16384 tokens, 16 local experts, top-8.
CONFIGS = {
    "qwen3-30b-a3b": dict(hidden=2048, intermediate=768),
    "qwen3-235b-a22b": dict(hidden=4096, intermediate=1536),
}


def balanced_routing(tokens, experts, top_k, device, gen):
    # Distinct experts per token, uniformly at random: about T*K/E rows per expert.
    scores = torch.rand(tokens, experts, generator=gen, device=device)
    return scores.topk(top_k, dim=1).indices


def time_ms(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def passes(layer, x, idx, w, w13, w2, d_out):
    leaves = [x, w, w13, w2]

    def forward():
        with torch.no_grad():
            layer(x, idx, w, w13, w2)

    def forward_backward():
        out = layer(x, idx, w, w13, w2)
        torch.autograd.grad(out, leaves, d_out)

    return forward, forward_backward


def measure(layer, x, idx, w, w13, w2, d_out, warmup, iters):
    forward, forward_backward = passes(layer, x, idx, w, w13, w2, d_out)
    fwd = time_ms(forward, warmup, iters)
    total = time_ms(forward_backward, warmup, iters)
    return fwd, max(total - fwd, 0.0), total


# GEMM kernels by name: megamoe's engine ("grouped_gemm"), its FP8 GEMMs ("fp8_gemm", "fp8_wgrad"), cuBLAS
# ("nvjet", "sm90_xmma_gemm"), CUTLASS (what torch._grouped_mm runs). Everything else (permutes, SwiGLU,
# quantizers, combine, copies) counts as "other".
GEMM_KERNELS = re.compile(r"gemm|wgrad|nvjet|cutlass|xmma|sm90", re.IGNORECASE)


def kernel_split(kernels, pattern=GEMM_KERNELS):
    """kernels: (name, microseconds) of the device kernels of some passes -> (GEMM ms, other kernels ms)."""
    gemm = other = 0.0
    for name, us in kernels:
        if pattern.search(name):
            gemm += us
        else:
            other += us
    return gemm / 1e3, other / 1e3


def profile_kernels(fn, iters):
    """(name, microseconds) of every device kernel that `iters` calls of fn ran, after one untimed call. The
    profiler's CUDA activity sees every kernel of the process, those megamoe launches on its own streams too."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == DeviceType.CUDA]


def gemm_profile(fn, iters, total_ms, flops):
    """The GEMM share of one forward+backward pass, per pass: the GEMM kernels' time and rate, and the rest
    of the measured total (other kernels and the gaps between kernels). Where kernels ran concurrently (the
    ranks of --ranks > 1 run on streams of their own) the summed kernel time exceeds the measured total; the
    split is then the kernels' proportion of the total, and `overlapped` says so."""
    gemm_ms, other_kernels_ms = (t / iters for t in kernel_split(profile_kernels(fn, iters)))
    rate = flops / (gemm_ms * 1e-3) / 1e12 if gemm_ms > 0 else None
    overlapped = gemm_ms + other_kernels_ms > total_ms
    share = gemm_ms * total_ms / (gemm_ms + other_kernels_ms) if overlapped else gemm_ms
    return dict(gemm_ms=share, other_kernels_ms=other_kernels_ms, total_ms=total_ms, rest_ms=total_ms - share,
                gemm_kernels_ms=gemm_ms, gemm_tflops=rate, overlapped=overlapped)


def run_config(name, shape, args):
    device = torch.device("cuda")
    ranks, tokens, experts, top_k = args.ranks, args.tokens, args.experts * args.ranks, args.top_k
    h, i = shape["hidden"], shape["intermediate"]
    gen = torch.Generator(device=device).manual_seed(args.seed)
    x = (torch.randn(tokens, h, device=device, generator=gen)).bfloat16().requires_grad_()
    idx = balanced_routing(tokens, experts, top_k, device, gen)
    w = torch.rand(tokens, top_k, device=device, generator=gen).requires_grad_()
    w13 = (torch.randn(experts, 2 * i, h, device=device, generator=gen) * 0.02).bfloat16().requires_grad_()
    w2 = (torch.randn(experts, h, i, device=device, generator=gen) * 0.02).bfloat16().requires_grad_()
    d_out = torch.randn(tokens, h, device=device, generator=gen).bfloat16()
    pairs = int((idx >= 0).sum())
    fwd_flops, bwd_flops = 6.0 * h * i * pairs, 12.0 * h * i * pairs

    row = dict(config=name, hidden=h, intermediate=i, experts=experts, top_k=top_k, tokens=tokens,
               virtual_ranks=ranks, precision=args.precision, flops=fwd_flops + bwd_flops)
    baseline = lambda *a: reference.moe(*a, check=False)  # noqa: E731
    base = measure(baseline, x, idx, w, w13, w2, d_out, args.warmup, args.iters)
    row["pytorch"] = _times(base, fwd_flops, bwd_flops)
    if args.profile:
        row["profile"] = {"pytorch": gemm_profile(passes(baseline, x, idx, w, w13, w2, d_out)[1], args.profile_iters,
                                                  base[2], fwd_flops + bwd_flops)}

    try:
        cfg = ops.LayerConfig(h, i, experts, top_k, max_tokens_per_rank=-(-tokens // ranks), num_ranks=ranks,
                              precision=ops.precision_from_name(args.precision))
        key = ops.new_key()

        # Every rank's experts stay in the one w13 / w2 (as MegaMoE holds them): slicing them per rank would make
        # autograd fill and add a full-size gradient tensor for each rank's slice.
        def megamoe_layer(x_, idx_, w_, w13_, w2_):
            outs = ops.moe_ranks_all_experts(list(torch.tensor_split(x_, ranks)), list(torch.tensor_split(idx_, ranks)),
                                             list(torch.tensor_split(w_, ranks)), w13_, w2_, config=cfg, key=key)
            return outs[0] if ranks == 1 else torch.cat(outs)

        checks = ops.debug_checks()
        ops.set_debug_checks(True)
        megamoe_layer(x, idx, w, w13, w2)  # checked once (ids, device errors), then timed without host syncs
        ops.set_debug_checks(False)
        try:
            mine = measure(megamoe_layer, x, idx, w, w13, w2, d_out, args.warmup, args.iters)
            if args.profile:
                prof = gemm_profile(passes(megamoe_layer, x, idx, w, w13, w2, d_out)[1], args.profile_iters, mine[2],
                                    fwd_flops + bwd_flops)
                row["profile"]["megamoe"] = prof
                if prof["gemm_tflops"]:
                    # The engine's rate as measured in this same profile (useful FLOPs over the time of megamoe's
                    # GEMM kernels), not from a separate GEMM benchmark: the package has no entry point for the
                    # engine alone, and the layer's own GEMMs, at its shapes and routing, are what the line is
                    # about. The line is then what the layer would cost if nothing but its GEMMs took time.
                    row["gemms_alone"] = dict(engine_tflops=prof["gemm_tflops"],
                                              ms=(fwd_flops + bwd_flops) / (prof["gemm_tflops"] * 1e12) * 1e3)
        finally:
            ops.set_debug_checks(checks)
        ops.synchronize_and_check(cfg, key)
        row["megamoe"] = _times(mine, fwd_flops, bwd_flops)
        row["speedup"] = {k: row["pytorch"][f"{k}_ms"] / row["megamoe"][f"{k}_ms"]
                          for k in ("fwd", "bwd", "total") if row["megamoe"][f"{k}_ms"] > 0}
    except Exception as e:  # the baseline row still reports
        row["megamoe_error"] = f"{type(e).__name__}: {e}"
    return row


def _times(t, fwd_flops, bwd_flops):
    fwd, bwd, total = t
    tflops = lambda flops, ms: flops / (ms * 1e-3) / 1e12 if ms > 0 else 0.0  # noqa: E731
    return dict(fwd_ms=fwd, bwd_ms=bwd, total_ms=total, fwd_tflops=tflops(fwd_flops, fwd),
                bwd_tflops=tflops(bwd_flops, bwd), total_tflops=tflops(fwd_flops + bwd_flops, total))


def _progress(row):
    p = row["pytorch"]
    line = f"[bench] {row['config']}: pytorch total {p['total_ms']:.3f} ms ({p['total_tflops']:.0f} TFLOP/s)"
    if "megamoe" in row:
        m = row["megamoe"]
        line += f", megamoe total {m['total_ms']:.3f} ms ({m['total_tflops']:.0f} TFLOP/s), " \
                f"speed-up {row['speedup'].get('total', 0):.2f}x"
    else:
        line += f", megamoe failed: {row['megamoe_error']}"
    for impl, prof in row.get("profile", {}).items():
        line += f"; {impl} GEMM kernels {prof['gemm_ms']:.3f} ms"
    print(line, file=sys.stderr, flush=True)


def plot(report, path):
    """The picture of --plot: per config, PyTorch and megamoe side by side, each bar its measured
    forward+backward time split into GEMM kernels and everything else; a dashed line at the time the
    layer's GEMMs alone would take at megamoe's GEMM rate in that same profile (the engine's measured rate),
    i.e. what the layer would cost if nothing but its GEMMs took time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if "profile" in r]
    if not rows:
        raise ValueError("no profiled rows to plot (run with --plot, or --plot-from a JSON written with --plot)")
    fig, ax = plt.subplots(figsize=(2.6 + 2.4 * len(rows), 4.8))
    width, colors = 0.36, {"gemm": "#2b6cb0", "rest": "#a0c4e8"}
    labelled = set()
    for c, row in enumerate(rows):
        bars = [("megamoe", c + width / 2), ("pytorch", c - width / 2)]  # megamoe first: the legend's swatches
        for impl, xpos in bars:
            prof = row["profile"].get(impl)
            if prof is None:
                ax.text(xpos, 0, "failed", ha="center", va="bottom", fontsize=8, rotation=90)
                continue
            for part, bottom in (("gemm", 0.0), ("rest", prof["gemm_ms"])):
                value = prof["gemm_ms"] if part == "gemm" else prof["rest_ms"]
                label = {"gemm": "GEMM kernels", "rest": "everything else"}[part]
                ax.bar(xpos, value, width * 0.92, bottom=bottom, color=colors[part],
                       edgecolor="#1a365d" if impl == "megamoe" else "#555555", linewidth=1.2,
                       hatch=None if impl == "megamoe" else "//", label=None if part in labelled else label)
                labelled.add(part)
            rate = f"\nGEMMs {prof['gemm_tflops']:.0f} TF/s" if prof.get("gemm_tflops") else ""
            ax.text(xpos, prof["total_ms"], f"{impl}\n{prof['total_ms']:.2f} ms{rate}", ha="center", va="bottom",
                    fontsize=8)
        alone = row.get("gemms_alone")
        if alone:
            ax.plot([c - width, c + width], [alone["ms"], alone["ms"]], "k--", linewidth=1.2,
                    label=None if "ideal" in labelled else "GEMMs alone at the engine's measured rate")
            labelled.add("ideal")
        if "speedup" in row and "total" in row["speedup"]:
            ax.text(c, 0, f"megamoe {row['speedup']['total']:.2f}x", ha="center", va="top", fontsize=9, fontweight="bold",
                    transform=ax.get_xaxis_transform())
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['config']}\nH={r['hidden']} I={r['intermediate']} E={r['experts']} K={r['top_k']}\n"
                        f"T={r['tokens']}" for r in rows], fontsize=8)
    ax.tick_params(axis="x", pad=16)
    ax.set_ylabel("forward + backward, ms (median)")
    ax.set_ylim(0, max(r["profile"][i]["total_ms"] for r in rows for i in r["profile"]) * 1.3)
    ax.set_title(f"megamoe ({report.get('precision', 'bf16')}) vs PyTorch (bf16, hatched) on "
                 f"{report.get('device', '?')}, torch {report.get('torch', '?')}",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _table(rows):
    head = f"{'config':<18}{'impl':<9}{'fwd ms':>9}{'bwd ms':>9}{'total ms':>10}{'fwd TF/s':>10}{'bwd TF/s':>10}" \
           f"{'tot TF/s':>10}{'speed-up':>10}"
    lines = [head, "-" * len(head)]
    for row in rows:
        for impl in ("pytorch", "megamoe"):
            t = row.get(impl)
            if t is None:
                lines.append(f"{row['config']:<18}{impl:<9}  error: {row.get('megamoe_error', '')}")
                continue
            ratio = f"{row['speedup']['total']:.2f}x" if impl == "megamoe" and "total" in row.get("speedup", {}) \
                else ""
            lines.append(f"{row['config']:<18}{impl:<9}{t['fwd_ms']:>9.3f}{t['bwd_ms']:>9.3f}{t['total_ms']:>10.3f}"
                         f"{t['fwd_tflops']:>10.0f}{t['bwd_tflops']:>10.0f}{t['total_tflops']:>10.0f}{ratio:>10}")
    return "\n".join(lines)


def _need_matplotlib(parser):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error("--plot needs matplotlib: pip install matplotlib (or pip install 'megamoe[plot]')")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m megamoe.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), action="append", help="default: all")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens in total (split over the ranks)")
    parser.add_argument("--experts", type=int, default=16, help="experts per rank")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=1, help="virtual ranks on this GPU")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", choices=sorted(ops.PRECISIONS), default="bf16",
                        help="megamoe's arithmetic (fp8: DeepSeek-V3's blockwise FP8, docs/FP8.md); the PyTorch "
                             "layer stays bf16")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="JSON results: to PATH (the table still goes to stdout), or to stdout instead of the "
                             "table when PATH is omitted or '-'")
    parser.add_argument("--plot", metavar="FILE.png", help="draw megamoe vs PyTorch per config, GEMM time and the "
                        "rest (profiles each implementation; needs matplotlib)")
    parser.add_argument("--profile", action="store_true", help="add the GEMM/other split to the results without "
                        "drawing (implied by --plot)")
    parser.add_argument("--profile-iters", type=int, default=3, help="forward+backward passes profiled per "
                        "implementation and config")
    parser.add_argument("--plot-from", metavar="JSON", help="no benchmark: draw --plot from a JSON file written "
                        "by --json with --plot or --profile")
    args = parser.parse_args(argv)
    for name in ("tokens", "experts", "top_k", "ranks", "iters", "profile_iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    if args.plot:
        _need_matplotlib(parser)
    if args.plot_from:
        if not args.plot:
            parser.error("--plot-from needs --plot FILE.png")
        with open(args.plot_from) as f:
            plot(json.load(f), args.plot)
        print(f"[bench] plot written to {args.plot}", file=sys.stderr, flush=True)
        return 0
    args.profile = args.profile or bool(args.plot)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (only --plot-from works without one)")
    rows = []
    for name in args.config or list(CONFIGS):
        rows.append(run_config(name, CONFIGS[name], args))
        _progress(rows[-1])
    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, iters=args.iters,
                   precision=args.precision, rows=rows)
    report = json.dumps(results, indent=2)
    if args.json == "-":
        print(report)
    else:
        if args.json is not None:
            with open(args.json, "w") as f:
                f.write(report + "\n")
            print(f"[bench] JSON written to {args.json}", file=sys.stderr, flush=True)
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, median of {args.iters} runs, "
              f"megamoe in {args.precision} (PyTorch in bf16)")
        print(_table(rows))
    if args.plot:
        plot(results, args.plot)
        print(f"[bench] plot written to {args.plot}", file=sys.stderr, flush=True)
    return 0 if all("megamoe" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
