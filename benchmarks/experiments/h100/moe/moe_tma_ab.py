"""A/B of the MoE gate-up grouped GEMM with the experts' weights read through TMA descriptors vs pointer loads,
side by side in one process (GPU). Usage: python3 benchmarks/experiments/h100/moe/moe_tma_ab.py [--out FILE.json]"""

import argparse
import json

import torch
from triton.testing import do_bench

from kernelkit.ops import _moe_gemm as G
from kernelkit.ops import moe as M
from moe_ab_inputs import SHAPES, routed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for label in ("mixtral", "qwen3"):
        shape = SHAPES[label]
        r = routed(shape)
        x, gate_up, t, k, hidden, inter, offs, tokens = r.x, r.gate_up, r.t, r.k, r.hidden, r.inter, r.offs, r.tokens
        h = torch.empty(t * k, inter, device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * t * k * hidden * 2 * inter
        out = {}
        for tma in (True, False, True):
            G.B_TMA = tma

            def run():
                M._grouped_gemm(x, gate_up.transpose(1, 2), h, offs, inter, a_idx=tokens, epilogue="swiglu")
            run()
            ms = do_bench(run, rep=200)
            out.setdefault("tma" if tma else "pointers", []).append(flops / ms / 1e9)
        x_perm = x[tokens]
        ms = do_bench(lambda: torch._grouped_mm(x_perm, gate_up.transpose(1, 2), offs=offs[1:]), rep=200)
        rows.append({"shape": label, "tflops": out, "torch._grouped_mm": flops / ms / 1e9})
        print(rows[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
