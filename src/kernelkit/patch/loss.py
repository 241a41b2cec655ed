"""The causal LM forward with the loss from `linear_cross_entropy`: the logits are never materialized.

Bound to one model instance when `kernelkit.patch(model, cross_entropy=True)`. A call with `labels` in
training mode runs the decoder (`model.model`), then computes Hugging Face's `ForCausalLMLoss` on the
hidden states with the lm_head's weight: labels padded with `ignore_index` on the right and shifted by
one (or the caller's `shift_labels`), the hidden states of `logits_to_keep`, the model's
`final_logit_softcapping`, 'mean' over non-ignored tokens or 'sum' / `num_items_in_batch`, and for MoE
families the router's load-balancing loss. It returns the model's usual output with ``logits=None``.
Without labels, or in eval mode (where evaluation loops read the logits, as in Liger), or with a custom
`loss_function`, or when the lm_head is no longer a plain nn.Linear at call time (a LoRA wrapper, a
quantized or subclassed Linear, forward hooks: the fused loss reads lm_head.weight and never calls the
module), the model's own forward runs, counted in the report.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..ops.linear_cross_entropy import fp8_unsupported, linear_cross_entropy
from . import choose
from .modules import CPU_REASON, DTENSOR_REASON, any_dtensor, runs_kernels
from .report import PatchReport


@dataclass
class LossSettings:
    names: tuple[str, ...]  # the original forward's positional parameter names, to read args by name
    router_aux_loss: bool
    linear_cross_entropy: Callable
    report: PatchReport
    token: int | None = None  # the choose.Site deciding kernelkit or the original
    precision: str = "bf16"  # "fp8": the logits and dhidden GEMMs in e4m3 (patch(precision="fp8"), fp8_lm_head)


def loss_settings(model, family, report: PatchReport) -> LossSettings | str:
    """Settings for `causal_lm_forward`, or why the model cannot take it."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    if not isinstance(getattr(model, "lm_head", None), torch.nn.Linear) or not hasattr(model, "model"):
        return "not a causal LM with model.model and an nn.Linear lm_head"
    if model.loss_function is not ForCausalLMLoss:
        return "custom loss_function"
    if "forward" in vars(model):
        return "forward already replaced on this instance"
    params = inspect.signature(type(model).forward).parameters.values()
    names = tuple(p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD)[1:]  # without self
    if "labels" not in names:
        return "forward takes no labels"
    return LossSettings(names, family.router_aux_loss, linear_cross_entropy, report)


def causal_lm_forward(self, *args, **kwargs):
    kk: LossSettings = self._kernelkit
    call = dict(zip(kk.names, args))
    call.update(kwargs)
    if call.get("labels") is None or not self.training or len(args) > len(kk.names):
        return type(self).forward(self, *args, **kwargs)
    from transformers.loss.loss_utils import ForCausalLMLoss

    reason = _plain_linear(self.lm_head)
    if reason is None and any_dtensor(self.lm_head.weight):
        reason = DTENSOR_REASON
    if reason is None:
        reason = (CPU_REASON if not runs_kernels(self.lm_head.weight) else
                  "custom loss_function" if self.loss_function is not ForCausalLMLoss else None)
    if reason is not None:
        kk.report.fell_back("cross_entropy", reason)
        return type(self).forward(self, *args, **kwargs)
    precision = _precision(kk, self.lm_head.weight)  # once per call: a fallback to bf16 is counted once
    if kk.token is not None:
        labels, w = call["labels"], self.lm_head.weight
        keep = call.get("logits_to_keep", 0)
        tokens = labels.numel() if not isinstance(keep, int) or keep == 0 else labels.shape[0] * keep
        key = (choose.bucket(tokens), w.shape[1], w.shape[0], choose.dtype_name(w.dtype),
               getattr(self.config, "final_logit_softcapping", None), self.lm_head.bias is not None,
               torch.is_grad_enabled(), precision)
        if not choose.decide(kk.token, key):
            return type(self).forward(self, *args, **kwargs)
    return _fused(self, kk, call, precision)


def _precision(kk: LossSettings, weight: torch.Tensor) -> str:
    """The LM head's precision for this call: kk.precision, or "bf16" where fp8 cannot take it (counted). The
    fused loss runs 'mean' or 'sum', both of which fp8 takes."""
    if kk.precision != "fp8":
        return kk.precision
    why = fp8_unsupported(weight, weight, "mean")
    if why is not None:
        kk.report.fell_back("fp8 lm_head", why)
        return "bf16"
    return "fp8"


