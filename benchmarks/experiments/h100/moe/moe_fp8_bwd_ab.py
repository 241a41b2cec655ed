"""The MoE backward's GEMMs in bf16 and in fp8 (backward_precision="fp8"), each part timed alone, side by side in
one process (GPU): the GEMMs on operands quantized beforehand, the quantization passes they need (quantize_rows of
dout and of d(gate, up), quantize_cols_t of both expert weights, quantize_segments_t of the wgrads' four operands,
with their GB/s), and torch._scaled_grouped_mm on the same fp8 dgrad products. dh: dout[rows] @ W_down[e] with the
SwiGLU-backward epilogue; dx: d(gate, up) @ W_gate_up[e], scattered to the (token, slot) rows; wgrads: d(gate, up)^T
@ x[rows] and (w * dout[rows])^T @ h per expert, bf16 as the layer runs them (torch._grouped_mm or kernelkit's wgrad
kernel, see moe._cublas_wgrads) and fp8.
Usage: python3 benchmarks/experiments/h100/moe/moe_fp8_bwd_ab.py [--shapes mixtral,qwen3,deepseek-v3] [--out F.json]"""

import argparse
import json

import torch
from triton.testing import do_bench

from kernelkit.ops import _fp8
from kernelkit.ops import _moe_gemm as G
from kernelkit.ops import moe as M
from kernelkit.testing.bench import env_fingerprint
from moe_ab_inputs import SHAPES, backward_buffers, routed


