"""What the MoE A/B scripts (moe_tma_ab, moe_persistent_ab, moe_dgrad_ab, moe_fp8_bwd_ab) share: the issue's three
layer shapes, and one layer's inputs routed and permuted as kernelkit.moe does, ready for the launchers (GPU)."""

from types import SimpleNamespace

import torch
import triton

from kernelkit.ops import _moe_gemm as G
from kernelkit.ops import moe as M
from kernelkit.ops import registry

SHAPES = {"mixtral": (8192, 4096, 14336, 8, 2), "qwen3": (8192, 2048, 768, 128, 8),
          "deepseek-v3": (8192, 7168, 2048, 256, 8)}


def routed(shape) -> SimpleNamespace:
    """The registry's bf16 inputs at `shape` (seed 0), routed and permuted: x, router, gate_up, down, k; t, hidden,
    inter, n_exp; weights, experts; order, offs, tokens (x's row of each sorted row) and w_rows (their routing
    weights, fp32)."""
    (x, router, gate_up, down, k), _ = registry.get("moe").make_inputs(
        shape, torch.bfloat16, "cuda", torch.Generator(device="cuda").manual_seed(0))
    t, hidden, inter, n_exp, _ = shape
    weights, experts = M.route(x, router, k)
    order, offs = M._permute(experts, n_exp)
    return SimpleNamespace(x=x, router=router, gate_up=gate_up, down=down, k=k, t=t, hidden=hidden, inter=inter,
                           n_exp=n_exp, weights=weights, experts=experts, order=order, offs=offs, tokens=order // k,
                           w_rows=weights.reshape(-1)[order].float())


def backward_buffers(r: SimpleNamespace) -> SimpleNamespace:
    """The dgrads' operands and outputs for `routed`'s layer: dout (T, H) and z (rows, 2I) random; dz (rows, 2I),
    dxr (rows, H) and h (rows, I) to write; rowdot (the routing weight's partial sums) zeroed."""
    rows = r.t * r.k
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    return SimpleNamespace(dout=torch.randn_like(r.x), z=torch.randn(rows, 2 * r.inter, **kw),
                           dz=torch.empty(rows, 2 * r.inter, **kw), dxr=torch.empty(rows, r.hidden, **kw),
                           h=torch.empty(rows, r.inter, **kw),
                           rowdot=torch.zeros(rows, triton.cdiv(r.inter, G._ROWDOT_BLOCK_N), device="cuda"))
