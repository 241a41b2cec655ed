"""Attention forward (and backward) against cuDNN, FA2 and FlashAttention-4, side by side in one process.

Issue 28's table: batch x seq = 16384 tokens, heads x head_dim = 2048, bf16, d64 and d128, seq 1k/4k/16k, causal or
not, plus GQA 32/8 at d128. Each row times kernelkit's Gluon forward (hopper.py), kernelkit's Triton forward,
SDPA pinned to cuDNN and to FlashAttention-2, and FlashAttention-4's CuTe-DSL kernels when `flash_attn.cute`
imports (its sm_90 path). `triton.testing.do_bench` median with the L2 flushed before each call; TFLOP/s from
the op's cost model (4·d per attended pair and head; backward 2.5x). Backward = (forward + backward) - forward.

    python benchmarks/attention_vs_cudnn.py --out results.json [--bwd] [--kernel-time] [--rows "d128 s4096,..."]
        [--bwd-variants] [--only cudnn,kernelkit,kk-bwd-gluon,...] [--model-rows]

`--bwd-variants` adds the Gluon backward forced on at both head dims (`kk-bwd-gluon`: its dK / dV kernel and the
Triton dQ kernel; `kk-bwd-gluon-s3`: 3 ring slots; `kk-bwd-gluon-bm64`: 64-query steps at d128; `kk-bwd-fused`: dQ
fused, as shipped where `backward.gluon_auto` takes it) and, as shipped but for one knob, `kk-bwd-launch-order`
(causal key blocks in launch order, not `hopper_bwd.LONGEST_FIRST`), `kk-bwd-unsplit` (a GQA group's query heads
never split over programs at small grids, `hopper_bwd.SPLIT_WAVES` 0) and `kk-bwd-one-loop` (the causal fused step in
one loop, the mask on every step: `hopper_bwd.ONE_LOOP`). Rows `eager` (SDPA with its own backend choice, as a
model calls it) and, with `--flex`, `flex` (FlexAttention under torch.compile) are torch's own. Every kernelkit
implementation sets all the backward's switches on each call and leaves them set, so the backward timed after it is
its own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton

from kernelkit.ops import registry
from kernelkit.ops.attention import attention, backward as bwd_mod, cost, forward as fwd_mod, hopper_bwd
from kernelkit.testing.bench import kernel_time_ms

# The backward's knobs as shipped (KERNELKIT_ATTENTION_GLUON_BWD and hopper_bwd's constants).
SHIPPED_BWD = dict(gluon=bwd_mod.GLUON, fused=bwd_mod.GLUON_FUSED_DQ, stages=hopper_bwd.STAGES,
                   bm128=hopper_bwd.BLOCK_M[128], longest_first=hopper_bwd.LONGEST_FIRST,
                   split_waves=hopper_bwd.SPLIT_WAVES, one_loop=hopper_bwd.ONE_LOOP)


def _bwd_state(**over) -> None:
    """Set every backward knob, the shipped value unless `over` names it, and leave it set: the backward runs after
    the implementation's call returns (in `bench_row`'s autograd step), so a knob restored on return would time the
    shipped backward under every name. Each kernelkit implementation calls this first."""
    st = {**SHIPPED_BWD, **{k: v for k, v in over.items() if v is not None}}
    bwd_mod.GLUON, bwd_mod.GLUON_FUSED_DQ, hopper_bwd.STAGES = st["gluon"], st["fused"], st["stages"]
    hopper_bwd.BLOCK_M[128] = st["bm128"]
    hopper_bwd.LONGEST_FIRST = st["longest_first"]
    hopper_bwd.SPLIT_WAVES = st["split_waves"]
    hopper_bwd.ONE_LOOP = st["one_loop"]


def rows(model_rows: bool = False):
    """Issue 28's 14 rows; with `model_rows`, also the attention calls of the Llama-shaped training steps that
    `kernelkit profile --patch` measures (GQA 32/8, 2048 tokens: d128 at batch 1, d64 at batch 4)."""
    out = [dict(name=f"d{d} s{s}{' causal' if c else ''}", b=16384 // s, s=s, h=2048 // d, hk=2048 // d, d=d,
                causal=c) for d in (128, 64) for s in (16384, 4096, 1024) for c in (False, True)]
    out += [dict(name=f"d128 s4096 GQA 32/8{' causal' if c else ''}", b=4, s=4096, h=32, hk=8, d=128, causal=c)
            for c in (False, True)]
    if model_rows:
        out += [dict(name="llama-8b b1 s2048 d128 GQA 32/8 causal", b=1, s=2048, h=32, hk=8, d=128, causal=True),
                dict(name="llama-1b b4 s2048 d64 GQA 32/8 causal", b=4, s=2048, h=32, hk=8, d=64, causal=True)]
    return out


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        kw = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, **kw).transpose(1, 2)
    return run


def _kk(gluon: bool | None):
    """kernelkit: the Gluon kernels forced (True; forward and dK / dV), the Triton ones (False), or as shipped (None:
    the Gluon forward where `hopper.preferred` says it measured faster, the backward as its switch says)."""
    from kernelkit.ops.attention import hopper

    def run(q, k, v, causal):
        fwd_mod.GLUON = gluon is not False
        _bwd_state(gluon=gluon)
        old = dict(hopper.TRITON_UP_TO)
        if gluon:
            hopper.TRITON_UP_TO.clear()
        try:
            return attention(q, k, v, causal=causal)
        finally:
            hopper.TRITON_UP_TO.update(old)
    return run


def _kk_bwd(fused_dq: bool, stages: int | None = None, bm128: int | None = None, longest_first: bool | None = None,
            gluon: bool | str = True, split_waves: int | None = None, one_loop: bool | None = None):
    """kernelkit as shipped forward, the Gluon kernel forced in the backward (or `gluon` as the switch takes it), with
    dQ fused (TMA reduces) or from the Triton dQ kernel, `stages` (Q, dO) ring slots, `bm128` queries a step at d128
    (Triton dQ), causal key blocks longest first or in launch order, GQA groups split at small grids or not, and the
    causal fused step in one loop or two (`hopper_bwd.ONE_LOOP`)."""
    def run(q, k, v, causal):
        fwd_mod.GLUON = True
        _bwd_state(gluon=gluon, fused=fused_dq, stages=stages, bm128=bm128, longest_first=longest_first,
                   split_waves=split_waves, one_loop=one_loop)
        return attention(q, k, v, causal=causal)
    return run


def _kk_variant(stages: int | None = None, persistent: bool | None = None, overlap: bool | None = None,
                pingpong: bool | None = None, consumers: int | None = None):
    """kernelkit's Gluon forward with `stages` K/V ring slots at d64 (d128 fits 2 only) and / or the persistent walk,
    the intra-warpgroup overlap or the forced ping-pong on or off."""
    from kernelkit.ops.attention import hopper

    def run(q, k, v, causal):
        fwd_mod.GLUON = True
        _bwd_state(gluon=True)
        old = (dict(hopper.STAGES), dict(hopper.PERSISTENT), dict(hopper.OVERLAP), dict(hopper.TRITON_UP_TO),
               dict(hopper.PINGPONG), dict(hopper.CONSUMERS))
        hopper.TRITON_UP_TO.clear()
        if stages:
            hopper.STAGES[64] = stages
        if persistent is not None:
            hopper.PERSISTENT[bool(causal)] = None if persistent else 0
        if overlap is not None:
            hopper.OVERLAP[q.shape[-1]] = overlap
        if pingpong is not None:
            hopper.PINGPONG[q.shape[-1]] = pingpong
        if consumers is not None and q.shape[-1] == 64:  # d128 fits two only
            hopper.CONSUMERS[64] = consumers
        try:
            return attention(q, k, v, causal=causal)
        finally:
            hopper.STAGES.update(old[0])
            hopper.PERSISTENT.update(old[1])
            hopper.OVERLAP.update(old[2])
            hopper.TRITON_UP_TO.update(old[3])
            hopper.PINGPONG.update(old[4])
            hopper.CONSUMERS.update(old[5])
    return run


def _plain(fn):
    """An op-spec row (q, k, v, causal=...) as this script's (q, k, v, causal)."""
    return lambda q, k, v, causal: fn(q, k, v, causal=causal)