def _loss_trial(model, key):
    """The loss from the hidden states both ways: kernelkit's fused one, and the model's (the lm_head's
    logits, softcapped, upcast to fp32, cross-entropy), or None when the model's logits would not fit."""
    tokens, hidden, vocab, dtype, softcap, bias, grad, precision = key
    head = model.lm_head
    dev, dt = head.weight.device, getattr(torch, dtype)
    logits_bytes = tokens * vocab * (dt.itemsize + 4 + 4)  # logits, their fp32 copy, its gradient
    if dev.type == "cuda" and logits_bytes > choose.LOGITS_SHARE * torch.cuda.mem_get_info(dev)[0]:
        return None
    g = choose.generator(dev)
    h = choose.randn((tokens, hidden), dt, dev, g, grad)
    labels = torch.randint(0, vocab, (tokens,), device=dev, generator=g)

    def original():
        logits = F.linear(h, head.weight, head.bias)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return F.cross_entropy(logits.float(), labels)

    wrt = [t for t in (h, head.weight, head.bias) if isinstance(t, torch.Tensor) and t.requires_grad] if grad else []
    return choose.Trial(lambda: linear_cross_entropy(h, head.weight, labels, head.bias, softcap=softcap,
                                                     precision=precision), original, wrt)


def _loss_shape(key) -> str:
    tokens, hidden, vocab, dtype, softcap, bias, grad, precision = key
    return (f"{tokens} tokens x {hidden} -> vocab {vocab} {dtype}{f' softcap {softcap:g}' if softcap else ''} "
            f"{'fwd+bwd' if grad else 'fwd'}{' fp8' if precision == 'fp8' else ''}")


def loss_site(model, modes: dict, report: PatchReport) -> choose.Site:
    return choose.Site("cross_entropy", modes, report, _loss_trial, _loss_shape, "lm_head + cross_entropy", model)


# Set on a forward hook that only watches calls and changes nothing (kernelkit profile's module tracker):
# such a hook on lm_head does not stop the fused loss, else profiling a patched model would measure the
# fallback instead of what the model runs.
OBSERVER = "_kernelkit_observer"


def observer(hook: Callable) -> Callable:
    """`hook`, marked as one that only observes: the fused loss may skip calling lm_head under it."""
    setattr(hook, OBSERVER, True)
    return hook


def _plain_linear(lm_head) -> str | None:
    """None when calling `lm_head` is exactly F.linear(x, lm_head.weight, lm_head.bias) — what the fused
    loss computes without calling it — else why not. Checked on every call: a LoRA adapter, a quantized
    or subclassed Linear, an instance forward, or forward hooks (FSDP's all-gather, weight norm, user hooks)
    put on after the patch must run, so such a call takes the model's own forward (hooks marked `observer`,
which only watch, do not count)."""
    nn = torch.nn
    if not isinstance(lm_head, nn.Linear) or type(lm_head).forward is not nn.Linear.forward \
            or "forward" in vars(lm_head):
        return "lm_head is not a plain nn.Linear (wrapped, subclassed or its forward replaced)"
    from torch.nn.modules import module as nn_module

    hooks = (lm_head._forward_hooks, lm_head._forward_pre_hooks, nn_module._global_forward_hooks,
             nn_module._global_forward_pre_hooks)
    if any(not getattr(h, OBSERVER, False) for d in hooks for h in d.values()):
        return "forward hooks on lm_head"
    if not isinstance(lm_head.weight, torch.Tensor) or type(lm_head.weight) not in (torch.Tensor, nn.Parameter):
        return "lm_head weight is not a plain tensor"
    return None


def _fused(model, kk: LossSettings, call: dict, precision: str):
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    labels = call.pop("labels")
    logits_to_keep = call.pop("logits_to_keep", 0)
    return_dict = call.pop("return_dict", None)
    if return_dict is None:  # as @can_return_tuple decides
        return_dict = getattr(model.config, "return_dict", True)
    if kk.router_aux_loss and call.get("output_router_logits") is None:
        call["output_router_logits"] = model.config.output_router_logits
    outputs = model.model(**call)  # the remaining kwargs go to the decoder, as the model's own forward does

    hidden = outputs.last_hidden_state
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    hidden = hidden[:, keep, :]
    ignore_index = call.get("ignore_index", -100)
    shift_labels = call.get("shift_labels")
    if shift_labels is None:  # tokens < n predict n; the last position predicts nothing
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    num_items = call.get("num_items_in_batch")
    lm_head = model.lm_head
    reduction = "sum" if num_items is not None else "mean"
    loss = kk.linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), lm_head.weight, shift_labels.reshape(-1).to(hidden.device),
        lm_head.bias, ignore_index=ignore_index, softcap=getattr(model.config, "final_logit_softcapping", None),
        reduction=reduction, precision=precision).float()
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)

    common = dict(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                  hidden_states=outputs.hidden_states, attentions=outputs.attentions)
    if kk.router_aux_loss:
        aux_loss = None
        if call["output_router_logits"]:
            balance = sys.modules[type(model).__module__].load_balancing_loss_func
            aux_loss = balance(outputs.router_logits, model.num_experts, model.num_experts_per_tok,
                               call.get("attention_mask"))
            common["loss"] = loss + model.router_aux_loss_coef * aux_loss.to(loss.device)
        out = MoeCausalLMOutputWithPast(aux_loss=aux_loss, router_logits=outputs.router_logits, **common)
    else:
        out = CausalLMOutputWithPast(**common)
    if return_dict:
        return out
    # to_tuple() drops None fields: keep logits' place (None) so that positions match the model's own tuple.
    return tuple(getattr(out, f.name) for f in dataclasses.fields(out)
                 if f.name == "logits" or getattr(out, f.name) is not None)
