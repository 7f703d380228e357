#!/usr/bin/env python3
"""torch._grouped_mm baseline for benchmarks/bench_gemm (same shapes, same device session).

Writes CSV lines "form,N,K,groups,median_ms" to --out PATH (default stdout); bench_gemm --baseline PATH reads them
and prints them next to the engine and cuBLAS. Timing: CUDA events around each call, 5 warm-ups,
median of 30. Inputs are random bf16 (never zeros).
"""
import sys

import torch

E, ROWS = 16, 8192
T = E * ROWS
SHAPES = [(1536, 2048), (2048, 768), (3072, 4096), (4096, 1536)]


def event_ms(fn):
    """One call of fn timed with CUDA events, in ms."""
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def median_ms(fn, warmup=5, iters=30):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = [event_ms(fn) for _ in range(iters)]
    times.sort()
    return times[len(times) // 2]


def skewed_sizes(e, mean):
    s = [0] * e
    total = e * mean
    s[0] = 4 * mean
    empty = e // 4
    rest = e - 1 - empty
    left = total - s[0]
    for i in range(1, rest + 1):
        s[i] = left if i == rest else left // (rest - i + 1)
        left -= s[i]
    return s


def offs_of(sizes):
    return torch.tensor(sizes, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)


def main():
    args = sys.argv[1:]
    out = open(args[args.index("--out") + 1], "w") if "--out" in args else sys.stdout
    dev = "cuda"
    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name()}", file=out)
    offs = {"balanced": offs_of([ROWS] * E), "skewed": offs_of(skewed_sizes(E, ROWS))}
    for n, k in SHAPES:
        a = torch.randn(T, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(E, n, k, device=dev, dtype=torch.bfloat16)
        for g, o in offs.items():
            # form 1: out[T, N] = a . w[e]^T  (w stored [E, N, K], a transposed view)
            ms = median_ms(lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=o))
            print(f"nt,{n},{k},{g},{ms:.4f}", file=out)
        # form 2: out[T, N] = a . w2[e], w2 stored [E, K, N]
        w2 = torch.randn(E, k, n, device=dev, dtype=torch.bfloat16)
        try:
            ms = median_ms(lambda: torch._grouped_mm(a, w2, offs=offs["balanced"]))
            print(f"nn,{n},{k},balanced,{ms:.4f}", file=out)
        except Exception as exc:  # noqa: BLE001
            print(f"# nn {n} {k}: {exc}", file=out)
        del w2
        # form 3: out[e] = x[rows_e, N]^T . y[rows_e, K]  (K-grouped over the token axis)
        x = torch.randn(T, n, device=dev, dtype=torch.bfloat16)
        for g, o in offs.items():
            try:
                ms = median_ms(lambda: torch._grouped_mm(x.t(), a, offs=o))
                print(f"tn,{n},{k},{g},{ms:.4f}", file=out)
            except Exception as exc:  # noqa: BLE001
                print(f"# tn {n} {k}: {exc}", file=out)
        del a, w, x
        torch.cuda.empty_cache()
    nd = 8192
    a = torch.randn(nd, nd, device=dev, dtype=torch.bfloat16)
    b = torch.randn(nd, nd, device=dev, dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b.t())
    print(f"dense,{nd},{nd},1,{ms:.4f}", file=out)
    out.flush()


if __name__ == "__main__":
    main()
