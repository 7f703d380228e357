"""experts_implementation="megamoe" on the GPU layer: tiny random transformers models built from a config
(nothing downloaded) against the same weights with transformers' eager experts: logits, loss and every
gradient within 3e-2 of bf16 eager (or, where bf16 eager is itself further than that from an fp32 eager
model, no further from it than bf16 eager: hf_models.compare_models), each experts call checked in
isolation against the fp32 reference on its own inputs (1e-2), a few AdamW steps that follow eager's
losses, from_pretrained of a saved model, and a batch that outgrows the layer between a forward and its
backward."""

import gc

import pytest
import torch
from gpu_support import why_no_gpu

moe_interface = pytest.importorskip("transformers.integrations.moe", reason="transformers 5.x is not installed")
if not hasattr(moe_interface, "ExpertsInterface"):
    pytest.skip("this transformers has no ExpertsInterface (5.x needed)", allow_module_level=True)

import hf_models  # noqa: E402

import megamoe  # noqa: E402
from megamoe import ops, reference  # noqa: E402




pytestmark = pytest.mark.skipif(bool(why_no_gpu()), reason=why_no_gpu() or "ok")

from megamoe.integrations import transformers as mt  # noqa: E402

H, I, E, K = 256, 256, 8, 2


@pytest.fixture(autouse=True)
def _settle():
    yield
    torch.cuda.synchronize()
    gc.collect()
    ops.release_all()
    torch.cuda.synchronize()


def models_for(family):
    config = hf_models.CONFIGS[family](hidden=H, inter=I, experts=E, top_k=K)
    eager = hf_models.build(config, "eager", device="cuda")
    state = eager.state_dict()
    return config, {"eager": eager, "megamoe": hf_models.build(config, "megamoe", state=state, device="cuda"),
                    "truth": hf_models.build(config, "eager", state=state, dtype=torch.float32, device="cuda")}


@pytest.mark.parametrize("family", sorted(hf_models.CONFIGS))
def test_logits_loss_and_every_gradient_match_eager(family):
    _, models = models_for(family)
    ids = torch.randint(0, hf_models.VOCAB, (4, 64), generator=torch.Generator().manual_seed(1)).cuda()
    errors = hf_models.compare_models(models, ids, tol=3e-2)
    worst = max(errors.items(), key=lambda kv: kv[1][0])
    print(f"{family}: worst megamoe vs eager: {worst[0]} {worst[1][0]:.3g}")
    megamoe.synchronize_and_check()  # every layer state: no error recorded on the device


def test_training_steps_follow_eager():
    """12 AdamW steps of the 2-layer Qwen3-MoE model in bf16 with megamoe, with eager experts, and in fp32
    with eager experts. Two bf16 runs part ways as their routing flips (hf_models.compare_models): measured
    on the H200, bf16 eager's loss drifts from the fp32 run's by up to 2.1% by step 12 (0.4% on average), so
    megamoe is held to that envelope: on average over the steps no further from the fp32 run than bf16
    eager (within 25%, plus 1e-3), and at every step within 1% of bf16 eager."""
    _, models = models_for("qwen3_moe")
    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, hf_models.VOCAB, (4, 64), generator=g).cuda() for _ in range(2)]
    want = hf_models.train(models["eager"], batches, steps=12)
    got = hf_models.train(models["megamoe"], batches, steps=12)
    truth = hf_models.train(models["truth"], batches, steps=12)
    print("eager  ", [round(v, 4) for v in want])
    print("megamoe", [round(v, 4) for v in got])
    print("fp32   ", [round(v, 4) for v in truth])
    assert want[-1] < 0.9 * want[0], f"the eager loss did not fall: {want}"
    assert got[-1] < 0.9 * got[0], f"the megamoe loss did not fall: {got}"
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 1e-2 * b, f"step {step}: megamoe loss {a}, bf16 eager {b}"
    mine = sum(abs(a - t) / t for a, t in zip(got, truth)) / len(truth)
    eager = sum(abs(b - t) / t for b, t in zip(want, truth)) / len(truth)
    print(f"mean relative distance to the fp32 run: megamoe {mine:.4f}, bf16 eager {eager:.4f}")
    assert mine <= 1.25 * eager + 1e-3, f"megamoe's losses are {mine:.4f} from fp32 on average, bf16 eager's {eager:.4f}"


