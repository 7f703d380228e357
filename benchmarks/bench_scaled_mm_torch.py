#!/usr/bin/env python3
"""torch._scaled_mm baselines for benchmarks/bench_fp8_gemm's dense 8192^3 row (same device session).

Two recipes of PyTorch's FP8 GEMM on the same e4m3 operands (A [M, K] row-major, B [N, K] row-major, so
D = A B^T as ours): per-tensor scales, and DeepSeek's blockwise recipe, the one our kernel computes (A's
scales per row and 128-deep K block, B's per 128 x 128 block). Each recipe's output is checked against a
float64 product of the dequantized operands before it is timed. Timing: CUDA events around each call, 5
warm-ups, then 30 rounds in which each recipe runs once in turn (interleaved); the median of each.
Prints one line per recipe: "torch._scaled_mm <recipe> M N K <ms> ms <TFLOP/s> TFLOP/s rel err <e>".
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gemm_torch import event_ms  # noqa: E402  (the same CUDA-event timing as the GEMM baseline)


def median_interleaved(fns, warmup=5, rounds=30):
    for fn in fns:
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            times[i].append(event_ms(fn))
    return [sorted(t)[len(t) // 2] for t in times]


def blockwise_operands(M, N, K, dev):
    """e4m3 codes of random data and positive scales of the recipe's shapes."""
    g = torch.Generator(device=dev).manual_seed(7)
    a = (torch.rand(M, K, device=dev, generator=g) * 2 - 1).to(torch.float8_e4m3fn)
    b = (torch.rand(N, K, device=dev, generator=g) * 2 - 1).to(torch.float8_e4m3fn)
    sa = torch.rand(M, K // 128, device=dev, generator=g) + 0.5  # per row and K block
    sb = torch.rand(N // 128, K // 128, device=dev, generator=g) + 0.5  # per 128 x 128 block
    return a, b, sa, sb


def reference(a, b, sa, sb, rows=256):
    """Rows [0, rows) of D in float64 from the dequantized operands."""
    K = a.shape[1]
    a64 = a[:rows].double() * sa[:rows].double().repeat_interleave(128, dim=1)[:, :K]
    b64 = b.double() * sb.double().repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)[: b.shape[0], :K]
    return a64 @ b64.t()


def main():
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    dev = "cuda"
    M = N = K = 8192
    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name()}, cuda {torch.version.cuda}")
    a, b, sa, sb = blockwise_operands(M, N, K, dev)
    one = torch.ones((), device=dev)
    # The blockwise recipe's layouts: A's scales outer-dim-major ([M, K/128] with stride [1, M]); B's as the
    # transposed view of [N/128, K/128] (K / 128 is a multiple of 4 here, so no padding).
    sa_layout = sa.t().contiguous().t()
    sb_layout = sb.t()
    recipes = {
        "per-tensor": lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16),
        "blockwise 1x128 / 128x128": lambda: torch._scaled_mm(a, b.t(), sa_layout, sb_layout,
                                                              out_dtype=torch.bfloat16),
    }
    usable = {}
    for name, fn in recipes.items():
        try:
            d = fn()
        except RuntimeError as e:
            print(f"torch._scaled_mm {name}: not supported here ({str(e).splitlines()[0]})")
            continue
        if name == "per-tensor":
            want = reference(a, b, torch.ones_like(sa), torch.ones_like(sb))
        else:
            want = reference(a, b, sa, sb)
        got = d[: want.shape[0]].double()
        err = float((got - want).norm() / want.norm())
        usable[name] = (fn, err)
    times = median_interleaved([fn for fn, _ in usable.values()])
    flop = 2.0 * M * N * K
    for (name, (_, err)), ms in zip(usable.items(), times):
        print(f"torch._scaled_mm {name:26s} {M} {N} {K} {ms:8.3f} ms {flop / ms * 1e-9:7.1f} TFLOP/s rel err {err:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
