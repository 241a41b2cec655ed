"""`kernelkit bench model --nproc N`: one FSDP2 training step (AdamW) of a Llama-3 decoder on N GPUs of one host,
per variant, side by side (issue 31). One process per GPU under torchrun; every variant runs in the same group,
one after the other, each freed before the next.

Variants — the same model-level changes as single-GPU `bench model` (model_bench.apply_variant), under
`fully_shard` per decoder layer, then the root:
    eager              Hugging Face's Llama, SDPA attention
    compile            + torch.compile per decoder layer (as torchtitan compiles: each block, before sharding)
    liger              Liger-Kernel's patch (when liger_kernel imports)
    kernelkit          kernelkit.patch(model)
    kernelkit+compile  kernelkit.patch, then torch.compile per decoder layer
    kernelkit-fp8      kernelkit.patch(model, precision="fp8")
    torchtitan         torchtitan's own Llama-3 `Transformer` and its own recipe (`apply_compile` per block,
                       `apply_fsdp`: fp32 master weights, MixedPrecisionPolicy(param bf16, reduce fp32))
The Hugging Face variants keep bf16 parameters (AdamW's state in bf16 too: 8 bytes per parameter, sharded);
torchtitan keeps fp32 masters (16 bytes per parameter). All start from the same weights (each parameter drawn
from a seed of its Hugging Face name, whole, then sharded) and train on the same tokens, so the first losses agree.

MFU = model FLOPs per token x tokens/s per GPU / the GPU's dense bf16 peak (kernelkit.hw.specs). Model FLOPs per
token: 6 x N (parameters less the input embedding; the LM head counts) + 12 x layers x seq x (heads x head_dim),
the PaLM / torchtitan convention: attention counted as if not causal (causal work is half that term).

    torchrun --nproc_per_node=4 -m kernelkit.testing.fsdp_bench --layers 32 --out bench.json
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch

from ..hw import specs
from .distributed import decoder_layers, device_mesh, require_process_group
from .model_bench import apply_variant, build_config, unavailable

VARIANTS = ("eager", "compile", "liger", "kernelkit", "kernelkit+compile", "kernelkit-fp8", "torchtitan")
# the single-GPU bench's name for the same model-level change (model_bench.apply_variant)
HF_VARIANT = {"eager": "eager", "compile": "eager", "liger": "liger", "kernelkit": "kernelkit",
              "kernelkit+compile": "kernelkit", "kernelkit-fp8": "kernelkit-fp8"}
# sharded bytes per parameter: param + grad + AdamW's two moments, in bf16 (Hugging Face variants) or fp32
STATE_BYTES = {"torchtitan": 16}
# below this share of a GPU's memory left for activations after the sharded state, a variant is not started
ACTIVATION_SHARE = 0.25


def parse_variants(text: str | None) -> tuple:
    """`--variants a,b`: in the order given, unknown names refused by name; None or "all": every variant."""
    if not text or text == "all":
        return VARIANTS
    chosen = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    bad = [v for v in chosen if v not in VARIANTS]
    if bad:
        raise ValueError(f"unknown variant(s) {bad}; known: {', '.join(VARIANTS)}")
    return chosen


# --- the arithmetic: model FLOPs, MFU, memory, scaling efficiency ---

def non_embedding_params(config) -> int:
    """Parameters of a Llama-like decoder less the input embedding: attention, MLP and norms of each layer, the
    final norm and the LM head (a GEMM every token pays; with tied embeddings the one matrix is counted here)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size + 2 * h
    return layers * per_layer + h + config.vocab_size * h


def total_params(config) -> int:
    tied = getattr(config, "tie_word_embeddings", False)
    return non_embedding_params(config) + (0 if tied else config.vocab_size * config.hidden_size)


def flops_per_token(config, seq: int) -> float:
    """6 N + 12 L s (heads x head_dim): forward and backward, attention's QK^T and PV counted in full."""
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 6.0 * non_embedding_params(config) + 12.0 * config.num_hidden_layers * seq * config.num_attention_heads * hd


def mfu(tokens_per_s_per_gpu: float, flops_token: float, peak_tflops: float | None) -> float | None:
    return None if not peak_tflops else tokens_per_s_per_gpu * flops_token / (peak_tflops * 1e12)


