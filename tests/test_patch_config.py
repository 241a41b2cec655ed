"""kernelkit.patch reads each family's own configuration: tiny random models (one layer) built from transformers'
config classes with non-default settings (RMSNorm eps, rope scaling, sliding windows, softcaps, the attention
scale, activations, tied embeddings, MoE routing and aux loss), patched and compared in float32 with the
unpatched model on the same inputs: logits, loss and every gradient. Each setting is first checked to move the
unpatched model's logits or loss far beyond the tolerance (a setting that changes nothing at these shapes,
as dynamic rope inside its original context, would test nothing): a patched norm reading `variance_epsilon`
(1e-6) where Gemma keeps `eps` survived every test at the default eps.

fp32 attention runs Hugging Face's own functions (the kernel takes bf16 / fp16): the settings the attention
kernel reads (scale, softcap, window) are checked in bf16 against the fp32 model, as close as HF's own bf16.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kernelkit.patch import patch  # noqa: E402

from .test_patch import COMMON, _grads, batch, close, device, linear_ce  # noqa: E402,F401  (fixtures)

EPS = 1e-2  # every family's default is 1e-6 or 1e-5: with the small embeddings below it dominates the norms
# fp32, kernelkit against HF: about 1e-6 of the largest value (logits, loss, gradients). A setting must move the
# unpatched model ten times further (exact against tanh GELU, the closest pair here, moves the logits 1.2e-4).
RTOL, MOVES = 1e-5, 1e-4
MOE = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16)


def _classes(family: str):
    t = transformers
    return {"llama": (t.LlamaForCausalLM, t.LlamaConfig), "mistral": (t.MistralForCausalLM, t.MistralConfig),
            "qwen2": (t.Qwen2ForCausalLM, t.Qwen2Config), "qwen3": (t.Qwen3ForCausalLM, t.Qwen3Config),
            "gemma": (t.GemmaForCausalLM, t.GemmaConfig), "gemma2": (t.Gemma2ForCausalLM, t.Gemma2Config),
            "gemma3": (t.Gemma3ForCausalLM, t.Gemma3TextConfig), "phi3": (t.Phi3ForCausalLM, t.Phi3Config),
            "mixtral": (t.MixtralForCausalLM, t.MixtralConfig),
            "qwen3_moe": (t.Qwen3MoeForCausalLM, t.Qwen3MoeConfig)}[family]


# id -> (family, settings the patched model must follow, sizes and switches that only make them take effect)
CASES = {
    # dynamic rope rescales only past max_position_embeddings: the 8 tokens go past 4
    "llama-dynamic-rope": ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 100.0},
                                         mlp_bias=True), dict(max_position_embeddings=4)),
    "mistral-yarn-window": ("mistral", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 100.0,
                                                             "original_max_position_embeddings": 4},
                                            sliding_window=3), {}),
    "qwen2-window": ("qwen2", dict(sliding_window=3), dict(use_sliding_window=True, max_window_layers=0)),
    "qwen3": ("qwen3", dict(tie_word_embeddings=True), {}),  # q_norm / k_norm take the eps too
    "gemma": ("gemma", dict(hidden_act="gelu"), dict(tie_word_embeddings=True)),
    "gemma2": ("gemma2", dict(hidden_activation="gelu", query_pre_attn_scalar=64, attn_logit_softcapping=2.0,
                              final_logit_softcapping=1.5, sliding_window=3), dict(tie_word_embeddings=True)),
    # a global layer: linear rope scaling. (Gemma 3's attention passes no softcap: HF ignores
    # attn_logit_softcapping there, and so does the patch.)
    "gemma3": ("gemma3", dict(query_pre_attn_scalar=64, final_logit_softcapping=1.5, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100.0}}),
        dict(layer_types=["full_attention"], tie_word_embeddings=True)),
    # long rope past original_max_position_embeddings (cos/sin scaled too) on half of each head
    "phi3-longrope": ("phi3", dict(rope_parameters={
        "rope_type": "longrope", "rope_theta": 100.0, "partial_rotary_factor": 0.5,
        "short_factor": [1.0, 2.0, 3.0, 4.0], "long_factor": [1.5, 3.0, 6.0, 9.0]}),
        dict(max_position_embeddings=16, original_max_position_embeddings=4)),
    "mixtral": ("mixtral", dict(router_aux_loss_coef=0.5, output_router_logits=True),
                dict(MOE, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("qwen3_moe", dict(router_aux_loss_coef=0.5, output_router_logits=True, norm_topk_prob=True),
                  dict(MOE, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[])),
}


def build(family: str, settings: dict, extra: dict, dtype=torch.float32, device="cpu", attn="eager"):
    """A one-layer random model; the same weights for any settings that keep the parameter shapes."""
    cls, config_cls = _classes(family)
    kw = copy.deepcopy({**COMMON, "num_hidden_layers": 1, **extra, **settings})  # configs edit their dicts
    if family == "phi3":
        kw.pop("head_dim")
    cfg = config_cls(**kw)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:  # small embeddings: the eps of the first norms matters as much as the activations
                p.copy_((0.015 if "embed_tokens" in name else 0.15) * torch.randn_like(p))
    return model.to(device=device, dtype=dtype).train()


def _run(model, ids, labels):
    with torch.no_grad():
        logits = model(ids).logits
    out = model(ids, labels=labels)
    return logits, out


def _moved(a, b, rtol) -> bool:
    return bool((a - b).abs().max() > rtol * b.abs().max())


@pytest.mark.parametrize("case", list(CASES))
def test_patched_family_follows_its_config(case, device, linear_ce):
    family, settings, extra = CASES[case]
    settings = {"rms_norm_eps": EPS, **settings}
    ref = build(family, settings, extra, device=device)
    ids, labels = (t.to(device) for t in batch())
    want_logits, want = _run(ref, ids, labels)
    for key in settings:  # each setting changes the unpatched model's answer at these inputs
        plain = build(family, {k: v for k, v in settings.items() if k != key}, extra, device=device)
        logits, out = _run(plain, ids, labels)
        assert _moved(logits, want_logits, MOVES) or _moved(out.loss, want.loss, MOVES), f"{key} changes nothing"

    model = copy.deepcopy(ref)
    report = patch(model)
    assert report.count("rms_norm") and report.count("cross_entropy") == 1
    assert report.count("mlp") + report.count("moe") == 1 and report.count("rope") == 1
    got_logits, got = _run(model, ids, labels)
    close(got_logits, want_logits, RTOL, "logits")
    assert got.logits is None  # the fused loss ran
    close(got.loss, want.loss, RTOL, "loss")
    if settings.get("output_router_logits"):
        close(got.aux_loss, want.aux_loss, RTOL, "aux loss")
    got.loss.backward()
    want.loss.backward()
    g, w = _grads(model), _grads(ref)
    assert g.keys() == w.keys()
    for name in w:
        close(g[name], w[name], RTOL, f"grad {name}")
    # Every replaced call ran kernelkit's kernels: only fp32 attention ran HF's code.
    assert set(report.fallbacks) == {("attention", "dtype float32 (the kernel takes bfloat16 / float16)")}


# The settings the attention kernel reads from the call: scale from query_pre_attn_scalar (not head_dim's), the
# logit softcap, the sliding window (3 keys: the kernel's window is 2 left of the diagonal).
ATTENTION_CASES = ["gemma2", "gemma3", "mistral-yarn-window"]


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_kernel_follows_the_config(case, device):
    family, settings, extra = CASES[case]
    settings = {"rms_norm_eps": EPS, **settings}
    ref = build(family, settings, extra, device=device).eval()
    ref16 = copy.deepcopy(ref).to(torch.bfloat16)
    model = copy.deepcopy(ref16)
    report = patch(model, rms_norm=False, mlp=False, rope=False, cross_entropy=False)
    ids, _ = batch(b=2, s=12)
    ids = ids.to(device)
    with torch.no_grad():
        got, hf16, want = (m(ids).logits.float() for m in (model, ref16, ref))
    assert report.fallback_count() == 0, report.fallbacks
    err, hf_err = (got - want).abs().max(), (hf16 - want).abs().max()
    assert err <= 1.5 * hf_err + 2e-3 * want.abs().max(), f"kernelkit bf16 error {err:.3g}, HF bf16 {hf_err:.3g}"


def test_softcap_note_only_where_the_attention_applies_it():
    """Gemma 2's attention passes attn_logit_softcapping on: its SDPA path drops it, kernelkit applies it, and
    the report says so. Gemma 3's attention never passes it: neither HF nor kernelkit applies it, and the
    report claimed it did."""
    for case, noted in (("gemma2", True), ("gemma3", False)):
        family, settings, extra = CASES[case]
        report = patch(build(family, {**settings, "attn_logit_softcapping": 2.0}, extra, attn="sdpa"))
        assert any("logit softcap 2 applied" in n for n in report.notes) == noted, (case, report.notes)
