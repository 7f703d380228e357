"""PyTorch baseline of the MoE layer (the benchmark configuration of docs/MODEL.md): permute, torch._grouped_mm x2, SwiGLU, weighted
index_add_, autograd backward; bf16, R = 1, T = 16384, 16 experts, top-8. Run by scripts/gpu-check.sh right
before bench_layer (same machine, same call), which reads the CSV written to --out and prints the ratios.

    python3 benchmarks/bench_layer_torch.py [--out PATH] [--iters N]
"""
import argparse
import statistics

import torch


def moe_forward(x, topk_idx, topk_w, w13, w2):
    T, H = x.shape
    K = topk_idx.shape[1]
    E, two_i, _ = w13.shape
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of_row = order // K
    counts = torch.bincount(flat, minlength=E)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[token_of_row]
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offsets)
    g, u = h.chunk(2, dim=-1)
    a = torch.nn.functional.silu(g) * u
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offsets)
    y = y * topk_w.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    out = torch.zeros_like(x)
    out.index_add_(0, token_of_row, y)
    return out


def time_ms(fn, iters):
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    times = []
    for it in range(iters + 3):
        start.record()
        fn(it)
        stop.record()
        stop.synchronize()
        if it >= 3:
            times.append(start.elapsed_time(stop))
    return statistics.median(times)


def run(H, I, iters):
    T, E, K = 16384, 16, 8
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    sets = []
    for _ in range(2):
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
        idx = torch.argsort(torch.rand(T, E, device=dev, generator=gen), dim=1)[:, :K]
        w = torch.full((T, K), 1.0 / K, device=dev, requires_grad=True)
        d_out = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=gen)
        sets.append((x, idx, w, d_out))
    w13 = (torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02).requires_grad_()
    w2 = (torch.randn(E, H, I, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02).requires_grad_()

    def fwd(it):
        x, idx, w, _ = sets[it % 2]
        with torch.no_grad():
            moe_forward(x, idx, w, w13, w2)

    def fwd_bwd(it):
        x, idx, w, d_out = sets[it % 2]
        out = moe_forward(x, idx, w, w13, w2)
        out.backward(d_out)

    fwd_ms = time_ms(fwd, iters)
    total_ms = time_ms(fwd_bwd, iters)
    flops_fwd = 6.0 * H * I * T * K
    return {"hidden": H, "intermediate": I, "forward_ms": fwd_ms, "total_ms": total_ms,
            "forward_tflops": flops_fwd / fwd_ms / 1e9, "total_tflops": 3 * flops_fwd / total_ms / 1e9}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="CSV: hidden,intermediate,forward_ms,total_ms")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_layer_torch: no CUDA device, nothing to time")
        return
    results = []
    for H, I in [(2048, 768), (4096, 1536)]:
        print(f"bench_layer_torch: H={H} I={I} E=16 K=8 T=16384 ...", flush=True)
        results.append(run(H, I, args.iters))
    if args.out:
        with open(args.out, "w") as f:
            for r in results:
                f.write(f"{r['hidden']},{r['intermediate']},{r['forward_ms']:.4f},{r['total_ms']:.4f}\n")
    print("| PyTorch layer H,I | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |")
    for r in results:
        print(f"| {r['hidden']},{r['intermediate']} | {r['forward_ms']:.3f} | {r['forward_tflops']:.1f} | "
              f"{r['total_ms']:.3f} | {r['total_tflops']:.1f} |")


if __name__ == "__main__":
    main()