def peak_bf16_tflops(device_name: str) -> float | None:
    spec = specs.lookup(device_name)
    return spec.tflops.get("bf16") if spec else None


def too_big(config, variant: str, world: int, gpu_gib: float) -> str | None:
    """Why `variant` would not leave room for activations on `world` GPUs of `gpu_gib` GiB, or None: the sharded
    parameters, gradients and AdamW moments alone (STATE_BYTES per parameter / world) past 75% of the GPU."""
    need = total_params(config) * STATE_BYTES.get(variant, 8) / world / 2**30
    if need > (1 - ACTIVATION_SHARE) * gpu_gib:
        return (f"does not fit: {STATE_BYTES.get(variant, 8)} bytes per parameter (weights, gradients, AdamW) x "
                f"{total_params(config) / 1e9:.2f} B parameters / {world} GPU(s) = {need:.1f} GiB per rank, over "
                f"{100 * (1 - ACTIVATION_SHARE):.0f}% of {gpu_gib:.0f} GiB; run it on more GPUs or fewer layers")
    return None


def add_scaling(rows: list[dict]) -> list[dict]:
    """tokens/s in total, and the scaling efficiency: tokens/s per GPU over that of the same variant and config on
    the fewest GPUs that ran it (`scaling_base_gpus`: 1 when a one-GPU run exists, else e.g. 2)."""
    def key(r):
        return r["variant"], r["layers"], r["seq"], r["batch_per_gpu"]

    ran = [r for r in rows if "tokens_per_s_per_gpu" in r]
    base, worlds = {}, {}
    for r in sorted(ran, key=lambda r: r["world_size"]):
        base.setdefault(key(r), r)
        worlds.setdefault(key(r), set()).add(r["world_size"])
    for r in ran:
        b = base[key(r)]
        r["tokens_per_s_total"] = round(r["tokens_per_s_per_gpu"] * r["world_size"], 1)
        alone = len(worlds[key(r)]) == 1  # nothing to set it against
        r["scaling_base_gpus"] = None if alone else b["world_size"]
        r["scaling_efficiency"] = None if alone else round(r["tokens_per_s_per_gpu"] / b["tokens_per_s_per_gpu"], 3)
    return rows


# --- the same weights for every variant ---

def _draw(name: str, shape, seed: int, device) -> torch.Tensor:
    """The whole tensor of parameter `name` (its Hugging Face name), the same on every rank and in every variant:
    ones for a norm, N(0, 0.02) otherwise, in fp32 from a generator seeded by the name."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device)
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g, device=device) * 0.02


def _load_shard(param, full: torch.Tensor) -> None:
    """Copy this rank's piece of `full` into a parameter that fully_shard split along dim 0 (or a plain one)."""
    local = param.to_local() if hasattr(param, "to_local") else param
    if local.shape != full.shape:
        dist = require_process_group("fsdp_bench")
        full = full.chunk(dist.get_world_size(), 0)[dist.get_rank()]  # FSDP2's Shard(0): torch.chunk's pieces
    local.copy_(full.to(local.dtype))


def init_weights(named_params, seed: int, device, hf_name=lambda n: (n, None)) -> None:
    """Every parameter from `_draw` of its Hugging Face name. `hf_name(name) -> (hf name, transform)` maps another
    model's names (torchtitan's) and says how to turn the Hugging Face tensor into its layout."""
    with torch.no_grad():
        for name, p in named_params:
            clean = name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
            hf, transform = hf_name(clean)
            full = _draw(hf, tuple(p.shape), seed, device).to(torch.bfloat16).float()  # bf16 values: fp32 masters
            _load_shard(p, transform(full) if transform else full)                   # compute what bf16 ones do


# --- torchtitan's recipe ---

TORCHTITAN = "0.2.2"


def torchtitan_modules():
    """torchtitan's Llama-3 model and parallelize modules, or ImportError with the reason. The package's
    `models/llama3/__init__.py` registers the whole training spec (data loader, validator: torchdata, datasets,
    which the GPU image lacks), so the package is entered without running that file; the model and parallelize
    modules are torchtitan's own, unchanged."""
    name = "torchtitan.models.llama3"
    if name not in sys.modules:
        importlib.import_module("torchtitan.models")
        spec = importlib.util.find_spec(name)
        if spec is None:
            raise ImportError("torchtitan.models.llama3 not found")
        sys.modules[name] = importlib.util.module_from_spec(spec)  # the package, its __init__ not run
    parallelize = importlib.import_module(name + ".infra.parallelize")
    model = importlib.import_module(name + ".model.model")
    args = importlib.import_module(name + ".model.args")
    loss = importlib.import_module("torchtitan.components.loss")
    config = importlib.import_module("torchtitan.config.job_config")
    return parallelize, model, args, loss, config


