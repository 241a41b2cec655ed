"""A/B of the MoE grouped GEMM's Hopper kernels, side by side in one process (GPU). Gate-up GEMM (SwiGLU epilogue)
and down GEMM (routing weight, scatter): the pointer kernel (gather fused in its loads, weights through TMA) against
the persistent TMA kernel with x's rows gathered beforehand (not timed), gathered by a copy inside the call, or
gathered in its loads; at fixed 128-row tiles, then autotuned over all configs.
Usage: KERNELKIT_TUNE_CACHE=0 python3 benchmarks/experiments/h100/moe/moe_persistent_ab.py [--out FILE.json]
    [--shapes mixtral,qwen3]"""

import argparse
import json
import time

import torch
import triton
from triton.testing import do_bench

from kernelkit import tune
from kernelkit.ops import _moe_gemm as G
from kernelkit.ops import moe as M
from kernelkit.testing.bench import env_fingerprint
from moe_ab_inputs import SHAPES, routed
KNOBS = ("PERSISTENT", "TMA_GATHER")


def variant(name, **knobs):
    return name, {"PERSISTENT": True, "TMA_GATHER": "auto", **knobs}


# (Variants measured in moe_persistent_ab.json / moe_persistent_ab2.json and since removed from the kernel: one
# tile per program, a flattened tile loop, a searched tile table; this script at commit 'A/B script records each
# variant's config' ran them.)
VARIANTS = [variant("pointer", PERSISTENT=False), variant("tma_pregathered"), variant("tma_copy", TMA_GATHER="copy"),
            variant("tma_gather", TMA_GATHER="loads")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--shapes", default="mixtral,qwen3,deepseek-v3")
    ap.add_argument("--tuned", default="pointer,tma_copy,tma_gather", help="variants also run autotuned")
    ap.add_argument("--rep", type=int, default=60)
    args = ap.parse_args()
    all_configs = G.moe_grouped_tma_kernel.configs
    fixed = [c for c in all_configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps)
             in ((128, 128, 64, 8), (128, 256, 64, 8))]
    rows = []
    saved = {k: getattr(G, k) for k in KNOBS}
    for label in args.shapes.split(","):
        shape = SHAPES[label]
        r = routed(shape)
        x, gate_up, down, t, k, hidden, inter = r.x, r.gate_up, r.down, r.t, r.k, r.hidden, r.inter
        order, offs, tokens, w_rows = r.order, r.offs, r.tokens, r.w_rows
        x_perm = x[tokens]
        h = torch.empty(t * k, inter, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(t * k, hidden, device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * t * k * hidden * 2 * inter
        row = {"shape": label, "dims": list(shape), "gate_up_tflops": {}, "down_tflops": {}, "max_abs_diff": {}}
        refs = {}
        for configs in ("fixed", "tuned"):
            G.moe_grouped_tma_kernel.configs = fixed if configs == "fixed" else all_configs
            for name, knobs in VARIANTS:
                if configs == "tuned" and name not in args.tuned.split(","):
                    continue
                tag = f"{name}_{configs}"
                for key, value in knobs.items():
                    setattr(G, key, value)
                tune.forget(G.moe_grouped_tma_kernel)
                pre = name == "tma_pregathered"
                gemms = {"gate_up": (lambda: M._grouped_gemm(x_perm if pre else x, gate_up.transpose(1, 2), h, offs,
                                                             inter, a_idx=None if pre else tokens, epilogue="swiglu"),
                                     flops, h),
                         "down": (lambda: M._grouped_gemm(h, down.transpose(1, 2), y, offs, hidden, c_idx=order,
                                                          scale=w_rows), flops / 2, y)}
                for which, (run, fl, out) in gemms.items():
                    if which == "down" and name not in ("pointer", "tma_copy"):
                        continue
                    try:
                        start = time.perf_counter()
                        run()
                        torch.cuda.synchronize()
                        tune_s = time.perf_counter() - start
                        ms = do_bench(run, rep=args.rep, return_mode="median")
                        row[f"{which}_tflops"][tag] = fl / ms / 1e9
                        kern = G.moe_grouped_gemm_kernel if name == "pointer" else G.moe_grouped_tma_kernel
                        row.setdefault("configs", {})[f"{which}_{tag}"] = str(kern.best_config)
                        if which not in refs:
                            refs[which] = out.clone()
                        else:
                            row["max_abs_diff"][f"{which}_{tag}"] = (out.float() - refs[which].float()).abs().max().item()
                        print(f"{label} {which} {tag}: {fl / ms / 1e9:.0f} TF/s ({ms:.3f} ms, first call {tune_s:.1f} s)",
                              flush=True)
                    except Exception as e:  # noqa: BLE001
                        row[f"{which}_tflops"][tag] = f"{type(e).__name__}: {e}"[:300]
                        print(f"{label} {which} {tag}: {row[f'{which}_tflops'][tag]}", flush=True)
                for key, value in saved.items():
                    setattr(G, key, value)
        ms = do_bench(lambda: torch._grouped_mm(x_perm, gate_up.transpose(1, 2), offs=offs[1:]), rep=args.rep,
                      return_mode="median")
        row["gate_up_tflops"]["torch._grouped_mm"] = flops / ms / 1e9
        hh = h.clone()
        ms = do_bench(lambda: torch._grouped_mm(hh, down.transpose(1, 2), offs=offs[1:]), rep=args.rep,
                      return_mode="median")
        row["down_tflops"]["torch._grouped_mm"] = flops / 2 / ms / 1e9
        print(f"{label} torch._grouped_mm: gate-up {row['gate_up_tflops']['torch._grouped_mm']:.0f} TF/s, down "
              f"{row['down_tflops']['torch._grouped_mm']:.0f} TF/s", flush=True)
        rows.append(row)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"env": env_fingerprint(), "triton": triton.__version__, "rows": rows,
                           "tuned_configs": tune.chosen_configs()}, f, indent=1)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
