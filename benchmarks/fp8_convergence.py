"""fp8 training's loss against bf16's (issue 30, item 5): the same model, weights and batches, trained with
AdamW in bf16 (unpatched, and kernelkit.patch) and in fp8 (kernelkit.patch(precision="fp8"): "kernelkit-fp8" with the
LM head's logits and dhidden GEMMs in fp8, "kernelkit-fp8-layers" with the LM head in bf16; torchao's float8
rowwise when it imports), the loss of every step recorded.

Data: sequences of a fixed random Markov chain whose tokens each have a handful of likely successors (random
probabilities), so the loss has a floor well above zero (the chain's entropy, printed) and a model has to learn
distributions, not a lookup table. Two settings:
- small: a Llama of 8 layers, hidden 512, vocab 8192, 16 x 512 tokens per step, 200 steps (the convergence test);
- 8b-layers: Llama-3-8B's layer shapes (2 layers, full vocab), 4 x 2048 tokens, 20 steps (the trend at scale).

    python benchmarks/fp8_convergence.py --setting small --out conv.json [--plot conv.png]

Writes per variant the loss curve, the mean of the last 10 steps and its difference from bf16 (unpatched).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

SETTINGS = {
    "small": dict(config=dict(model_type="llama", hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                              num_key_value_heads=4, num_hidden_layers=8, vocab_size=8192,
                              max_position_embeddings=512, tie_word_embeddings=False),
                  batch=16, seq=512, steps=200, lr=1e-3, warmup=20),
    "8b-layers": dict(config=None, batch=4, seq=2048, steps=20, lr=3e-4, warmup=5),
}
VARIANTS = ("bf16", "kernelkit", "kernelkit-fp8", "kernelkit-fp8-layers", "torchao-fp8")
SUCCESSORS = 6  # likely next tokens per token


def chain(vocab: int, seed: int = 0):
    """The Markov chain: (vocab, SUCCESSORS) successor ids and their probabilities, and its entropy in nats."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, SUCCESSORS), device="cuda", generator=g)
    probs = torch.softmax(torch.randn(vocab, SUCCESSORS, device="cuda", generator=g) * 1.5, dim=1)
    entropy = float(-(probs * probs.log()).sum(1).mean())
    return succ, probs, entropy


def batches(succ, probs, steps: int, batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    """(steps, batch, seq) token ids drawn from the chain, the same for every variant."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = steps * batch
    ids = torch.empty(n, seq, dtype=torch.long, device="cuda")
    ids[:, 0] = torch.randint(0, succ.shape[0], (n,), device="cuda", generator=g)
    for t in range(1, seq):
        prev = ids[:, t - 1]
        pick = torch.multinomial(probs[prev], 1, generator=g).squeeze(1)
        ids[:, t] = succ[prev, pick]
    return ids.view(steps, batch, seq)


def build(setting: dict, variant: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    if setting["config"] is None:
        from kernelkit.testing.model_bench import build_config

        config = build_config("llama", None, 2, setting["seq"])
    else:
        doc = dict(setting["config"])
        config = AutoConfig.for_model(doc.pop("model_type"), **doc)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    what = "unpatched"
    if variant.startswith("kernelkit"):
        import kernelkit

        report = kernelkit.patch(model, precision="fp8" if "fp8" in variant else "bf16",
                                 fp8_lm_head=not variant.endswith("layers"))
        what = str(report).splitlines()[0] if str(report) else variant
    elif variant == "torchao-fp8":
        from kernelkit.testing.model_bench import apply_torchao_fp8

        what = apply_torchao_fp8(model)
    return model.train(), config, what


def curve(model, data: torch.Tensor, lr: float, warmup: int, progress=None) -> tuple[list[float], float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    steps = data.shape[0]
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    losses = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=data[s], labels=data[s]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if progress and (s % 20 == 0 or s == steps - 1):
            progress(s, losses[-1])
    torch.cuda.synchronize()
    return losses, (time.perf_counter() - t0) / steps * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setting", choices=tuple(SETTINGS), default="small")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--plot", default=None)
    a = p.parse_args(argv)
    setting = dict(SETTINGS[a.setting])
    if a.steps:
        setting["steps"] = a.steps
    rows, data, entropy = [], None, None
    for variant in a.variants.split(","):
        try:
            model, config, what = build(setting, variant)
        except ImportError as e:
            rows.append({"variant": variant, "skipped": f"{type(e).__name__}: {e}"})
            print(f"{variant}: skipped ({e})", flush=True)
            continue
        if data is None:
            succ, probs, entropy = chain(config.vocab_size)
            data = batches(succ, probs, setting["steps"], setting["batch"], setting["seq"])
        losses, ms = curve(model, data, setting["lr"], setting["warmup"],
                           lambda s, v: print(f"{variant} step {s}: {v:.4f}", flush=True))
        rows.append({"variant": variant, "patch": what, "losses": losses, "step_ms": ms,
                     "final": sum(losses[-10:]) / len(losses[-10:])})
        del model
        torch.cuda.empty_cache()
    ref = next((r for r in rows if r["variant"] == "bf16" and "final" in r), None)
    for r in rows:
        if ref and "final" in r:
            r["final_rel_diff_vs_bf16"] = (r["final"] - ref["final"]) / ref["final"]
            r["max_rel_diff_vs_bf16"] = max(abs(a - b) / b for a, b in zip(r["losses"], ref["losses"]))
    doc = {"setting": a.setting, **{k: v for k, v in setting.items() if k != "config"},
           "config": setting["config"] or "llama-3-8b layer shapes, 2 layers", "chain_entropy_nats": entropy,
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    Path(a.out).write_text(json.dumps(doc, indent=1))
    for r in rows:
        if "final" in r:
            print(f"{r['variant']:>14}: last-10 mean {r['final']:.4f} ({r.get('final_rel_diff_vs_bf16', 0):+.2%} vs "
                  f"bf16), worst step {r.get('max_rel_diff_vs_bf16', 0):.2%}, {r['step_ms']:.1f} ms/step")
    if a.plot:
        plot(doc, a.plot)


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    ref = next((r for r in doc["rows"] if r["variant"] == "bf16" and "losses" in r), None)
    for r in doc["rows"]:
        if "losses" not in r:
            continue
        axes[0].plot(r["losses"], label=r["variant"], lw=1)
        if ref:
            axes[1].plot([(a - b) / b * 100 for a, b in zip(r["losses"], ref["losses"])], label=r["variant"], lw=1)
    if doc.get("chain_entropy_nats"):
        axes[0].axhline(doc["chain_entropy_nats"], color="#999", ls=":", lw=1, label="data entropy")
    axes[0].set(xlabel="step", ylabel="loss", title=f"{doc['setting']}: loss")
    axes[1].set(xlabel="step", ylabel="% vs bf16 (unpatched)", title="difference from bf16")
    axes[1].axhline(0, color="#999", lw=0.8)
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(f"{doc['gpu']}, torch {doc['torch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