def torchtitan_unavailable() -> str | None:
    try:
        torchtitan_modules()
    except Exception as e:  # noqa: BLE001 - any import failure is the reason the row gives
        return (f"torchtitan's llama3 does not import ({type(e).__name__}: {e}); carry torchtitan=={TORCHTITAN} "
                f"and tyro's wheels (scripts/multi_gpu_check.sh, WHEELS)")
    return None


def _meta_to_hf(config):
    """torchtitan name -> (Hugging Face name, layout change). torchtitan's rope rotates interleaved pairs, Hugging
    Face's rotates halves: the same attention needs wq/wk's rows in Meta's order (HF's conversion, inverted)."""
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def unpermute(heads):
        return lambda w: w.view(heads, 2, hd // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)

    fixed = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    inner = {"attention.wq": ("self_attn.q_proj", unpermute(config.num_attention_heads)),
             "attention.wk": ("self_attn.k_proj", unpermute(config.num_key_value_heads)),
             "attention.wv": ("self_attn.v_proj", None), "attention.wo": ("self_attn.o_proj", None),
             "feed_forward.w1": ("mlp.gate_proj", None), "feed_forward.w2": ("mlp.down_proj", None),
             "feed_forward.w3": ("mlp.up_proj", None), "attention_norm": ("input_layernorm", None),
             "ffn_norm": ("post_attention_layernorm", None)}

    def hf_name(name):
        if name in fixed:
            return fixed[name], None
        _, i, rest = name.split(".", 2)  # layers.<i>.<module>.weight
        hf, transform = inner[rest.rsplit(".", 1)[0]]
        return f"model.layers.{i}.{hf}.weight", transform
    return hf_name


def _torchtitan_model(config, seq: int, mesh, device, seed: int, ac: str):
    """torchtitan's Transformer at `config`'s shapes, its parallelize steps in parallelize_llama's order (AC,
    per-block compile, FSDP2 with fp32 masters and bf16 compute), materialized on the shards. Returns
    (model, loss_fn(ids) -> mean loss, the loss scaled for backward)."""
    parallelize, tt_model, tt_args, tt_loss, tt_config = torchtitan_modules()
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if hd * config.num_attention_heads != config.hidden_size:
        raise ValueError("torchtitan's Llama-3 takes head_dim = hidden / heads")
    args = tt_args.TransformerModelArgs(
        dim=config.hidden_size, n_layers=config.num_hidden_layers, n_heads=config.num_attention_heads,
        n_kv_heads=config.num_key_value_heads, vocab_size=config.vocab_size, norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_parameters["rope_theta"], max_seq_len=seq,
        # Hugging Face's config has no Llama-3.1 rope scaling; a factor of 1 turns torchtitan's off
        rope_scaling_args=tt_args.RoPEScalingArgs(scaling_factor=1.0))
    # torchtitan derives the MLP width: int(multiplier * int(8 dim / 3)), rounded up to multiple_of; +0.5 makes
    # int() land on the config's width (Llama-3-8B's own 1.3 and 1024 give 14336 too)
    args.multiple_of = 1
    args.ffn_dim_multiplier = (config.intermediate_size + 0.5) / int(8 * config.hidden_size / 3)
    with torch.device("meta"):
        model = tt_model.Transformer(args)
    ffn = model.layers["0"].feed_forward.w1.out_features
    if ffn != config.intermediate_size:
        raise ValueError(f"torchtitan built an MLP of {ffn}, the config has {config.intermediate_size}")
    if ac != "none":
        parallelize.apply_ac(model, tt_config.ActivationCheckpoint(mode=ac), model_compile_enabled=True,
                             op_sac_save_list=parallelize._op_sac_save_list, base_folder="/tmp")
    if device.type == "cuda":
        parallelize.apply_compile(model, tt_config.Compile(enable=True, components=["model"]))
    parallelize.apply_fsdp(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, pp_enabled=False)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)  # its rope table; the weights are then the shared ones
    init_weights(model.named_parameters(), seed, device, _meta_to_hf(config))
    world = mesh.size()

    def loss_fn(ids):
        # Hugging Face's shift: position t predicts token t+1, the last position has no label
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], tt_loss.IGNORE_INDEX)], 1)
        total = tt_loss.cross_entropy_loss(model(ids), labels)
        tokens = ids.shape[0] * (ids.shape[1] - 1)
        # apply_fsdp turns off FSDP's gradient division: torchtitan divides by the global token count itself
        return total / tokens, total / (tokens * world)
    return model, loss_fn


