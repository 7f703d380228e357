"""Tiny random transformers MoE models (built from a config, nothing downloaded) and the comparisons the
transformers-integration tests make between experts implementations of the same weights."""

import copy

import torch

VOCAB = 256


def qwen3_moe_config(hidden=128, inter=128, experts=8, top_k=2, layers=2):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                          moe_intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=hidden // 4, num_experts=experts,
                          num_experts_per_tok=top_k, decoder_sparse_step=1, norm_topk_prob=True,
                          max_position_embeddings=256)


def deepseek_v3_config(hidden=128, inter=128, experts=8, top_k=2):
    """Layer 0 dense, layer 1 MoE with a shared expert and grouped routing (fp32 routing weights)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                            moe_intermediate_size=inter, num_hidden_layers=2, first_k_dense_replace=1,
                            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=experts,
                            n_shared_experts=1, num_experts_per_tok=top_k, n_group=2, topk_group=1,
                            q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                            v_head_dim=32, max_position_embeddings=256)


CONFIGS = {"qwen3_moe": qwen3_moe_config, "deepseek_v3": deepseek_v3_config}


def build(config, implementation, *, dtype=torch.bfloat16, device="cpu", state=None, seed=0):
    """A causal LM of config on device. `_from_config` writes experts_implementation into the config it gets,
    so every model gets its own copy (two models sharing one config would share one implementation)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), experts_implementation=implementation,
                                             dtype=dtype)
    if state is not None:
        model.load_state_dict(state)
    return model.to(device)


def rel_err(got, want):
    got, want = got.detach().double(), want.detach().double()
    assert torch.isfinite(got).all(), "non-finite values"
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    return out.logits.detach(), out.loss.detach(), grads


def compare_models(models, ids, *, tol, worse_than_eager_by=1.0):
    """models: {"eager": bf16 eager, "megamoe": bf16 megamoe, "truth": fp32 eager}, same weights.

    On logits, loss and every gradient, megamoe must be within tol of bf16 eager. The one exception is a
    quantity where bf16 eager is itself further than tol from the fp32 truth: there two bf16 runs of the same
    model can part ways by about as much as each differs from fp32 (in a 2-layer Qwen3-MoE model the second
    layer's routing depends on the first layer's bf16 output and some tokens pick other experts in each bf16
    run; bf16 eager's layer-1 expert and norm gradients were measured 9-10% from fp32, megamoe's 7-8%,
    docs/PERF.md), so their distance says nothing about megamoe, and megamoe must instead be no further from
    the truth than worse_than_eager_by times bf16 eager's distance (plus tol / 10). Where megamoe is within
    tol of bf16 eager, the two distances to the truth differ by at most that tol (triangle inequality) and
    comparing them tests rounding noise, not megamoe (seen in CI: 0.212 against 0.208 for a gate gradient that
    megamoe and bf16 eager shared within 0.011). The layer itself is checked per call in isolation
    (check_each_experts_call). Returns the errors."""
    results = {name: loss_and_grads(m, ids) for name, m in models.items()}
    (e_logits, e_loss, e_grads), (m_logits, m_loss, m_grads), (t_logits, t_loss, t_grads) = \
        results["eager"], results["megamoe"], results["truth"]
    pairs = [("logits", m_logits, e_logits, t_logits), ("loss", m_loss, e_loss, t_loss)]
    assert set(m_grads) == set(e_grads), "megamoe and eager differ in their trainable parameters"
    for name in e_grads:
        assert m_grads[name] is not None, f"no gradient for {name} with megamoe"
        assert m_grads[name].dtype == e_grads[name].dtype, name
        pairs.append((f"grad {name}", m_grads[name], e_grads[name], t_grads[name]))
    errors = {}
    for what, mine, eager, truth in pairs:
        errors[what] = (rel_err(mine, eager), rel_err(mine, truth), rel_err(eager, truth))
    # The whole table first: one failing entry alone does not tell whether megamoe or bf16 eager moved.
    print(f"{'':60s} {'vs eager':>10s} {'vs fp32':>10s} {'eager-fp32':>10s}")
    for what, (direct, mine_vs_truth, eager_vs_truth) in errors.items():
        print(f"{what:60s} {direct:10.3g} {mine_vs_truth:10.3g} {eager_vs_truth:10.3g}")
    for what, (direct, mine_vs_truth, eager_vs_truth) in errors.items():
        if direct <= tol:
            continue
        assert eager_vs_truth > tol, f"{what}: megamoe vs eager rel err {direct:.3g} > {tol}"
        assert mine_vs_truth <= worse_than_eager_by * eager_vs_truth + tol / 10, \
            f"{what}: megamoe is {direct:.3g} from bf16 eager and {mine_vs_truth:.3g} from fp32, " \
            f"bf16 eager {eager_vs_truth:.3g} from fp32"
    return errors


