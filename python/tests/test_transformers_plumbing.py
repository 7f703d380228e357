"""megamoe.integrations.transformers on the CPU: registration, from_pretrained, argument mapping (dtypes,
sentinel ids, shapes), token capacity, refusals, torch.compile, with the library swapped for the reference
backend (reference_backend.py), so that whole tiny transformers models run their experts through the
integration and megamoe's ops. The same checks on the GPU layer: test_transformers_gpu.py."""

import copy
import warnings

import pytest
import torch

moe_interface = pytest.importorskip("transformers.integrations.moe", reason="transformers 5.x is not installed")
if not hasattr(moe_interface, "ExpertsInterface"):
    pytest.skip("this transformers has no ExpertsInterface (5.x needed)", allow_module_level=True)

import hf_models  # noqa: E402
from reference_backend import ReferenceBackend  # noqa: E402

from megamoe import _lib, ops, reference  # noqa: E402
from megamoe.integrations import transformers as mt  # noqa: E402


@pytest.fixture
def backend(monkeypatch):
    try:
        _lib.lib()  # the integration validates each layer's shape with the library's own rules
    except ImportError as e:
        pytest.skip(str(e))
    b = ReferenceBackend()
    monkeypatch.setattr(ops, "_backend", b)
    yield b
    ops.release_all()


def experts_of(model):
    modules = mt.experts_modules(model)
    assert modules, "no experts module found"
    return modules


def routed_inputs(tokens, experts=8, top_k=2, hidden=128, seed=0, weight_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    w = torch.rand(tokens, top_k, generator=g).to(weight_dtype)
    return x, idx, w


def test_registered_and_chosen_by_from_pretrained(backend, tmp_path):
    assert mt.NAME in moe_interface.ALL_EXPERTS_FUNCTIONS
    assert moe_interface.ALL_EXPERTS_FUNCTIONS[mt.NAME] is mt.experts_forward
    mt.register()  # idempotent
    saved = hf_models.build(hf_models.qwen3_moe_config(), "eager")
    saved.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, experts_implementation="megamoe")
    assert model.config._experts_implementation == "megamoe"
    ids = torch.randint(0, hf_models.VOCAB, (2, 8))
    before = backend.forwards
    model(input_ids=ids)
    assert backend.forwards - before == len(experts_of(model))  # every MoE layer ran on megamoe


@pytest.mark.parametrize("family", sorted(hf_models.CONFIGS))
def test_model_matches_eager_experts(backend, family):
    config = hf_models.CONFIGS[family]()
    eager = hf_models.build(config, "eager")
    state = eager.state_dict()
    models = {"eager": eager, "megamoe": hf_models.build(config, "megamoe", state=state),
              "truth": hf_models.build(config, "eager", state=state, dtype=torch.float32)}
    ids = torch.randint(0, hf_models.VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    before = backend.backwards
    hf_models.compare_models(models, ids, tol=3e-2)
    assert backend.backwards - before == len(experts_of(models["megamoe"]))


def test_each_experts_call_in_a_two_layer_model_is_the_layer_on_its_own_inputs(backend):
    model = hf_models.build(hf_models.qwen3_moe_config(layers=2), "megamoe")
    ids = torch.randint(0, hf_models.VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    hf_models.check_each_experts_call(model, ids, tol=1e-2)


def test_training_steps_follow_eager(backend):
    config = hf_models.qwen3_moe_config()
    eager = hf_models.build(config, "eager")
    mine = hf_models.build(config, "megamoe", state=eager.state_dict())
    g = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, hf_models.VOCAB, (4, 16), generator=g) for _ in range(2)]
    want = hf_models.train(eager, batches, steps=6)
    got = hf_models.train(mine, batches, steps=6)
    assert want[-1] < 0.95 * want[0], f"the eager loss did not fall: {want}"
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 2e-3 * b, f"step {step}: megamoe loss {a}, eager {b}"


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_routing_weights_of_any_float_dtype(backend, weight_dtype):
    module = experts_of(hf_models.build(hf_models.qwen3_moe_config(layers=1), "megamoe"))[0]
    x, idx, w = routed_inputs(20, weight_dtype=weight_dtype)
    x.requires_grad_()
    w.requires_grad_()
    out = mt.experts_forward(module, x, idx, w)
    assert out.dtype == x.dtype and out.shape == x.shape
    want = reference.moe(x.float(), idx, w.float(), module.gate_up_proj.float(), module.down_proj.float())
    assert hf_models.rel_err(out, want) <= 1e-2
    d_x, d_w = torch.autograd.grad(out.float().square().sum(), [x, w])
    assert d_x.dtype == x.dtype and d_w.dtype == weight_dtype


def test_int32_ids_give_the_same_result(backend):
    module = experts_of(hf_models.build(hf_models.qwen3_moe_config(layers=1), "megamoe"))[0]
    x, idx, w = routed_inputs(12)
    assert torch.equal(mt.experts_forward(module, x, idx, w), mt.experts_forward(module, x, idx.int(), w))