def _flag_tile(tile, fn):
    saved = _fp8.COLS_T_TILE
    _fp8.COLS_T_TILE = tile
    try:
        return fn()
    finally:
        _fp8.COLS_T_TILE = saved


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--shapes", default="mixtral,qwen3,deepseek-v3")
    ap.add_argument("--rep", type=int, default=60)
    ap.add_argument("--tiles", default="", help="quantize_cols_t tiles to sweep, e.g. 64x64x4,256x64x8")
    a = ap.parse_args()
    tiles = [tuple(map(int, s.split("x"))) for s in a.tiles.split(",") if s]
    rows = []
    for label in a.shapes.split(","):
        shape = SHAPES[label]
        r = routed(shape)
        b = backward_buffers(r)
        x, gate_up, down, t, k, hidden, inter = r.x, r.gate_up, r.down, r.t, r.k, r.hidden, r.inter
        order, offs, tokens, w_rows = r.order, r.offs, r.tokens, r.w_rows
        dout, z, dz_out, dxr, rowdot, h = b.dout, b.z, b.dz, b.dxr, b.rowdot, b.h.normal_()
        dz = torch.randn_like(z)  # (an input here: the gate-up dgrad's and wgrad's)
        doutq, douts = M.quantize_rows(dout)
        dzq, dzs = M.quantize_rows(dz)
        dq, ds = M.quantize_cols_t(down)  # (E, I, H)
        guq, gus = M.quantize_cols_t(gate_up)  # (E, H, 2I)
        flops = 2.0 * t * k * hidden * inter
        doutq_g, douts_g = doutq[tokens], douts[tokens]
        parts = {
            "dh bf16": (lambda: G._grouped_gemm(dout, down, dz_out, offs, inter, a_idx=tokens, scale=w_rows, z=z,
                                                rowdot=rowdot, epilogue="swiglu_bwd", h_out=h), flops, None),
            "dh fp8": (lambda: G._grouped_gemm(doutq, dq.transpose(1, 2), dz_out, offs, inter, a_idx=tokens,
                                               scale=w_rows, z=z, rowdot=rowdot, epilogue="swiglu_bwd", h_out=h,
                                               a_scale=douts, b_scale=ds), flops, None),
            "dh torch._scaled_grouped_mm": (lambda: torch._scaled_grouped_mm(
                doutq_g, dq.transpose(1, 2), douts_g, ds, offs=offs[1:], out_dtype=torch.bfloat16),
                flops, None),
            "dx bf16": (lambda: G._grouped_gemm(dz, gate_up, dxr, offs, hidden, c_idx=order), 2 * flops, None),
            "dx fp8": (lambda: G._grouped_gemm(dzq, guq.transpose(1, 2), dxr, offs, hidden, c_idx=order,
                                               a_scale=dzs, b_scale=gus), 2 * flops, None),
            "dx torch._scaled_grouped_mm": (lambda: torch._scaled_grouped_mm(
                dzq, guq.transpose(1, 2), dzs, gus, offs=offs[1:], out_dtype=torch.bfloat16),
                2 * flops, None),
            "quantize_rows dout": (lambda: M.quantize_rows(dout), None, dout.numel() * 3),
            "quantize_rows dz": (lambda: M.quantize_rows(dz), None, dz.numel() * 3),
            "quantize_cols_t W_down": (lambda: M.quantize_cols_t(down), None, down.numel() * 3),
            "quantize_cols_t W_gate_up": (lambda: M.quantize_cols_t(gate_up), None, gate_up.numel() * 3),
            "copy W_gate_up (bf16 clone)": (lambda: gate_up.clone(), None, gate_up.numel() * 4),
        }
        dgu = torch.empty_like(gate_up)
        dd = torch.empty_like(down)
        cublas = M._cublas_wgrads(x, gate_up, down)
        x_g = x[tokens]
        scaled = dout[tokens] * w_rows[:, None].to(dout.dtype)
        wgu_ops = G.quantize_segments_t(dz, offs, None, None)
        wgx_ops = G.quantize_segments_t(x, offs, tokens, None)
        wdo_ops = G.quantize_segments_t(dout, offs, tokens, w_rows)
        wdh_ops = G.quantize_segments_t(h, offs, None, None)
        rows_n = t * k
        parts |= {
            "wgrad gate-up bf16": ((lambda: torch._grouped_mm(dz.t(), x_g, offs=offs[1:])) if cublas else
                                   (lambda: G._wgrad(dz, x, dgu, offs, b_idx=tokens)), 2 * flops, None),
            "wgrad gate-up fp8 GEMM": (lambda: G._wgrad_fp8_gemm(wgu_ops[0], wgu_ops[1], wgx_ops[0], wgx_ops[1],
                                                                wgu_ops[2], dgu, rows_n), 2 * flops, None),
            "wgrad gate-up fp8 (with its quantization)": (lambda: G._wgrad_fp8(dz, x, dgu, offs, b_idx=tokens),
                                                          2 * flops, None),
            "wgrad down bf16": ((lambda: torch._grouped_mm(scaled.t(), h, offs=offs[1:])) if cublas else
                                (lambda: G._wgrad(dout, h, dd, offs, a_idx=tokens, scale=w_rows)), flops, None),
            "wgrad down fp8 GEMM": (lambda: G._wgrad_fp8_gemm(wdo_ops[0], wdo_ops[1], wdh_ops[0], wdh_ops[1],
                                                             wdo_ops[2], dd, rows_n), flops, None),
            "wgrad down fp8 (with its quantization)": (
                lambda: G._wgrad_fp8(dout, h, dd, offs, a_idx=tokens, scale=w_rows), flops, None),
            "quantize_segments_t dz": (lambda: G.quantize_segments_t(dz, offs), None, dz.numel() * 3),
            "quantize_segments_t x gathered": (lambda: G.quantize_segments_t(x, offs, tokens), None,
                                               rows_n * hidden * 3),
        }
        for tile in tiles:  # the same pass at other (BLOCK_R, BLOCK_C, num_warps)
            parts[f"quantize_cols_t W_gate_up {tile}"] = (
                (lambda tile: lambda: _flag_tile(tile, lambda: M.quantize_cols_t(gate_up)))(tile), None,
                gate_up.numel() * 3)
        row = {"shape": label, "dims": list(shape), "ms": {}, "tflops": {}, "gbps": {}}
        for name, (run, fl, nbytes) in parts.items():
            try:
                run()
                torch.cuda.synchronize()
                ms = do_bench(run, rep=a.rep, return_mode="median")
            except Exception as e:  # noqa: BLE001
                row["ms"][name] = f"{type(e).__name__}: {e}"[:200]
                print(f"{label} {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            row["ms"][name] = ms
            extra = ""
            if fl:
                row["tflops"][name] = fl / ms / 1e9
                extra = f"{fl / ms / 1e9:.0f} TF/s"
            if nbytes:
                row["gbps"][name] = nbytes / ms / 1e6
                extra = f"{nbytes / ms / 1e6:.0f} GB/s (ideal bytes)"
            print(f"{label} {name}: {ms:.3f} ms {extra}", flush=True)
        m = row["ms"]
        try:
            bf16 = m["dh bf16"] + m["dx bf16"]
            fp8 = m["dh fp8"] + m["dx fp8"] + m["quantize_rows dout"] + m["quantize_rows dz"]
            weights_q = m["quantize_cols_t W_down"] + m["quantize_cols_t W_gate_up"]
            row["dgrads_bf16_ms"], row["dgrads_fp8_ms_weights_kept"] = bf16, fp8
            row["dgrads_fp8_ms_with_weight_quantization"] = fp8 + weights_q
            print(f"{label}: dgrads bf16 {bf16:.2f} ms, fp8 {fp8:.2f} ms with the weights' copies kept, "
                  f"{fp8 + weights_q:.2f} ms quantizing them", flush=True)
            wb = m["wgrad gate-up bf16"] + m["wgrad down bf16"]
            wf = m["wgrad gate-up fp8 (with its quantization)"] + m["wgrad down fp8 (with its quantization)"]
            row["wgrads_bf16_ms"], row["wgrads_fp8_ms"] = wb, wf
            print(f"{label}: wgrads bf16 {wb:.2f} ms, fp8 {wf:.2f} ms (quantization included)", flush=True)
        except (KeyError, TypeError):
            pass
        rows.append(row)
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"env": env_fingerprint(), "rows": rows}, f, indent=1)
        parts.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
