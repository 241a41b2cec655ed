"""The MoE backward's two dgrad GEMMs on the persistent TMA kernel (weights N-major) at single tile configs, against
torch._grouped_mm on the same products, side by side in one process (GPU). dh: dout[rows] @ W_down[e] with the
SwiGLU-backward epilogue; dx: dz @ W_gate_up[e], scattered.
Usage: python3 benchmarks/experiments/h100/moe/moe_dgrad_ab.py [--out F.json]"""

import argparse
import json

import torch
import triton
from triton.testing import do_bench

from kernelkit import tune
from kernelkit.ops import _moe_gemm as G
from kernelkit.testing.bench import env_fingerprint
from moe_ab_inputs import SHAPES, backward_buffers, routed
TILES = [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 3, 8), (256, 128, 64, 3, 8),
         (128, 256, 32, 4, 8), (128, 128, 128, 3, 8), (64, 256, 64, 4, 8), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--shapes", default="mixtral,deepseek-v3")
    ap.add_argument("--rep", type=int, default=40)
    a = ap.parse_args()
    all_configs = G.moe_grouped_tma_kernel.configs
    rows = []
    for label in a.shapes.split(","):
        shape = SHAPES[label]
        r = routed(shape)
        b = backward_buffers(r)
        gate_up, down, t, k, hidden, inter = r.gate_up, r.down, r.t, r.k, r.hidden, r.inter
        order, offs, tokens, w_rows = r.order, r.offs, r.tokens, r.w_rows
        dout, z, dz, dxr, rowdot, h = b.dout, b.z, b.dz, b.dxr, b.rowdot, b.h
        flops = 2.0 * t * k * hidden * inter
        gemms = {"dh": (lambda: G._grouped_gemm(dout, down, dz, offs, inter, a_idx=tokens, scale=w_rows, z=z,
                                                rowdot=rowdot, epilogue="swiglu_bwd", h_out=h), flops),
                 "dx": (lambda: G._grouped_gemm(dz, gate_up, dxr, offs, hidden, c_idx=order), 2 * flops)}
        row = {"shape": label, "dims": list(shape), "tflops": {}}
        for name, (run, fl) in gemms.items():
            for tile in TILES:
                G.moe_grouped_tma_kernel.configs = [c for c in all_configs if (
                    c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_stages, c.num_warps) == tile]
                if not G.moe_grouped_tma_kernel.configs:
                    G.moe_grouped_tma_kernel.configs = [triton.Config(
                        {"BLOCK_M": tile[0], "BLOCK_N": tile[1], "BLOCK_K": tile[2], "GROUP_M": 8},
                        num_stages=tile[3], num_warps=tile[4])]
                tune.forget(G.moe_grouped_tma_kernel)
                try:
                    run()
                    ms = do_bench(run, rep=a.rep, return_mode="median")
                    row["tflops"][f"{name} {tile}"] = fl / ms / 1e9
                    print(f"{label} {name} {tile}: {fl / ms / 1e9:.0f} TF/s", flush=True)
                except Exception as e:  # noqa: BLE001
                    row["tflops"][f"{name} {tile}"] = f"{type(e).__name__}: {e}"[:200]
                    print(f"{label} {name} {tile}: {type(e).__name__}", flush=True)
        dout_g = dout[tokens]
        for name, run, fl in (("dh torch._grouped_mm", lambda: torch._grouped_mm(dout_g, down, offs=offs[1:]), flops),
                              ("dx torch._grouped_mm", lambda: torch._grouped_mm(dz, gate_up, offs=offs[1:]),
                               2 * flops)):
            ms = do_bench(run, rep=a.rep, return_mode="median")
            row["tflops"][name] = fl / ms / 1e9
            print(f"{label} {name}: {fl / ms / 1e9:.0f} TF/s", flush=True)
        rows.append(row)
        G.moe_grouped_tma_kernel.configs = all_configs
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"env": env_fingerprint(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