def test_expert_parallel_sentinels_become_masked_slots(backend):
    module = experts_of(hf_models.build(hf_models.qwen3_moe_config(layers=1), "megamoe"))[0]
    x, idx, w = routed_inputs(16)
    idx[::3, 0] = 8     # the sentinel transformers' expert parallelism writes: num_experts (on this rank)
    idx[1::4, 1] = 11   # anything above is off-rank too
    caller_idx = idx.clone()
    w.requires_grad_()
    out = mt.experts_forward(module, x, idx, w)
    assert torch.equal(idx, caller_idx), "the caller's routing tensor was modified"
    masked = idx >= 8
    want = reference.moe(x.float(), torch.where(masked, -1, idx), w.detach(), module.gate_up_proj.float(),
                         module.down_proj.float())
    assert hf_models.rel_err(out, want) <= 1e-2
    (d_w,) = torch.autograd.grad(out.float().sum(), [w])
    assert torch.all(d_w[masked] == 0) and torch.all(d_w[~masked] != 0)


def test_hidden_states_of_another_dtype_and_shape(backend):
    module = experts_of(hf_models.build(hf_models.qwen3_moe_config(layers=1), "megamoe"))[0]
    x, idx, w = routed_inputs(12)
    out = mt.experts_forward(module, x.float().reshape(3, 4, 128), idx, w)
    assert out.dtype == torch.float32 and out.shape == (3, 4, 128)
    assert torch.equal(out.reshape(12, 128).bfloat16(), mt.experts_forward(module, x, idx, w))


def test_fp32_weights_are_cast_with_a_warning(backend):
    model = hf_models.build(hf_models.qwen3_moe_config(layers=1), "megamoe", dtype=torch.float32)
    module = experts_of(model)[0]
    mt._warned_casts.discard(type(module))
    x, idx, w = routed_inputs(12)
    with pytest.warns(UserWarning, match="casts them on every call"):
        out = mt.experts_forward(module, x.float(), idx, w)
    out.sum().backward()
    assert module.gate_up_proj.grad.dtype == torch.float32 and module.down_proj.grad.dtype == torch.float32


