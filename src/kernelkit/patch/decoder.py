"""The decoder layer's post-attention residual add, fused into the RMSNorm after it (`kernelkit.add_rms_norm`).

A pre-norm decoder layer (Llama, Mistral, Qwen2/3, Gemma, Mixtral, Qwen3-MoE in transformers 5) runs

    residual = h;  h = input_layernorm(h);  h = self_attn(h)[0];  h = residual + h
    residual = h;  h = post_attention_layernorm(h);  h = mlp(h);  h = residual + h

The middle add and norm read the same rows: `add_rms_norm` does both in one pass (reads the attention output and
the residual once, writes the sum and the normed rows), and its backward adds the residual stream's gradient to
the norm's in the same pass, where autograd would launch an add of its own. Per layer that is one forward launch
and one backward launch fewer, and one read of the rows in each direction.

It needs the layer's own forward to be replaced: the bound forward below runs the same modules in the same order
with the same arguments, taking only the add and the norm together. It is bound only where the class's forward is
that sequence (`matches`: its source, line by line); a layer of any other shape keeps its forward, with the reason
in the report. At call time it fuses only where the patched norm would run kernelkit's kernel anyway (its own
measured choice, `NormSettings.token`) and does not write fp8 rows (precision="fp8": the norm's fp8 rows for
gate/up are worth more than the fused add); otherwise it runs the class's forward. `KERNELKIT_PATCH_FUSE_ADD=0`
turns it off (A/B).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch

from ..ops.rms_norm import add_rms_norm
from .modules import any_dtensor, norm_decides, runs_kernels
from .report import PatchReport

# The forward's statements, in order, with whitespace and the self_attn call's arguments stripped.
_SHAPE = ("residual=hidden_states", "hidden_states=self.input_layernorm(hidden_states)",
          "hidden_states,_=self.self_attn(", "hidden_states=residual+hidden_states", "residual=hidden_states",
          "hidden_states=self.post_attention_layernorm(hidden_states)", "hidden_states=self.mlp(hidden_states)",
          "hidden_states=residual+hidden_states", "returnhidden_states")


def matches(cls) -> str | None:
    """None where `cls.forward` is the pre-norm sequence above (so the fused forward computes what it does), else
    why not."""
    fn = cls.forward
    if inspect.unwrap(fn) is not fn:
        return "decoder layer forward is wrapped"
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return "decoder layer forward has no source to check"
    body = src.split(":\n", 1)[-1] if ") ->" not in src else src.split(") ->", 1)[1].split(":\n", 1)[-1]
    lines = [re.sub(r"\s+", "", ln.split("#", 1)[0]) for ln in body.splitlines()]
    lines = [ln for ln in lines if ln]
    got, i = [], 0
    while i < len(lines):  # fold the self_attn call's argument lines into its first line
        ln = lines[i]
        if ln.startswith("hidden_states,_=self.self_attn("):
            depth = ln.count("(") - ln.count(")")
            while depth > 0 and i + 1 < len(lines):
                i += 1
                depth += lines[i].count("(") - lines[i].count(")")
            ln = "hidden_states,_=self.self_attn("
        got.append(ln)
        i += 1
    if tuple(got) != _SHAPE:
        return "decoder layer forward is not the plain pre-norm sequence (residual + attention, residual + mlp)"
    params = inspect.signature(fn).parameters
    if list(params)[1:2] != ["hidden_states"] or not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return "decoder layer forward does not take hidden_states and **kwargs"
    return None


@dataclass
class DecoderSettings:
    report: PatchReport
    positional: tuple[str, ...]  # the forward's parameters after hidden_states that a caller may pass by position


def decoder_forward(self, *args, **kwargs):
    """Bound to a decoder layer: the class's forward with the post-attention add and norm in one kernel. The layer's
    arguments go to self_attn by name, as the class's forward passes them (no inspect at call time: torch.compile
    traces this)."""
    kk: DecoderSettings = self._kernelkit_decoder
    norm = self.post_attention_layernorm
    if "hidden_states" in kwargs:
        h = kwargs.pop("hidden_states")
    else:
        h, args = args[0], args[1:]
    kwargs.update(zip(kk.positional, args))
    residual = h
    x = self.input_layernorm(h)
    x, _ = self.self_attn(hidden_states=x, **kwargs)
    if not _fuses(norm, x, residual):
        h = residual + x
        return h + self.mlp(norm(h))
    settings = norm._kernelkit
    eps = getattr(norm, settings.eps_attr)
    if eps is None:  # torch.nn.RMSNorm's default
        eps = torch.finfo(x.dtype).eps
    normed, h = add_rms_norm(x, residual, norm.weight, eps=eps, offset=settings.offset)
    return h + self.mlp(normed)


def _fuses(norm, x: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether the norm would run kernelkit's kernel on x + residual (its patched forward's own tests, in the same
    order) and does not write fp8 rows."""
    settings = vars(norm).get("_kernelkit")
    if settings is None or "forward" not in vars(norm) or not hasattr(settings, "eps_attr"):
        return False  # the norm is not kernelkit's (unpatched, or rms_norm=False)
    if type(x) is not torch.Tensor or type(residual) is not torch.Tensor:
        return False  # a subclass (a row-parallel projection's AsyncCollectiveTensor, a DTensor): torch's add first
    if x.shape != residual.shape or x.dtype != residual.dtype or x.dtype != norm.weight.dtype:
        return False
    if _hooked(norm):  # the fused path does not call the norm module: its hooks (a tensor-parallel plan's) would not run
        return False
    if not runs_kernels(x) or any_dtensor(x, residual, norm.weight) or settings.writes_fp8(x):
        return False
    return norm_decides(norm, x)


def _hooked(module: torch.nn.Module) -> bool:
    """Whether calling the module runs hooks (its own or every module's) besides its forward."""
    own = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    every = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
             "_global_backward_pre_hooks")
    return any(getattr(module, a, None) for a in own) or any(getattr(torch.nn.modules.module, a, None) for a in every)


def patch_decoders(model, report: PatchReport, undo, bind) -> None:
    """Bind `decoder_forward` to each decoder layer (model.model.layers) whose class forward `matches`."""
    layers = getattr(getattr(model, "model", model), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        return
    done, skipped = 0, {}
    for layer in layers:
        cls = type(layer)
        why = matches(cls)
        if why is None and "forward" in vars(layer):
            why = "forward already replaced"
        if why is not None:
            skipped[cls.__name__] = why
            continue
        params = list(inspect.signature(cls.forward).parameters.values())
        positional = tuple(p.name for p in params[2:] if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        undo.set(layer, "_kernelkit_decoder", DecoderSettings(report, positional))
        undo.set(layer, "forward", bind(decoder_forward, layer))
        done += 1
    for name, why in skipped.items():
        report.skip(f"{name} (residual add into the norm)", why)
    if done:
        report.add("add_rms_norm", type(layers[0]).__name__,
                   "kernelkit.add_rms_norm: the post-attention residual add in the norm's pass", done)


__all__ = ["patch_decoders", "decoder_forward", "matches"]
