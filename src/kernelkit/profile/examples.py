"""Built-in example models: nothing downloaded, random weights, sized for the machine."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class LlamaRMSNorm(nn.Module):
    """The eager RMSNorm of Llama-style models (what kernelkit's profiler should flag)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, dim, heads, kv_heads, hidden):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(dim)
        self.self_attn = Attention(dim, heads, kv_heads)
        self.post_attention_layernorm = LlamaRMSNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlama(nn.Module):
    """A Llama-style decoder returning the mean next-token cross-entropy loss."""

    def __init__(self, vocab=32000, dim=2048, layers=4, heads=16, kv_heads=4, hidden=5632, theta=10000.0):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(DecoderLayer(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = LlamaRMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.head_dim, self.theta = dim // heads, theta

    def forward(self, ids, labels):
        s = ids.shape[1]
        inv = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, device=ids.device).float() / self.head_dim))
        freqs = torch.outer(torch.arange(s, device=ids.device).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        x = self.embed_tokens(ids)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.view(-1))


EXAMPLES = ("llama", "hf-llama", "hf-llama3-8b", "hf-llama3.2-1b")
# Llama-3-8B's layer shapes, 2 decoder layers and the whole vocabulary, one 2048-token sequence (per rank): the
# FSDP2 step of scripts/multi_gpu_check.sh (kernelkit.testing.distributed's bench runs the same shapes).
LLAMA3_8B = {"vocab": 128256, "dim": 4096, "layers": 2, "heads": 32, "kv_heads": 8, "hidden": 14336}
# Llama-3.2-1B's shapes (head_dim 64: 32 query heads over 8 kv heads of 2048), 4 of its 16 layers, the whole vocabulary.
LLAMA32_1B = {"vocab": 128256, "dim": 2048, "layers": 4, "heads": 32, "kv_heads": 8, "hidden": 8192}


def _hf_llama(cfg: dict, seq: int, dtype, device):
    """transformers' LlamaForCausalLM with the hand-written example's sizes: the model kernelkit.patch takes."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        raise ValueError("example 'hf-llama' needs transformers (pip install transformers)") from None
    config = LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["dim"], intermediate_size=cfg["hidden"],
                         num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                         num_key_value_heads=cfg["kv_heads"], max_position_embeddings=max(seq, 2048),
                         rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype=dtype).train()


def build_example(name: str = "llama", device: str | None = None, tiny: bool | None = None):
    """(model, inputs) for a built-in example; `model(*inputs)` (`model(**inputs)` for a dict) returns the
    loss (a scalar, or an output with `.loss`).

    llama: 4 decoder layers (RMSNorm, RoPE, GQA attention through F.scaled_dot_product_attention,
    SwiGLU MLP), lm_head and cross-entropy, random weights, written out in this file. hf-llama: the same
    sizes as transformers' LlamaForCausalLM (SDPA attention), inputs {"input_ids", "labels"}: what
    `kernelkit.patch` takes. Full size (hidden 2048, 16 heads over 4 kv heads, MLP 5632, vocab 32000,
    batch 4 x seq 2048, bf16) on a GPU or the meta device (shapes only, for predicted mode); tiny
    (hidden 64, 2 layers, batch 2 x seq 32, fp32) on the CPU. hf-llama3-8b: LlamaForCausalLM with Llama-3-8B's
    layer shapes (2 layers, vocab 128256), batch 1 x seq 2048, what `profile --fsdp` runs per rank.
    hf-llama3.2-1b: Llama-3.2-1B's shapes (head_dim 64, 4 layers, vocab 128256), batch 4 x seq 2048.
    """
    if name not in EXAMPLES:
        raise ValueError(f"unknown example {name!r}; available: {', '.join(EXAMPLES)}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tiny = (device != "cuda") if tiny is None else tiny
    torch.manual_seed(0)
    if tiny:
        cfg = {"vocab": 512, "dim": 64, "layers": 2, "heads": 4, "kv_heads": 2, "hidden": 160}
        batch, seq, dtype = 2, 32, torch.float32
    else:
        cfg, batch, seq, dtype = dict(), 4, 2048, torch.bfloat16
    if name.startswith("hf-llama"):
        full = {"vocab": 32000, "dim": 2048, "layers": 4, "heads": 16, "kv_heads": 4, "hidden": 5632}
        if name == "hf-llama3-8b":
            full, batch = LLAMA3_8B, (batch if tiny else 1)
        elif name == "hf-llama3.2-1b":
            full = LLAMA32_1B
        model = _hf_llama({**full, **cfg}, seq, dtype, device)
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
        return model, {"input_ids": ids, "labels": torch.randint(0, model.config.vocab_size, (batch, seq),
                                                                  device=device)}
    with torch.device(device):  # weights born where they live: no 250M-parameter init on the CPU first
        model = TinyLlama(**cfg).to(dtype=dtype)
    ids = torch.randint(0, cfg.get("vocab", 32000), (batch, seq), device=device)
    labels = torch.randint(0, cfg.get("vocab", 32000), (batch, seq), device=device)
    return model, (ids, labels)