def _fa4():
    from flash_attn.cute import flash_attn_func  # noqa: F401 - FlashAttention-4 (CuTe DSL)

    def run(q, k, v, causal):
        out = flash_attn_func(q, k, v, causal=causal)
        return out[0] if isinstance(out, tuple) else out
    return run


def impls(want_fa4: bool, stages=(), variants=False, consumers=(), bwd_variants=False, flex=False) -> dict:
    from torch.nn.attention import SDPBackend

    spec = registry.get("attention")
    got = {"kk-gluon": _kk(True), "kk-triton": _kk(False), "kernelkit": _kk(None),
           "cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
           "fa2": _sdpa(SDPBackend.FLASH_ATTENTION),
           "eager": _plain(spec.eager)}  # torch eager: SDPA as a model calls it, its own backend choice
    if flex:  # torch.compile: FlexAttention, compiled once per shape (tens of seconds each)
        got["flex"] = _plain(spec.competitors["flex"]())
    got.update({f"kk-gluon-s{n}": _kk_variant(stages=n) for n in stages})
    if variants:
        got.update({"kk-gluon-grid": _kk_variant(persistent=False), "kk-gluon-overlap": _kk_variant(overlap=True),
                    "kk-gluon-pingpong": _kk_variant(overlap=False, pingpong=True),
                    "kk-gluon-overlap-pingpong": _kk_variant(overlap=True, pingpong=True)})
    if consumers:
        got.update({f"kk-gluon-{n}wg": _kk_variant(consumers=n) for n in consumers})
        got.update({f"kk-gluon-{n}wg-grid": _kk_variant(consumers=n, persistent=False) for n in consumers})
    if bwd_variants:
        got.update({"kk-bwd-gluon": _kk_bwd(False), "kk-bwd-fused": _kk_bwd(True),
                    "kk-bwd-gluon-s3": _kk_bwd(False, stages=3), "kk-bwd-gluon-bm64": _kk_bwd(False, bm128=64),
                    "kk-bwd-launch-order": _kk_bwd(True, longest_first=False, gluon=bwd_mod.GLUON),
                    "kk-bwd-unsplit": _kk_bwd(True, split_waves=0, gluon=bwd_mod.GLUON),
                    "kk-bwd-one-loop": _kk_bwd(True, one_loop=True, gluon=bwd_mod.GLUON)})
    if want_fa4:
        try:
            got["fa4"] = _fa4()
        except Exception as e:  # noqa: BLE001 - say why the anchor is missing, keep the others
            print(f"fa4: not available ({type(e).__name__}: {e})", flush=True)
    return got


