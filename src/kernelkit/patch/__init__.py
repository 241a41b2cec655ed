"""Use it: swap kernelkit ops into one Hugging Face model instance, and back.

    report = kernelkit.patch(model)      # RMSNorm, SwiGLU/GeGLU, RoPE, attention, fused linear CE, MoE experts
    print(report)                        # what was replaced, what was left alone, fallbacks so far
    kernelkit.unpatch(model)             # the model as it was

One table-driven patcher (`families.FAMILIES`, one row per model family) serves every family. It patches
the instance, never its class: another model of the same class in the process keeps its code.
- RMSNorms and gated MLPs get a bound `forward` on the instance (`modules.py`); parameters stay where
  they are, so the state_dict is unchanged, shared, never copied.
- Decoder layers whose forward is the plain pre-norm sequence get a bound `forward` that runs the
  post-attention residual add inside the RMSNorm's pass (`decoder.py`, with the norms' switch).
- Attention modules get a bound `forward`: the class's own function with the module-level rope function
  swapped for kernelkit's (`modules.with_globals`); the rotary module still computes cos/sin, so every
  rope scaling (Llama 3, YaRN, Phi-3's long rope) works unchanged.
- Attention runs through `transformers.AttentionInterface` under the name "kernelkit" (`attention.py`).
  The attention implementation is read from the config, which instances built from one config object
  share: the patched instance gets a private deep copy of its config naming "kernelkit" (unpatch puts
  the original object back; edits made to `model.config` while patched are dropped with the copy).
- The causal LM's forward takes the fused linear cross-entropy when called with labels (`loss.py`).
- The experts module of each sparse MoE block (Mixtral, Qwen3-MoE) gets a bound `forward` running
  kernelkit's grouped-GEMM experts (`ops.moe.moe_experts`); the block's own forward (Mixtral's router
  jitter included) and its router run unchanged, so the routing and the router logits recorded for the
  aux loss are computed by Hugging Face's code.

Calls kernelkit cannot compute exactly run the original code and are counted in the report. On a
machine without CUDA, outside the Triton interpreter (TRITON_INTERPRET=1), `patch` still patches, and
every call runs the original code (counted as fallbacks), as `kernelkit.nn.RMSNorm` does.
"""

from __future__ import annotations

import copy
import inspect
import types

import torch

from .. import switches
from ..ops.fp8_linear import QuantizedWeight, SharedInputs
from ..ops.registry import get
from .families import ACTIVATIONS, FAMILIES, Family, find_family
from .report import PatchReport, Replacement

class _MISSING:  # "no instance attribute": a class, so that a deep copy of a patched model keeps it
    pass


class _Undo:
    """Attributes set on objects, and what was there before, restored in reverse order."""

    def __init__(self):
        self.log: list[tuple[object, str, object]] = []

    def set(self, obj, name: str, value) -> None:
        self.log.append((obj, name, vars(obj).get(name, _MISSING)))
        setattr(obj, name, value)

    def restore(self) -> None:
        for obj, name, old in reversed(self.log):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self.log.clear()


class _Patched:
    def __init__(self, report: PatchReport, undo: _Undo):
        self.report, self.undo = report, undo


def _instances(model, class_names) -> dict[str, list[torch.nn.Module]]:
    found: dict[str, list[torch.nn.Module]] = {}
    for m in model.modules():
        if type(m).__name__ in class_names:
            found.setdefault(type(m).__name__, []).append(m)
    return found


def _bind(undo: _Undo, module, forward, settings) -> None:
    undo.set(module, "_kernelkit", settings)
    undo.set(module, "forward", types.MethodType(forward, module))


def _patch_norms(model, fam: Family, report, undo, modes) -> None:
    from .modules import norm_forward, norm_settings, norm_site

    names = set(fam.norms) | {n for n in get("rms_norm").replaces if "::" not in n}
    op = f"kernelkit.rms_norm(offset={fam.norm_offset:g})"
    for cls, mods in _instances(model, names).items():
        done, site = 0, norm_site(mods[0], modes, report)
        for m in mods:
            settings = norm_settings(m, fam.norm_offset, report)
            if isinstance(settings, str) or "forward" in vars(m):
                report.skip(cls, settings if isinstance(settings, str) else "forward already replaced")
                continue
            settings.token = site.token
            _bind(undo, m, norm_forward, settings)
            done += 1
        report.add("rms_norm", cls, op, done)