# --- one variant, every rank ---

def _hf_model(config, variant: str, mesh, device, seed: int):
    """Hugging Face's Llama on the meta device, the variant's change, compile per layer, fully_shard per layer
    and the root, then materialized shard by shard (bf16)."""
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).train()
    report = apply_variant(model, HF_VARIANT[variant])
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        if variant.endswith("compile"):
            layer = layers[i] = torch.compile(layer)  # fully_shard's hooks stay outside the compiled forward
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    for m in model.modules():  # to_empty emptied the rope's inverse frequencies (a non-persistent buffer)
        if hasattr(m, "inv_freq") and hasattr(m, "original_inv_freq"):
            fresh = type(m)(model.config)
            m.inv_freq.copy_(fresh.inv_freq)
            m.original_inv_freq.copy_(fresh.original_inv_freq)
    init_weights(model.named_parameters(), seed, device)

    def loss_fn(ids):
        loss = model(input_ids=ids, labels=ids).loss
        return loss, loss  # FSDP2 averages the gradients over ranks
    return model, loss_fn, report


def _timed_steps(step, steps: int, warmup: int, device) -> tuple[list[float], list[float]]:
    """(losses of every step, milliseconds of each timed step)."""
    losses, times = [], []
    for i in range(warmup + steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            losses.append(step())
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            losses.append(step())
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    return losses, times


def bench_variant(variant: str, config, batch: int, seq: int, steps: int, warmup: int, seed: int = 0,
                  ac: str = "none") -> dict:
    """One row: this variant's training steps on every rank of the group; the same row on every rank."""
    dist = require_process_group("kernelkit.testing.fsdp_bench")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    row: dict = {"variant": variant, "layers": config.num_hidden_layers, "seq": seq, "batch_per_gpu": batch,
                 "world_size": world, "params_b": round(total_params(config) / 1e9, 3)}
    reason = torchtitan_unavailable() if variant == "torchtitan" else unavailable(HF_VARIANT[variant])
    if reason is None and device.type == "cuda":
        reason = too_big(config, variant, world, torch.cuda.get_device_properties(device).total_memory / 2**30)
    if reason:
        return {**row, "skipped": reason}
    mesh = device_mesh(device.type)
    g = torch.Generator(device=device).manual_seed(seed + 1 + rank)  # data parallel: each rank its own tokens
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device, generator=g)
    t0 = time.perf_counter()
    if variant == "torchtitan":
        model, loss_fn = _torchtitan_model(config, seq, mesh, device, seed, ac)
        report = None
        row["recipe"] = (f"torchtitan {_torchtitan_version()}: apply_compile per block, apply_fsdp "
                         f"(fp32 masters, bf16 params, fp32 reduce), AC {ac}")
    else:
        model, loss_fn, report = _hf_model(config, variant, mesh, device, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step():
        loss, scaled = loss_fn(ids)
        scaled.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = _timed_steps(step, steps, warmup, device)
    ms = statistics.median(times)
    stats = torch.tensor([ms, torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0],
                         dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(stats) for _ in range(world)]
    dist.all_gather(gathered, stats)
    step_ms = max(float(s[0]) for s in gathered)  # the group steps together: the slowest rank's median
    row.update(step_ms=round(step_ms, 2), step_ms_rank0=[round(t, 2) for t in times],
               tokens_per_s_per_gpu=round(batch * seq / step_ms * 1e3, 1),
               first_loss=losses[0], last_loss=losses[-1], setup_and_steps_s=round(time.perf_counter() - t0, 1))
    if device.type == "cuda":
        row["peak_gib_per_rank"] = [round(float(s[1]), 3) for s in gathered]
        row["peak_gib_max"] = max(row["peak_gib_per_rank"])
        peak = peak_bf16_tflops(torch.cuda.get_device_name(device))
        row["mfu"] = None if peak is None else round(mfu(row["tokens_per_s_per_gpu"], flops_per_token(config, seq),
                                                         peak), 4)
    if report is not None:
        row["patch"] = str(report)
    del model, opt, loss_fn, report
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _torchtitan_version() -> str:
    try:
        from importlib.metadata import version

        return version("torchtitan")
    except Exception:  # noqa: BLE001
        return "?"


def _environment(device_type: str) -> dict:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0]}
    if device_type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(), gpus=torch.cuda.device_count(), cuda=torch.version.cuda,
                   nccl=".".join(map(str, torch.cuda.nccl.version())))
    for pkg in ("triton", "liger_kernel", "torchtitan", "torchao"):
        try:
            from importlib.metadata import version

            env[pkg] = version(pkg)
        except Exception:  # noqa: BLE001 - not installed
            pass
    return env


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="FSDP2 training step per variant, Llama-3-8B shapes, one process per GPU")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--config", default=None, help="a Hugging Face config.json instead of Llama-3-8B's shapes")
    ap.add_argument("--batch", type=int, default=1, help="sequences per GPU")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", default="all", help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--torchtitan-ac", default="none", choices=("none", "selective", "full"))
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    variants = parse_variants(a.variants)
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        config = build_config(None, a.config, a.layers, a.seq) if a.config else build_config("llama", None, a.layers,
                                                                                             a.seq)
        rows = []
        for v in variants:
            try:
                rows.append(bench_variant(v, config, a.batch, a.seq, a.steps, a.warmup, ac=a.torchtitan_ac))
            except torch.cuda.OutOfMemoryError as e:  # every rank runs out alike: the group goes on to the next
                rows.append({"variant": v, "layers": config.num_hidden_layers, "world_size": dist.get_world_size(),
                             "error": f"out of memory: {str(e)[:300]}"})
            gc.collect()  # here, not in the handler: its traceback still holds the variant's model
            if cuda:
                torch.cuda.empty_cache()
            if dist.get_rank() == 0:
                print(json.dumps(rows[-1]), flush=True)
        if dist.get_rank() == 0:
            doc = {"environment": _environment("cuda" if cuda else "cpu"),
                   "flops_per_token": flops_per_token(config, a.seq), "rows": add_scaling(rows)}
            Path(a.out).write_text(json.dumps(doc, indent=1))
    finally:
        dist.destroy_process_group()