def bench_row(r, fns, bwd: bool, kernel_time: bool = False) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(r["b"], r["s"], r["h"], r["d"], device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(r["b"], r["s"], r["hk"], r["d"], device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    fl = cost(q, k, v, causal=r["causal"]).flops
    ref = None
    out = {"row": r["name"], "shape": [r["b"], r["s"], r["h"], r["hk"], r["d"], r["causal"]], "impls": {}}
    for name, fn in fns.items():
        res = {}
        try:
            o = fn(q, k, v, r["causal"])
            if ref is None:
                ref = o.float()
            res["max_abs_diff_vs_first"] = float((o.float() - ref).abs().max())
            ms = triton.testing.do_bench(lambda: fn(q, k, v, r["causal"]), warmup=25, rep=200, return_mode="median")
            res.update(fwd_ms=ms, fwd_tflops=fl / ms / 1e9)
            if kernel_time:  # the kernels' device time alone (torch.profiler), host time excluded
                kms = kernel_time_ms(lambda: fn(q, k, v, r["causal"]))
                if kms:
                    res.update(fwd_kernel_ms=kms, fwd_kernel_tflops=fl / kms / 1e9)
            if bwd:
                qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
                do = torch.randn_like(q)

                def step():
                    torch.autograd.grad(fn(qg, kg, vg, r["causal"]), (qg, kg, vg), do)
                ms2 = triton.testing.do_bench(step, warmup=10, rep=200, return_mode="median")
                res.update(bwd_ms=ms2 - ms, bwd_tflops=2.5 * fl / (ms2 - ms) / 1e9)
                if kernel_time and res.get("fwd_kernel_ms"):
                    kms2 = kernel_time_ms(step)
                    if kms2 and kms2 > res["fwd_kernel_ms"]:
                        kb = kms2 - res["fwd_kernel_ms"]
                        res.update(bwd_kernel_ms=kb, bwd_kernel_tflops=2.5 * fl / kb / 1e9)
        except Exception as e:  # noqa: BLE001 - a row an anchor cannot run is recorded, not fatal
            res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out["impls"][name] = res
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="attention_vs_cudnn.json")
    ap.add_argument("--bwd", action="store_true", help="also time forward + backward")
    ap.add_argument("--no-fa4", action="store_true")
    ap.add_argument("--stages", default="", help="also kernelkit's Gluon forward at these d64 ring depths (2,3)")
    ap.add_argument("--variants", action="store_true",
                    help="also the Gluon forward with one program per tile, and with the intra-warpgroup overlap")
    ap.add_argument("--kernel-time", action="store_true",
                    help="also each call's kernels' device time alone (torch.profiler; host time excluded)")
    ap.add_argument("--consumers", default="", help="also the Gluon forward with these consumer counts at d64 (2,3)")
    ap.add_argument("--bwd-variants", action="store_true",
                    help="also the Gluon backward with dQ fused (TMA reduces) and with the Triton dQ kernel, and their knobs")
    ap.add_argument("--flex", action="store_true", help="also FlexAttention under torch.compile (slow to compile)")
    ap.add_argument("--model-rows", action="store_true", help="also the Llama-shaped calls (GQA 32/8, 2048 tokens)")
    ap.add_argument("--only", default="", help="comma-separated implementations to time (default: all)")
    ap.add_argument("--rows", default="", help="comma-separated row names (default: all)")
    a = ap.parse_args(argv)
    fns = impls(not a.no_fa4, [int(n) for n in a.stages.split(",") if n], a.variants,
                [int(n) for n in a.consumers.split(",") if n], a.bwd_variants, a.flex)
    if a.only:
        fns = {n: f for n, f in fns.items() if n in a.only.split(",")}
    todo = [r for r in rows(a.model_rows) if not a.rows or r["name"] in a.rows.split(",")]
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "cudnn": torch.backends.cudnn.version(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    results = []
    for i, r in enumerate(todo):
        t0 = time.time()
        res = bench_row(r, fns, a.bwd, a.kernel_time)
        results.append(res)
        def cell(n, v):
            if "error" in v:
                return f"{n} ERR"
            c = f"{n} {v.get('fwd_tflops', 0):.0f}" + (f"/{v['bwd_tflops']:.0f}" if "bwd_tflops" in v else "")
            if "fwd_kernel_tflops" in v:  # kernels alone
                c += f" (k {v['fwd_kernel_tflops']:.0f}" + (f"/{v['bwd_kernel_tflops']:.0f}" if "bwd_kernel_tflops" in v
                                                             else "") + ")"
            return c
        cells = "  ".join(cell(n, v) for n, v in res["impls"].items())
        print(f"[{i + 1}/{len(todo)}] {r['name']:<26} {cells}  ({time.time() - t0:.0f}s)", flush=True)
        with open(a.out, "w") as f:
            json.dump({"env": env, "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
