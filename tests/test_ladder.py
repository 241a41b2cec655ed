"""kernelkit ladder: the Triton rungs in the interpreter and compiled for sm_90, the CUDA rungs compiled by nvcc
for sm_90 and run on the CPU through a thread-per-CUDA-thread emulation, the ncu CSV parser and the CLI.
On the GPU (`-m gpu`): every rung of both ladders against float64 at 1024^3 and at non-square shapes."""

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kernelkit import ladder
from kernelkit.commands.cli import app
from kernelkit.ladder import hgemm, nvrtc, run, sgemm, signature
from kernelkit.testing import compile_check

runner = CliRunner()


def _rel_error(c, a, b) -> float:
    ref = a.double() @ b.double()
    return ((c.double() - ref).norm() / ref.norm()).item()


# --- the rung lists ---

@pytest.mark.parametrize("kind", ladder.KINDS)
def test_rungs_have_unique_names_and_say_what_changed(kind):
    rungs = ladder.rungs(kind)
    names = [r.name for r in rungs]
    assert len(names) == len(set(names)) and "cublas" not in names
    assert len(rungs) >= (9 if kind == "sgemm" else 6)
    for r in rungs:
        assert r.what_changed.strip() and r.expect.strip() and r.kernel, r.name
    assert ladder.get(kind, names[-1]).name == names[-1]
    with pytest.raises(KeyError, match="rungs:"):
        ladder.get(kind, "no_such_rung")


def test_select_rejects_unknown_rungs():
    assert [r.name for r in run.select("sgemm", ["smem", "naive"])] == ["smem", "naive"]
    with pytest.raises(KeyError, match="unknown sgemm rung"):
        run.select("sgemm", ["smem", "fastest"])


# --- hgemm: the Triton rungs ---

# In the interpreter every rung runs 32x32x16 tiles (see hgemm._fixed), so these shapes span several programs
# with ragged M, N and K edges; the persistent rung runs 3 programs looping over the tiles. (33, 47, 40) has
# N % 8 != 0: the TMA rung says it cannot run it (needs), the others must.
HGEMM_SHAPES = [(70, 88, 72), (33, 47, 40), (1, 8, 8)]


