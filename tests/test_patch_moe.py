"""kernelkit.patch on the sparse MoE blocks of Mixtral and Qwen3-MoE: the block's own forward and router run,
its experts module runs kernelkit's grouped GEMMs. One tiny layer (hidden 32, 4 experts, top-2, intermediate
24, 16 tokens a sequence) in fp32, compared with an unpatched deep copy holding the same weights.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from kernelkit.patch import modules as patch_modules  # noqa: E402
from kernelkit.patch import patch, unpatch  # noqa: E402
from kernelkit.patch.modules import CPU_REASON  # noqa: E402

from .test_patch import _grads, batch, close, device, linear_ce, tiny_model  # noqa: E402,F401  (fixtures)

SEQ = 16
SIZE = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
BLOCK = {"mixtral": "MixtralSparseMoeBlock", "qwen3_moe": "Qwen3MoeSparseMoeBlock"}


def moe_model(family: str, device, **config):
    if family == "mixtral":
        kw = dict(intermediate_size=24)
    else:  # every layer sparse
        kw = dict(moe_intermediate_size=24, mlp_only_layers=[])
    return tiny_model(family, device=device, layers=1, **SIZE, **kw, **config).train()


def _tokens(device):
    ids, labels = batch(s=SEQ)
    return ids.to(device), labels.to(device)


@pytest.fixture
def kernel_calls(monkeypatch):
    """How many times the patched experts reached kernelkit's moe_experts."""
    calls = []
    real = patch_modules.moe_experts

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(patch_modules, "moe_experts", counted)  # the name the patched forward calls
    return calls


@pytest.mark.parametrize("family,norm_topk", [("mixtral", None), ("qwen3_moe", False), ("qwen3_moe", True)])
def test_training_step_matches_unpatched(family, norm_topk, device, linear_ce, kernel_calls):
    """Loss (aux loss included), router logits and every gradient agree with the unpatched model."""
    extra = {} if norm_topk is None else {"norm_topk_prob": norm_topk}
    ref = moe_model(family, device, **extra)
    model = copy.deepcopy(ref)
    report = patch(model)
    assert report.count("moe") == 1
    ids, labels = _tokens(device)
    got = model(ids, labels=labels, output_router_logits=True)
    want = ref(ids, labels=labels, output_router_logits=True)
    assert len(kernel_calls) == 1 and report.fallback_count("moe") == 0
    assert got.aux_loss is not None
    close(got.aux_loss, want.aux_loss, what="aux loss")
    close(got.loss, want.loss, what="loss")
    for g, w in zip(got.router_logits, want.router_logits, strict=True):
        close(g, w, what="router logits")
    got.loss.backward()
    want.loss.backward()
    g, w = _grads(model), _grads(ref)
    assert g.keys() == w.keys()
    assert any("experts.gate_up_proj" in n for n in w) and any("gate.weight" in n for n in w)
    for name in w:
        close(g[name], w[name], what=f"grad {name}")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_router_logits_are_hugging_faces(family, device, kernel_calls):
    """With only the experts patched, the block sees the same input: the router logits, the routing and the
    aux loss are HF's own, bit for bit (its router module runs; its recorded output is the one returned)."""
    ref = moe_model(family, device)
    model = copy.deepcopy(ref)
    report = patch(model, rms_norm=False, mlp=False, rope=False, attention=False, cross_entropy=False)
    assert [r.kind for r in report.replaced] == ["moe"]
    ids, labels = _tokens(device)
    got = model(ids, labels=labels, output_router_logits=True)
    want = ref(ids, labels=labels, output_router_logits=True)
    assert len(kernel_calls) == 1
    for g, w in zip(got.router_logits, want.router_logits, strict=True):
        assert torch.equal(g, w)
    assert torch.equal(got.aux_loss, want.aux_loss)
    close(got.logits, want.logits, what="logits")


