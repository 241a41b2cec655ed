"""The decoder layers' post-attention residual add fused into the RMSNorm (`kernelkit.patch.decoder`): the patched
layer computes what the unpatched one does (loss and every gradient, fp32 and bf16), runs `add_rms_norm` once per
layer instead of an add and a norm, binds only layers whose forward is the plain pre-norm sequence, and steps
aside where the norm would not run kernelkit's kernel (rms_norm=False, fp8 rows) or when switched off."""

from __future__ import annotations

import copy

import pytest
import torch

from kernelkit.patch import patch, unpatch
from kernelkit.patch import decoder as D

from .test_patch import batch, close, device, tiny_model  # noqa: F401  (fixture)

pytest.importorskip("transformers")


def _count_fused(monkeypatch):
    calls = []
    real = D.add_rms_norm

    def counted(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(D, "add_rms_norm", counted)
    return calls


def _step(model):
    model.zero_grad(set_to_none=True)
    dev = next(model.parameters()).device
    ids, labels = (t.to(dev) for t in batch())
    loss = model(ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family,dtype", [("llama", torch.float32), ("qwen3", torch.float32),
                                          ("gemma", torch.float32), ("llama", torch.bfloat16)])
def test_fused_add_norm_computes_what_the_layer_does(family, dtype, device, monkeypatch):
    monkeypatch.setenv("KERNELKIT_PATCH_CHOICE", "kernelkit")
    model = tiny_model(family, dtype=dtype, layers=2, device=device)
    ref = copy.deepcopy(model)
    calls = _count_fused(monkeypatch)
    # only the norms (and the fused add with them): the comparison isolates the fusion
    report = patch(model, mlp=False, rope=False, attention=False, cross_entropy=False)
    base = copy.deepcopy(ref)
    patch(base, mlp=False, rope=False, attention=False, cross_entropy=False)
    for layer in base.model.layers:  # the same patch without the fused forward: norms alone
        del layer.forward
    model.train(), ref.train(), base.train()
    got, got_g = _step(model)
    want, want_g = _step(ref)
    alone, alone_g = _step(base)
    assert len(calls) == 2  # one per layer
    assert "add_rms_norm" in {r.kind for r in report.replaced}
    rtol = 1e-4 if dtype == torch.float32 else 2e-2
    close(got, want, rtol, "loss")
    for n, g in want_g.items():
        close(got_g[n], g, rtol * 10, n)
    if dtype == torch.float32:  # against the norms alone the sum is the same bits; only the order of adds differs
        close(got, alone, 1e-6, "loss vs norms alone")


def test_rms_norm_off_or_fp8_rows_keep_the_add_apart(device, monkeypatch):
    monkeypatch.setenv("KERNELKIT_PATCH_CHOICE", "kernelkit")
    calls = _count_fused(monkeypatch)
    model = tiny_model("llama", layers=1, device=device)
    report = patch(model, rms_norm=False, mlp=False, rope=False, attention=False, cross_entropy=False)
    assert "forward" not in vars(model.model.layers[0])  # the norms are off: nothing to fuse into
    assert "add_rms_norm" not in {r.kind for r in report.replaced}
    unpatch(model)
    model = tiny_model("llama", dtype=torch.bfloat16, layers=1, device=device)
    report = patch(model, precision="fp8", mlp=False, rope=False, attention=False, cross_entropy=False)
    model.train()
    _step(model)
    assert calls == []  # the post-attention norm writes gate/up's fp8 rows instead
    assert any("fp8 rows" in why for _, why in report.skipped)
    unpatch(model)
    # a hook on the norm (a tensor-parallel plan's, or the user's) must run: the layer keeps the norm's call
    model = tiny_model("llama", layers=1, device=device)
    patch(model, mlp=False, rope=False, attention=False, cross_entropy=False)
    seen = []
    model.model.layers[0].post_attention_layernorm.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    model.train()
    _step(model)
    assert calls == [] and len(seen) == 1


def test_switched_off_and_unpatched_layers_keep_their_forward(device, monkeypatch):
    monkeypatch.setenv("KERNELKIT_PATCH_FUSE_ADD", "0")
    model = tiny_model("llama", layers=1)
    patch(model, mlp=False, rope=False, attention=False, cross_entropy=False)
    assert "forward" not in vars(model.model.layers[0])
    monkeypatch.setenv("KERNELKIT_PATCH_FUSE_ADD", "1")
    model = tiny_model("llama", layers=1)
    patch(model, mlp=False, rope=False, attention=False, cross_entropy=False)
    assert "forward" in vars(model.model.layers[0])
    unpatch(model)
    assert "forward" not in vars(model.model.layers[0]) and not hasattr(model.model.layers[0], "_kernelkit_decoder")


def test_only_the_plain_pre_norm_sequence_matches():
    from transformers.models.gemma2.modeling_gemma2 import Gemma2DecoderLayer
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer
    from transformers.models.phi3.modeling_phi3 import Phi3DecoderLayer

    assert D.matches(LlamaDecoderLayer) is None
    assert D.matches(MixtralDecoderLayer) is None
    assert "not the plain pre-norm" in D.matches(Gemma2DecoderLayer)  # four norms a layer
    assert "not the plain pre-norm" in D.matches(Phi3DecoderLayer)  # residual dropout

    class Reordered(LlamaDecoderLayer):  # the same statements in another order must not match
        def forward(self, hidden_states, **kwargs):
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
            hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states = self.mlp(hidden_states)
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = residual + hidden_states
            return hidden_states

    assert "not the plain pre-norm" in D.matches(Reordered)


def test_a_phi3_model_keeps_its_layers_and_says_why(device, monkeypatch):
    monkeypatch.setenv("KERNELKIT_PATCH_CHOICE", "kernelkit")
    model = tiny_model("phi3", layers=1)
    report = patch(model, mlp=False, rope=False, attention=False, cross_entropy=False)
    assert "forward" not in vars(model.model.layers[0])
    assert any("residual add" in what for what, _ in report.skipped), report.skipped


def test_the_layer_takes_positional_arguments_and_compiles_whole(device, monkeypatch):
    """The bound forward passes a positional call's arguments on by name, and torch.compile traces it in one graph."""
    monkeypatch.setenv("KERNELKIT_PATCH_CHOICE", "kernelkit")
    model = tiny_model("llama", layers=1, device=device)
    ref = copy.deepcopy(model)
    patch(model, mlp=False, rope=False, attention=False, cross_entropy=False)
    calls = _count_fused(monkeypatch)
    layer, ref_layer = model.model.layers[0], ref.model.layers[0]
    g = torch.Generator().manual_seed(4)
    h = torch.randn(2, 8, model.config.hidden_size, generator=g).to(device)
    pos = torch.arange(8, device=device)[None]
    cos_sin = model.model.rotary_emb(h, pos)
    got = layer(h, None, pos, None, False, cos_sin)  # attention_mask, position_ids, past, use_cache, embeddings
    want = ref_layer(h, None, pos, None, False, cos_sin)
    assert len(calls) == 1
    close(got, want, 1e-4, "positional call")
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    close(compiled(h, position_embeddings=cos_sin, position_ids=pos), want, 1e-4, "compiled")