def test_from_pretrained_runs_on_megamoe(tmp_path):
    config = hf_models.qwen3_moe_config(hidden=H, inter=I, experts=E, top_k=K)
    eager = hf_models.build(config, "eager", device="cuda")
    eager.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16,
                                                 experts_implementation="megamoe").cuda()
    assert model.config._experts_implementation == "megamoe"
    ids = torch.randint(0, hf_models.VOCAB, (2, 32)).cuda()
    with torch.no_grad():
        assert hf_models.rel_err(model(input_ids=ids).logits, eager(input_ids=ids).logits) <= 3e-2
    assert all(getattr(m, mt._STATE_ATTR, None) is not None for m in mt.experts_modules(model))


def test_growth_between_a_forward_and_its_backward():
    config = hf_models.qwen3_moe_config(hidden=H, inter=I, experts=E, top_k=K, layers=1)
    module = mt.experts_modules(hf_models.build(config, "megamoe", device="cuda"))[0]
    g = torch.Generator().manual_seed(3)

    def inputs(tokens):
        x = torch.randn(tokens, H, generator=g).bfloat16().cuda().requires_grad_()
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]).cuda()
        idx[::5, 1] = E  # an expert-parallel sentinel
        w = torch.rand(tokens, K, generator=g).bfloat16().cuda().requires_grad_()
        return x, idx, w

    small = inputs(100)
    out_small = mt.experts_forward(module, *small)
    with pytest.warns(UserWarning, match="recreating it"):
        out_big = mt.experts_forward(module, *inputs(1000))
    for (x, idx, w), out in ((small, out_small),):
        d_x, d_w = torch.autograd.grad(out.float().square().sum(), [x, w])
        up = [x.detach().float().requires_grad_(), w.detach().float().requires_grad_()]
        want = reference.moe(up[0], torch.where(idx >= E, -1, idx), up[1], module.gate_up_proj.float(),
                             module.down_proj.float())
        want_d_x, want_d_w = torch.autograd.grad(want.square().sum(), up)
        assert hf_models.rel_err(out, want) <= 1e-2
        assert hf_models.rel_err(d_x, want_d_x) <= 1e-2 and hf_models.rel_err(d_w, want_d_w) <= 1e-2
        assert torch.all(d_w[idx >= E] == 0)
    assert torch.isfinite(out_big).all()


def test_no_host_synchronisation_with_the_debug_checks_off():
    config = hf_models.qwen3_moe_config(hidden=H, inter=I, experts=E, top_k=K, layers=1)
    module = mt.experts_modules(hf_models.build(config, "megamoe", device="cuda"))[0]
    x = torch.randn(64, H, device="cuda").bfloat16().requires_grad_()
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(64)]).cuda()
    idx[::3, 0] = E  # expert-parallel sentinels
    w = torch.rand(64, K, device="cuda").bfloat16().requires_grad_()
    mt.experts_forward(module, x, idx, w).sum().backward()  # creates the layer
    megamoe.set_debug_checks(False)
    torch.cuda.set_sync_debug_mode("error")  # any torch op that waits for the GPU now raises
    try:
        out = mt.experts_forward(module, x, idx, w)
        torch.autograd.backward(out, torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")
        megamoe.set_debug_checks(True)
    megamoe.synchronize_and_check()
    assert torch.isfinite(out).all()


def test_each_experts_call_in_the_model_is_the_layer_on_its_own_inputs():
    config = hf_models.qwen3_moe_config(hidden=H, inter=I, experts=E, top_k=K)
    model = hf_models.build(config, "megamoe", device="cuda")
    ids = torch.randint(0, hf_models.VOCAB, (4, 64), generator=torch.Generator().manual_seed(1)).cuda()
    hf_models.check_each_experts_call(model, ids, tol=1e-2)