def run_nproc(nproc: int, layers: int = 2, batch: int = 1, seq: int = 2048, steps: int = 5, out: Path | None = None,
              progress=None, timeout: float = 1800.0, variants: str = "all", scale_layers: int | None = None) -> dict:
    """`kernelkit bench model --nproc N`: every variant under torchrun on N GPUs of this host and, for the scaling
    efficiency, on one GPU (each a torchrun of its own). `scale_layers`: the one-GPU run (and an N-GPU run to set
    against it) at that many layers, for a model whose `layers` do not fit one GPU; the N-GPU rows at `layers`
    then have no efficiency unless a smaller world ran them too."""
    import subprocess
    import tempfile

    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    have = torch.cuda.device_count()
    if nproc > have:
        raise ValueError(f"nproc={nproc} but this host has {have} CUDA GPU(s)")
    parse_variants(variants)
    runs = [(nproc, layers)] + ([(1, layers)] if not scale_layers else [(1, scale_layers), (nproc, scale_layers)])
    docs, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for n, nl in dict.fromkeys(runs):
            if progress:
                progress(f"FSDP2, {nl} layers on {n} GPU(s), torchrun")
            path = os.path.join(tmp, f"n{n}-l{nl}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                   "-m", "kernelkit.testing.fsdp_bench", "--layers", str(nl), "--batch", str(batch),
                   "--seq", str(seq), "--steps", str(steps), "--variants", variants, "--out", path]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            if proc.returncode != 0 or not os.path.exists(path):
                raise RuntimeError(f"torchrun on {n} GPU(s) failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
            docs.append(json.loads(Path(path).read_text()))
            rows += docs[-1]["rows"]
    result = {"environment": docs[0]["environment"], "nproc": nproc, "rows": add_scaling(rows)}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "model-nproc.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
