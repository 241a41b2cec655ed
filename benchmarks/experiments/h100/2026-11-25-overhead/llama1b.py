"""Llama-3.2-1B-shaped Hugging Face model (4 layers, 8 x 2048 tokens, bf16, random weights) for
`kernelkit profile benchmarks/experiments/h100/2026-11-25-overhead/llama1b.py:build --patch` (issue 32)."""

import torch


def build():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=4,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                         rope_theta=500000.0, max_position_embeddings=8192)
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).train()
    ids = torch.randint(0, config.vocab_size, (8, 2048), device="cuda")
    return model, {"input_ids": ids, "labels": ids}