def test_jitter_noise_runs_the_kernel(device, kernel_calls):
    """Mixtral's router jitter is applied by the block's own forward before the router: the experts see the
    jittered input and the routing made from it, so the kernel runs (same seed, same noise)."""
    ref = moe_model("mixtral", device, router_jitter_noise=0.1)
    model = copy.deepcopy(ref)
    report = patch(model)
    ids, labels = _tokens(device)
    torch.manual_seed(3)
    got = model(ids, labels=labels)
    torch.manual_seed(3)
    want = ref(ids, labels=labels)
    close(got.loss, want.loss, what="loss with jitter")
    assert len(kernel_calls) == 1 and report.fallback_count("moe") == 0


def test_experts_with_no_tokens_match_hugging_face(device):
    """The experts module alone against HF's loop, on a routing that leaves expert 3 without a token."""
    ref = moe_model("mixtral", device)
    model = copy.deepcopy(ref)
    patch(model)
    patched, hf = model.model.layers[0].mlp.experts, ref.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SEQ, 32, generator=g).to(device)
    idx = torch.stack([torch.randint(0, 2, (SEQ,), generator=g), torch.full((SEQ,), 2)], 1).to(device)
    weights = torch.rand(SEQ, 2, generator=g).to(device)
    outs, grads = [], []
    for experts in (patched, hf):
        xx, ww = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = experts(xx, idx, ww)
        out.square().sum().backward()
        outs.append(out)
        grads.append((xx.grad, ww.grad, experts.gate_up_proj.grad, experts.down_proj.grad))
    close(outs[0], outs[1], what="out")
    for a, b, name in zip(grads[0], grads[1], ("x", "weights", "gate_up_proj", "down_proj")):
        close(a, b, what=f"grad {name}")
    assert torch.all(grads[0][2][3] == 0) and torch.all(grads[0][3][3] == 0)


def test_non_silu_experts_are_left_alone(device):
    model = moe_model("qwen3_moe", device, hidden_act="gelu")
    report = patch(model)
    assert report.count("moe") == 0
    assert any(what == BLOCK["qwen3_moe"] and "not SiLU" in why for what, why in report.skipped)
    assert "forward" not in vars(model.model.layers[0].mlp.experts)


def test_cpu_outside_interpreter_falls_back_and_counts(monkeypatch, linear_ce):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ref = moe_model("mixtral", "cpu")
    model = copy.deepcopy(ref)
    report = patch(model)
    assert report.count("moe") == 1
    ids, labels = batch(s=SEQ)
    got, want = model(ids, labels=labels, output_router_logits=True), ref(ids, labels=labels, output_router_logits=True)
    close(got.loss, want.loss, what="loss")
    assert report.fallbacks[("moe", CPU_REASON)] == 1


def test_report_and_unpatch(device):
    ref = moe_model("mixtral", device)
    model = copy.deepcopy(ref)
    experts = model.model.layers[0].mlp.experts
    report = patch(model)
    text = str(report)
    assert "MixtralSparseMoeBlock.experts" in text and "moe_experts" in text and "eager" not in text
    assert "forward" in vars(experts)
    unpatch(model)
    assert "forward" not in vars(experts) and "_kernelkit" not in vars(experts)
    ids, _ = _tokens(device)
    model.eval(), ref.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_block_compiles_fullgraph(device):
    """The patched block under torch.compile(fullgraph=True): HF's router in torch ops, the experts one custom
    op (HF's own expert loop breaks the graph on its data-dependent expert list)."""
    ref = moe_model("qwen3_moe", device, norm_topk_prob=True)
    model = copy.deepcopy(ref)
    patch(model)
    block, want_block = model.model.layers[0].mlp, ref.model.layers[0].mlp
    h = torch.randn(2, SEQ, 32, generator=torch.Generator().manual_seed(0)).to(device)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    xs = [h.clone().requires_grad_() for _ in range(2)]
    got, want = compiled(xs[0]), want_block(xs[1])
    close(got, want, what="compiled block")
    got.square().sum().backward()
    want.square().sum().backward()
    close(xs[0].grad, xs[1].grad, what="grad x")
    close(block.experts.gate_up_proj.grad, want_block.experts.gate_up_proj.grad, what="grad gate_up_proj")
    close(block.gate.weight.grad, want_block.gate.weight.grad, what="grad router")