@pytest.mark.parametrize("shape", HGEMM_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rung", [r.name for r in hgemm.RUNGS])
def test_hgemm_rung_matches_float64(rung, shape, device):
    r = ladder.get("hgemm", rung)
    m, n, k = shape
    if r.needs(m, n, k):
        assert rung in ("persistent_tma", "gluon_warp_specialized") and n % 8 or \
            rung == "gluon_warp_specialized" and device == "cpu"
        return
    gen = torch.Generator().manual_seed(m * n + k)
    a = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
    b = torch.randn(k, n, generator=gen).to(device, torch.bfloat16)
    c = torch.full((m, n), float("nan"), device=device, dtype=torch.bfloat16)
    r.build(a, b, c).run()
    assert torch.isfinite(c).all()
    assert _rel_error(c, a, b) < run.TOLERANCE["hgemm"]


def test_hgemm_rejects_mismatched_operands():
    a, b = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(6, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not chain"):
        ladder.get("hgemm", "tile").build(a, b, torch.zeros(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        ladder.get("hgemm", "tile").build(a.float(), b.float(), torch.zeros(4, 8))


# Compiled for the H100 in a process that is not interpreting, with strides known to be multiples of 16 (as
# Triton specializes 4096): each rung's step must be visible in the PTX.
_SM90 = textwrap.dedent("""
    import json, re, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kernelkit.ladder import hgemm

    def features(fn, sig, consts, opts):
        names = list(sig)
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in sig if sig[n] in ("i32", "*bf16")}
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options=opts)
        ptx = k.asm["ptx"]
        return {"wgmma": "wgmma.mma_async" in ptx, "cp_async": bool(re.search(r"cp\\.async\\.c[ag]", ptx)),
                "tma": "cp.async.bulk.tensor" in ptx, "smem": k.metadata.shared}

    ops = {"A": "*bf16", "B": "*bf16", "C": "*bf16", "M": "i32", "N": "i32", "K": "i32"}
    out = {}
    for name, p in (("tile", hgemm._TILE), ("pipelined", hgemm._PIPELINED), ("wide_tiles", hgemm._WIDE)):
        meta, opts = hgemm._config(p)
        sig = dict(ops, stride_am="i32", stride_ak="constexpr", stride_bk="i32", stride_bn="constexpr",
                   stride_cm="i32", stride_cn="constexpr", **{k: "constexpr" for k in meta})
        out[name] = features(hgemm.hgemm_kernel, sig, dict(meta, stride_ak=1, stride_bn=1, stride_cn=1), opts)
    meta, opts = hgemm._config(hgemm._params(hgemm.hgemm_persistent_tma_autotuned.configs[0]))
    sig = dict(ops, NUM_SMS="constexpr", **{k: "constexpr" for k in meta})
    out["persistent_tma"] = features(hgemm.hgemm_persistent_tma_kernel, sig, dict(meta, NUM_SMS=132), opts)
    print(json.dumps(out))
""")


@pytest.mark.slow  # 15-24 s each (nvcc, g++, Triton compiles): `make test-all` (CI time)
def test_hgemm_rungs_compile_for_sm90_and_show_their_step():
    out = compile_check.run_uninterpreted(_SM90, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    f = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(v["wgmma"] for v in f.values()), f  # tl.dot is a warpgroup MMA on Hopper
    assert not f["tile"]["cp_async"] and f["pipelined"]["cp_async"], f  # num_stages=1 vs 4
    assert f["pipelined"]["smem"] == 4 * f["tile"]["smem"], f  # a ring of 4 k-steps of A and B
    assert f["persistent_tma"]["tma"] and not f["persistent_tma"]["cp_async"], f
    assert f["persistent_tma"]["smem"] <= 227 * 1024, f


_GLUON_SM90 = r"""
import json
import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from kernelkit.ladder import hgemm_gluon as G
from kernelkit.testing.compile_check import compile_gluon
out = []
for cfg in G.CONFIGS:
    m = n = k = 512
    def desc(t, block):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block,
                                gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))
    args = {"a_desc": desc(torch.empty(m, k, dtype=torch.bfloat16), [G.HALF_M, G.BLOCK_K]),
            "b_desc": desc(torch.empty(k, n, dtype=torch.bfloat16), [G.BLOCK_K, cfg["BLOCK_N"]]),
            "c_desc": desc(torch.empty(m, n, dtype=torch.bfloat16), [G.HALF_M, cfg["BLOCK_N"]]), "M": m, "N": n, "K": k}
    got = compile_gluon(G.hgemm_gluon_ws_kernel, args, {"STAGES": cfg["STAGES"], "GROUP_M": cfg["GROUP_M"],
                        "CONSUMER_REGS": G.CONSUMER_REGS, "PRODUCER_REGS": G.PRODUCER_REGS})
    ptx = got.pop("ptx")
    out.append(dict(got, cfg=cfg, wgmma="wgmma.mma_async" in ptx, tma="cp.async.bulk.tensor" in ptx,
                    setmaxnreg="setmaxnreg" in ptx))
print(json.dumps(out))
"""


@pytest.mark.slow  # ~19 s: `make test-all` (CI time)
def test_gluon_rung_compiles_for_sm90_and_is_warp_specialized():
    # Gluon has no interpreter: CI builds every config the GPU run will time, and checks the rung's step
    # (TMA, wgmma, registers moved between the roles) and what would silently cost speed (spills, C7514).
    out = compile_check.run_uninterpreted(_GLUON_SM90, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for cfg in json.loads(out.stdout.strip().splitlines()[-1]):
        assert cfg["ptxas_rc"] == 0 and cfg["wgmma"] and cfg["tma"] and cfg["setmaxnreg"], cfg
        assert cfg["shared"] <= 232448, cfg
        assert "0 bytes spill stores" in cfg["ptxas"] and "C7514" not in cfg["ptxas"], cfg["ptxas"]


# --- sgemm: the CUDA C rungs ---

_ENTRY = re.compile(r'extern "C" __global__ void\s+(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s*)?(\w+)\s*\(')


def _configs():
    return [(r, p) for r in sgemm.CUDA_RUNGS for p in r.configs()]


def test_cuda_sources_define_the_kernels_their_launchers_name():
    for r, p in _configs():
        code = r.code(p)
        entries = _ENTRY.findall(code)
        assert len(entries) == 1, (r.name, entries)
        defines = dict(re.findall(r"#define (\w+) (\S+)", code))
        assert defines.get(entries[0], entries[0]) == r.kernel, (r.name, entries)
        used = set(re.findall(r"\b(BM|BN|BK|TM|TN|TILE|THREADS|WM|WN|WNITER)\b", r.source))
        own = set(re.findall(r"(?:constexpr int|#define) (\w+)", r.source))
        assert used - own <= set(p), (r.name, used - own - set(p))  # every parameter the source reads is defined


def test_cuda_rung_shape_requirements():
    naive, tiled = ladder.get("sgemm", "naive"), ladder.get("sgemm", "double_buffered")
    assert naive.needs(1000, 999, 7) is None
    assert "M % 128" in tiled.needs(1000, 1024, 1024)
    assert tiled.needs(4096, 4096, 4096) is None
    assert "2^31" in naive.needs(50000, 50000, 8)
    assert nvrtc.compiler() in ("cupy", "cuda-python") or "pip install" in nvrtc.compiler()


def _bundle(configs, emulate: bool) -> str:
    """All configurations in one translation unit, each in its own namespace (C++ linkage: extern "C" would make
    the same-named kernels of a sweep collide), with every macro undefined after it."""
    parts = [_SHIM] if emulate else []
    for i, (r, p) in enumerate(configs):
        code = r.code(p).replace('extern "C" ', "")
        macros = sorted(set(re.findall(r"#define (\w+)", code)))
        parts.append(f"namespace cfg{i} {{\n{code}\n}}\n" + "".join(f"#undef {m}\n" for m in macros))
    if emulate:
        table = ", ".join(f"cfg{i}::{r.kernel}" for i, (r, _) in enumerate(configs))
        parts.append(_DRIVER.replace("KERNELS", table))
    return "".join(parts)


@pytest.mark.slow  # 15-24 s each (nvcc, g++, Triton compiles): `make test-all` (CI time)
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cuda_rungs_compile_for_sm90_without_spills(tmp_path):
    """nvcc stands in for NVRTC here (same front end and ptxas; the sources use no header either would lack)."""
    src = tmp_path / "ladder.cu"
    src.write_text(_bundle(_configs(), emulate=False))
    out = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o",
                          str(tmp_path / "ladder.cubin"), str(src)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    spills = re.findall(r"(\d+) bytes spill stores", out.stderr)
    assert len(spills) == len(_configs()) and set(spills) == {"0"}, out.stderr[-3000:]


# A CPU stand-in for the CUDA execution model, enough for these kernels: one host thread per CUDA thread of a
# block, blocks one after another (so a function-static array is exactly one block's shared memory), a barrier
# for __syncthreads and between blocks. It checks the index arithmetic of every rung and configuration.
_SHIM = r"""
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>
struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;
struct Barrier {
    std::mutex m; std::condition_variable cv; unsigned n = 0, count = 0, gen = 0;
    void wait() {
        std::unique_lock<std::mutex> lock(m);
        const unsigned g = gen;
        if (++count == n) { count = 0; ++gen; cv.notify_all(); }
        else cv.wait(lock, [&] { return gen != g; });
    }
};
static Barrier block_barrier;
inline void __syncthreads() { block_barrier.wait(); }
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
"""

_DRIVER = r"""
typedef void (*Kernel)(const float*, const float*, float*, int, int, int);
static const Kernel kernels[] = {KERNELS};
extern "C" void launch(int which, const float* A, const float* B, float* C, int M, int N, int K,
                       unsigned gx, unsigned gy, unsigned bx, unsigned by) {
    const Kernel kernel = kernels[which];
    blockDim = dim3{bx, by, 1};
    gridDim = dim3{gx, gy, 1};
    block_barrier.n = bx * by;
    std::vector<std::thread> threads;
    for (unsigned ty = 0; ty < by; ++ty)
        for (unsigned tx = 0; tx < bx; ++tx)
            threads.emplace_back([=] {
                threadIdx = dim3{tx, ty, 1};
                for (unsigned y = 0; y < gy; ++y)
                    for (unsigned x = 0; x < gx; ++x) {
                        blockIdx = dim3{x, y, 1};
                        kernel(A, B, C, M, N, K);
                        __syncthreads();
                    }
            });
    for (auto& t : threads) t.join();
}
"""


@pytest.mark.slow  # 15-24 s each (nvcc, g++, Triton compiles): `make test-all` (CI time)
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_cuda_rungs_compute_the_product_in_a_cpu_emulation(tmp_path):
    configs = _configs()
    src, lib = tmp_path / "ladder_emulated.cpp", tmp_path / "ladder_emulated.so"
    src.write_text(_bundle(configs, emulate=True))
    out = subprocess.run(["g++", "-std=c++17", "-O0", "-fPIC", "-shared", "-pthread", "-fno-strict-aliasing",
                          "-Wno-unknown-pragmas", str(src), "-o", str(lib)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    emulated = ctypes.CDLL(str(lib))
    rng = np.random.default_rng(0)
    for i, (r, p) in enumerate(configs):
        # guarded rungs: ragged edges everywhere; tiled ones: the smallest non-square multiple of their tiles
        m, n, k = (67, 45, 33) if not r.tiled else (2 * p["BM"], 3 * p["BN"], 3 * p["BK"])
        assert sgemm.shape_problem(r, p, m, n, k) is None
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        c = np.full((m, n), np.nan, dtype=np.float32)
        (gx, gy, _), (bx, by, _) = r.grid(p, m, n), r.block(p)
        emulated.launch(i, *(ctypes.c_void_p(t.ctypes.data) for t in (a, b, c)), m, n, k, gx, gy, bx, by)
        ref = a.astype(np.float64) @ b.astype(np.float64)
        err = np.linalg.norm(c - ref) / np.linalg.norm(ref)  # NaN if an output was never written
        assert err < 1e-6, (r.name, p, err)


# --- signatures: ncu's CSV ---

_HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
           '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _csv(values: dict, kernel="sgemm_smem") -> str:
    rows = [f'"0","4242","python3.12","127.0.0.1","{kernel}","1","7","(32, 32, 1)","(128, 128, 1)","0","9.0",'
            f'"Command line profiler metrics","{name}","{unit}","{value}"' for name, (unit, value) in values.items()]
    return "\n".join(["==PROF== Connected to process 4242 (/usr/bin/python3.12)",
                      "==PROF== Profiling \"sgemm_smem\" - 0: 0%....50%....100% - 38 passes",
                      _HEADER, *rows, "==PROF== Disconnected from process 4242"])


_SAMPLE = {
    "gpu__time_duration.sum": ("ns", "9,874,112"),
    "launch__registers_per_thread": ("register/thread", "31"),
    "launch__grid_size": ("", "16,384"),
    "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum": ("sector", "1,073,741,824"),
    "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum": ("request", "268,435,456"),
    "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum": ("sector", "2,097,152"),
    "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum": ("request", "524,288"),
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum": ("", "0"),
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum": ("", "1,024"),
    "sm__warps_active.avg.pct_of_peak_sustained_active": ("%", "97.61"),
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active": ("%", "21.4"),
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": ("%", "0"),
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": ("%", "4.12"),
    "lts__t_sector_hit_rate.pct": ("%", "n/a"),
    "smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio": ("", "12.5"),
    "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": ("", "7.25"),
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio": ("", "3.1"),
}


def test_ncu_csv_is_parsed_into_a_signature():
    kernels = signature.parse_csv(_csv(_SAMPLE))
    assert list(kernels) == ["0"] and kernels["0"]["kernel"] == "sgemm_smem"
    m = kernels["0"]["metrics"]
    assert m["gpu__time_duration.sum"] == 9874112 and m["lts__t_sector_hit_rate.pct"] is None
    sig = signature.summarize(m, kernels["0"]["kernel"])
    assert sig["global_ld_sectors_per_request"] == 4.0 and sig["global_st_sectors_per_request"] == 4.0
    assert sig["shared_ld_bank_conflicts"] == 0 and sig["shared_st_bank_conflicts"] == 1024
    assert sig["achieved_occupancy_pct"] == 97.61 and sig["registers_per_thread"] == 31
    assert sig["top_stall"] == "mio_throttle" and sig["top_stall_cycles_per_issue"] == 12.5
    assert sig["tensor_pipe_pct"] == 0 and abs(sig["ncu_ms"] - 9.874112) < 1e-9
    line = signature.describe(sig, "sgemm")
    assert "4.0 sect/req" in line and "FMA 21%" in line and "stall mio_throttle" in line and "L2 hit -" in line
    assert signature.parse_csv("==PROF== nothing here") == {}


def test_signature_says_plainly_when_ncu_is_absent(monkeypatch):
    monkeypatch.setattr(signature, "find_ncu", lambda: None)
    out = signature.profile("sgemm", "naive", (64, 64, 64))
    assert isinstance(out, str) and "ncu" in out and "not on PATH" in out
    assert signature.describe(out, "sgemm") == out


def _fake_ncu(tmp_path, monkeypatch, script: str):
    path = tmp_path / "ncu"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    monkeypatch.setenv("KERNELKIT_NCU", str(path))
    return path


def test_signature_through_a_stand_in_ncu(tmp_path, monkeypatch):
    (tmp_path / "out.csv").write_text(_csv(_SAMPLE) + "\n")
    _fake_ncu(tmp_path, monkeypatch, f'echo "$@" > {tmp_path}/args\ncat {tmp_path}/out.csv\n')
    sig = signature.profile("sgemm", "smem", (256, 256, 256), {"TILE": 32})
    assert isinstance(sig, dict) and sig["top_stall"] == "mio_throttle"
    args = (tmp_path / "args").read_text()
    assert "--clock-control none" in args and "--profile-from-start off" in args and "--csv" in args
    assert "kernelkit.ladder.run_one --kind sgemm --rung smem --shape 256,256,256" in args


def test_signature_reports_unreadable_counters(tmp_path, monkeypatch):
    _fake_ncu(tmp_path, monkeypatch, 'echo "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to '
                                     'access NVIDIA GPU Performance Counters on the target device 0."\nexit 1\n')
    assert signature.profile("hgemm", "tile", (256, 256, 256)) == signature.NO_COUNTERS


def test_signature_drops_a_metric_this_ncu_does_not_know(tmp_path, monkeypatch):
    (tmp_path / "out.csv").write_text(_csv(_SAMPLE) + "\n")
    gmma = signature.METRICS["tensor_gmma_pipe_pct"]
    _fake_ncu(tmp_path, monkeypatch, f'case "$*" in *{gmma.split(".")[0]}*) '
                                     f'echo "==ERROR== Failed to find metric {gmma}"; exit 1;; esac\n'
                                     f'cat {tmp_path}/out.csv\n')
    assert isinstance(signature.profile("hgemm", "tile", (256, 256, 256)), dict)


# --- reporting and the CLI ---

def _rows():
    rows = [run.Row("naive", "one thread per output", ms=400.0, tflops=0.34, rel_error=1e-7),
            run.Row("smem", "tiles in shared memory", ms=20.0, tflops=6.9, rel_error=1e-7,
                    signature=signature.summarize(signature.parse_csv(_csv(_SAMPLE))["0"]["metrics"])),
            run.Row("vectorized", "float4", status="wrong", detail="relative error 1.4e+00 > 5e-05: not timed"),
            run.Row("cublas", "cuBLAS via torch.mm", ms=2.7, tflops=50.9, pct_of_cublas=100.0, rel_error=2e-7)]
    rows[1].pct_of_cublas, rows[1].x_previous = 13.5, 20.0
    return rows


def test_table_json_and_plot(tmp_path):
    from rich.console import Console

    console = Console(record=True, width=200)
    run.print_rows(_rows(), "sgemm", (4096, 4096, 4096), "NVIDIA H100 80GB HBM3", console)
    text = console.export_text()
    assert "13.5%" in text and "20.00x" in text and "wrong" in text and "stall mio_throttle" in text
    path = run.write_json(_rows(), tmp_path / "ladder.json", "sgemm", (4096, 4096, 4096))
    doc = json.loads(path.read_text())
    assert doc["kind"] == "sgemm" and doc["shape"] == [4096] * 3 and len(doc["rows"]) == 4
    assert doc["rows"][1]["signature"]["top_stall"] == "mio_throttle"
    png = run.plot(_rows(), tmp_path / "ladder.png", "sgemm", (4096, 4096, 4096), "H100")
    assert png.stat().st_size > 1000


def test_cli_ladder_list_needs_no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = runner.invoke(app, ["ladder", "--list"])
    assert res.exit_code == 0, res.output
    for kind in ladder.KINDS:
        for r in ladder.rungs(kind):
            assert r.name in res.output
    res = runner.invoke(app, ["ladder", "hgemm", "--list"])
    assert res.exit_code == 0 and "persistent_tma" in res.output and "double_buffered" not in res.output


def test_cli_ladder_without_gpu_exits_2(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = runner.invoke(app, ["ladder", "sgemm"])
    assert res.exit_code == 2 and "needs a CUDA GPU" in res.output
    res = runner.invoke(app, ["ladder", "dgemm"])
    assert res.exit_code == 2 and "unknown ladder" in res.output


# --- on the GPU ---

GPU_SHAPES = [(1024, 1024, 1024), (768, 1280, 512)]  # the second: non-square, a multiple of every sgemm tile


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("cfg", [(r.name, i) for r in sgemm.CUDA_RUNGS for i in range(len(r.configs()))],
                         ids=lambda c: f"{c[0]}-{c[1]}")
def test_sgemm_rung_on_gpu(cfg, shape):
    if nvrtc.compiler() not in ("cupy", "cuda-python"):
        pytest.skip(nvrtc.compiler())
    r = next(x for x in sgemm.CUDA_RUNGS if x.name == cfg[0])
    params = r.configs()[cfg[1]]
    m, n, k = shape
    a, b = run.make_inputs("sgemm", m, n, k)
    c = torch.full((m, n), float("nan"), device="cuda")
    sgemm.build(r, a, b, c, params).run()
    torch.cuda.synchronize()
    assert run.rel_error(c, a.double() @ b.double()) < run.TOLERANCE["sgemm"]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [*GPU_SHAPES, (999, 1001, 1003)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rung", [r.name for r in hgemm.RUNGS])
def test_hgemm_rung_on_gpu(rung, shape):
    r = ladder.get("hgemm", rung)
    m, n, k = shape
    if r.needs(m, n, k):
        pytest.skip(r.needs(m, n, k))
    a, b = run.make_inputs("hgemm", m, n, k)
    c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    r.build(a, b, c).run()
    torch.cuda.synchronize()
    assert run.rel_error(c, a.double() @ b.double()) < run.TOLERANCE["hgemm"]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ladder.KINDS)
def test_run_ladder_end_to_end_on_gpu(kind, tmp_path):
    if kind == "sgemm" and nvrtc.compiler() not in ("cupy", "cuda-python"):
        pytest.skip(nvrtc.compiler())
    names = ["coalesced", "double_buffered"] if kind == "sgemm" else ["tile", "persistent_tma"]
    rows = run.run_ladder(kind, (512, 512, 512), names, ncu=True, log=lambda s: None)
    assert [r.rung for r in rows] == [*names, "cublas"]
    assert all(r.status == "ok" and r.ms and r.tflops for r in rows), [(r.rung, r.status, r.detail) for r in rows]
    assert rows[-1].pct_of_cublas == 100.0 and rows[1].x_previous
    assert all(isinstance(r.signature, (dict, str)) for r in rows)  # measured, or a sentence saying why not
    run.write_json(rows, tmp_path / "l.json", kind, (512, 512, 512))
