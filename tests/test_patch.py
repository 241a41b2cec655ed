"""kernelkit.patch on tiny random Hugging Face models of every family in the table (no downloads).

Each patched model is compared with an unpatched deep copy holding the same weights. In fp32 the
attention kernel (bf16/fp16 only) falls back to Hugging Face's functions, so the attention tests that
exercise the kernel itself run in bf16.
"""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import kernelkit  # noqa: E402
from kernelkit.patch import patch, unpatch  # noqa: E402
from kernelkit.patch import attention as hf_attention  # noqa: E402

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, SEQ = 128, 64, 128, 2, 4, 2, 16, 8
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
              num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
              max_position_embeddings=64, attention_dropout=0.0, pad_token_id=0, tie_word_embeddings=False)


def _config(family: str):
    t = transformers
    if family == "llama":  # Llama 3.x rope scaling: computed by HF's rotary module, rotated by kernelkit
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 4, "rope_theta": 500000.0}
        return t.LlamaForCausalLM, t.LlamaConfig(**COMMON, rope_parameters=rope)
    if family == "mistral":
        return t.MistralForCausalLM, t.MistralConfig(**COMMON, sliding_window=4)
    if family == "qwen2":
        return t.Qwen2ForCausalLM, t.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=4,
                                                 max_window_layers=1)
    if family == "qwen3":
        return t.Qwen3ForCausalLM, t.Qwen3Config(**COMMON)
    if family == "gemma":
        return t.GemmaForCausalLM, t.GemmaConfig(**COMMON, hidden_act="gelu_pytorch_tanh")
    if family == "gemma2":
        return t.Gemma2ForCausalLM, t.Gemma2Config(**COMMON, sliding_window=4, query_pre_attn_scalar=16,
                                                   attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    if family == "gemma3":
        return t.Gemma3ForCausalLM, t.Gemma3TextConfig(**COMMON, sliding_window=4, query_pre_attn_scalar=16,
                                                       layer_types=["sliding_attention", "full_attention"])
    if family == "phi3":  # partial rotary: half of each head rotates
        kw = dict(COMMON)
        kw.pop("head_dim")
        return t.Phi3ForCausalLM, t.Phi3Config(**kw, partial_rotary_factor=0.5)
    if family == "mixtral":  # experts' intermediate 32 as Qwen3-MoE's: the interpreted grouped GEMMs grow with it
        return t.MixtralForCausalLM, t.MixtralConfig(**{**COMMON, "intermediate_size": 32}, num_local_experts=4,
                                                     num_experts_per_tok=2)
    if family == "qwen3_moe":
        return t.Qwen3MoeForCausalLM, t.Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2,
                                                       moe_intermediate_size=32, mlp_only_layers=[0])
    raise KeyError(family)


# family -> (RMSNorm modules, gated MLP modules) a 2-layer model holds: the report must count these.
EXPECTED = {
    "llama": (5, 2), "mistral": (5, 2), "qwen2": (5, 2),
    "qwen3": (9, 2),  # + q_norm, k_norm per layer
    "gemma": (5, 2),
    "gemma2": (9, 2),  # four norms per layer (pre/post attention, pre/post feed-forward) + final
    "gemma3": (13, 2),  # gemma2's + q_norm, k_norm
    "phi3": (5, 2),
    "mixtral": (5, 0),  # the sparse blocks: see MOE_BLOCKS
    "qwen3_moe": (9, 1),  # layer 0 is dense (mlp_only_layers), layer 1 sparse
}
FAMILIES = list(EXPECTED)
# family -> sparse MoE blocks whose experts run kernelkit's grouped GEMMs (2 layers, Qwen3-MoE's first dense).
MOE_BLOCKS = {"mixtral": 2, "qwen3_moe": 1}


