"""python -m megamoe.bench: megamoe against the plain PyTorch layer (megamoe.reference: permute,
torch._grouped_mm, SwiGLU, index_add combine), measured in the same run on the same inputs.

Per config: forward, backward (fwd+bwd minus fwd), total; TFLOP/s with DESIGN.md's convention (forward
6*H*I per routed pair, backward 12*H*I); speed-up = PyTorch time / megamoe time. CUDA events around each
region, warm-up first, median of --iters runs. A progress line per config goes to stderr, the table to
stdout. --json prints the JSON to stdout instead of the table; --json PATH writes it to PATH and still prints
the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from . import ops, reference

# DESIGN.md section 7: one H200, T=16384 tokens, 16 local experts, top-8.
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


def measure(layer, x, idx, w, w13, w2, d_out, warmup, iters):
    leaves = [x, w, w13, w2]

    def forward():
        with torch.no_grad():
            layer(x, idx, w, w13, w2)

    def forward_backward():
        out = layer(x, idx, w, w13, w2)
        torch.autograd.grad(out, leaves, d_out)

    fwd = time_ms(forward, warmup, iters)
    total = time_ms(forward_backward, warmup, iters)
    return fwd, max(total - fwd, 0.0), total


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
               virtual_ranks=ranks)
    base = measure(lambda *a: reference.moe(*a, check=False), x, idx, w, w13, w2, d_out, args.warmup, args.iters)
    row["pytorch"] = _times(base, fwd_flops, bwd_flops)

    try:
        cfg = ops.LayerConfig(h, i, experts, top_k, max_tokens_per_rank=-(-tokens // ranks), num_ranks=ranks)
        key = ops.new_key()
        per = experts // ranks

        def megamoe_layer(x_, idx_, w_, w13_, w2_):
            outs = ops.moe_ranks(list(torch.tensor_split(x_, ranks)), list(torch.tensor_split(idx_, ranks)),
                                 list(torch.tensor_split(w_, ranks)),
                                 [w13_[r * per:(r + 1) * per] for r in range(ranks)],
                                 [w2_[r * per:(r + 1) * per] for r in range(ranks)], config=cfg, key=key)
            return outs[0] if ranks == 1 else torch.cat(outs)

        checks = ops.debug_checks()
        ops.set_debug_checks(True)
        megamoe_layer(x, idx, w, w13, w2)  # checked once (ids, device errors), then timed without host syncs
        ops.set_debug_checks(False)
        try:
            mine = measure(megamoe_layer, x, idx, w, w13, w2, d_out, args.warmup, args.iters)
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
    print(line, file=sys.stderr, flush=True)


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
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="JSON results: to PATH (the table still goes to stdout), or to stdout instead of the "
                             "table when PATH is omitted or '-'")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    rows = []
    for name in args.config or list(CONFIGS):
        rows.append(run_config(name, CONFIGS[name], args))
        _progress(rows[-1])
    report = json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, iters=args.iters,
                             rows=rows), indent=2)
    if args.json == "-":
        print(report)
    else:
        if args.json is not None:
            with open(args.json, "w") as f:
                f.write(report + "\n")
            print(f"[bench] JSON written to {args.json}", file=sys.stderr, flush=True)
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, median of {args.iters} runs")
        print(_table(rows))
    return 0 if all("megamoe" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