def _patch_mlps(model, fam: Family, report, undo, modes) -> None:
    from .modules import mlp_forward, mlp_settings, mlp_site

    for cls, mods in _instances(model, fam.mlps).items():
        done, op, site = 0, "", mlp_site(mods[0], modes, report)
        for m in mods:
            settings = mlp_settings(m, fam, ACTIVATIONS, report)
            if isinstance(settings, str) or "forward" in vars(m):
                report.skip(cls, settings if isinstance(settings, str) else "forward already replaced")
                continue
            settings.token = site.token
            _bind(undo, m, mlp_forward, settings)
            op = settings.describe()
            done += 1
        report.add("mlp", cls, op, done)


def _patch_moe(model, fam: Family, report, undo, modes) -> None:
    from .modules import experts_forward, experts_settings, experts_site

    for cls, blocks in _instances(model, fam.moe_blocks).items():
        done, site = 0, None
        for block in blocks:
            settings = experts_settings(block, ACTIVATIONS, report)
            if isinstance(settings, str):
                report.skip(cls, settings)
                continue
            site = site or experts_site(block.experts, modes, report)
            settings.token = site.token
            _bind(undo, block.experts, experts_forward, settings)
            done += 1
        report.add("moe", f"{cls}.experts", "kernelkit moe_experts (grouped GEMM, SwiGLU); HF router", done)


def _patch_rope(model, fam: Family, report, undo, modes) -> None:
    from .modules import rope_function, rope_signature_ok, with_globals

    for cls, mods in _instances(model, fam.attentions).items():
        fn = type(mods[0]).forward
        original = getattr(fn, "__globals__", {}).get(fam.rope_function)
        if inspect.unwrap(fn) is not fn or fam.rope_function not in fn.__code__.co_names \
                or original is None or not rope_signature_ok(original):
            report.skip(cls, f"forward does not call {fam.rope_function}(q, k, cos, sin, unsqueeze_dim) directly")
            continue
        forward = with_globals(fn, {fam.rope_function: rope_function(original, report, modes)})
        done = 0
        for m in mods:
            if "forward" in vars(m):
                report.skip(cls, "forward already replaced")
                continue
            undo.set(m, "forward", types.MethodType(forward, m))
            done += 1
        report.add("rope", cls, f"kernelkit.rope in place of {fam.rope_function}", done)


def _patch_attention(model, fam: Family, report, undo, modes) -> None:
    from . import attention

    found = _instances(model, fam.attentions)
    if not found:
        return
    config = model.config
    if getattr(config, "sub_configs", None) and any(getattr(config, k, None) is not None for k in config.sub_configs):
        report.skip("attention", "composite (multimodal) config: attention left to its sub-models' settings")
        return
    attention.register()
    original = getattr(config, "_attn_implementation", None)
    private = copy.deepcopy(config)
    private._attn_implementation = attention.NAME
    for m in model.modules():
        if getattr(m, "config", None) is config:
            undo.set(m, "config", private)
    for cls, mods in found.items():
        site = attention.site(mods[0], modes, report, original)
        for m in mods:
            undo.set(m, "_kernelkit", attention.AttentionSettings(report, original, site.token))
        report.add("attention", cls, f'kernelkit attention (AttentionInterface "{attention.NAME}")', len(mods))
    # Only where the attention forward passes the softcap on (Gemma 2 does; Gemma 3 keeps it in its config and
    # never applies it, nor does kernelkit then).
    passes_softcap = any("attn_logit_softcapping" in inspect.unwrap(type(mods[0]).forward).__code__.co_names
                         for mods in found.values())
    if getattr(config, "attn_logit_softcapping", None) and original != "eager" and passes_softcap:
        report.note(f"attention logit softcap {config.attn_logit_softcapping:g} applied: the model's "
                    f"{original!r} attention skipped it, its eager attention applies it (kernelkit computes the "
                    f"model as trained)")


