"""Expert parallelism with one process per GPU, as a multi-node training job lays it out.

    torchrun --nproc-per-node=8 examples/torchrun_expert_parallel.py                  # one node, EP over 8 GPUs
    torchrun --nnodes=4 --nproc-per-node=8 ... examples/torchrun_expert_parallel.py   # 4 nodes: EP 8 x DP 4
    torchrun --nproc-per-node=1 examples/torchrun_expert_parallel.py                  # one GPU: a group of one
    torchrun --nproc-per-node=4 examples/torchrun_expert_parallel.py --cpu-reference --ep-size 2 --hidden 128 \\
        --intermediate 128 --tokens 32                                                # no GPU: gloo + reference

Layout: every process drives one GPU (its LOCAL_RANK). The ranks of one node form an expert-parallel (EP)
group: megamoe exchanges tokens between them through CUDA IPC, so an EP group never spans nodes. Each EP rank
holds E / ep_size experts and its own tokens. The rank at the same position in every node holds the same
experts: those form a data-parallel (DP) group, over which the experts' gradients are summed. Everything
else in the model is replicated on every rank and its gradients are summed over all ranks. Each rank's
loss is divided by the world size first, so those sums are the gradient of the mean loss.

--cpu-reference runs the same script on CPU processes (gloo) with megamoe.reference.moe_distributed in place
of the GPU layer: same groups, same gradients, no GPU needed.
"""

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import megamoe


class ReferenceExperts(nn.Module):
    """The experts of one EP rank computed with megamoe.reference (all_to_all over the EP group): the
    stand-in for megamoe.MegaMoE(..., group=ep_group) on machines without a GPU."""

    def __init__(self, hidden, intermediate, num_experts, top_k, group):
        super().__init__()
        local = num_experts // group.size()
        self.group = group
        self.w13 = nn.Parameter(torch.randn(local, 2 * intermediate, hidden) * 0.02)
        self.w2 = nn.Parameter(torch.randn(local, hidden, intermediate) * 0.02)

    def forward(self, x, topk_idx, topk_weights):
        return megamoe.reference.moe_distributed(x.float(), topk_idx, topk_weights, self.w13, self.w2,
                                                 group=self.group).to(x.dtype)


class Model(nn.Module):
    """Projection, top-k router, routed experts (on megamoe), residual, projection."""

    def __init__(self, args, ep_group, dtype, device, ep_rank):
        super().__init__()
        h = args.hidden
        torch.manual_seed(args.seed)  # the replicated parameters: the same on every rank
        self.inp = nn.Linear(h, h, bias=False, device=device, dtype=dtype)
        self.router = nn.Linear(h, args.experts, bias=False, device=device, dtype=dtype)
        self.out = nn.Linear(h, h, bias=False, device=device, dtype=dtype)
        self.top_k = args.top_k
        torch.manual_seed(args.seed + 1 + ep_rank)  # this EP rank's experts: the same in every DP replica
        if args.cpu_reference:
            self.experts = ReferenceExperts(h, args.intermediate, args.experts, args.top_k, ep_group)
        else:
            self.experts = megamoe.MegaMoE(h, args.intermediate, args.experts, args.top_k,
                                           max_tokens_per_rank=args.tokens, group=ep_group, device=device)

    def forward(self, x):
        h = self.inp(x)
        probs = self.router(h).float().softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.out(h + self.experts(h, experts, weights))


def make_groups(world, ep_size):
    """Every rank creates every group, in the same order (new_group is collective)."""
    ep_groups = [dist.new_group(list(range(n * ep_size, (n + 1) * ep_size))) for n in range(world // ep_size)]
    dp_groups = [dist.new_group(list(range(r, world, ep_size))) for r in range(ep_size)]
    rank = dist.get_rank()
    return ep_groups[rank // ep_size], dp_groups[rank % ep_size]


def batch(args, rank, step, teacher, device, dtype):
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + rank * 10_007 + step)
    x = torch.randn(args.tokens, args.hidden, generator=g)
    return x.to(device, dtype), torch.tanh(x @ teacher).to(device, dtype)


def same_everywhere(tensors, group):
    """Whether these parameters are equal on every rank of group (a checksum each, gathered)."""
    local = torch.stack([t.detach().double().sum() for t in tensors] + [t.detach().double().norm() for t in tensors])
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16, help="experts in the whole model")
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank and step")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ep-size", type=int, default=0,
                        help="ranks per expert-parallel group (default: the processes of one node, LOCAL_WORLD_SIZE)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-reference", action="store_true",
                        help="CPU processes over gloo, experts computed by megamoe.reference (no GPU needed)")
    args = parser.parse_args()

    if args.cpu_reference:
        device, dtype = torch.device("cpu"), torch.float32
        dist.init_process_group("gloo")
    else:
        device, dtype = torch.device("cuda", int(os.environ["LOCAL_RANK"])), torch.bfloat16
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    ep_size = args.ep_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % ep_size or args.experts % ep_size:
        raise SystemExit(f"--ep-size {ep_size} must divide the world size {world} and the experts {args.experts}")
    ep_group, dp_group = make_groups(world, ep_size)
    if rank == 0:
        print(f"{world} ranks: expert-parallel groups of {ep_size} (one per node), {world // ep_size} data-parallel "
              f"replicas of the experts; {args.experts // ep_size} experts per rank, {args.tokens} tokens per rank")

    model = Model(args, ep_group, dtype, device, ep_group.rank())
    experts = {id(p) for p in model.experts.parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    teacher = torch.randn(args.hidden, args.hidden, generator=torch.Generator().manual_seed(args.seed)) / \
        args.hidden ** 0.5
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    for step in range(args.steps):
        # megamoe's checks that wait for the GPU (expert ids, device errors) on the first step only; later
        # errors are collected by synchronize_and_check below, without a host sync per call.
        megamoe.set_debug_checks(step == 0)
        sync()
        start = time.perf_counter()
        x, target = batch(args, rank, step, teacher, device, dtype)
        loss = F.mse_loss(model(x).float(), target.float())
        (loss / world).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=dp_group if id(p) in experts else None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        sync()
        elapsed = time.perf_counter() - start
        if not args.cpu_reference:
            megamoe.synchronize_and_check(model.experts)
        if rank == 0:
            print(f"step {step}: loss {float(mean_loss) / world:.5f}, {elapsed * 1e3:.1f} ms")

    dense = [p for p in model.parameters() if id(p) not in experts]
    in_sync = same_everywhere(dense, None) and same_everywhere(list(model.experts.parameters()), dp_group)
    if rank == 0:
        print("replicas in sync: dense weights equal on every rank, expert weights equal in every data-parallel group"
              if in_sync else "replicas OUT OF SYNC")
    # Every rank's GPU work is done before any rank frees the workspace its peers have mapped.
    sync()
    dist.barrier()
    del model, optimizer, experts, dense
    gc.collect()
    megamoe.ops.release_all()
    dist.barrier()
    dist.destroy_process_group()
    raise SystemExit(0 if in_sync else 1)


if __name__ == "__main__":
    main()