def check_each_experts_call(model, ids, *, tol):
    """Inside a model on megamoe every experts call must be what the layer computes on that call's inputs
    alone: its output bitwise the same when re-run in isolation, its weight gradients in .grad bitwise those
    of the isolated call (nothing carried between two layers' calls or between a forward and the backward
    of another), and the isolated call within tol of the fp32 reference on the very inputs (the routing
    weights in the dtype the model gave) and output gradient the model gave it. Returns the errors per call."""
    from transformers.integrations.moe import ExpertsInterface

    from megamoe import reference
    from megamoe.integrations import transformers as mt

    calls = []

    def recording(module, hidden_states, top_k_index, top_k_weights):
        out = mt.experts_forward(module, hidden_states, top_k_index, top_k_weights)
        call = {"module": module, "x": hidden_states.detach().clone(), "idx": top_k_index.detach().clone(),
                "w": top_k_weights.detach().clone(), "out": out.detach().clone()}
        if out.requires_grad:
            out.register_hook(lambda g: call.update(d_out=g.detach().clone()))
        calls.append(call)
        return out

    ExpertsInterface.register(mt.NAME, recording)
    try:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        mt.register()
    modules = mt.experts_modules(model)
    assert len(calls) == len(modules) >= 1, f"{len(calls)} experts calls for {len(modules)} experts modules"
    results = []
    for n, call in enumerate(calls):
        module = call["module"]
        experts = module.gate_up_proj.shape[0]
        x = call["x"].requires_grad_()
        w = call["w"].requires_grad_()
        w13 = torch.nn.Parameter(module.gate_up_proj.detach().clone())
        w2 = torch.nn.Parameter(module.down_proj.detach().clone())
        saved = module.gate_up_proj, module.down_proj
        try:  # the isolated call on clones of the weights, through the same experts module
            module.gate_up_proj, module.down_proj = w13, w2
            out = mt.experts_forward(module, x, call["idx"], w)
        finally:
            module.gate_up_proj, module.down_proj = saved
        d_x, d_w, d_w13, d_w2 = torch.autograd.grad(out, [x, w, w13, w2], call["d_out"])
        assert torch.equal(out, call["out"]), f"layer {n}: the output differs when the call is re-run alone"
        assert torch.equal(d_w13, module.gate_up_proj.grad), f"layer {n}: gate_up_proj.grad is not the call's own"
        assert torch.equal(d_w2, module.down_proj.grad), f"layer {n}: down_proj.grad is not the call's own"

        up = [t.detach().float().requires_grad_() for t in (call["x"], call["w"], w13, w2)]
        idx = torch.where(call["idx"] >= experts, -1, call["idx"])
        want = reference.moe(up[0], idx, up[1], up[2], up[3])
        wants = torch.autograd.grad(want, up, call["d_out"].float())
        errors = {name: rel_err(got, ref) for name, got, ref in
                  zip(("out", "d_x", "d_topk_weights", "d_gate_up_proj", "d_down_proj"),
                      (out, d_x, d_w, d_w13, d_w2), (want, *wants))}
        print(f"layer {n}: " + ", ".join(f"{k} {v:.3g}" for k, v in errors.items()))
        for name, err in errors.items():
            assert err <= tol, f"layer {n}: {name} rel err {err:.3g} from the fp32 reference on the same inputs"
        results.append(errors)
    return results


def train(model, batches, steps, lr=1e-3):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        ids = batches[step % len(batches)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses
