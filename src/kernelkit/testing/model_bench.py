"""`kernelkit bench model`: a Hugging Face causal LM, one training step and one prefill, per variant.

Variants — eager (HF, SDPA attention), torch.compile, Liger-Kernel (when installed), kernelkit.patch,
kernelkit.patch + torch.compile, and in fp8 kernelkit's and torchao's (the anchor, when installed) — each run
in a process of their own (a patch, a compile cache or an allocator state must not leak into the next row),
on the same random weights and the same batch (both seeded). Each reports tokens/s of a training step
(forward with labels, loss, backward) and of a prefill (forward without labels, last-token logits), peak
memory, the loss, and the agreement of every parameter's gradient with eager's (the worst parameter is named).

    python -m kernelkit.testing.model_bench --variant eager --out row.json   # one row, in this process
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..hw.sustain import sustain

# kernelkit: each switch runs kernelkit only where measured faster than the model's code (the default);
# kernelkit-always: every switch forced to kernelkit.
# ...+compile-ro: torch.compile(mode="reduce-overhead"), CUDA graphs around the compiled regions.
# kernelkit-fp8: kernelkit.patch(model, precision="fp8"), the decoder layers' Linear GEMMs in fp8, and the LM head's
# logits and dhidden GEMMs inside the fused loss; kernelkit-fp8-layers: the same with fp8_lm_head=False.
# torchao-fp8: the unpatched model with torchao's float8 training on the same Linears (`apply_torchao_fp8`).
VARIANTS = ("eager", "torch.compile", "liger", "kernelkit", "kernelkit+compile", "kernelkit-always",
            "kernelkit-always+compile", "torch.compile-ro", "kernelkit+compile-ro", "kernelkit-fp8",
            "kernelkit-fp8+compile", "kernelkit-fp8-layers", "kernelkit-fp8-layers+compile", "torchao-fp8",
            "torchao-fp8+compile")

# Llama-3-8B's layer shapes (hidden 4096, MLP 14336, 32 heads, 8 KV heads, vocab 128256).
LLAMA = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
             max_position_embeddings=8192, tie_word_embeddings=False, hidden_act="silu")
# Llama-3.2-1B's (hidden 2048, MLP 8192, 32 heads of 64, 8 KV heads, tied embeddings).
LLAMA_1B = dict(LLAMA, hidden_size=2048, intermediate_size=8192, head_dim=64, tie_word_embeddings=True)
EXAMPLES = {"llama": LLAMA, "llama-1b": LLAMA_1B}


def fp8_variants(variants) -> tuple:
    """`bench model --precision fp8`: each kernelkit variant followed by its fp8 counterparts, kernelkit's and
    torchao's (kernelkit -> kernelkit-fp8, torchao-fp8; kernelkit+compile -> kernelkit-fp8+compile,
    torchao-fp8+compile), so the fp8 rows sit next to the bf16 ones."""
    out = []
    for v in variants:
        twins = (v.replace("kernelkit", "kernelkit-fp8", 1), v.replace("kernelkit", "torchao-fp8", 1)) \
            if v in ("kernelkit", "kernelkit+compile") else ()
        out += [w for w in (v, *twins) if w not in out]
    return tuple(out)


def torchao_fp8_filter(model):
    """torchao's `module_filter_fn(module, fqn)` for this model: True for exactly the Linears kernelkit-fp8 runs
    in fp8. The rule is kernelkit.patch's (`_patch_fp8`): every plain nn.Linear inside the decoder layers
    (model.model.layers); the embeddings and lm_head stay bf16."""
    import torch

    layers = getattr(getattr(model, "model", model), "layers", None)
    # id -> module: the references keep a swapped-out module's id from being reused while the filter lives
    chosen = {} if not isinstance(layers, torch.nn.ModuleList) else {
        id(m): m for layer in layers for m in layer.modules()
        if type(m) is torch.nn.Linear and "forward" not in vars(m)}
    return lambda module, fqn: chosen.get(id(module)) is module


def apply_torchao_fp8(model) -> str:
    """torchao-fp8 and torchao-fp8+compile, the fp8 anchor: torchao's float8 training, rowwise recipe (e4m3,
    rowwise scales, forward and both backward GEMMs through torch._scaled_mm), on `torchao_fp8_filter`'s
    Linears. Raises ImportError without torchao; returns what was converted.

    torchao 0.17.0 is the release built for torch 2.11; float8 training is its Python only. The GPU machine has
    no network: the wheel is downloaded beforehand into the git-ignored .whl/torchao/ (carried to the machine)
    and installed there with
        python3 -m pip install --no-index --no-deps --target /tmp/ao .whl/torchao/*.whl
        export PYTHONPATH=/tmp/ao:$PWD/src   # each variant's process inherits it
    """
    import torchao
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                               module_filter_fn=torchao_fp8_filter(model))
    swapped = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    return f"torchao {torchao.__version__} float8 rowwise: {swapped} decoder-layer nn.Linear -> Float8Linear"


def build_config(example: str | None, config_path: str | None, layers: int | None, seq: int):
    from transformers import AutoConfig

    if config_path:
        doc = json.loads(Path(config_path).read_text())
    else:
        doc = dict(EXAMPLES[example or "llama"])
    kind = doc.pop("model_type")
    if layers:
        doc["num_hidden_layers"] = layers
    doc.setdefault("num_hidden_layers", 2)
    doc["max_position_embeddings"] = max(doc.get("max_position_embeddings", 0), seq)
    return AutoConfig.for_model(kind, **doc)


def _median_ms(fn, warmup: int, iters: int) -> tuple[float, list[float]]:
    """Median of `iters` CUDA-event timings of `fn`, after `warmup` calls and at least a second of them
    (`hw.sustain`: the clock a training loop runs at)."""
    import torch

    sustain(fn, warmup)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), times


def unavailable(variant: str) -> str | None:
    """Why this environment cannot run `variant` (a package it needs does not import), or None. Asked before a
    model is built: CPU CI has neither Liger nor torchao, and no GPU."""
    if variant.startswith("torchao"):
        try:
            import torchao.float8  # noqa: F401
        except ImportError as e:
            return f"torchao is not installed (import torchao.float8: {e})"
    if variant == "liger":
        try:
            from liger_kernel.transformers import _apply_liger_kernel_to_instance  # noqa: F401
        except ImportError as e:
            return f"Liger-Kernel is not installed (import liger_kernel.transformers: {e})"
    return None


def apply_variant(model, variant: str):
    """The part of a variant that changes the model itself, before any torch.compile and any sharding:
    Liger's patch, kernelkit.patch (auto switches, or forced with -always, fp8 Linears with -fp8) or torchao's
    float8 training. Returns kernelkit's PatchReport, torchao's summary, or None."""
    if variant == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    if variant.startswith("kernelkit"):
        from ..patch import patch  # transformers' model classes, loaded with the variant that needs them

        if "always" in variant:
            return patch(model, rms_norm="kernelkit", mlp="kernelkit", rope="kernelkit", attention="kernelkit",
                         cross_entropy="kernelkit", moe="kernelkit")
        return patch(model, rms_norm="auto", mlp="auto", rope="auto", attention="auto", cross_entropy="auto",
                     moe="auto", precision="fp8" if "fp8" in variant else "bf16",
                     fp8_lm_head="fp8-layers" not in variant)
    if variant.startswith("torchao"):
        return apply_torchao_fp8(model)
    return None


def run_variant(variant: str, config, batch: int, seq: int, steps: int, grads_path: str | None,
                ref_grads_path: str | None, kernels: bool = False) -> dict:
    """One row, in this process; `kernels`: also `kernel_table` of two training steps."""
    import torch
    from transformers import AutoModelForCausalLM

    row: dict = {"variant": variant}
    reason = unavailable(variant)
    if reason:
        return {**row, "skipped": reason}
    torch.manual_seed(0)
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.train()
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device="cuda", generator=gen)
    report = apply_variant(model, variant)
    if variant.startswith("torchao"):
        row["patch"] = report
    run = torch.compile(model) if variant.endswith("compile") else \
        torch.compile(model, mode="reduce-overhead") if variant.endswith("compile-ro") else model

    def step():
        if variant.endswith("compile-ro"):
            torch.compiler.cudagraph_mark_step_begin()  # each step's outputs may overwrite the last's
        out = run(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss

    # First step: the loss and the gradients compared with eager's (the weights never change: no optimizer).
    loss = step()
    row["loss"] = float(loss.detach().float())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if grads_path:
        torch.save({n: g.cpu() for n, g in grads.items()}, grads_path)
    if ref_grads_path and os.path.exists(ref_grads_path):
        ref = torch.load(ref_grads_path)
        errs = {}
        for n, g in ref.items():
            got = grads.get(n)
            g = g.to("cuda").float()
            errs[n] = float("inf") if got is None else float((got.float() - g).norm() / g.norm().clamp_min(1e-30))
        worst = max(errs, key=errs.get)
        row["grad_worst"] = {"param": worst, "rel_err": errs[worst]}
        row["grad_median_rel_err"] = statistics.median(errs.values())
    del grads

    def train_step():
        model.zero_grad(set_to_none=True)
        step()

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    row["step_ms"], row["step_ms_all"] = _median_ms(train_step, warmup=2, iters=steps)
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    row["train_tokens_per_s"] = batch * seq / row["step_ms"] * 1e3
    if kernels:
        row["kernels"] = kernel_table(train_step, steps=2)
    model.zero_grad(set_to_none=True)

    def prefill():
        with torch.no_grad():
            run(input_ids=ids, use_cache=False, logits_to_keep=1)

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    row["prefill_ms"], _ = _median_ms(prefill, warmup=2, iters=steps)
    row["prefill_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    row["prefill_tokens_per_s"] = batch * seq / row["prefill_ms"] * 1e3
    if variant.startswith("kernelkit"):
        row["patch"] = str(report)  # after the runs: the report counts the calls that fell back
    return row


# Kernel families of `kernel_table`, first match wins (lower-case substrings of the kernel's name).
KERNEL_FAMILIES = (
    ("fp8 GEMM (kernelkit)", ("scaled_matmul",)),
    ("fp8 quantization", ("quantize",)),
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa", "cudnn")),
    ("GEMM (cuBLAS / CUTLASS)", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "sm90_")),
    ("elementwise / reduce (torch)", ("at::native", "elementwise", "vectorized", "reduce_kernel", "memcpy", "memset")),
    ("Triton (kernelkit, torch.compile)", ("_kernel", "triton")),
)


def kernel_family(name: str) -> str:
    low = name.lower()
    return next((fam for fam, keys in KERNEL_FAMILIES if any(k in low for k in keys)), "other")


def kernel_table(train_step, steps: int = 2, top: int = 12) -> dict:
    """GPU kernel time of `steps` training steps under torch.profiler, per step: by `KERNEL_FAMILIES` and the
    `top` kernels, with the kernel count and the step's wall time (busy < wall: idle GPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            train_step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / steps
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
        doc = json.loads(Path(tmp, "trace.json").read_text())
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    fams: dict[str, float] = {}
    names: dict[str, list] = {}
    count = 0
    for e in events:
        if e.get("cat") != "kernel":
            continue
        ms = float(e.get("dur", 0.0)) / 1e3 / steps
        fam = kernel_family(e["name"])
        fams[fam] = fams.get(fam, 0.0) + ms
        n = names.setdefault(e["name"][:120], [0.0, 0])
        n[0] += ms
        n[1] += 1
        count += 1
    busiest = sorted(names.items(), key=lambda kv: -kv[1][0])[:top]
    return {"busy_ms": sum(fams.values()), "profiled_wall_ms": wall, "kernels_per_step": count / steps,
            "families_ms": dict(sorted(fams.items(), key=lambda kv: -kv[1])),
            "top": [{"name": k, "ms": v[0], "calls": v[1] / steps} for k, v in busiest]}


def run_model_bench(example: str | None = "llama", config_path: str | None = None, layers: int | None = 2,
                    batch: int = 4, seq: int = 2048, steps: int = 5, variants=VARIANTS, out: Path | None = None,
                    timeout: int = 600, progress=None, kernels: bool = False) -> list[dict]:
    """Every variant in a process of its own; eager first (the gradients the others are compared with).
    `kernels`: each row also gets `kernel_table` (GPU kernel time per step by family)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ref = os.path.join(tmp, "eager-grads.pt")
        order = ["eager"] + [v for v in variants if v != "eager"]
        for v in order:
            if progress:
                progress(v)
            cmd = [sys.executable, "-m", "kernelkit.testing.model_bench", "--variant", v, "--batch", str(batch),
                   "--seq", str(seq), "--steps", str(steps), "--json", os.path.join(tmp, "row.json")]
            cmd += ["--config", config_path] if config_path else ["--example", example or "llama"]
            cmd += ["--layers", str(layers)] if layers else []
            cmd += ["--save-grads", ref] if v == "eager" else ["--ref-grads", ref]
            cmd += ["--kernels"] if kernels else []
            t0 = time.time()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            if proc.returncode:
                rows.append({"variant": v, "error": (proc.stderr or proc.stdout)[-1500:]})
            else:
                rows.append(json.loads(Path(tmp, "row.json").read_text()))
            rows[-1]["wall_s"] = time.time() - t0
            if out:  # row by row: a run cut short keeps what it measured
                out.mkdir(parents=True, exist_ok=True)
                (out / "model.partial.json").write_text(json.dumps(rows, indent=1))
    eager = next((r for r in rows if r["variant"] == "eager" and "step_ms" in r), None)
    for r in rows:
        if eager and "step_ms" in r:
            r["x_eager_train"] = eager["step_ms"] / r["step_ms"]
            r["x_eager_prefill"] = eager["prefill_ms"] / r["prefill_ms"]
            r["loss_rel_diff"] = abs(r["loss"] - eager["loss"]) / abs(eager["loss"])
    if out:
        out.mkdir(parents=True, exist_ok=True)
        meta = {"example": example, "config": config_path, "layers": layers, "batch": batch, "seq": seq,
                "steps": steps}
        try:
            import torch
            import transformers

            meta.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                        transformers=transformers.__version__)
        except Exception:  # noqa: BLE001 - the rows stand on their own
            pass
        (out / "model.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        plot_rows(rows, out / "model.png", meta)
    return rows


def plot_rows(rows, path: Path, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "step_ms" in r]
    if not ok:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for ax, key, title in ((axes[0], "train_tokens_per_s", "training step"), (axes[1], "prefill_tokens_per_s",
                                                                                 "prefill")):
        vals = [r[key] / 1e3 for r in ok]
        ax.barh([r["variant"] for r in ok], vals, color=["#888" if not r["variant"].startswith("kernelkit")
                                                          else "#2a7" for r in ok])
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:.1f}k", va="center", fontsize=8)
        ax.set_xlabel("k tokens/s")
        ax.set_title(title)
        ax.invert_yaxis()
    fig.suptitle(f"{meta.get('example') or meta.get('config')}: {meta['layers']} layers, {meta['batch']}x{meta['seq']} "
                 f"tokens, bf16, {meta.get('gpu', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_rows(rows, console) -> None:
    from rich.table import Table

    table = Table(title="one training step and one prefill, each variant in its own process")
    for col in ("variant", "step ms", "x eager", "train tok/s", "peak GiB", "prefill ms", "x eager", "loss",
                "|dloss|/loss", "worst grad (rel. err)"):
        table.add_column(col, justify="left" if col in ("variant", "worst grad (rel. err)") else "right")
    for r in rows:
        if "step_ms" not in r:
            table.add_row(r["variant"], r.get("skipped") or f"[red]{(r.get('error') or '')[-200:]}[/]")
            continue
        worst = r.get("grad_worst")
        table.add_row(r["variant"], f"{r['step_ms']:.1f}", f"{r.get('x_eager_train', 1):.2f}",
                      f"{r['train_tokens_per_s']:.0f}", f"{r['peak_gib']:.1f}", f"{r['prefill_ms']:.1f}",
                      f"{r.get('x_eager_prefill', 1):.2f}", f"{r['loss']:.5f}", f"{r.get('loss_rel_diff', 0):.1e}",
                      f"{worst['param']} ({worst['rel_err']:.2e})" if worst else "-")
    console.print(table)
    for r in rows:
        k = r.get("kernels")
        if k:
            fams = ", ".join(f"{f} {ms:.1f}" for f, ms in k["families_ms"].items())
            console.print(f"{r['variant']}: GPU busy {k['busy_ms']:.1f} of {k['profiled_wall_ms']:.1f} ms per profiled "
                          f"step, {k['kernels_per_step']:.0f} kernels: {fams}", soft_wrap=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--example", default=None)
    p.add_argument("--config", default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", required=True)
    p.add_argument("--save-grads", default=None)
    p.add_argument("--ref-grads", default=None)
    p.add_argument("--kernels", action="store_true", help="add the GPU kernel time of two steps by family")
    a = p.parse_args(argv)
    config = build_config(a.example, a.config, a.layers, a.seq)
    row = run_variant(a.variant, config, a.batch, a.seq, a.steps, a.save_grads, a.ref_grads, a.kernels)
    Path(a.json).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
