"""Replacement forwards bound to one module instance: RMSNorm, gated MLP, the rope of an attention, and the
experts of a sparse MoE block.

Each forward is a module-level function bound with `types.MethodType` to the instance, its settings in
the instance's `_kernelkit` attribute: nothing is assigned to a class, a deep copy of a patched model
rebinds to the copy, and `unpatch` deletes the two attributes. A call that kernelkit cannot run exactly
(a CPU tensor outside the Triton interpreter, mixed dtypes) runs the class's own forward instead and is
counted in the report.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..runtime import interpreting
from ..ops import glu
from . import choose
from ..ops._validate import is_dtensor
from ..ops.fp8_linear import SharedInputs, fp8_linear, takes_input as fp8_takes_input
from ..ops.gemm.fp8 import quantize_rows
from ..ops.fp8_linear import unsupported as fp8_unsupported
from ..ops.moe import moe_experts
from ..ops.rms_norm import rms_norm, rms_norm_fp8
from ..ops.rope import rope
from .report import PatchReport

CPU_REASON = "CPU tensor outside the Triton interpreter"


def runs_kernels(x: torch.Tensor) -> bool:
    """Whether kernelkit's Triton kernels can take `x`: a CUDA tensor, or any tensor in the interpreter."""
    return x.is_cuda or interpreting()


DTENSOR_REASON = "DTensor input (a tensor-parallel plan hands this module sharded tensors; kernelkit takes plain ones)"


def any_dtensor(*tensors) -> bool:
    """Whether any argument is a torch.distributed DTensor (`_validate.is_dtensor`)."""
    return any(is_dtensor(t) for t in tensors)


# --- producers of an fp8 Linear's input (precision="fp8"): the RMSNorm before q/k/v and gate/up, the SwiGLU ---

@dataclass
class Fp8Producer:
    """precision="fp8": the model's SharedInputs, to which the module hands its output's fp8 rows, and whether fp8
    Linears read them (None until the first output is replaced; False stops writing them)."""
    fp8_shared: SharedInputs | None = field(default=None, kw_only=True)
    fp8_read: bool | None = field(default=None, kw_only=True)

    def fp8_rows_read(self, read: bool) -> None:
        if self.fp8_read is None:
            self.fp8_read = read

    def can_write_fp8(self) -> bool:
        """Whether this module has an fp8-writing kernel (every RMSNorm; of the GLUs, SwiGLU)."""
        return True

    def writes_fp8(self, x: torch.Tensor) -> bool:
        """Whether this call should also write its output's fp8 rows (x: a tensor of the output's dtype and width)."""
        shared = self.fp8_shared
        return (shared is not None and self.fp8_read is not False and self.can_write_fp8() and not choose.measuring()
                and not shared.bypassed(x) and fp8_takes_input(x))


# --- RMSNorm ---

@dataclass
class NormSettings(Fp8Producer):
    offset: float
    eps_attr: str
    report: PatchReport
    token: int | None = None  # the choose.Site deciding kernelkit or the original (one per class per patch)


def norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    kk: NormSettings = self._kernelkit
    w = self.weight
    if not runs_kernels(x) or w.dtype != x.dtype or any_dtensor(x, w):
        # Llama multiplies in the weight's dtype and promotes; Gemma rounds to x's: only equal dtypes agree.
        kk.report.fell_back("rms_norm", CPU_REASON if not runs_kernels(x) else DTENSOR_REASON if any_dtensor(x, w)
                            else "weight dtype differs from input")
        return type(self).forward(self, x)
    if not norm_decides(self, x):
        return type(self).forward(self, x)
    return _norm(self, x, fp8=True)