def test_capacity_is_sized_from_the_first_batch_and_grows_with_a_warning(backend):
    module = experts_of(hf_models.build(hf_models.qwen3_moe_config(layers=1), "megamoe"))[0]
    x, idx, w = routed_inputs(10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mt.experts_forward(module, x, idx, w)
    ((key, config),) = getattr(module, mt._STATE_ATTR).layers.values()
    assert config.max_tokens_per_rank == mt.CAPACITY_ALIGNMENT and key in ops._states
    big_x, big_idx, big_w = routed_inputs(300, seed=1)
    with pytest.warns(UserWarning, match="batch of 300 tokens, more than its layer holds \\(256\\); recreating it "
                                          "for 512 tokens"):
        out = mt.experts_forward(module, big_x, big_idx, big_w)
    assert out.shape == big_x.shape
    ((new_key, new_config),) = getattr(module, mt._STATE_ATTR).layers.values()
    assert new_key != key and new_config.max_tokens_per_rank == 512
    assert key not in ops._states, "the outgrown layer state was not released"
    # Smaller batches keep using the grown layer.
    mt.experts_forward(module, x, idx, w)
    assert getattr(module, mt._STATE_ATTR).layers[(128, 128, 8, 2)][0] == new_key


def test_backward_of_a_forward_before_growth_is_still_right(backend):
    module = experts_of(hf_models.build(hf_models.qwen3_moe_config(layers=1), "megamoe"))[0]
    x, idx, w = routed_inputs(10)
    x.requires_grad_()
    small = mt.experts_forward(module, x, idx, w)
    with pytest.warns(UserWarning, match="recreating"):
        mt.experts_forward(module, *routed_inputs(400, seed=2))
    (d_x,) = torch.autograd.grad(small.float().sum(), [x])
    up = x.detach().float().requires_grad_()
    want = reference.moe(up, idx, w, module.gate_up_proj.float(), module.down_proj.float())
    (want_d_x,) = torch.autograd.grad(want.sum(), [up])
    assert hf_models.rel_err(d_x, want_d_x) <= 1e-2


def test_set_max_tokens_fixes_the_capacity(backend):
    model = hf_models.build(hf_models.qwen3_moe_config(), "megamoe")
    assert mt.set_max_tokens(model, 64) == 2
    module = experts_of(model)[0]
    mt.experts_forward(module, *routed_inputs(64))
    assert getattr(module, mt._STATE_ATTR).layers[(128, 128, 8, 2)][1].max_tokens_per_rank == 64
    with pytest.raises(ValueError, match="got 65 tokens, more than the 64 that set_max_tokens gave it"):
        mt.experts_forward(module, *routed_inputs(65))
    mt.set_max_tokens(model, None)
    mt.experts_forward(module, *routed_inputs(65))
    for bad in (0, -3, 1.5, mt.MAX_TOKENS + 1):
        with pytest.raises(ValueError, match="set_max_tokens needs a whole number"):
            mt.set_max_tokens(model, bad)
    with pytest.raises(ValueError, match="has no experts module"):
        mt.set_max_tokens(torch.nn.Linear(2, 2), 8)


def test_growth_during_graph_capture_is_refused(backend, monkeypatch):
    module = experts_of(hf_models.build(hf_models.qwen3_moe_config(layers=1), "megamoe"))[0]
    mt.experts_forward(module, *routed_inputs(10))
    monkeypatch.setattr(mt, "_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="during CUDA graph capture"):
        mt.experts_forward(module, *routed_inputs(300))
    mt.experts_forward(module, *routed_inputs(200))  # fits: no new layer needed


def test_release_and_copies_get_their_own_state(backend):
    model = hf_models.build(hf_models.qwen3_moe_config(layers=1), "megamoe")
    module = experts_of(model)[0]
    mt.experts_forward(module, *routed_inputs(10))
    ((key, _),) = getattr(module, mt._STATE_ATTR).layers.values()
    copied = copy.deepcopy(module)
    mt.experts_forward(copied, *routed_inputs(10))
    ((copy_key, _),) = getattr(copied, mt._STATE_ATTR).layers.values()
    assert copy_key != key
    mt.release(model)
    assert key not in ops._states and copy_key in ops._states
    del copied
    import gc

    gc.collect()
    assert copy_key not in ops._states, "a collected module's layer state was not released"


class _Custom(torch.nn.Module):
    pass


def _refuse(change):
    model = hf_models.build(hf_models.qwen3_moe_config(layers=1), "megamoe")
    module = experts_of(model)[0]
    return change(module) or module


@pytest.mark.parametrize("change, match", [
    (lambda m: setattr(m, "has_bias", True), "its experts have biases"),
    (lambda m: setattr(m, "is_transposed", True), "stores its weights transposed"),
    (lambda m: setattr(m, "is_concatenated", False), "interleaves the gate and up rows"),
    (lambda m: setattr(m, "has_gate", False), "have no gate"),
    (lambda m: setattr(m, "has_post_expert_norm", True), "applies a norm after each expert"),
    (lambda m: setattr(m, "act_fn", torch.nn.GELU()), "its activation is GELU"),
    (lambda m: setattr(m, "__class__", type("GatedExperts", (type(m),), {"_apply_gate": lambda self, h: h})),
     "overrides the gating function"),
])
def test_unsupported_experts_are_refused_clearly(backend, change, match):
    module = _refuse(change)
    with pytest.raises(ValueError, match=f"cannot run \\w+: .*{match}.*use another experts_implementation"):
        mt.experts_forward(module, *routed_inputs(4))


def test_a_model_megamoe_cannot_run_is_refused_at_its_first_call(backend):
    from transformers import GptOssConfig

    config = GptOssConfig(vocab_size=hf_models.VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
                          num_experts_per_tok=2)
    model = hf_models.build(config, "megamoe")
    with pytest.raises(ValueError, match="cannot run GptOssExperts: its experts have biases"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))


def test_shapes_megamoe_cannot_run_name_the_rule(backend):
    model = hf_models.build(hf_models.qwen3_moe_config(hidden=128, inter=96), "megamoe")
    with pytest.raises(ValueError, match="cannot run Qwen3MoeExperts \\(H=128, I=96, E=8, K=2\\).*multiple of 128"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    module = experts_of(hf_models.build(hf_models.qwen3_moe_config(layers=1), "megamoe"))[0]
    x, idx, w = routed_inputs(4)
    with pytest.raises(ValueError, match="top_k_index and top_k_weights of shape \\[T, K\\] with T=4"):
        mt.experts_forward(module, x, idx[:3], w[:3])
    with pytest.raises(TypeError, match="integer expert ids"):
        mt.experts_forward(module, x, idx.float(), w)
    with pytest.raises(ValueError, match="hidden states of width 64"):
        mt.experts_forward(module, x[:, :64], idx, w)
    idx[2, 1] = -2
    with pytest.raises(ValueError, match="expert id -2"):
        mt.experts_forward(module, x, idx, w)


def test_compiled_model_has_no_graph_break_once_its_layers_exist(backend):
    model = hf_models.build(hf_models.qwen3_moe_config(), "megamoe")
    ids = torch.randint(0, hf_models.VOCAB, (2, 8))

    def loss(ids):
        return model(input_ids=ids, labels=ids).loss

    want = loss(ids)  # creates the layers (the one step that leaves the graph)
    explanation = torch._dynamo.explain(loss)(ids)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    got = torch.compile(loss, backend="aot_eager")(ids)
    assert torch.equal(got, want)
