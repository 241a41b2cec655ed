"""kernelkit.attention against SDPA pinned to cuDNN and to FlashAttention-2, side by side in one process (GPU).

    PYTHONPATH=src python benchmarks/attention.py --json attention.json [--configs] [--warm-workers 14]

Rows: head_dim in {64, 128} x seq in {1024, 4096, 16384} x causal in {False, True}, 16384 tokens per row
(batch = 16384 // seq), heads = 2048 // head_dim; plus GQA, 32 query / 8 KV heads, d128, s4096. bf16,
layout (batch, seq, heads, d) for kernelkit and (batch, heads, seq, d) for SDPA (each its native one).
FLOPs: forward 4·b·h·s²·d (half under the causal mask), backward 2.5x the forward. Times are
`triton.testing.do_bench` medians (L2 flushed before every run); backward is `torch.autograd.grad` of a
recorded forward. kernelkit's errors are max|x - cuDNN| / max|cuDNN| of o and of dq, dk, dv.

--configs also times each candidate config of each kernelkit kernel alone (the kernel's config list
replaced by that one config): the current lists plus the candidates below, forward and the two backward
kernels separately (dk/dv first, the dq kernel's candidates then with the best dk/dv config), and the
pointer path at seq 1024 (in-kernel TMA descriptors cost a global-memory write and fence per program).
Before timing, --warm-workers processes compile every candidate in parallel (Triton's disk cache), each
recording which compiled and ran, so that the timing process never compiles and skips what failed.
The persistent tuning cache is off (KERNELKIT_TUNE_CACHE=0) unless already set: the sweep tunes afresh.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("KERNELKIT_TUNE_CACHE", "0")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import kernelkit  # noqa: E402
from kernelkit import runtime  # noqa: E402
from kernelkit.ops.attention import backward as bwd_mod, forward as fwd_mod, tiles  # noqa: E402

TOKENS, WIDTH = 16384, 2048
DEVICE = "cuda"


def rows():
    out = [dict(d=d, seq=s, causal=c, hq=WIDTH // d, hk=WIDTH // d, batch=TOKENS // s)
           for d in (64, 128) for s in (1024, 4096, 16384) for c in (False, True)]
    out.append(dict(d=128, seq=4096, causal=False, hq=32, hk=8, batch=TOKENS // 4096))
    return out


def row_name(r):
    gqa = f"-gqa{r['hq']}/{r['hk']}" if r["hq"] != r["hk"] else ""
    return f"d{r['d']}-s{r['seq']}{'-causal' if r['causal'] else ''}{gqa}"


def fwd_flops(r):
    f = 4.0 * r["batch"] * r["hq"] * r["seq"] ** 2 * r["d"]
    return f / 2 if r["causal"] else f


# Candidates beyond the current lists, (BLOCK_M, BLOCK_N, warps, stages[, warp-specialized]) per head dim.
NEW = {
    "fwd": {64: [(128, 128, 4, 3), (128, 128, 8, 4, True), (128, 128, 8, 2, True), (128, 64, 4, 4)],
            128: [(128, 128, 8, 4), (128, 128, 8, 4, True), (128, 64, 8, 4), (128, 64, 8, 4, True)]},
    "dkdv": {64: [(64, 128, 8, 2, True), (32, 128, 8, 2, True), (64, 128, 8, 3, True), (128, 128, 8, 2)],
             128: [(64, 128, 8, 2, True), (32, 128, 8, 2, True), (64, 128, 8, 3, True), (32, 128, 8, 3, True)]},
    "dq": {64: [(128, 64, 8, 2, True), (128, 128, 8, 3)],
           128: [(128, 128, 8, 3), (128, 64, 8, 2, True), (128, 64, 8, 3, True), (128, 128, 8, 2, True),
                 (64, 64, 4, 4)]},
}
# Pointer-path backward configs timed at seq 1024 (tile loads without descriptors; the forward: every candidate).
POINTER = {"fwd": [(128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3)], "dkdv": [(64, 128, 8, 2), (32, 128, 8, 2)],
           "dq": [(128, 64, 8, 2)]}
KERNELS = {"fwd": (fwd_mod, "attn_fwd_kernel", "_FWD_CONFIGS", "_FWD_PRUNE"),
           "dkdv": (bwd_mod, "attn_bwd_dkdv_kernel", "_DKDV_CONFIGS", "_DKDV_PRUNE"),
           "dq": (bwd_mod, "attn_bwd_dq_kernel", "_DQ_CONFIGS", "_DQ_PRUNE")}


def config(t):
    m, n, w, s, *ws = t
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n, **({"WS": True} if ws and ws[0] else {})}, num_warps=w,
                         num_stages=s)


def ident(c):
    return (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages, bool(c.kwargs.get("WS", False)))


def cfg_name(t):
    m, n, w, s, *ws = t
    return f"{m}x{n}w{w}s{s}{'ws' if ws and ws[0] else ''}"


def current(kind, d):
    """The tuples of the kernel's config list that its pruner keeps for head dim d at long sequences."""
    mod, _, configs, prune = KERNELS[kind]
    if getattr(mod, prune) is None:  # the interpreter's one config
        return [ident(c) for c in getattr(mod, configs)]
    kept = getattr(mod, prune)["early_config_prune"](getattr(mod, configs), {}, BLOCK_D=tiles.block_d(d),
                                                      SEQ_Q_KEY=1 << 20, SEQ_K_KEY=1 << 20)
    return [ident(c) for c in kept]


