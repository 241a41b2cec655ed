"""kernelkit.moe (grouped-GEMM MoE layer) against torch._grouped_mm, a dense GEMM and a per-expert loop, side by
side in one process (GPU).

    PYTHONPATH=src python benchmarks/moe.py --out moe.json [--quick] [--shapes mixtral,qwen3] [--rows gate_up,layer]
        [--only kernelkit,torch._grouped_mm,...]

Shapes (tokens, hidden, intermediate, experts, top_k), bf16, inputs from the registry's make_inputs (random
routing with built-in margins, so the experts' loads are near balanced):
  mixtral      (8192, 4096, 14336, 8, 2)
  qwen3        (8192, 2048, 768, 128, 8)     Qwen3-30B-A3B
  deepseek-v3  (8192, 7168, 2048, 256, 8)    routed experts only (sigmoid scoring, renormalized)
  mixtral-decode, qwen3-decode: the same layers with 64 tokens (a decode batch; rows add weight GB/s)
Rows per shape:
  gate-up GEMM alone (forward), FLOPs 2·T·k·H·2I:
    kernelkit          the grouped GEMM (on Hopper the persistent TMA kernel: x's rows gathered by a copy inside the
                       call for wide outputs, in its loads otherwise), SwiGLU epilogue (writes h, allocated once
                       outside the timing)
    kernelkit_pregathered  the same on x gathered beforehand (the gather not timed, as torch._grouped_mm's row)
    kernelkit_pointer  the pointer kernel (KERNELKIT_MOE_PERSISTENT=0): x gathered in its loads, weights via TMA
    kernelkit_fp8      the same on e4m3 x and weights quantized per row beforehand, dequantized in the epilogue
    kernelkit_mxfp8_upcast   MXFP8 x and weights (E8M0 per 32 along K) quantized beforehand, dequantized to bf16
                       by their own passes inside the timing (_kept: the weights' bf16 copy made beforehand), the
                       bf16 GEMM writing h as MXFP8 (MX_MODE "upcast", the default)
    kernelkit_mxfp8_dequant  the same operands dequantized in the K loop (MX_MODE "dequant"); _quantized_h: h
                       written as MXFP8 (the fused quantization's overhead in % of the GEMM). MX_MODE "promote" and
                       "dot_scaled" measured about half of dequant's TFLOP/s at Mixtral (moe-mxfp8-promote-gateup.json,
                       moe-mxfp8-dot-scaled-mixtral.json) and are no longer timed here
    kernelkit_quantized_h    kernelkit's bf16 GEMM writing h as MXFP8 (the fusion's overhead vs kernelkit)
    quantize_rows_h    rowwise fp8's separate quantization pass over h (its overhead in % of kernelkit_fp8)
    torch._scaled_grouped_mm_fp8   torch's rowwise fp8 grouped GEMM on the pre-gathered rows
    torch._grouped_mm  the same GEMM on the pre-gathered x (the gather not timed), no epilogue (writes gate|up)
    dense mm           one torch.mm of the same FLOPs: (T·k, H) @ (H, 2I)
  whole layer, forward and forward+backward (all four inputs require grad), FLOPs 2·T·k·3·I·H (x3 with backward):
    kernelkit          kernelkit.moe
    kernelkit_fp8      kernelkit.moe(..., precision="fp8"): quantization of x, both weights and h included
    kernelkit_mxfp8    kernelkit.moe(..., precision="mxfp8"): the same for MXFP8 (h quantized in the epilogue)
    kernelkit_triton_wgrads  fwd+bwd only: kernelkit.moe with kernelkit's wgrad kernel instead of torch._grouped_mm's
    kernelkit_fp8_bwd  fwd+bwd only: precision="fp8", backward_precision="fp8" (fp8 forward GEMMs and fp8 dgrads,
                       every quantization included); _kept: inside keep_quantized_weights() (frozen experts)
    kernelkit_pointer  kernelkit.moe with the pointer grouped GEMM (KERNELKIT_MOE_PERSISTENT=0)
    *_kept             forward only: inside keep_quantized_weights(), the weights' copies made once and reused
    grouped_mm layer   torch router + argsort permute + torch._grouped_mm x2 + SwiGLU + weighted unpermute
    per-expert loop    kernelkit.ops.moe.reference in bf16 (one torch.where and two F.linear per expert, HF-style)
Each: triton.testing.do_bench median (L2 flushed before every run), TFLOP/s and % of the datasheet bf16 dense
peak, the ratio of kernelkit to each other row, and the peak memory one call allocates above the inputs. The
layer rows also give kernelkit's max |err| / max |ref| against the grouped_mm layer's output. kernelkit's first
call (autotuning) is excluded from the timings and reported as tune_s. A row that fails records its error.
Results go to --out as JSON, rewritten after every row.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import kernelkit
from kernelkit.hw import lookup
from kernelkit.ops.gemm import grouped as G
from kernelkit.ops import moe as M
from kernelkit.ops.mxfp8 import mxfp8_dequantize
from kernelkit.ops import registry
from kernelkit.testing.bench import env_fingerprint
from kernelkit.runtime.alloc import empty
from kernelkit.runtime import chosen_configs

SHAPES = {"mixtral": ((8192, 4096, 14336, 8, 2), "softmax"), "qwen3": ((8192, 2048, 768, 128, 8), "softmax"),
          "deepseek-v3": ((8192, 7168, 2048, 256, 8), "sigmoid"),
          # Decode batches: 64 sequences, one token each. Memory-bound on the experts' weights, so the rows
          # also give the weight bytes read per second (every expert gets tokens here).
          "mixtral-decode": ((64, 4096, 14336, 8, 2), "softmax"), "qwen3-decode": ((64, 2048, 768, 128, 8), "softmax")}
QUICK = ("mixtral", "qwen3")


def timed(fn, rep):
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, rep=rep, return_mode="median")


def peak_mb(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def max_rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def grouped_mm_layer(x, router, gate_up, down, k, scoring="softmax", renormalize=True):
    """The MoE layer in torch ops around torch._grouped_mm (what a model without a fused kernel can do)."""
    t, hidden = x.shape
    weights, experts = M.route(x, router, k, scoring, renormalize)
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)
    ends = torch.bincount(flat, minlength=gate_up.shape[0]).cumsum(0).to(torch.int32)
    rows = order // k
    z = torch._grouped_mm(x[rows], gate_up.transpose(1, 2), offs=ends)
    gate, up = z.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=ends)
    y = y * weights.reshape(-1)[order, None].to(y.dtype)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return y[inverse].view(t, k, hidden).sum(1)


ONLY = None  # --only: the row names to measure (None: all)


def want(name):
    return ONLY is None or name in ONLY


def flagged(module, attr, value, fn):
    """fn run with `module.attr` set to `value` (restored after)."""
    def call():
        saved = getattr(module, attr)
        setattr(module, attr, value)
        try:
            return fn()
        finally:
            setattr(module, attr, saved)
    return call


def measure(row, name, fn, flops, rep, peak):
    if not want(name):
        return
    try:
        ms = timed(fn, rep)
        row[name] = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12, "peak_mb": peak_mb(fn)}
        if "weight_bytes" in row:  # the bytes of expert weights the call reads at least once
            row[name]["weight_gbps"] = row["weight_bytes"] / (ms * 1e-3) / 1e9
        if peak:
            row[name]["pct_bf16_peak"] = 100.0 * row[name]["tflops"] / peak
    except Exception as e:  # noqa: BLE001 - a row that fails says why instead of ending the run
        row[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
    torch.cuda.empty_cache()


def ratios(row, names):
    ours = row["kernelkit"].get("ms")
    for other in names:
        if ours and "ms" in row.get(other, {}):
            row[f"kernelkit_x_{other}"] = row[other]["ms"] / ours


def gate_up_rows(label, shape, args, rep, peak):
    x, router, gate_up, down, k = args
    t, hidden, inter, n_exp, _ = shape
    weights, experts = M.route(x, router, k)
    order, offs = M._permute(experts, n_exp)
    rows = order // k
    x_perm = x[rows]
    h = empty((t * k, inter), dtype=x.dtype, device=x.device)
    dense_w = gate_up[0].t()  # (H, 2I): one expert's weight, the same FLOPs as all groups together
    flops = 2.0 * t * k * hidden * 2 * inter
    row = {"kind": "gate_up_gemm", "shape": label, "dims": list(shape), "flops": flops}
    if label.endswith("-decode"):
        row["weight_bytes"] = gate_up.numel() * gate_up.element_size()
    start = time.perf_counter()
    M.grouped_gemm(x, gate_up.transpose(1, 2), h, offs, inter, a_idx=rows, epilogue="swiglu")
    torch.cuda.synchronize()
    row["tune_s"] = round(time.perf_counter() - start, 2)
    measure(row, "kernelkit", lambda: M.grouped_gemm(x, gate_up.transpose(1, 2), h, offs, inter, a_idx=rows,
                                                      epilogue="swiglu"), flops, rep, peak)
    # the persistent TMA kernel on rows gathered beforehand (the gather not timed, as torch._grouped_mm's), and the
    # pointer kernel with the gather fused into its loads (KERNELKIT_MOE_PERSISTENT=0)
    measure(row, "kernelkit_pregathered", lambda: M.grouped_gemm(x_perm, gate_up.transpose(1, 2), h, offs, inter,
                                                                  epilogue="swiglu"), flops, rep, peak)
    measure(row, "kernelkit_pointer", flagged(G, "PERSISTENT", False, lambda: M.grouped_gemm(
        x, gate_up.transpose(1, 2), h, offs, inter, a_idx=rows, epilogue="swiglu")), flops, rep, peak)
    measure(row, "torch._grouped_mm", lambda: torch._grouped_mm(x_perm, gate_up.transpose(1, 2), offs=offs[1:]),
            flops, rep, peak)
    measure(row, "dense_mm", lambda: torch.mm(x_perm, dense_w), flops, rep, peak)
    # precision="fp8": the same GEMM on e4m3 operands quantized per row beforehand (as weights kept in fp8 would
    # be), gather and dequantization fused; torch._scaled_grouped_mm rowwise on the pre-gathered rows.
    if not any(want(n) for n in ("kernelkit_fp8", "kernelkit_mxfp8_upcast", "kernelkit_mxfp8_upcast_kept",
                                 "kernelkit_quantized_h", "kernelkit_mxfp8_dequant", "quantize_rows_h",
                                 "torch._scaled_grouped_mm_fp8")):
        return gate_up_ratios(row)
    xq, xs = M.quantize_rows(x)
    guq, gus = M.quantize_rows(gate_up)
    M.grouped_gemm(xq, guq.transpose(1, 2), h, offs, inter, a_idx=rows, epilogue="swiglu", a_scale=xs, b_scale=gus)
    measure(row, "kernelkit_fp8", lambda: M.grouped_gemm(xq, guq.transpose(1, 2), h, offs, inter, a_idx=rows,
                                                          epilogue="swiglu", a_scale=xs, b_scale=gus), flops, rep, peak)
    # MXFP8 operands quantized beforehand (the rows below say how they are multiplied)
    xm, xms = M.mxfp8_quantize(x)
    gum, gums = M.mxfp8_quantize(gate_up)
    hq = empty((t * k, inter), dtype=torch.float8_e4m3fn, device=x.device)
    hs = empty((t * k, inter // 32), dtype=torch.uint8, device=x.device)
    default = G.MX_MODE
    bf = torch.bfloat16
    gud = mxfp8_dequantize(gum, gums, bf)
    # MX_MODE "upcast" (the default): the operands dequantized to bf16 by their own passes (inside the timing;
    # _kept: the weight's bf16 copy made beforehand, as keep_quantized_weights holds it), a bf16 GEMM writing h as
    # MXFP8. kernelkit_quantized_h: the bf16 GEMM on x itself writing h as MXFP8 (the fusion's cost vs kernelkit).
    for name, call in (
            ("kernelkit_mxfp8_upcast", lambda: M.grouped_gemm(
                mxfp8_dequantize(xm, xms, bf), mxfp8_dequantize(gum, gums, bf).transpose(1, 2), hq, offs, inter,
                a_idx=rows, epilogue="swiglu", c_scales=hs)),
            ("kernelkit_mxfp8_upcast_kept", lambda: M.grouped_gemm(
                mxfp8_dequantize(xm, xms, bf), gud.transpose(1, 2), hq, offs, inter, a_idx=rows, epilogue="swiglu",
                c_scales=hs)),
            ("kernelkit_quantized_h", lambda: M.grouped_gemm(x, gate_up.transpose(1, 2), hq, offs, inter, a_idx=rows,
                                                              epilogue="swiglu", c_scales=hs))):
        if not want(name):
            continue
        try:
            call()
        except Exception:  # noqa: BLE001 - measure records the error
            pass
        measure(row, name, call, flops, rep, peak)
    try:  # the upcast path's quantized h against torch._grouped_mm on the dequantized operands
        if not want("kernelkit_mxfp8_upcast"):
            raise LookupError("not measured (--only)")
        ref = torch._grouped_mm(mxfp8_dequantize(xm, xms)[rows], gud.transpose(1, 2), offs=offs[1:]).float()
        ref = F.silu(ref[:, :inter]) * ref[:, inter:]
        M.grouped_gemm(mxfp8_dequantize(xm, xms, bf), gud.transpose(1, 2), hq, offs, inter, a_idx=rows,
                        epilogue="swiglu", c_scales=hs)
        row["kernelkit_mxfp8_upcast_quantized_h_max_rel_err"] = max_rel(mxfp8_dequantize(hq, hs, torch.float32), ref)
        del ref
    except Exception as e:  # noqa: BLE001
        row["kernelkit_mxfp8_upcast_quantized_h_max_rel_err"] = f"{type(e).__name__}: {e}"[:200]
    gud = None  # the bf16 copy freed before the next rows
    for name, mode in (("kernelkit_mxfp8_dequant", "dequant"),):
        if not want(name):
            continue
        G.MX_MODE = mode
        try:
            for out, scales, suffix in ((h, None, ""), (hq, hs, "_quantized_h")):
                call = (lambda o, sc: lambda: M.grouped_gemm(xm, gum.transpose(1, 2), o, offs, inter, a_idx=rows,
                                                              epilogue="swiglu", a_scale=xms, b_scale=gums, mx=True,
                                                              c_scales=sc))(out, scales)
                try:
                    call()  # tuning, outside the timing
                except Exception:  # noqa: BLE001 - measure records the error
                    pass
                measure(row, name + suffix, call, flops, rep, peak)
            # correctness at the tuned tiles: h against torch._grouped_mm on the dequantized operands (exact in
            # bf16, so the same products), and the quantized h against the quantizer's reference on that h
            try:
                ref = torch._grouped_mm(mxfp8_dequantize(xm, xms)[rows], mxfp8_dequantize(gum, gums).transpose(1, 2),
                                        offs=offs[1:]).float()
                ref = F.silu(ref[:, :inter]) * ref[:, inter:]
                M.grouped_gemm(xm, gum.transpose(1, 2), h, offs, inter, a_idx=rows, epilogue="swiglu", a_scale=xms,
                                b_scale=gums, mx=True)
                row[f"{name}_h_max_rel_err"] = max_rel(h, ref)
                M.grouped_gemm(xm, gum.transpose(1, 2), hq, offs, inter, a_idx=rows, epilogue="swiglu",
                                a_scale=xms, b_scale=gums, mx=True, c_scales=hs)
                back = mxfp8_dequantize(hq, hs, torch.float32)
                row[f"{name}_quantized_h_max_rel_err"] = max_rel(back, ref)
                del ref, back
            except Exception as e:  # noqa: BLE001
                row[f"{name}_h_max_rel_err"] = f"{type(e).__name__}: {e}"[:200]
        finally:
            G.MX_MODE = default
    # rowwise fp8's h quantization is a pass of its own (the row's amax spans every N tile): its time alone
    measure(row, "quantize_rows_h", lambda: M.quantize_rows(h), flops, rep, peak)
    xq_perm, xs_perm = xq[rows], xs[rows]
    measure(row, "torch._scaled_grouped_mm_fp8", lambda: torch._scaled_grouped_mm(
        xq_perm, guq.transpose(1, 2), xs_perm, gus, offs=offs[1:], out_dtype=torch.bfloat16), flops, rep, peak)
    return gate_up_ratios(row)


def gate_up_ratios(row):
    """The gate-up row's ratios between what it measured (each pair where both ran) and the fused quantizations'
    overheads."""
    ratios(row, ("torch._grouped_mm", "dense_mm"))
    for mine in ("kernelkit_fp8", "kernelkit_mxfp8_dequant", "kernelkit_mxfp8_upcast", "kernelkit_mxfp8_upcast_kept",
                 "kernelkit"):
        if "ms" in row.get(mine, {}):
            for other in ("kernelkit", "torch._grouped_mm", "torch._scaled_grouped_mm_fp8", "kernelkit_fp8"):
                if other != mine and "ms" in row.get(other, {}):
                    row[f"{mine}_x_{other}"] = row[other]["ms"] / row[mine]["ms"]
            if "ms" in row.get(mine + "_quantized_h", {}):  # the fused quantization's cost, in % of the GEMM
                row[f"{mine}_quantize_h_overhead_pct"] = 100 * (row[mine + "_quantized_h"]["ms"] / row[mine]["ms"] - 1)
    if "ms" in row.get("kernelkit_fp8", {}) and "ms" in row.get("quantize_rows_h", {}):
        row["kernelkit_fp8_quantize_h_overhead_pct"] = 100 * row["quantize_rows_h"]["ms"] / row["kernelkit_fp8"]["ms"]
    for mine in ("kernelkit_pregathered", "kernelkit_pointer"):
        if "ms" in row.get(mine, {}):
            for other in ("kernelkit", "torch._grouped_mm", "dense_mm"):
                if "ms" in row.get(other, {}):
                    row[f"{mine}_x_{other}"] = row[other]["ms"] / row[mine]["ms"]
    return row


def layer_rows(label, shape, scoring, args, rep, peak, modes=("fwd", "fwd+bwd")):
    """The forward row, then the forward+backward row (a generator: each is reported as it is done)."""
    x, router, gate_up, down, k = args
    t, hidden, inter, _, _ = shape
    kw = {"scoring": scoring}
    leaves = [a.detach().requires_grad_() for a in (x, router, gate_up, down)]
    dy = torch.randn_like(x)
    impls = {"kernelkit": kernelkit.moe, "kernelkit_fp8": lambda *a, **kw: kernelkit.moe(*a, **kw, precision="fp8"),
             "kernelkit_mxfp8": lambda *a, **kw: kernelkit.moe(*a, **kw, precision="mxfp8"),
             "kernelkit_pointer": lambda *a, **kw: flagged(G, "PERSISTENT", False, lambda: kernelkit.moe(*a, **kw))(),
             "grouped_mm_layer": grouped_mm_layer, "per_expert_loop": M.reference}
    # weights quantized once, reused while unchanged (inference; forward rows only, run inside
    # keep_quantized_weights below)
    fwd_only = {"kernelkit_fp8_kept": impls["kernelkit_fp8"], "kernelkit_mxfp8_kept": impls["kernelkit_mxfp8"]}
    # fp8 training: both fp8 forward GEMMs and the backward's two fp8 dgrads; _kept: the weights' quantized copies
    # (forward and transposed) made once and reused (frozen experts)
    fp8_bwd = lambda *a, **kw: kernelkit.moe(*a, **kw, precision="fp8", backward_precision="fp8")  # noqa: E731
    bwd_only = {"kernelkit_fp8_bwd": fp8_bwd, "kernelkit_fp8_bwd_kept": fp8_bwd}
    fwd_flops = 2.0 * t * k * 3 * inter * hidden
    start = time.perf_counter()
    torch.autograd.grad(kernelkit.moe(*leaves, k, **kw), leaves, dy)
    torch.cuda.synchronize()
    tune_s = round(time.perf_counter() - start, 2)
    for mode, flops in (("fwd", fwd_flops), ("fwd+bwd", 3 * fwd_flops)):
        if mode not in modes:
            continue
        row = {"kind": f"layer_{mode}", "shape": label, "dims": list(shape), "scoring": scoring, "flops": flops,
               "tune_s": tune_s}
        if label.endswith("-decode"):
            row["weight_bytes"] = (gate_up.numel() + down.numel()) * gate_up.element_size() * (1 if mode == "fwd" else 3)
        for name, fn in (impls | fwd_only if mode == "fwd" else impls | bwd_only).items():
            if not want(name):
                continue
            if mode == "fwd":
                call = (lambda f: lambda: f(x, router, gate_up, down, k, **kw))(fn)
                with torch.no_grad():
                    if name in fwd_only:  # the copies made once, outside the timing, and kept across its calls
                        with M.keep_quantized_weights():
                            call()
                            measure(row, name, call, flops, rep, peak)
                        continue
                    measure(row, name, call, flops, rep, peak)
            else:
                call = (lambda f: lambda: torch.autograd.grad(f(*leaves, k, **kw), leaves, dy))(fn)
                if name.endswith("_kept"):
                    with M.keep_quantized_weights():
                        call()
                        measure(row, name, call, flops, rep, peak)
                    continue
                measure(row, name, call, flops, rep, peak)
        if mode == "fwd+bwd":
            measure(row, "kernelkit_triton_wgrads", flagged(M, "CUBLAS_WGRADS", False, lambda: torch.autograd.grad(
                kernelkit.moe(*leaves, k, **kw), leaves, dy)), flops, rep, peak)
        if mode == "fwd":
            try:
                with torch.no_grad():
                    got = kernelkit.moe(x, router, gate_up, down, k, **kw)
                    row["max_rel_err_vs_grouped_mm_layer"] = max_rel(got, grouped_mm_layer(x, router, gate_up, down,
                                                                                           k, **kw))
            except Exception as e:  # noqa: BLE001
                row["max_rel_err_vs_grouped_mm_layer"] = f"{type(e).__name__}: {e}"[:200]
        ratios(row, ("grouped_mm_layer", "per_expert_loop"))
        for mine in ("kernelkit_fp8", "kernelkit_mxfp8", "kernelkit_fp8_kept", "kernelkit_mxfp8_kept",
                     "kernelkit_pointer", "kernelkit_triton_wgrads", "kernelkit_fp8_bwd", "kernelkit_fp8_bwd_kept"):
            for other in ("kernelkit", "grouped_mm_layer", "per_expert_loop"):
                if "ms" in row.get(mine, {}) and "ms" in row.get(other, {}):
                    row[f"{mine}_x_{other}"] = row[other]["ms"] / row[mine]["ms"]
        yield row


def describe(row):
    parts = []
    for name in ("kernelkit", "kernelkit_pregathered", "kernelkit_pointer", "kernelkit_triton_wgrads", "kernelkit_fp8",
                 "kernelkit_mxfp8_dequant", "kernelkit_mxfp8_dequant_quantized_h", "kernelkit_mxfp8_upcast",
                 "kernelkit_mxfp8_upcast_kept", "kernelkit_quantized_h", "quantize_rows_h",
                 "kernelkit_fp8_kept", "kernelkit_mxfp8_kept", "kernelkit_fp8_bwd", "kernelkit_fp8_bwd_kept",
                 "torch._grouped_mm", "torch._scaled_grouped_mm_fp8",
                 "dense_mm", "grouped_mm_layer", "per_expert_loop"):
        if name in row:
            r = row[name]
            gbps = f" {r['weight_gbps']:.0f} GB/s" if "weight_gbps" in r else ""
            parts.append(f"{name} " + (f"{r['ms']:.3f} ms {r['tflops']:.0f} TF/s{gbps} {r['peak_mb']:.0f} MB"
                                       if "ms" in r else r["error"][:80]))
    xs = [f"{k[len('kernelkit_'):]} {v:.2f}x" for k, v in row.items() if k.startswith("kernelkit_") and "_x_" in k]
    xs += [f"{k} {v:.1f}%" for k, v in row.items() if k.endswith("_overhead_pct")]
    return " | ".join(parts) + (" | kernelkit vs " + ", ".join(xs) if xs else "")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="moe.json")
    ap.add_argument("--quick", action="store_true", help="Mixtral and Qwen3 shapes only")
    ap.add_argument("--shapes", default=None, help=f"comma-separated subset of {', '.join(SHAPES)}")
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    ap.add_argument("--rows", default="gate_up,layer", help="which rows: gate_up, layer or both (comma-separated)")
    ap.add_argument("--only", default=None, help="comma-separated row names to measure (default: all), e.g. "
                    "kernelkit,kernelkit_pointer,torch._grouped_mm,dense_mm,grouped_mm_layer")
    a = ap.parse_args()
    global ONLY
    ONLY = set(a.only.split(",")) if a.only else None
    names = a.shapes.split(",") if a.shapes else list(QUICK if a.quick else SHAPES)
    spec = registry.get("moe")
    datasheet = lookup(torch.cuda.get_device_name())
    peak = datasheet.tflops.get("bf16") if datasheet else None
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": __import__("triton").__version__,
            "dtype": "bfloat16", "bf16_peak_tflops_datasheet": peak, "grouped_mm": hasattr(torch, "_grouped_mm"),
            "env": env_fingerprint()}
    rows = []
    plan = len(names) * (("gate_up" in a.rows) + 2 * ("layer" in a.rows))
    i = 0
    for label in names:
        shape, scoring = SHAPES[label]
        gen = torch.Generator(device="cuda").manual_seed(0)
        args, _ = spec.make_inputs(shape, torch.bfloat16, "cuda", gen)
        kinds = a.rows.split(",")
        for rows_of_shape in (([gate_up_rows(label, shape, args, a.rep, peak)] if "gate_up" in kinds else []),
                              (layer_rows(label, shape, scoring, args, a.rep, peak,
                                          ("fwd", "fwd+bwd") if "layer" in kinds else ("fwd+bwd",))
                               if "layer" in kinds or "layer_bwd" in kinds else [])):
            for row in rows_of_shape:
                i += 1
                rows.append(row)
                print(f"[{i}/{plan}] {row['kind']} {label} {shape}: {describe(row)}", flush=True)
                meta["tuned_configs"] = chosen_configs()
                Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        del args
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
