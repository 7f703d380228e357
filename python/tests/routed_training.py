"""A short training run of a small routed model (router, MegaMoE experts, classifier head; AdamW) on a
synthetic classification task with label noise, so that its loss, like a language model's, keeps an
irreducible part: the FP8 layer's loss curve is compared with the BF16 layer's on the same data and init."""

import torch
import torch.nn.functional as F

import megamoe


class RoutedClassifier(torch.nn.Module):
    def __init__(self, hidden, inter, experts, top_k, classes, max_tokens, device, precision):
        super().__init__()
        self.top_k = top_k
        self.router = torch.nn.Linear(hidden, experts, bias=False, device=device)
        self.moe = megamoe.MegaMoE(hidden, inter, experts, top_k, max_tokens, device=device, precision=precision,
                                   init_std=hidden ** -0.5)
        self.head = torch.nn.Linear(hidden, classes, device=device)

    def forward(self, x):
        probs = F.softmax(self.router(x.float()), dim=-1)
        weights, idx = probs.topk(self.top_k, dim=-1)
        return self.head(self.moe(x, idx, weights / weights.sum(-1, keepdim=True)).float())


def loss_curve(precision, *, steps=300, tokens=256, hidden=256, inter=256, experts=8, top_k=2, classes=16,
               device="cuda", seed=0, train_experts=True):
    """The per-step training loss of RoutedClassifier with `precision`; the same init, data and labels for
    every precision (all drawn from `seed`). train_experts=False freezes the expert weights (the control that
    shows what the curve would look like if their gradients were lost)."""
    torch.manual_seed(seed)
    model = RoutedClassifier(hidden, inter, experts, top_k, classes, tokens, device, "bf16")
    if precision != "bf16":  # the same initial weights in the other precision
        other = RoutedClassifier(hidden, inter, experts, top_k, classes, tokens, device, precision)
        other.load_state_dict(model.state_dict())
        model = other
    data = torch.Generator().manual_seed(seed + 1)
    teacher = torch.randn(hidden, classes, generator=data) * (2.0 / hidden ** 0.5)
    if not train_experts:
        model.moe.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.01)
    losses = []
    for _ in range(steps):
        x = torch.randn(tokens, hidden, generator=data)
        # Labels sampled from the teacher's softmax: the best possible loss is its entropy, not 0.
        labels = torch.multinomial(F.softmax(x @ teacher, dim=-1), 1, generator=data).squeeze(1)
        loss = F.cross_entropy(model(x.bfloat16().to(device)), labels.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def smoothed(losses, window=20):
    return [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
            for i in range(len(losses))]