def candidates(kind, d):
    out = list(dict.fromkeys(current(kind, d) + [(*t[:4], bool(t[4]) if len(t) > 4 else False)
                                                 for t in NEW[kind][d]]))
    return out


@contextlib.contextmanager
def only(kind, t):
    """The kernel's config list replaced by the one config t (None: unchanged), its pruner off."""
    if t is None:
        yield
        return
    mod, name, _, _ = KERNELS[kind]
    kernel = getattr(mod, name)
    saved = kernel.configs, kernel.early_config_prune, dict(kernel.cache)
    chosen = {k: v for k, v in runtime._chosen.items() if k[0] is kernel}
    kernel.configs, kernel.early_config_prune = [config(t)], None
    kernel.cache.clear()
    for k in chosen:
        del runtime._chosen[k]
    try:
        yield
    finally:
        for k in [k for k in runtime._chosen if k[0] is kernel]:
            del runtime._chosen[k]
        runtime._chosen.update(chosen)
        kernel.configs, kernel.early_config_prune = saved[:2]
        kernel.cache.clear()
        kernel.cache.update(saved[2])


@contextlib.contextmanager
def tma(on):
    saved = tiles.USE_TMA
    tiles.USE_TMA = on
    if on:  # the launcher sets the descriptors' scratch allocator only where it chooses TMA itself
        runtime.ensure_tma_allocator()
    try:
        yield
    finally:
        tiles.USE_TMA = saved


