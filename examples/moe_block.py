"""An MoE transformer block's feed-forward part as training code writes it, with the routed experts on megamoe.

    python examples/moe_block.py                  # one GPU: a few AdamW steps, loss and step time
    python examples/moe_block.py --cpu-reference  # no GPU: the experts computed by megamoe.reference

The block: RMSNorm, a linear router with softmax and top-k (weights renormalised over the chosen k), the
routed experts on megamoe.MegaMoE, a shared expert (a plain PyTorch SwiGLU MLP that sees every token), a
load-balancing loss on the router, and the residual. Autograd differentiates all of it: megamoe returns the
gradients of the tokens, of the routing weights (so the router learns) and of the expert weights.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import megamoe


class SwiGLU(nn.Module):
    def __init__(self, hidden, intermediate, **factory):
        super().__init__()
        self.gate = nn.Linear(hidden, intermediate, bias=False, **factory)
        self.up = nn.Linear(hidden, intermediate, bias=False, **factory)
        self.down = nn.Linear(intermediate, hidden, bias=False, **factory)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class ReferenceExperts(nn.Module):
    """megamoe.MegaMoE's weights and call, computed by megamoe.reference (CPU, no library needed)."""

    def __init__(self, hidden, intermediate, num_experts, top_k, max_tokens_per_rank, device=None, dtype=None):
        super().__init__()
        self.w13 = nn.Parameter(torch.randn(num_experts, 2 * intermediate, hidden, device=device) * 0.02)
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden, intermediate, device=device) * 0.02)

    def forward(self, x, topk_idx, topk_weights):
        return megamoe.reference.moe(x.float(), topk_idx, topk_weights, self.w13, self.w2).to(x.dtype)


class MoEFeedForward(nn.Module):
    def __init__(self, hidden, intermediate, num_experts, top_k, shared_intermediate, max_tokens, *,
                 experts_class=megamoe.MegaMoE, device=None, dtype=torch.bfloat16):
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        self.num_experts, self.top_k = num_experts, top_k
        self.norm = nn.RMSNorm(hidden, **factory)
        self.router = nn.Linear(hidden, num_experts, bias=False, **factory)
        # max_tokens_per_rank sizes megamoe's buffers: the most tokens one call may hold (batch x sequence).
        self.experts = experts_class(hidden, intermediate, num_experts, top_k, max_tokens_per_rank=max_tokens,
                                     device=device)
        self.shared = SwiGLU(hidden, shared_intermediate, **factory)

    def forward(self, x):
        """x [batch, seq, hidden] -> (x + feed-forward(x), load-balancing loss)."""
        h = self.norm(x).reshape(-1, x.shape[-1])
        probs = self.router(h).float().softmax(dim=-1)       # routing in fp32
        weights, experts = probs.topk(self.top_k, dim=-1)    # [T, K] fp32, [T, K] int64
        weights = weights / weights.sum(dim=-1, keepdim=True)
        routed = self.experts(h, experts, weights)           # megamoe: [T, H] bf16
        y = routed + self.shared(h)
        # Switch-style balance loss: fraction of the slots each expert got times its mean probability.
        load = torch.zeros(self.num_experts, device=x.device).index_add_(
            0, experts.reshape(-1), torch.ones(experts.numel(), device=x.device)) / experts.numel()
        balance = self.num_experts * (load * probs.mean(dim=0)).sum()
        return x + y.reshape_as(x), balance


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--shared-intermediate", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--cpu-reference", action="store_true", help="CPU, experts computed by megamoe.reference")
    args = parser.parse_args()

    torch.manual_seed(0)
    if args.cpu_reference:
        device, dtype, experts_class = torch.device("cpu"), torch.float32, ReferenceExperts
    else:
        if not torch.cuda.is_available():
            raise SystemExit("moe_block.py needs a CUDA GPU for megamoe; --cpu-reference runs it on the CPU")
        device, dtype, experts_class = torch.device("cuda"), torch.bfloat16, megamoe.MegaMoE
    block = MoEFeedForward(args.hidden, args.intermediate, args.experts, args.top_k, args.shared_intermediate,
                           args.batch * args.seq, experts_class=experts_class, device=device, dtype=dtype)
    optimizer = torch.optim.AdamW(block.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(args.hidden, args.hidden, generator=g) / args.hidden ** 0.5
    x = torch.randn(args.batch, args.seq, args.hidden, generator=g)
    x, target = x.to(device, dtype), (x + torch.tanh(x @ teacher)).to(device, dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"block: H={args.hidden}, {args.experts} experts of I={args.intermediate} (top-{args.top_k}) on "
          f"{'megamoe.reference (CPU)' if args.cpu_reference else 'megamoe'}, shared expert I={args.shared_intermediate}, "
          f"{args.batch}x{args.seq} tokens")
    losses = []
    for step in range(args.steps):
        megamoe.set_debug_checks(step == 0)  # host-synchronising checks on the first step only
        sync()
        start = time.perf_counter()
        out, balance = block(x)
        loss = F.mse_loss(out.float(), target.float())
        (loss + 0.01 * balance).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        losses.append(loss.item())
        print(f"step {step}: loss {losses[-1]:.5f}, balance {balance.item():.3f}, "
              f"{(time.perf_counter() - start) * 1e3:.1f} ms")
    if not args.cpu_reference:
        megamoe.synchronize_and_check(block.experts)  # errors the GPU recorded while the checks were off
    if args.steps > 1 and not losses[-1] < losses[0]:
        raise SystemExit(f"the loss did not fall: {losses[0]:.5f} -> {losses[-1]:.5f}")


if __name__ == "__main__":
    main()