def _patch_decoders(model, fam: Family, report, undo, modes, precision: str = "bf16") -> None:
    from .decoder import patch_decoders

    if precision == "fp8":
        report.skip("decoder layers (residual add into the norm)",
                    "precision='fp8': the post-attention norm writes gate/up's fp8 rows in its pass instead")
    elif switches.on("KERNELKIT_PATCH_FUSE_ADD"):
        patch_decoders(model, report, undo, types.MethodType)


def _patch_loss(model, fam: Family, report, undo, modes, precision: str = "bf16") -> None:
    from .loss import causal_lm_forward, loss_settings, loss_site

    settings = loss_settings(model, fam, report)
    if isinstance(settings, str):
        report.skip(f"{type(model).__name__} loss", settings)
        return
    settings.token = loss_site(model, modes, report).token
    settings.precision = precision
    _bind(undo, model, causal_lm_forward, settings)
    report.add("cross_entropy", type(model).__name__, "linear_cross_entropy on hidden states (labels, training)"
               + (", logits and dhidden GEMMs in fp8" if precision == "fp8" else ""), 1)


PRECISIONS = ("bf16", "fp8")


def _patch_fp8(model, report, undo, keep: bool, lm_head: bool, modes: dict) -> None:
    """Every plain nn.Linear inside the decoder layers runs `ops.fp8_linear` where measured faster (modes["fp8"]:
    "auto") or everywhere ("kernelkit"); the embeddings keep their dtype, and the LM head too unless the fused loss
    runs it in fp8 (`lm_head`). Unless KERNELKIT_FP8_FUSE=0, Linears reading one tensor (q/k/v, gate/up) share its
    quantizations (`SharedInputs`), and the layers' patched RMSNorms write their output's fp8 rows in their pass."""
    from .modules import Fp8Producer, Fp8Settings, fp8_linear_forward, fp8_site

    layers = getattr(getattr(model, "model", model), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        report.skip("precision='fp8'", "no decoder layers at model.model.layers")
        return
    shared = SharedInputs() if switches.on("KERNELKIT_FP8_FUSE") else None
    done, fused, token = 0, 0, fp8_site(modes, report).token
    for layer in layers:
        for m in layer.modules():
            if type(m) is torch.nn.Linear and "forward" not in vars(m):
                _bind(undo, m, fp8_linear_forward,
                      Fp8Settings(report, QuantizedWeight() if keep else None, token, shared))
                done += 1
            elif shared is not None and isinstance(vars(m).get("_kernelkit"), Fp8Producer):
                if m._kernelkit.can_write_fp8():  # a patched RMSNorm, or a patched MLP's SwiGLU
                    undo.set(m._kernelkit, "fp8_shared", shared)
                    fused += 1
    report.add("fp8", "nn.Linear in decoder layers", "kernelkit.fp8_linear (e4m3, rowwise scales, fwd + both bwd GEMMs)",
               done)
    if done:
        head = ("the LM head's logits and dhidden GEMMs run in fp8 inside the fused loss (its dweight GEMM in the "
                "model's dtype)" if lm_head else "the LM head stays in the model's dtype")
        report.note("precision='fp8': the decoder layers' Linear GEMMs run in fp8 (bf16/fp16 masters and gradients); "
                    f"the embeddings stay in the model's dtype; {head}")
        report.note("precision='fp8': " + ("Linears reading one input quantize it once (rows and columns), and "
                                           f"{fused} RMSNorm(s) and SwiGLU(s) in the layers write their output's fp8 "
                                           "rows in their pass" if shared is not None else
                                           "KERNELKIT_FP8_FUSE=0: each Linear quantizes its own input"))


def patch(model: torch.nn.Module, *, rms_norm=True, mlp=True, rope=True, attention=True, cross_entropy=True,
          moe=True, swiglu=None, precision: str = "bf16", keep_quantized_weights: bool = False,
          fp8_lm_head: bool = True) -> PatchReport:
    """Run kernelkit's kernels inside this Hugging Face model instance; returns what was replaced.

    Switches: `rms_norm`, `mlp` (SwiGLU / GeGLU; `swiglu` is an alias), `rope`, `attention`,
    `cross_entropy` (the fused linear cross-entropy when called with labels in training mode, returning
    logits=None), `moe` (the experts of sparse MoE blocks). Each takes:
    - True or "auto" (the default): kernelkit runs only where it is measured faster than what the model
      ran before, per shape, dtype and GPU (the first call at a new shape times both; `patch.choose`);
    - "kernelkit": kernelkit at every shape, unmeasured;
    - False: the switch is off (the model's own code everywhere).
    `precision="fp8"` also runs the nn.Linear modules of the decoder layers in fp8 (forward and both backward GEMMs,
    e4m3 with rowwise scales, `kernelkit.ops.fp8_linear`) at every shape where fp8 is measured faster than the
    Linear's own GEMM (a decision per tokens/in/out shape, as the switches' "auto"; KERNELKIT_PATCH_CHOICE=kernelkit
    forces fp8 everywhere); a call fp8 cannot take (no fp8 tensor cores, dims not multiples of 16, fp32) stays in
    its dtype, counted in the report. "bf16" (the default) leaves them.
    With fp8 the fused loss (`cross_entropy`) also runs the LM head's logits and dhidden GEMMs in fp8 (its
    dweight GEMM stays in the model's dtype); `fp8_lm_head=False` keeps the whole LM head in the model's dtype.
    `keep_quantized_weights=True` (with fp8) keeps each weight's fp8 copies until the weight changes (an
    optimizer step): with gradient accumulation they are made once per step, at one byte per weight element each.
    The report's `choices` say, per switch and shape, which path runs and the measured ratio. Families:
    see `kernelkit.patch.families.FAMILIES`. Raises ValueError for a model of no known family, one
    already patched, or a switch value not in the list above.
    """
    from .choose import mode

    if precision not in PRECISIONS:
        raise ValueError(f"kernelkit.patch: precision={precision!r} is not one of {', '.join(map(repr, PRECISIONS))}")
    if swiglu is not None:
        mlp = swiglu
    modes = {kind: mode(name, value) for kind, name, value in (
        ("rms_norm", "rms_norm", rms_norm), ("mlp", "mlp" if swiglu is None else "swiglu", mlp),
        ("rope", "rope", rope), ("attention", "attention", attention),
        ("cross_entropy", "cross_entropy", cross_entropy), ("moe", "moe", moe))}
    if isinstance(vars(model).get("_kernelkit_patch"), _Patched):
        raise ValueError("this model is patched already; call kernelkit.unpatch(model) first")
    fam = find_family(model)
    report, undo = PatchReport(model=type(model).__name__, family=fam.name), _Undo()
    if not isinstance(fp8_lm_head, bool):
        raise ValueError(f"kernelkit.patch: fp8_lm_head={fp8_lm_head!r} is not True or False")
    lm_precision = "fp8" if precision == "fp8" and fp8_lm_head else "bf16"
    steps = {"rms_norm": _patch_norms, "mlp": _patch_mlps, "moe": _patch_moe, "rope": _patch_rope,
             "attention": _patch_attention, "decoder": lambda *a: _patch_decoders(*a, precision=precision),
             "cross_entropy": lambda *a: _patch_loss(*a, precision=lm_precision)}
    try:
        for kind, step in steps.items():
            if modes["rms_norm" if kind == "decoder" else kind] is not None:  # the fused add goes with the norms
                step(model, fam, report, undo, modes)
        if precision == "fp8":
            _patch_fp8(model, report, undo, keep_quantized_weights,
                       lm_precision == "fp8" and modes["cross_entropy"] is not None, {"fp8": mode("precision", True)})
    except BaseException:
        undo.restore()
        raise
    undo.set(model, "_kernelkit_patch", _Patched(report, undo))
    return report


def unpatch(model: torch.nn.Module) -> PatchReport:
    """Put back everything `patch` changed on this instance; returns the report of that patch."""
    state = vars(model).get("_kernelkit_patch")
    if not isinstance(state, _Patched):
        raise ValueError("this model is not patched by kernelkit")
    state.undo.restore()
    return state.report


__all__ = ["patch", "unpatch", "PatchReport", "Replacement", "Family", "FAMILIES"]