def inputs(r, dtype=torch.bfloat16):
    device = DEVICE
    g = torch.Generator(device=device).manual_seed(0)
    b, s, d = r["batch"], r["seq"], r["d"]
    q = torch.randn(b, s, r["hq"], d, device=device, dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(b, s, r["hk"], d, device=device, dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(b, s, r["hk"], d, device=device, dtype=dtype, generator=g).requires_grad_()
    do = torch.randn(b, s, r["hq"], d, device=device, dtype=dtype, generator=g)
    return q, k, v, do


def bhsd(*xs):
    return [x.detach().transpose(1, 2).contiguous().requires_grad_() for x in xs]


def rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


class Row:
    def __init__(self, r, rep, warmup):
        self.r, self.rep, self.warmup = r, rep, warmup
        self.q, self.k, self.v, self.do = inputs(r)
        self.qs, self.ks, self.vs, self.dos = bhsd(self.q, self.k, self.v, self.do)
        self.ref = None

    def time(self, fn):
        return do_bench(fn, warmup=self.warmup, rep=self.rep, return_mode="median")

    # --- SDPA ---
    def sdpa(self, backend):
        gqa = self.r["hq"] != self.r["hk"]
        with sdpa_kernel(backend):
            fwd = lambda: F.scaled_dot_product_attention(self.qs, self.ks, self.vs, is_causal=self.r["causal"],  # noqa
                                                         enable_gqa=gqa)
            o = fwd()
            grad = lambda: torch.autograd.grad(o, (self.qs, self.ks, self.vs), self.dos, retain_graph=True)  # noqa
            res = {"fwd_ms": self.time(fwd), "bwd_ms": self.time(grad)}
        if self.ref is None:  # cuDNN's, else FA2's where cuDNN failed
            dq, dk, dv = grad()
            self.ref = [x.detach().transpose(1, 2) for x in (o, dq, dk, dv)]
        return res

    # --- kernelkit ---
    def kk_fwd(self):
        return kernelkit.attention(self.q, self.k, self.v, causal=self.r["causal"])

    def kk_grad_fn(self):
        o = self.kk_fwd()
        return lambda: torch.autograd.grad(o, (self.q, self.k, self.v), self.do, retain_graph=True)

    def errors(self, o=None, grads=None):
        if self.ref is None:
            return {}
        out = {}
        if o is not None:
            out["err_o"] = rel(o, self.ref[0])
        if grads is not None:
            out.update({f"err_{n}": rel(x, y) for n, x, y in zip(("dq", "dk", "dv"), grads, self.ref[1:])})
        return out

    def kk(self):
        fwd = self.kk_fwd
        o = fwd()
        res = {"fwd_ms": self.time(fwd)}
        grad = self.kk_grad_fn()
        res["bwd_ms"] = self.time(grad)
        res.update(self.errors(o, grad()))
        return res

    def run_fwd(self, t, pointer=False, timed=True):
        with only("fwd", t), tma(not pointer):
            fwd = self.kk_fwd
            o = fwd()
            torch.cuda.synchronize()
            return {"ms": self.time(fwd), **self.errors(o=o)} if timed else {}

    def run_bwd(self, dkdv, dq, pointer=False, timed=True):
        with only("dkdv", dkdv), only("dq", dq), tma(not pointer):
            grad = self.kk_grad_fn()
            grads = grad()
            torch.cuda.synchronize()
            return {"ms": self.time(grad), **self.errors(grads=grads)} if timed else {}


def uses_dq_kernel(r):
    return r["d"] >= bwd_mod.SEPARATE_DQ_MIN_HEAD_DIM and r["seq"] >= bwd_mod.SEPARATE_DQ_MIN_SEQ_K


def trials(r):
    """(kind, config tuple, pointer) of every candidate timed alone at row r."""
    out = [("fwd", t, False) for t in candidates("fwd", r["d"])]
    out += [("dkdv", t, False) for t in candidates("dkdv", r["d"])]
    if uses_dq_kernel(r):
        out += [("dq", t, False) for t in candidates("dq", r["d"])]
    if r["seq"] == 1024:
        out += [("fwd", t, True) for t in candidates("fwd", r["d"])]
        out += [(kind, t, True) for kind in ("dkdv", "dq") for t in POINTER[kind] if kind != "dq" or uses_dq_kernel(r)]
    return out


def key(r, kind, t, pointer):
    return f"{row_name(r)}|{kind}|{cfg_name(t)}|{'ptr' if pointer else 'tma'}"


def warm_one(row, kind, t, pointer, first):
    if kind == "fwd":
        row.run_fwd(t, pointer, timed=False)
    elif kind == "dkdv":
        row.run_bwd(t, POINTER["dq"][0] if pointer else first["dkdv"][1], pointer, timed=False)
    else:
        row.run_bwd(POINTER["dkdv"][0] if pointer else first["dq"][1], t, pointer, timed=False)


def warm(shard, n, status_path):
    """Compile and run once every candidate of one shard (rows of seq 1024 and the GQA row stand for every
    seq: same specializations); one status line per candidate."""
    reps = [r for r in rows() if r["seq"] == 1024 or r["hq"] != r["hk"]]
    jobs = [(r, tr) for r in reps for tr in trials(r)]
    mine = jobs[shard::n]
    cache = {}
    with open(status_path, "a") as f:
        for r, (kind, t, pointer) in mine:
            name = row_name(r)
            if name not in cache:
                cache[name] = Row(r, 1, 1)
            row = cache[name]
            first = {"dkdv": ("dq", candidates("dq", r["d"])[0]), "dq": ("dkdv", candidates("dkdv", r["d"])[0])}
            start = time.perf_counter()
            # The backward's recorded forward runs one config: no autotuning in the workers.
            pin = only("fwd", POINTER["fwd"][0] if pointer else candidates("fwd", r["d"])[0]) if kind != "fwd" \
                else contextlib.nullcontext()
            try:
                with pin:
                    warm_one(row, kind, t, pointer, first)
                ok, err = True, ""
            except Exception as e:  # noqa: BLE001 - a candidate that fails is recorded, not fatal
                ok, err = False, f"{type(e).__name__}: {str(e)[:300]}"
            f.write(json.dumps({"key": key(r, kind, t, pointer), "ok": ok, "error": err,
                                "s": round(time.perf_counter() - start, 2)}) + "\n")
            f.flush()
            if not ok and "CUDA" in err:  # the context is gone: leave the rest to nobody
                return


def rep_key(r, kind, t, pointer):
    """The status key of the row whose specializations r shares."""
    rep = dict(r, seq=1024, batch=TOKENS // 1024) if r["hq"] == r["hk"] else dict(r, seq=4096)
    return key(rep, kind, t, pointer)


def sweep(row, status):
    r = row.r
    res = {"fwd": {}, "dkdv": {}, "dq": {}, "pointer": {}}
    ok = lambda kind, t, p: status.get(rep_key(r, kind, t, p), {}).get("ok", False)  # noqa: E731
    for kind, t, pointer in trials(r):
        if pointer or kind != "fwd":
            continue
        if ok(kind, t, pointer):
            res["fwd"][cfg_name(t)] = row.run_fwd(t)
    for kind, t, pointer in trials(r):
        if kind == "dkdv" and not pointer and ok(kind, t, pointer):
            res["dkdv"][cfg_name(t)] = row.run_bwd(t, None)
    best_dkdv = min(((v["ms"], n) for n, v in res["dkdv"].items()), default=(None, None))[1]
    if uses_dq_kernel(r) and best_dkdv:
        tb = next(t for _, t, p in trials(r) if cfg_name(t) == best_dkdv)
        for kind, t, pointer in trials(r):
            if kind == "dq" and not pointer and ok(kind, t, pointer):
                res["dq"][cfg_name(t)] = row.run_bwd(tb, t)
    if r["seq"] == 1024:
        for t in candidates("fwd", r["d"]):
            if ok("fwd", t, True):
                res["pointer"]["fwd " + cfg_name(t)] = row.run_fwd(t, True)
        for t in POINTER["dkdv"]:
            dq = POINTER["dq"][0] if uses_dq_kernel(r) else None
            if ok("dkdv", t, True) and (dq is None or ok("dq", dq, True)):
                with only("fwd", POINTER["fwd"][0]):  # compiled by the warm-up (no pointer-path autotuning)
                    res["pointer"]["bwd " + cfg_name(t)] = row.run_bwd(t, dq, True)
    return res


def best(d):
    items = [(v["ms"], n) for n, v in d.items()]
    return min(items) if items else (None, None)


def run_warm(workers, status_path):
    procs = [subprocess.Popen([sys.executable, __file__, "--warm-shard", f"{i}/{workers}", "--status", status_path])
             for i in range(workers)]
    for p in procs:
        p.wait()
    status = {}
    for line in Path(status_path).read_text().splitlines():
        rec = json.loads(line)
        status[rec["key"]] = rec
    return status


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here (rewritten after every row)")
    ap.add_argument("--configs", action="store_true", help="also time every candidate config alone")
    ap.add_argument("--warm-workers", type=int, default=12)
    ap.add_argument("--rep", type=int, default=60, help="do_bench rep (ms)")
    ap.add_argument("--warmup", type=int, default=15, help="do_bench warmup (ms)")
    ap.add_argument("--rows", default="", help="comma-separated row names to run (default: all)")
    ap.add_argument("--warm-shard", help=argparse.SUPPRESS)
    ap.add_argument("--status", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.warm_shard:
        i, n = map(int, args.warm_shard.split("/"))
        return warm(i, n, args.status)

    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "cudnn": torch.backends.cudnn.version(), "rep_ms": args.rep, "warmup_ms": args.warmup,
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    status = {}
    if args.configs:
        start = time.perf_counter()
        status_path = str(Path(args.json or "attention.json").with_suffix(".warm.jsonl"))
        Path(status_path).unlink(missing_ok=True)
        status = run_warm(args.warm_workers, status_path)
        env["warm_s"] = round(time.perf_counter() - start, 1)
        failed = [k for k, v in status.items() if not v["ok"]]
        print(f"warm: {len(status)} candidates compiled in {env['warm_s']} s, {len(failed)} failed", flush=True)
        for k in failed:
            print("  failed:", k, status[k]["error"][:160], flush=True)
    out = {"env": env, "rows": []}
    wanted = set(filter(None, args.rows.split(",")))
    header = f"{'row':<24}{'kk fwd':>8}{'cuDNN':>8}{'FA2':>8}{'kk bwd':>8}{'cuDNN':>8}{'FA2':>8}"
    if args.configs:
        header += f"{'best fwd':>10}{'best bwd':>10}"
    print(header + "   (TFLOP/s)", flush=True)
    for r in rows():
        name = row_name(r)
        if wanted and name not in wanted:
            continue
        t0 = time.perf_counter()
        row = Row(r, args.rep, args.warmup)
        rec = {"row": name, **r, "fwd_flops": fwd_flops(r), "bwd_flops": 2.5 * fwd_flops(r)}
        for impl, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
            try:
                rec[impl] = row.sdpa(backend)
            except Exception as e:  # noqa: BLE001
                rec[impl] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        n_log = len(runtime.tune_log)
        rec["kernelkit"] = row.kk()
        rec["kernelkit"]["configs"] = [{"kernel": t["kernel"], "config": t["config"]}
                                       for t in runtime.tune_log[n_log:]]
        if args.configs:
            rec["sweep"] = sweep(row, status)
        for impl in ("cudnn", "fa2", "kernelkit"):
            for m in ("fwd", "bwd"):
                ms = rec[impl].get(f"{m}_ms")
                if ms:
                    rec[impl][f"{m}_tflops"] = rec[f"{m}_flops"] / ms / 1e9
        tf = lambda impl, m: rec[impl].get(f"{m}_tflops")  # noqa: E731
        f = lambda x: f"{x:8.0f}" if x else f"{'-':>8}"  # noqa: E731
        line = f"{name:<24}" + "".join(f(tf(i, m)) for m in ("fwd", "bwd") for i in ("kernelkit", "cudnn", "fa2"))
        if args.configs:
            sw = rec["sweep"]
            bf, nf = best(sw["fwd"])
            bwd_pool = {**sw["dkdv"], **{f"{k} + dq {n}": v for n, v in sw["dq"].items()
                                         for k in [best(sw["dkdv"])[1]]}}
            bb, nb = best(bwd_pool)
            rec["best"] = {"fwd": nf, "fwd_tflops": bf and rec["fwd_flops"] / bf / 1e9,
                           "bwd": nb, "bwd_tflops": bb and rec["bwd_flops"] / bb / 1e9}
            line += f"{(rec['best']['fwd_tflops'] or 0):10.0f}{(rec['best']['bwd_tflops'] or 0):10.0f}"
            line += f"  {nf} | {nb}"
        out["rows"].append(rec)
        print(line + f"   [{time.perf_counter() - t0:.0f} s]", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        del row
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