def tiny_model(family: str, dtype=torch.float32, seed: int = 0, attn: str = "eager", layers: int = LAYERS,
               device="cpu", **config):
    """A tiny random model with weights large enough that every op moves the logits."""
    cls, cfg = _config(family)
    cfg.num_hidden_layers = layers
    for k, v in config.items():
        setattr(cfg, k, v)
    if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
        cfg.layer_types = cfg.layer_types[:layers]
    cfg._attn_implementation = attn  # eager: Gemma 2's SDPA path ignores its attention softcap
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if p.dim() == 1 else 0.15 * torch.randn_like(p))
    return model.to(device=device, dtype=dtype)


def batch(seed: int = 1, b: int = 2, s: int = SEQ):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (b, s), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100
    return ids, labels


def close(a, b, rtol=1e-4, what=""):
    """Agreement relative to the reference's scale: |a - b| <= rtol * max|b| elementwise."""
    scale = b.detach().abs().max().clamp_min(1e-6)
    err = (a.detach().float() - b.detach().float()).abs().max()
    assert err <= rtol * scale, f"{what}: max |diff| {err:.3g} > {rtol:g} x {scale:.3g}"


@pytest.fixture
def device():
    from kernelkit.runtime import interpreting

    if torch.cuda.is_available() and not interpreting():
        return "cuda"
    if not interpreting():
        pytest.skip("kernelkit.patch tests need a GPU or TRITON_INTERPRET=1")
    return "cpu"


def _reference_linear_cross_entropy(hidden, weight, target, bias=None, *, ignore_index=-100, label_smoothing=0.0,
                                    z_loss=0.0, softcap=None, reduction="mean"):
    logits = F.linear(hidden, weight, bias).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)


@pytest.fixture
def linear_ce(monkeypatch):
    """kernelkit's linear_cross_entropy when it imports, else a plain PyTorch stand-in with its signature
    (the patcher's loss wiring is tested either way; test_fused_ce_kernel needs the real one)."""
    try:
        from kernelkit.ops.linear_cross_entropy import linear_cross_entropy  # noqa: F401

        return "kernelkit"
    except ImportError:
        mod = types.ModuleType("kernelkit.ops.linear_cross_entropy")
        mod.linear_cross_entropy = _reference_linear_cross_entropy
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
        return "stand-in"


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


# --- every family: logits, loss, gradients, counts ---

# The two MoE families are the slowest in the interpreter (11-14 s each): in the slow set (the GPU suite and `-m slow`
# run them; CI's budget is 15 minutes). tests/test_moe.py and the other families keep the paths covered in CI.
_SLOW_FAMILIES = ("mixtral", "qwen3_moe")


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f in _SLOW_FAMILIES else f
                                    for f in FAMILIES])
def test_family_matches_unpatched(family, device, linear_ce):
    ref = tiny_model(family, device=device).train()
    model = copy.deepcopy(ref)
    report = patch(model)
    n_norms, n_mlps = EXPECTED[family]
    assert report.count("rms_norm") == n_norms
    assert report.count("mlp") == n_mlps
    assert report.count("moe") == MOE_BLOCKS.get(family, 0)
    assert report.count("rope") == LAYERS and report.count("attention") == LAYERS
    assert report.count("cross_entropy") == 1
    ids, labels = batch()
    ids, labels = ids.to(device), labels.to(device)

    with torch.no_grad():
        close(model(ids).logits, ref(ids).logits, what="logits")
    out, want = model(ids, labels=labels), ref(ids, labels=labels)
    assert out.logits is None, "with labels in training the logits are never materialized"
    close(out.loss, want.loss, what="loss")
    out.loss.backward()
    want.loss.backward()
    got, expected = _grads(model), _grads(ref)
    assert got.keys() == expected.keys()
    for name in expected:
        close(got[name], expected[name], what=f"grad {name}")
    # The norm, MLP and rope kernels ran on every call; fp32 attention fell back (the kernel takes bf16/fp16).
    assert report.fallback_count("rms_norm") == report.fallback_count("mlp") == report.fallback_count("rope") == 0
    assert report.fallback_count("moe") == 0
    assert report.fallbacks == {("attention", "dtype float32 (the kernel takes bfloat16 / float16)"): 2 * LAYERS}