def norm_decides(module, x: torch.Tensor) -> bool:
    """Whether the patched norm runs kernelkit's kernel on x: its measured choice at x's shape (`choose`)."""
    kk: NormSettings = module._kernelkit
    key = (choose.bucket(x.numel() // x.shape[-1]), x.shape[-1], choose.dtype_name(x.dtype),
           choose.needs_grad(x, module.weight))
    return kk.token is None or choose.decide(kk.token, key)


def _norm(self, x: torch.Tensor, fp8: bool = False) -> torch.Tensor:
    """The norm; with `fp8`, in a model patched with precision="fp8", its pass also writes the output's fp8 rows
    and hands them to the fp8 Linears that read it (`SharedInputs.offer`), until it is seen that none does."""
    kk: NormSettings = self._kernelkit
    eps = getattr(self, kk.eps_attr)
    if eps is None:  # torch.nn.RMSNorm's default
        eps = torch.finfo(x.dtype).eps
    if fp8 and kk.writes_fp8(x):
        y, q, scale = rms_norm_fp8(x, self.weight, eps=eps, offset=kk.offset)
        kk.fp8_shared.offer(y, q, scale, kk.fp8_rows_read)
        return y
    return rms_norm(x, self.weight, eps=eps, offset=kk.offset)


def _norm_trial(module, key) -> choose.Trial:
    rows, hidden, dtype, grad = key
    w = module.weight
    x = choose.randn((rows, hidden), getattr(torch, dtype), w.device, choose.generator(w.device), grad)
    return choose.Trial(lambda: _norm(module, x), lambda: type(module).forward(module, x),
                        [t for t in (x, w) if t.requires_grad] if grad else [])


def _rows_shape(key) -> str:
    return f"{key[0]}x{key[1]} {key[2]} {'fwd+bwd' if key[3] else 'fwd'}"


def norm_site(module, modes: dict, report: PatchReport) -> choose.Site:
    return choose.Site("rms_norm", modes, report, _norm_trial, _rows_shape, f"{type(module).__name__}.forward", module)


def norm_settings(module: torch.nn.Module, offset: float, report: PatchReport) -> NormSettings | str:
    """Settings for `norm_forward`, or why the module cannot take it."""
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1:
        return "no 1-D weight"
    eps_attr = next((a for a in ("variance_epsilon", "eps") if hasattr(module, a)), None)
    if eps_attr is None:
        return "no eps attribute (variance_epsilon / eps)"
    return NormSettings(offset, eps_attr, report)


# --- gated MLP ---

@dataclass
class MLPSettings(Fp8Producer):
    glu: Callable
    glu_kwargs: dict
    fused: bool  # gate_up_proj with the gate in the first half (Phi-3) instead of gate_proj + up_proj
    report: PatchReport
    token: int | None = None  # the choose.Site deciding kernelkit or the original

    def can_write_fp8(self) -> bool:
        return self.glu is glu.swiglu

    def describe(self) -> str:
        args = ["gate_up" if self.fused else "gate, up"] + [f"{k}={v!r}" for k, v in self.glu_kwargs.items()]
        return f"kernelkit.{self.glu.__name__}({', '.join(args)})"


def mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    kk: MLPSettings = self._kernelkit
    # Sharded projection weights are fine: the local-output plan hands the glu local tensors (a plan that does
    # not makes the glu op refuse its DTensor arguments by name).
    if not runs_kernels(x) or any_dtensor(x):
        kk.report.fell_back("mlp", CPU_REASON if not runs_kernels(x) else DTENSOR_REASON)
        return type(self).forward(self, x)
    key = (choose.bucket(x.numel() // x.shape[-1]), x.shape[-1], choose.dtype_name(x.dtype),
           choose.needs_grad(x, *self.parameters()))
    if kk.token is not None and not choose.decide(kk.token, key):
        return type(self).forward(self, x)
    return _mlp(self, x)


def _mlp(self, x: torch.Tensor) -> torch.Tensor:
    """down(glu(gate, up)); with precision="fp8" (fp8_shared set, SwiGLU), the SwiGLU also writes its output's fp8
    rows for the fp8 down projection (`glu.swiglu_fp8`), until it is seen that it does not read them."""
    kk: MLPSettings = self._kernelkit
    gate, up = (self.gate_up_proj(x), None) if kk.fused else (self.gate_proj(x), self.up_proj(x))
    if kk.writes_fp8(gate if up is not None else gate[..., : gate.shape[-1] // 2]):
        h, q, scale = glu.swiglu_fp8(gate, up)
        kk.fp8_shared.offer(h, q, scale, kk.fp8_rows_read)
        return self.down_proj(h)
    return self.down_proj(kk.glu(gate, up, **kk.glu_kwargs))


def _mlp_trial(module, key) -> choose.Trial:
    rows, hidden, dtype, grad = key
    dev = next(module.parameters()).device
    x = choose.randn((rows, hidden), getattr(torch, dtype), dev, choose.generator(dev), grad)
    wrt = [x, *(p for p in module.parameters() if p.requires_grad)] if grad else []
    return choose.Trial(lambda: _mlp(module, x), lambda: type(module).forward(module, x), wrt)


def mlp_site(module, modes: dict, report: PatchReport) -> choose.Site:
    return choose.Site("mlp", modes, report, _mlp_trial, _rows_shape, f"{type(module).__name__}.forward", module)


def mlp_settings(module: torch.nn.Module, family, activations: dict, report: PatchReport) -> MLPSettings | str:
    act = getattr(module, family.mlp_activation, None)
    name = type(act).__name__
    if name not in activations:
        return f"activation {name} has no kernelkit glu"
    op, kwargs = activations[name]
    if isinstance(act, torch.nn.GELU):
        kwargs = {"approximate": act.approximate}
    fused = family.mlp_layout == "fused"
    needed = ("gate_up_proj", "down_proj") if fused else ("gate_proj", "up_proj", "down_proj")
    missing = [a for a in needed if not hasattr(module, a)]
    if missing:
        return f"no {', '.join(missing)}"
    return MLPSettings(getattr(glu, op), dict(kwargs), fused, report)


# --- rope: the attention forward, its module globals with the rope function swapped ---

# Each patched model's rope: (the modeling file's own function, the report), by the token baked into its stand-in.
_ROPES: dict[int, tuple[Callable, PatchReport, bool]] = {}


def _rope_call(token: int, q, k, cos, sin, unsqueeze_dim):
    original, report, choosing = _ROPES[token]
    if not runs_kernels(q) or unsqueeze_dim not in (1, 2) or cos.dim() != 3 or cos.requires_grad \
            or any_dtensor(q, k, cos, sin):
        report.fell_back("rope", CPU_REASON if not runs_kernels(q) else DTENSOR_REASON if any_dtensor(q, k, cos, sin)
                         else "cos/sin not per-token (B, S, D)")
        return original(q, k, cos, sin, unsqueeze_dim)
    h_dim, s_dim = (1, 2) if unsqueeze_dim == 1 else (2, 1)
    key = (choose.bucket(q.shape[0]), q.shape[h_dim], k.shape[h_dim], choose.bucket(q.shape[s_dim]), q.shape[3],
           cos.shape[-1], unsqueeze_dim, choose.dtype_name(q.dtype), choose.needs_grad(q, k))
    if choosing and not choose.decide(token, key):
        return original(q, k, cos, sin, unsqueeze_dim)
    return rope(q, k, cos, sin, layout="bhsd" if unsqueeze_dim == 1 else "bshd")


def _rope_trial(original, key) -> choose.Trial:
    b, hq, hk, seq, d, rot, dim, dtype, grad = key
    dt, dev = getattr(torch, dtype), choose.device()
    g = choose.generator(dev)
    q, k = ((b, h, seq, d) if dim == 1 else (b, seq, h, d) for h in (hq, hk))
    q, k = choose.randn(q, dt, dev, g, grad), choose.randn(k, dt, dev, g, grad)
    cos, sin = choose.randn((b, seq, rot), dt, dev, g), choose.randn((b, seq, rot), dt, dev, g)
    layout = "bhsd" if dim == 1 else "bshd"
    return choose.Trial(lambda: rope(q, k, cos, sin, layout=layout), lambda: original(q, k, cos, sin, dim),
                        [q, k] if grad else [])


def _rope_shape(key) -> str:
    b, hq, hk, seq, d, rot, dim, dtype, grad = key
    return (f"b{b} s{seq} heads {hq}" + (f"/{hk}" if hk != hq else "") + f" d{d}"
            + (f" rotary {rot}" if rot != d else "") + f" {dtype} {'fwd+bwd' if grad else 'fwd'}")


def rope_function(original: Callable, report: PatchReport, modes: dict | None = None) -> Callable:
    """kernelkit's stand-in for Hugging Face's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``:
    per-token cos/sin (B, S, rotary_dim) from the model's rotary module (any rope scaling), q and k
    (B, H, S, D) (unsqueeze_dim=1) or (B, S, H, D) (unsqueeze_dim=2); partial rotary from cos's width.

    The stand-in is compiled with its token as a literal and this module's globals: torch.compile reaches it
    through the modeling module's name (the attention forward's globals are a copy, `with_globals`), so a
    value it read from a closure would be guarded at a path that does not lead to it."""
    site = choose.Site("rope", modes or {"rope": "kernelkit"}, report, _rope_trial, _rope_shape,
                       getattr(original, "__name__", "rope"), original)
    _ROPES[site.token] = (original, report, modes is not None)
    src = (f"def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):\n"
           f"    return _rope_call({site.token}, q, k, cos, sin, unsqueeze_dim)\n")
    code = next(c for c in compile(src, f"<kernelkit rope {site.token}>", "exec").co_consts
                if isinstance(c, types.CodeType))
    return types.FunctionType(code, globals(), "apply_rotary_pos_emb", (1,))


def rope_signature_ok(fn: Callable) -> bool:
    """Whether `fn` has the signature `rope_function` stands in for."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(params) == 5 and params[4].name == "unsqueeze_dim"


def with_globals(fn: types.FunctionType, replacements: dict) -> types.FunctionType:
    """`fn` with the same code, defaults and closure, looking its globals up in a copy of its module's
    namespace where `replacements` are swapped in: the function is the class's own, only the names it
    calls differ, and neither the class nor the module changes. (Globals rebound in the module after
    this copy is taken are not seen; Hugging Face modeling files do not rebind theirs.)"""
    namespace = dict(fn.__globals__)
    namespace.update(replacements)
    new = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    new.__dict__.update(fn.__dict__)
    return new


# --- MoE experts: the sparse block's own router, kernelkit's grouped-GEMM experts ---

# The call the sparse blocks of the table make: ``self.experts(hidden_states, top_k_index, top_k_weights)``.
EXPERTS_SIGNATURE = ("hidden_states", "top_k_index", "top_k_weights")
# Flags transformers' `use_experts_implementation` sets on an experts module, and the values of the layout
# the kernel reads: [gate; up] stacked along dim 1, each expert in nn.Linear's (out, in) order, no biases.
EXPERTS_LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True}
MOE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class ExpertsSettings:
    report: PatchReport
    token: int | None = None  # the choose.Site deciding kernelkit or the original


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """Bound to the block's experts module: the block's forward (jitter, HF's router and its recorded
    router_logits, the reshapes) runs unchanged and hands this the routing it computed."""
    kk: ExpertsSettings = self._kernelkit
    gate_up, down = self.gate_up_proj, self.down_proj
    reason = None
    if not runs_kernels(hidden_states):
        reason = CPU_REASON
    elif any_dtensor(hidden_states, top_k_index, top_k_weights, gate_up, down):
        reason = DTENSOR_REASON
    elif hidden_states.dim() != 2 or top_k_index.shape != top_k_weights.shape or top_k_index.dim() != 2:
        reason = "hidden_states not (tokens, hidden) or routing not (tokens, k)"
    elif hidden_states.dtype not in MOE_DTYPES or gate_up.dtype != hidden_states.dtype \
            or down.dtype != hidden_states.dtype:
        reason = "expert weights' dtype differs from the input's (or not fp32 / bf16 / fp16)"
    if reason is not None:
        kk.report.fell_back("moe", reason)
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    key = (choose.bucket(hidden_states.shape[0]), top_k_index.shape[1], *gate_up.shape, choose.dtype_name(gate_up.dtype),
           choose.needs_grad(hidden_states, top_k_weights, gate_up, down))
    if kk.token is not None and not choose.decide(kk.token, key):
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    return moe_experts(hidden_states, top_k_weights, gate_up, down, top_k_index)


def _experts_trial(experts, key) -> choose.Trial:
    tokens, k, n_exp, _, hidden, dtype, grad = key
    gate_up, down = experts.gate_up_proj, experts.down_proj
    dt, dev = getattr(torch, dtype), gate_up.device
    g = choose.generator(dev)
    h = choose.randn((tokens, hidden), dt, dev, g, grad)
    logits = torch.rand(tokens, n_exp, device=dev, generator=g)
    w, ids = logits.topk(k, dim=1)
    w = (w / w.sum(1, keepdim=True)).to(dt).requires_grad_(grad)
    wrt = [t for t in (h, w, gate_up, down) if t.requires_grad] if grad else []
    return choose.Trial(lambda: moe_experts(h, w, gate_up, down, ids),
                        lambda: type(experts).forward(experts, h, ids, w), wrt)


def _experts_shape(key) -> str:
    tokens, k, n_exp, i2, hidden, dtype, grad = key
    return f"{tokens} tokens top-{k} of {n_exp} experts {hidden}->{i2 // 2} {dtype} {'fwd+bwd' if grad else 'fwd'}"


def experts_site(experts, modes: dict, report: PatchReport) -> choose.Site:
    return choose.Site("moe", modes, report, _experts_trial, _experts_shape, f"{type(experts).__name__}.forward",
                       experts)


def experts_settings(block: torch.nn.Module, activations: dict, report: PatchReport) -> ExpertsSettings | str:
    """Settings for `experts_forward` on `block.experts`, or why that module cannot take it."""
    experts = getattr(block, "experts", None)
    if not isinstance(experts, torch.nn.Module) or not isinstance(getattr(block, "gate", None), torch.nn.Module):
        return "no gate / experts submodules"
    try:
        params = tuple(inspect.signature(type(experts).forward).parameters)[1:]
    except (TypeError, ValueError):
        params = ()
    if params != EXPERTS_SIGNATURE:
        return f"experts forward is not ({', '.join(EXPERTS_SIGNATURE)})"
    act = getattr(experts, "act_fn", None)
    if activations.get(type(act).__name__, ("",))[0] != "swiglu":
        return f"experts activation {type(act).__name__} is not SiLU (the kernel fuses SwiGLU)"
    odd = [f"{k}={getattr(experts, k)!r}" for k, v in EXPERTS_LAYOUT.items() if getattr(experts, k, v) != v]
    if odd:
        return f"experts layout {', '.join(odd)} (the kernel reads concatenated [gate; up], untransposed, no bias)"
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) \
            or gate_up.dim() != 3 or down.dim() != 3:
        return "no 3-D experts.gate_up_proj / experts.down_proj"
    n_exp, i2, hidden = gate_up.shape
    if i2 % 2 or tuple(down.shape) != (n_exp, hidden, i2 // 2):
        return (f"experts.gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not "
                f"(E, 2I, H) and (E, H, I)")
    if "forward" in vars(experts):
        return "experts forward already replaced"
    return ExpertsSettings(report)


# --- fp8 training of the decoder layers' nn.Linear modules (kernelkit.patch(model, precision="fp8")) ---

@dataclass
class Fp8Settings:
    report: PatchReport
    cache: object = None  # an ops.fp8_linear.QuantizedWeight (keep_quantized_weights=True), else None
    token: int | None = None  # the choose.Site deciding fp8 or the model's dtype, per shape
    shared: SharedInputs | None = None  # the model's: one quantization of an input its Linears share


def fp8_linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    """Bound to an nn.Linear: its GEMMs in fp8 (`ops.fp8_linear`) where fp8 is measured faster at this shape, or
    in its dtype (the model's own nn.Linear) where it is not or where fp8 cannot take the call (counted in the
    report with the reason)."""
    kk: Fp8Settings = self._kernelkit
    why = fp8_unsupported(x, self.weight)
    if why is None and any_dtensor(x, self.weight):
        why = DTENSOR_REASON
    if why is not None:
        kk.report.fell_back("fp8", why)
        return torch.nn.functional.linear(x, self.weight, self.bias)
    if kk.token is not None:
        n, k = self.weight.shape
        # made: x's rows are already kept (its producer wrote them, or an earlier reader of x made them), so the
        # trial times fp8 without quantizing x's rows, as this call runs
        made = kk.shared is not None and kk.shared.has_rows(x)
        key = (choose.bucket(x.numel() // max(k, 1)), n, k, choose.dtype_name(x.dtype), self.bias is not None,
               choose.needs_grad(x, self.weight, self.bias), made)
        if not choose.decide(kk.token, key):
            return torch.nn.functional.linear(x, self.weight, self.bias)
    return fp8_linear(x, self.weight, self.bias, kk.cache, kk.shared if not choose.measuring() else None)


FP8_IN_FLIGHT = 8  # calls timed back to back per sample of the fp8 trial (choose.Trial.in_flight)


def _fp8_trial(_owner, key) -> choose.Trial:
    tokens, n, k, dtype, bias, grad, made = key
    dt, dev = getattr(torch, dtype), choose.device()
    g = choose.generator(dev)
    x = choose.randn((tokens, k), dt, dev, g, grad)
    w = choose.randn((n, k), dt, dev, g, grad, scale=k ** -0.5)
    b = choose.randn((n,), dt, dev, g, grad) if bias else None
    wrt = [t for t in (x, w, b) if t is not None] if grad else []
    if made:  # x's rows come with it (made upstream): hand them in, as SharedInputs does in the model
        shared, rows = SharedInputs(), quantize_rows(x.detach())

        def kernelkit():
            shared.offer(x, *rows)
            return fp8_linear(x, w, b, None, shared)
    else:
        def kernelkit():
            return fp8_linear(x, w, b)
    # in flight: the many short launches of the fp8 path (quantizations beside each GEMM) cost only where the host,
    # not the GPU, is the bottleneck (small token counts); timed one at a time, fp8 lost even where it wins in a step
    return choose.Trial(kernelkit, lambda: torch.nn.functional.linear(x, w, b), wrt, in_flight=FP8_IN_FLIGHT)


def _fp8_shape(key) -> str:
    tokens, n, k, dtype, bias, grad, made = key
    return (f"{tokens} tokens x {k} -> {n} {dtype}{' +bias' if bias else ''} {'fwd+bwd' if grad else 'fwd'}"
            f"{', input rows made upstream' if made else ''}")


def fp8_site(modes: dict, report: PatchReport) -> choose.Site:
    """One site for every Linear of a model patched with precision="fp8": a decision per shape."""
    return choose.Site("fp8", modes, report, _fp8_trial, _fp8_shape, "nn.Linear (bf16 GEMMs)")
