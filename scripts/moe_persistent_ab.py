"""A/B of the MoE grouped GEMM's Hopper kernels, side by side in one process (GPU): the TMA kernel's variants
(persistent or one tile per program; tile map by block reductions or a searched table; flattened loop or not) on
rows gathered beforehand, against the pointer kernel (gather fused or not) and torch._grouped_mm.
Usage: python3 scripts/moe_persistent_ab.py [--out FILE.json] [--shapes mixtral,qwen3] [--configs all|fixed]"""

import argparse
import itertools
import json
import time

import torch
import triton
from triton.testing import do_bench

from kernelkit.ops import _moe_gemm as G
from kernelkit.ops import moe as M
from kernelkit.ops import registry
from kernelkit.testing.bench import env_fingerprint
from kernelkit.tune import chosen_configs

SHAPES = {"mixtral": (8192, 4096, 14336, 8, 2), "qwen3": (8192, 2048, 768, 128, 8),
          "deepseek-v3": (8192, 7168, 2048, 256, 8)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--shapes", default="mixtral,qwen3")
    ap.add_argument("--configs", default="fixed", help="fixed: 128x128x64 tiles, 8 warps, 3 or 4 stages")
    ap.add_argument("--rep", type=int, default=100)
    args = ap.parse_args()
    if args.configs == "fixed":
        G.moe_grouped_tma_kernel.configs = [c for c in G.moe_grouped_tma_kernel.configs
                                            if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"],
                                                c.num_warps) == (128, 128, 64, 8)]
    rows = []
    spec = registry.get("moe")
    for label in args.shapes.split(","):
        shape = SHAPES[label]
        (x, router, gate_up, down, k), _ = spec.make_inputs(shape, torch.bfloat16, "cuda",
                                                            torch.Generator(device="cuda").manual_seed(0))
        t, hidden, inter, n_exp, _ = shape
        _, experts = M.route(x, router, k)
        order, offs = M._permute(experts, n_exp)
        tokens = order // k
        x_perm = x[tokens]
        h = torch.empty(t * k, inter, device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * t * k * hidden * 2 * inter
        row = {"shape": label, "dims": list(shape), "tflops": {}, "max_abs_diff_vs_pointer": {}}
        ref = None
        variants = [("pointer_fused_gather", False, None), ("pointer_pregathered", False, None)]
        variants += [(f"tma_{'persist' if p else 'grid'}_{tm}{'_flat' if fl else ''}", True, (p, tm, fl))
                     for p, tm, fl in itertools.product((True, False), ("reduce", "table"), (True, False))
                     if p or not fl]
        for name, persistent, knobs in variants:
            G.PERSISTENT = persistent
            if knobs:
                G.TMA_PERSIST, G.TMA_TILE_MAP, G.TMA_FLATTEN = knobs
            gathered = name == "pointer_fused_gather"

            def run():
                if gathered:
                    M._grouped_gemm(x, gate_up.transpose(1, 2), h, offs, inter, a_idx=tokens, epilogue="swiglu")
                else:
                    M._grouped_gemm(x_perm, gate_up.transpose(1, 2), h, offs, inter, epilogue="swiglu")
            try:
                start = time.perf_counter()
                run()
                torch.cuda.synchronize()
                tune_s = time.perf_counter() - start
                ms = do_bench(run, rep=args.rep, return_mode="median")
                row["tflops"][name] = flops / ms / 1e9
                if ref is None:
                    ref = h.clone()
                else:
                    row["max_abs_diff_vs_pointer"][name] = (h.float() - ref.float()).abs().max().item()
                print(f"{label} {name}: {flops / ms / 1e9:.0f} TF/s ({ms:.3f} ms, first call {tune_s:.1f} s)",
                      flush=True)
            except Exception as e:  # noqa: BLE001
                row["tflops"][name] = f"{type(e).__name__}: {e}"[:300]
                print(f"{label} {name}: {row['tflops'][name]}", flush=True)
        G.PERSISTENT = True
        ms = do_bench(lambda: torch._grouped_mm(x_perm, gate_up.transpose(1, 2), offs=offs[1:]), rep=args.rep,
                      return_mode="median")
        row["tflops"]["torch._grouped_mm"] = flops / ms / 1e9
        print(f"{label} torch._grouped_mm: {flops / ms / 1e9:.0f} TF/s", flush=True)
        rows.append(row)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"env": env_fingerprint(), "triton": triton.__version__, "configs": args.configs,
                           "rows": rows, "tuned_configs": chosen_configs()}, f, indent=1)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