def test_report_prints(device):
    report = patch(tiny_model("gemma2", device=device))
    text = str(report)
    assert "Gemma2RMSNorm" in text and "kernelkit.rms_norm(offset=1)" in text
    assert "kernelkit.geglu(gate, up, approximate='tanh')" in text
    from rich.console import Console

    console = Console(record=True, width=160)
    console.print(report)
    assert "Gemma2MLP" in console.export_text()


def test_switches_turn_replacements_off(device):
    model = tiny_model("llama", device=device)
    report = patch(model, rms_norm=False, swiglu=False, rope=True, attention=False, cross_entropy=False)
    assert [r.kind for r in report.replaced] == ["rope"]
    assert model.config._attn_implementation == "eager"
    assert "forward" not in vars(model.model.norm) and "forward" not in vars(model)


def test_unknown_family_and_double_patch_raise(device):
    with pytest.raises(ValueError, match="no row"):
        patch(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    model = tiny_model("llama", device=device)
    patch(model)
    with pytest.raises(ValueError, match="patched already"):
        patch(model)
    unpatch(model)
    with pytest.raises(ValueError, match="not patched"):
        unpatch(model)


# --- one instance only; unpatch restores; parameters shared ---

def test_other_instance_untouched_and_unpatch_restores(device, linear_ce):
    model = tiny_model("qwen3", device=device)
    cls, cfg = type(model), model.config
    other = cls(cfg).to(device)  # the same config object: a shared config must not leak "kernelkit"
    other.load_state_dict(model.state_dict())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    ids, _ = batch()
    ids = ids.to(device)
    with torch.no_grad():
        want = other(ids).logits

    report = patch(model)
    assert model.config._attn_implementation == hf_attention.NAME
    assert cfg._attn_implementation == "eager" and other.config is cfg
    for m in other.modules():
        assert "forward" not in vars(m) and not hasattr(m, "_kernelkit")
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs, "parameters are shared, never copied"
    assert model.state_dict().keys() == before.keys()
    with torch.no_grad():
        close(model(ids).logits, want, what="patched logits")
        close(other(ids).logits, want, what="other instance")
    assert report.fallback_count() == report.fallback_count("attention")  # other's calls are not ours

    assert unpatch(model) is report
    assert model.config is cfg
    for m in model.modules():
        assert "forward" not in vars(m) and not hasattr(m, "_kernelkit")
    assert not hasattr(model, "_kernelkit_patch")
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs


def test_deepcopy_of_a_patched_model_is_its_own(device):
    model = tiny_model("llama", device=device, layers=1).eval()
    patch(model)
    twin = copy.deepcopy(model)
    assert twin.model.norm.forward.__self__ is twin.model.norm, "bound forwards rebind to the copy"
    with torch.no_grad():
        twin.model.norm.weight.mul_(2.0)
        ids, _ = batch()
        ids = ids.to(device)
        assert not torch.allclose(twin(ids).logits, model(ids).logits)
    unpatch(twin)
    assert "forward" not in vars(twin.model.norm) and twin.config._attn_implementation == "eager"
    assert "forward" in vars(model.model.norm), "the original stays patched"


# --- attention: padding, fallbacks, the kernel itself in bf16 ---

def _padded(ids, left: bool):
    mask = torch.ones_like(ids)
    if left:
        mask[0, :3] = 0
    else:
        mask[0, -3:] = 0
    return mask


@pytest.mark.parametrize("family,left", [("llama", True), ("mistral", False), ("gemma2", True)])
def test_padded_batch_matches_on_tokens(family, left, device):
    ref = tiny_model(family, device=device).eval()
    model = copy.deepcopy(ref)
    report = patch(model)
    ids, _ = batch()
    ids = ids.to(device)
    mask = _padded(ids, left).to(device)
    with torch.no_grad():
        got, want = model(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    keep = mask.bool()
    close(got[keep], want[keep], what="logits on tokens")
    assert report.fallback_count("attention") == LAYERS  # fp32


@pytest.mark.parametrize("attn,dtype", [("eager", torch.float32), ("eager", torch.bfloat16),
                                        ("sdpa", torch.bfloat16)])
def test_fully_masked_queries_answer_as_the_original_attention(attn, dtype, device, linear_ce):
    """A left-padded batch with collator labels (-100 on pads): the last pad position predicts the first
    token, so the loss reads a query that sees no valid key. Eager attention gives it uniform weights over
    every key, SDPA zeros; the patched model must answer as the implementation it replaced (it wrote
    zeros under eager: fp32 loss 5.1001 vs 5.1018, lm_head grad 16% off, bf16 up to 84%)."""
    ref = tiny_model("llama", device=device, attn=attn).train()
    ref_dtype = copy.deepcopy(ref).to(dtype)
    model = copy.deepcopy(ref_dtype)
    report = patch(model)
    ids, _ = batch(b=2, s=12)
    ids = ids.to(device)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    labels = ids.masked_fill(mask == 0, -100)
    outs = [m(ids, attention_mask=mask, labels=labels) for m in (model, ref_dtype, ref)]
    for o in outs:
        o.loss.backward()
    (got, hf, want), names = [_grads(m) for m in (model, ref_dtype, ref)], list(_grads(ref))
    if dtype == torch.float32:
        close(outs[0].loss, outs[2].loss, what="loss")
        for n in names:
            close(got[n], want[n], what=f"grad {n}")
    else:  # as close to the fp32 model as Hugging Face's own bf16 model, within a margin
        for n in names:
            err, hf_err = (got[n].float() - want[n]).abs().max(), (hf[n].float() - want[n]).abs().max()
            assert err <= 2 * hf_err + 1e-2 * want[n].abs().max(), f"grad {n}: {err:.3g} vs HF bf16 {hf_err:.3g}"
    if dtype == torch.bfloat16:
        assert report.fallback_count("attention") == 0, report.fallbacks


class _Lora(torch.nn.Module):
    """What peft's lora.Linear looks like: the base layer, a low-rank delta, the base weight exposed."""

    def __init__(self, base, r=4):
        super().__init__()
        self.base_layer = base
        self.lora_a = torch.nn.Linear(base.in_features, r, bias=False, device=base.weight.device)
        self.lora_b = torch.nn.Linear(r, base.out_features, bias=False, device=base.weight.device)
        torch.nn.init.normal_(self.lora_b.weight, std=0.5)

    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def bias(self):
        return self.base_layer.bias

    def forward(self, x):
        return self.base_layer(x) + self.lora_b(self.lora_a(x))


@pytest.mark.parametrize("change", ["lora", "hook"])
def test_lm_head_changed_after_patch_is_called(change, device, linear_ce):
    """The fused loss reads lm_head.weight without calling the module: an adapter wrapped around lm_head
    after the patch (its delta got no gradient) or a forward hook must make the call take the model's own
    forward, counted in the report."""
    ref = tiny_model("llama", device=device).train()
    model = copy.deepcopy(ref)
    report = patch(model)
    for m in (model, ref):
        torch.manual_seed(3)
        if change == "lora":
            m.lm_head = _Lora(m.lm_head)
        else:
            m.lm_head.register_forward_hook(lambda mod, args, out: out * 1.5)
    ids, labels = batch()
    ids, labels = ids.to(device), labels.to(device)
    out, want = model(ids, labels=labels), ref(ids, labels=labels)
    close(out.loss, want.loss, what="loss")
    out.loss.backward()
    want.loss.backward()
    got, expected = _grads(model), _grads(ref)
    assert got.keys() == expected.keys()
    for name in expected:
        close(got[name], expected[name], what=f"grad {name}")
    assert report.fallback_count("cross_entropy") == 1, report.fallbacks


def test_tuple_output_keeps_the_logits_place(device, linear_ce):
    """return_dict=False: the fused loss has no logits, but the tuple keeps their place (None), so that
    code unpacking the model's own tuple by position still reads the right fields."""
    ref = tiny_model("llama", device=device).train()
    model = copy.deepcopy(ref)
    patch(model)
    ids, labels = batch()
    ids, labels = ids.to(device), labels.to(device)
    got, want = model(ids, labels=labels, return_dict=False), ref(ids, labels=labels, return_dict=False)
    assert len(got) == len(want) and got[1] is None
    close(got[0], want[0], what="loss")


def test_output_attentions_falls_back_and_is_counted(device):
    ref = tiny_model("llama", device=device, dtype=torch.bfloat16).eval()
    model = copy.deepcopy(ref)
    report = patch(model)
    ids, _ = batch()
    ids = ids.to(device)
    with torch.no_grad():
        got = model(ids, output_attentions=True)
        want = ref(ids, output_attentions=True)
    assert len(got.attentions) == LAYERS and got.attentions[0].shape == (2, HEADS, SEQ, SEQ)
    for a, b in zip(got.attentions, want.attentions):
        close(a, b, rtol=2e-2, what="attention weights")
    assert report.fallbacks == {("attention", "output_attentions"): LAYERS}


BF16_CASES = [("llama", None), ("llama", "left"), ("gemma2", "right"), ("mistral", None)]


@pytest.mark.parametrize("family,pad", BF16_CASES)
def test_attention_kernel_in_bf16(family, pad, device):
    """The kernel itself (no fallback): GQA, causal, sliding window, softcap, varlen unpadding. Only the
    attention is patched; against the fp32 model it must be as close as HF's own bf16 eager attention."""
    ref = tiny_model(family, device=device).eval()
    ref16 = copy.deepcopy(ref).to(torch.bfloat16)
    model = copy.deepcopy(ref16)
    report = patch(model, rms_norm=False, mlp=False, rope=False, cross_entropy=False)
    ids, _ = batch(b=2, s=12)
    ids = ids.to(device)
    mask = None if pad is None else _padded(ids, pad == "left").to(device)
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits.float()
        hf16 = ref16(ids, attention_mask=mask).logits.float()
        want = ref(ids, attention_mask=mask).logits
    keep = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    got, hf16, want = got[keep], hf16[keep], want[keep]
    err, hf_err = (got - want).abs().max(), (hf16 - want).abs().max()
    assert err <= 1.5 * hf_err + 1e-2 * want.abs().max(), f"kernelkit bf16 error {err:.3g}, HF bf16 {hf_err:.3g}"
    assert report.fallback_count() == 0, report.fallbacks


def _qkv(b, hq, hk, sq, sk, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g).to(dtype)
    k = torch.randn(b, hk, sk, d, generator=g).to(dtype)
    v = torch.randn(b, hk, sk, d, generator=g).to(dtype)
    return q, k, v


class _Attn(torch.nn.Module):  # what HF's attention functions read from the module
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups, self.is_causal, self.training = groups, True, False


@pytest.mark.parametrize("window,softcap,pad", [(None, None, "left"), (3, None, "right"), (None, 4.0, None),
                                                (3, 4.0, "left")])
def test_attention_function_matches_eager_math(window, softcap, pad, device):
    """The registered function against HF's eager math in fp32 on a dense mask, for the masks the kernel
    takes (causal, sliding window, softcap, padding through varlen)."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    q, k, v = (x.to(device) for x in _qkv(2, 4, 2, 9, 9, 16))
    mask = None
    if pad:
        mask = torch.ones(2, 9, dtype=torch.bool, device=device)
        mask[1, :4] = pad != "left"
        mask[1, 5:] = pad == "left"
    module = _Attn(2)
    got, weights = hf_attention.attention_forward(module, q, k, v, mask, scaling=0.3, sliding_window=window,
                                                  softcap=softcap)
    assert weights is None
    dense = hf_attention._dense_mask(mask, q, k, True, window, allow_none=False)
    additive = torch.zeros(dense.shape, device=device).masked_fill(~dense, torch.finfo(torch.float32).min)
    want, _ = eager_attention_forward(module, q.float(), k.float(), v.float(), additive, scaling=0.3,
                                      softcap=softcap)
    rows = torch.ones(2, 9, dtype=torch.bool, device=device) if mask is None else mask
    close(got.float()[rows], want[rows], rtol=2e-2, what="attention output")
    if mask is not None:
        assert (got[~rows] == 0).all(), "padded queries get zeros"


def test_attention_function_cached_keys_and_fallbacks(device):
    """Decoding against cached keys (bottom-right causal); a padding mask with cached keys and a
    4-D mask fall back to SDPA on the same mask, and the report counts each."""
    from kernelkit.patch.report import PatchReport

    q, k, v = (x.to(device) for x in _qkv(1, 4, 2, 3, 10, 16))
    module = _Attn(2)
    report = PatchReport("test", "test")
    module._kernelkit = hf_attention.AttentionSettings(report)
    got, _ = hf_attention.attention_forward(module, q, k, v, None, scaling=0.25)
    dense = hf_attention._dense_mask(None, q, k, True, None, allow_none=False)
    want = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(2, 1),
                                          v.float().repeat_interleave(2, 1), attn_mask=dense, scale=0.25)
    close(got.float(), want.transpose(1, 2), rtol=2e-2, what="decode")
    assert report.fallback_count() == 0
    pad = torch.ones(1, 10, dtype=torch.bool, device=device)
    pad[0, 0] = False
    got, _ = hf_attention.attention_forward(module, q, k, v, pad, scaling=0.25)
    assert report.fallbacks == {("attention", "padding mask with cached keys"): 1}
    got4, _ = hf_attention.attention_forward(module, q, k, v, hf_attention._dense_mask(pad, q, k, True, None),
                                             scaling=0.25)
    close(got4, got, rtol=1e-3, what="4-D mask fallback")
    assert report.fallback_count() == 2


def test_mask_builder_answers_like_flash_for_plain_causal():
    from transformers.masking_utils import (and_masks, causal_mask_function, packed_sequence_mask_function,
                                            sliding_window_causal_mask_function)

    pad = torch.ones(2, 6, dtype=torch.bool)
    pad[0, 0] = False
    kw = dict(batch_size=2, q_length=6, kv_length=6, q_offset=0, kv_offset=0, dtype=torch.float32, device="cpu")
    assert hf_attention.attention_mask(mask_function=causal_mask_function, attention_mask=None, **kw) is None
    assert torch.equal(hf_attention.attention_mask(mask_function=sliding_window_causal_mask_function(3),
                                                   attention_mask=pad, **kw), pad)
    packed = and_masks(causal_mask_function, packed_sequence_mask_function(torch.tensor([[0, 0, 0, 1, 1, 1]] * 2)))
    assert hf_attention.attention_mask(mask_function=packed, attention_mask=None, **kw).dim() == 4
    static = dict(kw, kv_length=10)  # a static cache's unfilled tail: the kernel's alignment does not hold
    assert hf_attention.attention_mask(mask_function=causal_mask_function, attention_mask=None, **static).dim() == 4


# --- the causal LM loss ---

def test_labels_variants_match_hf_loss(device, linear_ce):
    ref = tiny_model("gemma2", device=device).train()  # final_logit_softcapping set
    model = copy.deepcopy(ref)
    patch(model)
    ids, labels = batch()
    ids, labels = ids.to(device), labels.to(device)
    n = torch.tensor(11, device=device)
    for kw in ({"num_items_in_batch": n}, {"shift_labels": labels.roll(-1, 1)}, {"logits_to_keep": 3}):
        lab = labels[:, -3:] if "logits_to_keep" in kw else labels
        got, want = model(ids, labels=lab, **kw), ref(ids, labels=lab, **kw)
        assert got.logits is None
        close(got.loss, want.loss, what=str(kw))
    got = model(ids, labels=labels, return_dict=False)
    assert isinstance(got, tuple) and got[0].dim() == 0
    model.eval()  # evaluation loops read the logits: the model's own forward
    got, want = model(ids, labels=labels), ref.eval()(ids, labels=labels)
    assert got.logits is not None
    close(got.loss, want.loss, what="eval loss")


def test_moe_router_aux_loss(device, linear_ce):
    ref = tiny_model("mixtral", device=device, layers=1).train()
    model = copy.deepcopy(ref)
    patch(model)
    ids, labels = batch()
    ids, labels = ids.to(device), labels.to(device)
    got = model(ids, labels=labels, output_router_logits=True)
    want = ref(ids, labels=labels, output_router_logits=True)
    assert got.logits is None and got.aux_loss is not None
    close(got.aux_loss, want.aux_loss, what="aux loss")
    close(got.loss, want.loss, what="loss with aux")


def test_fused_ce_kernel_is_used(device, linear_ce):
    if linear_ce != "kernelkit":
        pytest.skip("kernelkit.ops.linear_cross_entropy is not importable yet")
    import kernelkit.ops.linear_cross_entropy as lce

    model = tiny_model("llama", device=device, layers=1).train()
    report = patch(model)
    assert report.count("cross_entropy") == 1
    assert model._kernelkit.linear_cross_entropy is lce.linear_cross_entropy


# --- training features ---

def test_gradient_checkpointing(device, linear_ce):
    ref = tiny_model("qwen2", device=device).train()
    model = copy.deepcopy(ref)
    patch(model)
    model.gradient_checkpointing_enable()
    ref.gradient_checkpointing_enable()
    ids, labels = batch()
    ids, labels = ids.to(device), labels.to(device)
    got, want = model(ids, labels=labels), ref(ids, labels=labels)
    close(got.loss, want.loss, what="loss")
    got.loss.backward()
    want.loss.backward()
    g, w = _grads(model), _grads(ref)
    for name in w:
        close(g[name], w[name], what=f"grad {name}")


@pytest.mark.parametrize("family,dtype", [("qwen3", torch.float32), ("gemma2", torch.bfloat16)])
def test_decoder_layer_compiles_fullgraph(family, dtype, device):
    """One patched decoder layer under torch.compile(fullgraph=True): no graph break (norms, MLP, rope
    and, in bf16, the attention kernel are custom ops; fp32 attention traces HF's SDPA)."""
    model = tiny_model(family, device=device, dtype=dtype, layers=1).eval()
    report = patch(model)
    layer = model.model.layers[0]
    torch.manual_seed(0)
    h = torch.randn(2, SEQ, HIDDEN, device=device, dtype=dtype)
    pos = torch.arange(SEQ, device=device)[None].expand(2, -1)
    kw = dict(attention_mask=None, position_ids=pos, position_embeddings=model.model.rotary_emb(h, pos))
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        want = layer(h, **kw)
        got = compiled(h, **kw)
    want, got = (x[0] if isinstance(x, tuple) else x for x in (want, got))
    close(got, want, rtol=1e-3 if dtype == torch.float32 else 2e-2, what="compiled layer")
    attn_fallbacks = report.fallback_count("attention")
    assert (attn_fallbacks > 0) == (dtype == torch.float32)


def test_whole_model_compiles_and_keeps_the_kernel(device, linear_ce):
    """torch.compile(model) after patching: a bf16 training step with a sliding window (the mask builder
    recognizes HF's sliding-window call under tracing) runs every kernel, attention included."""
    ref = tiny_model("mistral", device=device, dtype=torch.bfloat16, layers=1).train()
    model = copy.deepcopy(ref)
    report = patch(model)
    ids, labels = batch()
    ids, labels = ids.to(device), labels.to(device)
    torch._dynamo.reset()
    got = torch.compile(model, backend="aot_eager")(ids, labels=labels)
    got.loss.backward()
    want = ref(ids, labels=labels)
    assert got.logits is None
    close(got.loss, want.loss, rtol=2e-2, what="compiled loss")
    assert all(p.grad is not None for p in model.parameters())
    assert report.fallback_count() == 0, report.fallbacks


def test_a_fallback_under_compile_does_not_recompile_every_call(device):
    """A fallback counted at call time inside a compiled model was a value torch.compile guarded on: every
    call failed the guard and recompiled (the patched, compiled prefill took 765 ms a call on the H100).
    fp32 attention falls back to the original code (the kernel takes bf16/fp16): after the first traced call
    of each grad mode, calls reuse the graph, and the report records the reason once."""
    model = tiny_model("llama", device=device, layers=1).train()
    report = patch(model)
    ids, labels = (t.to(device) for t in batch())
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    torch._dynamo.reset()
    run = torch.compile(model, backend=backend)
    for _ in range(3):
        run(ids, labels=labels).loss.backward()
    with torch.no_grad():
        for _ in range(3):
            run(ids, use_cache=False, logits_to_keep=1)
    torch._dynamo.reset()
    # traced: training (then once more as the fallback's key appears), prefill (grad mode off)
    assert len(compiles) <= 4, len(compiles)
    assert report.fallbacks and set(report.fallbacks.values()) == {0}, report.fallbacks
    assert "under torch.compile" in str(report)


def test_mask_builder_under_compile():
    """Under tracing closure cells are opaque: the sliding-window call is recognized by its arguments,
    and a packed-sequence mask (HF adds one whenever it cannot check position_ids) stays 4-D."""
    from transformers.masking_utils import (and_masks, packed_sequence_mask_function,
                                            sliding_window_causal_mask_function)

    cfg = transformers.MistralConfig(**COMMON, sliding_window=3)
    packed_ids = torch.tensor([[0, 0, 0, 1, 1, 1]] * 2)

    def build(packed: bool):
        fn = sliding_window_causal_mask_function(3)
        if packed:
            fn = and_masks(fn, packed_sequence_mask_function(packed_ids))
        return hf_attention.attention_mask(batch_size=2, q_length=6, kv_length=6, mask_function=fn,
                                           attention_mask=None, allow_is_causal_skip=not packed, local_size=3,
                                           config=cfg, dtype=torch.float32, device="cpu")

    torch._dynamo.reset()
    assert torch.compile(lambda: build(False), fullgraph=True, backend="eager")() is None
    assert torch.compile(lambda: build(True), fullgraph=True, backend="eager")().dim() == 4


def test_generate_matches_unpatched(device):
    """Greedy decoding with a KV cache: prefill, then one query against the cached keys per step; with a
    left-padded batch the prefill unpads (varlen) and the steps after it fall back (padding + cached keys)."""
    ref = tiny_model("llama", device=device).eval()
    model = copy.deepcopy(ref)
    report = patch(model)
    ids, _ = batch()
    ids = ids[:, :5].to(device)
    assert torch.equal(model.generate(ids, max_new_tokens=2, do_sample=False),
                       ref.generate(ids, max_new_tokens=2, do_sample=False))
    assert report.fallback_count() == report.fallback_count("attention")  # fp32 attention only
    model16, ref16 = model.to(torch.bfloat16), copy.deepcopy(ref).to(torch.bfloat16)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    report.fallbacks.clear()
    kw = dict(attention_mask=mask, max_new_tokens=2, do_sample=False, output_scores=True, return_dict_in_generate=True)
    got, want = model16.generate(ids, **kw), ref16.generate(ids, **kw)
    close(got.scores[0].float(), want.scores[0].float(), rtol=3e-2, what="prefill of a padded batch")
    assert report.fallbacks == {("attention", "padding mask with cached keys"): LAYERS}


def test_cpu_outside_interpreter_runs_original_code(monkeypatch, linear_ce):
    """No CUDA and no interpreter: patch still patches; every call runs the original code, counted."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ref = tiny_model("phi3").train()
    model = copy.deepcopy(ref)
    report = patch(model)
    assert report.count("rms_norm") == 5 and report.count("mlp") == 2
    ids, labels = batch()
    got, want = model(ids, labels=labels), ref(ids, labels=labels)
    assert got.logits is not None, "the original forward ran"
    close(got.loss, want.loss, what="loss")
    reason = "CPU tensor outside the Triton interpreter"
    assert report.fallbacks[("rms_norm", reason)] == 5 and report.fallbacks[("mlp", reason)] == 2
    assert report.fallbacks[("rope", reason)] == LAYERS and report.fallbacks[("cross_entropy", reason)] == 1
