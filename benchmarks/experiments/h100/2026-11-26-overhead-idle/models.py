"""The two models of issue 32's targets, for `kernelkit profile models.py:<name>`:
- llama1b / llama1b_patched: Llama-3.2-1B shapes, 4 layers, 8 x 2048 tokens (../2026-11-25-overhead/llama1b.py);
- llama8b / llama8b_patched: Llama-3-8B layer shapes, 2 layers, 4 x 2048 tokens, untied vocabulary.
Hugging Face LlamaForCausalLM, bf16, random weights, training step; `_patched` applies kernelkit.patch(model)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-25-overhead"))
from llama1b import build as llama1b  # noqa: E402,F401


def llama8b():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                         rope_theta=500000.0, max_position_embeddings=8192)
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).train()
    ids = torch.randint(0, config.vocab_size, (4, 2048), device="cuda")
    return model, {"input_ids": ids, "labels": ids}


def _patched(build):
    import kernelkit

    model, inputs = build()
    kernelkit.patch(model)
    return model, inputs


def llama1b_patched():
    return _patched(llama1b)


def llama8b_patched():
    return _patched(llama8b)
