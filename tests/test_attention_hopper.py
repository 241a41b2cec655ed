"""The Gluon attention forward for Hopper (ops/attention/hopper.py): which calls reach it (CPU), its sm_90 build
(CPU, through ptxas), and its results against the float64 reference on the GPU."""

import os
import re

import pytest
import torch

from kernelkit.ops.attention import attention, backward as bwd_mod, forward as fwd_mod, reference
from kernelkit.testing import check, compile_check

hopper = pytest.importorskip("kernelkit.ops.attention.hopper")
hopper_bwd = pytest.importorskip("kernelkit.ops.attention.hopper_bwd")
gluon_rt = pytest.importorskip("kernelkit.runtime.gluon")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _qkv(b, sq, sk, hq, hk, d, dtype=torch.bfloat16, device="cuda", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(s, dtype=dtype, device=device, generator=g) for s in
            ((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d))]


# --- on the CPU: the dispatch and the build ---

def _meta(shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


class _Cuda:
    """Just enough of a CUDA tensor for `supports`: shape, dtype, strides, an address."""

    def __init__(self, shape, strides=None, dtype=torch.bfloat16, ptr=1024):
        self.shape, self.dtype, self._ptr = torch.Size(shape), dtype, ptr
        self._strides = strides or torch.empty(shape, device="meta").stride()
        self.is_cuda, self.device = True, "cuda:0"

    def stride(self, i=None):
        return self._strides if i is None else self._strides[i]

    def element_size(self):
        return torch.empty((), dtype=self.dtype).element_size()

    def data_ptr(self):
        return self._ptr


@pytest.mark.parametrize("case,expected", [
    ({}, True),
    ({"d": 96}, False),  # head_dim 64 or 128 only
    ({"dtype": torch.float32}, False),
    ({"window": 8}, False), ({"softcap": 30.0}, False), ({"varlen": True}, False),
    ({"k_strides": (0, 4096, 128, 1)}, False),  # k broadcast over batch: TMA takes no zero stride
    ({"ptr": 1026}, False),  # 2 bytes off the 16-byte grid
    ({"q_strides": (3 * 16 * 128 * 64, 3 * 16 * 128, 128, 1)}, True),  # a slice of a packed qkv projection
])
def test_supports_only_what_the_kernel_computes(case, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    d = case.get("d", 128)
    dt = case.get("dtype", torch.bfloat16)
    q = _Cuda((2, 64, 16, d), case.get("q_strides"), dt, case.get("ptr", 1024))
    k = _Cuda((2, 64, 8, d), case.get("k_strides"), dt)
    o = _Cuda((2, 64, 16, d), None, dt)
    assert hopper.supports(q, k, k, o, True, case.get("window"), case.get("softcap"), case.get("varlen", False)) \
        is expected
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert not hopper.supports(q, k, k, o, True, None, None, False)  # sm_100 has no wgmma


def test_attention_fwd_routes_supported_calls_to_gluon(monkeypatch):
    # Host logic only: with the kernel and the Hopper check faked, eligible calls launch it and never Triton;
    # decoding (split-KV) and the switch turned off stay on Triton.
    calls = []
    monkeypatch.setattr(fwd_mod, "interpreting", lambda: False)
    monkeypatch.setattr(hopper, "supports", lambda *a: True)
    monkeypatch.setattr(hopper, "TRITON_UP_TO", {})  # the measured rule is tried below
    monkeypatch.setattr(hopper, "attention_fwd_hopper", lambda q, k, v, o, lse, causal, scale2: calls.append(
        (tuple(q.shape), causal, scale2)))
    monkeypatch.setattr(fwd_mod, "launch", lambda *a, **kw: calls.append("triton"))
    monkeypatch.setattr(fwd_mod, "_decode", lambda *a, **kw: calls.append("decode"))
    q, k, v = _qkv(1, 300, 300, 4, 2, 64, device="cpu")
    fwd_mod.attention_fwd(q, k, v, causal=True, scale=0.5)
    assert calls == [((1, 300, 4, 64), True, pytest.approx(0.5 * 1.4426950408889634))]
    fwd_mod.attention_fwd(q[:, :4], k, v)
    assert calls[-1] == "decode"
    monkeypatch.setitem(hopper.TRITON_UP_TO, (64, True), 300)  # where Triton measured faster: kept
    fwd_mod.attention_fwd(q, k, v, causal=True)
    assert calls[-1] == "triton"
    fwd_mod.attention_fwd(q, k, v)
    assert calls[-1][1] is False
    monkeypatch.setattr(fwd_mod, "GLUON", False)
    fwd_mod.attention_fwd(q, k, v)
    assert calls[-1] == "triton"


def test_three_consumers_only_where_they_measured_faster(monkeypatch):
    monkeypatch.setitem(hopper.CONSUMERS, 64, 3)
    assert hopper.consumers(64, False, 1024) == 3 and hopper.consumers(64, False, 16384) == 3
    assert hopper.consumers(64, True, 16384) == 3  # 86 tiles a head: one program per tile
    assert hopper.consumers(64, True, 4096) == 2 and hopper.consumers(64, True, 1024) == 2  # the persistent walk
    assert hopper.consumers(128, False, 16384) == 2


_BUILD = r"""
import json, sys
import torch
from triton.experimental.gluon import language as gl
from kernelkit.ops.attention import hopper
from kernelkit.testing.compile_check import compile_gluon
d, causal, n_wg = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
q, k, o = (torch.empty(s, dtype=torch.bfloat16) for s in ((2, 200, 4, d), (2, 300, 2, d), (2, 200, 4, d)))
lse = torch.empty(2, 4, 200)
args = dict(q_desc=hopper._desc(q, hopper.HALF_M), k_desc=hopper._desc(k, hopper.BLOCK_N),
            v_desc=hopper._desc(k, hopper.BLOCK_N), o_desc=hopper._desc(o, hopper.HALF_M), LSE=lse,
            stride_lb=lse.stride(0), stride_lh=lse.stride(1), seqlen_q=200, seqlen_k=300, n_heads_q=4, group=2,
            n_m=2, n_bh=8, scale2=0.2)
const = dict(CAUSAL=causal, STAGES=hopper.STAGES[d], OVERLAP=hopper.OVERLAP[d], PINGPONG=hopper.PINGPONG[d],
             Q_SMEM=gl.NVMMASharedLayout.get_default_for([hopper.HALF_M, d], gl.bfloat16),
             KV_SMEM=gl.NVMMASharedLayout.get_default_for([hopper.BLOCK_N, d], gl.bfloat16),
             CONSUMER_REGS=hopper.CONSUMER_REGS if n_wg == 2 else hopper.CONSUMER_REGS_3,
             PRODUCER_REGS=hopper.PRODUCER_REGS, N_WG=n_wg)
r = compile_gluon(hopper.attn_fwd_hopper_kernel, args, const)
print(json.dumps({"shared": r["shared"], "ptxas": r["ptxas"], "rc": r["ptxas_rc"]}))
"""


@pytest.mark.parametrize("d,causal,n_wg", [(128, True, 2), (64, False, 2), (64, True, 3)])
def test_sm90_build_fits_without_spills_or_serialized_wgmma(d, causal, n_wg):
    # Gluon has no interpreter: CI builds the kernel for the H100 (Triton's compiler, then ptxas) in a process
    # that is not interpreting, and checks what the design needs: shared memory within the SM's 227 KiB, no
    # spills, and no C7514 (ptxas serializing the wgmmas).
    import json

    run = compile_check.run_uninterpreted(_BUILD, (d, int(causal), n_wg), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["rc"] == 0, r["ptxas"]
    assert r["shared"] <= 227 * 1024
    assert "C7514" not in r["ptxas"] and "C7515" not in r["ptxas"], r["ptxas"]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", r["ptxas"])]
    assert spills and not any(spills), r["ptxas"]


# --- on the GPU: results against float64 ---

def _gpu_hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _counting(monkeypatch):
    """Count the Gluon kernel's launches; every eligible call takes it (the measured Triton rows included)."""
    monkeypatch.setattr(hopper, "TRITON_UP_TO", {})
    calls = []
    real = hopper.attention_fwd_hopper
    monkeypatch.setattr(hopper, "attention_fwd_hopper", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    return calls


def _check(q, k, v, **kw):
    return check(lambda q, k, v: attention(q, k, v, return_lse=True, **kw),
                 lambda q, k, v: reference(q, k, v, return_lse=True, **kw), (q, k, v), grad_args=(0, 1, 2))


GPU_CASES = [  # (batch, seq_q, seq_k, heads_q, heads_kv, d, dtype, causal)
    (2, 1000, 1000, 4, 4, 128, torch.bfloat16, False),
    (2, 1000, 1000, 4, 4, 128, torch.bfloat16, True),
    (1, 333, 1200, 8, 2, 128, torch.float16, True),  # seq_q < seq_k: the diagonal shifts right; GQA 4:1
    (1, 1200, 333, 4, 1, 64, torch.bfloat16, True),  # seq_q > seq_k: 867 rows see no key (o 0, lse -inf); MQA
    (3, 257, 129, 6, 3, 64, torch.float16, False),
    (1, 4096, 4096, 2, 2, 64, torch.bfloat16, True),
    (1, 64, 64, 2, 2, 128, torch.bfloat16, True),  # half a query tile
]


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_gpu_gluon_matches_fp64_reference(case, monkeypatch):
    b, sq, sk, hq, hk, d, dtype, causal = case
    calls = _counting(monkeypatch)
    _check(*_qkv(b, sq, sk, hq, hk, d, dtype), causal=causal).raise_if_failed()
    assert calls, "the Gluon kernel did not run"


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("overlap,pingpong", [(False, True), (True, False), (True, True), (False, False)])
@pytest.mark.parametrize("case", [GPU_CASES[i] for i in (1, 2, 3, 4)],
                         ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_gpu_gluon_every_schedule_matches_fp64_reference(case, overlap, pingpong, monkeypatch):
    # The inner-loop schedules (intra-warpgroup overlap, the forced ping-pong) on and off, whichever ships: a turn
    # handed out of order deadlocks or races the ring, a wrong phase reads a slot before it lands.
    b, sq, sk, hq, hk, d, dtype, causal = case
    monkeypatch.setitem(hopper.OVERLAP, d, overlap)
    monkeypatch.setitem(hopper.PINGPONG, d, pingpong)
    calls = _counting(monkeypatch)
    _check(*_qkv(b, sq, sk, hq, hk, d, dtype), causal=causal).raise_if_failed()
    assert calls, "the Gluon kernel did not run"


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", [c for c in GPU_CASES if c[5] == 64],
                         ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_gpu_gluon_three_consumers_match_fp64_reference(case, monkeypatch):
    # 192-query tiles at d64 (CONSUMERS[64] = 3), whichever ships: ragged tiles, rows with no key, MQA. Causal calls
    # take three consumers only off the persistent walk (`consumers`): the walk is turned off for them here.
    b, sq, sk, hq, hk, d, dtype, causal = case
    monkeypatch.setitem(hopper.CONSUMERS, 64, 3)
    monkeypatch.setitem(hopper.PERSISTENT, True, 0)
    assert hopper.consumers(d, causal, sq) == 3
    calls = _counting(monkeypatch)
    _check(*_qkv(b, sq, sk, hq, hk, d, dtype), causal=causal).raise_if_failed()
    assert calls, "the Gluon kernel did not run"


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("layout", ["transposed", "qkv_packed", "head_dim_slice", "offset"])
def test_gpu_gluon_reads_views_in_place(layout, monkeypatch):
    # Memory around each view is NaN: a read outside it poisons the result.
    b, s, h, d = 2, 700, 4, 128
    g = torch.Generator(device="cuda").manual_seed(1)

    def nan(*shape):
        return torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")

    def fill(x):
        return x.copy_(torch.randn(x.shape, generator=g, device="cuda"))

    if layout == "qkv_packed":
        q, k, v = fill(nan(b, s, 3, h, d)).unbind(2)
    else:
        views = []
        for _ in range(3):
            if layout == "transposed":
                views.append(fill(nan(b, h, s, d).transpose(1, 2)))
            elif layout == "head_dim_slice":
                views.append(fill(nan(b, s, h, d + 64)[..., :d]))
            else:  # an offset view, 16-byte aligned
                views.append(fill(nan(b * s * h * d + 64)[64:].view(b, s, h, d)))
        q, k, v = views
    calls = _counting(monkeypatch)
    _check(q, k, v, causal=True).raise_if_failed()
    assert calls, "the Gluon kernel did not run"


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_hopper(), reason="needs an sm_90 GPU")
def test_gpu_gluon_agrees_with_triton_and_propagates_nan(monkeypatch):
    q, k, v = _qkv(2, 2048, 2048, 8, 2, 128)
    o, lse = attention(q, k, v, causal=True, return_lse=True)
    monkeypatch.setattr(fwd_mod, "GLUON", False)
    o_t, lse_t = attention(q, k, v, causal=True, return_lse=True)
    assert (o.float() - o_t.float()).abs().max() < 2e-2
    assert torch.allclose(lse, lse_t, atol=1e-3, rtol=1e-4)
    monkeypatch.setattr(fwd_mod, "GLUON", True)
    q[0, 5, 3, 7] = float("nan")
    o = attention(q, k, v, causal=True)
    o_ref = reference(q, k, v, causal=True)
    assert torch.equal(o.isnan(), o_ref.isnan())


# --- FlashAttention-4 as a competitor row of `kernelkit bench attention` (stand-in module: FA4 needs a GPU) ---

def test_fa4_row_maps_kernelkit_arguments(monkeypatch):
    import sys
    import types

    from kernelkit.ops import registry

    calls = []
    mod = types.ModuleType("flash_attn.cute")
    mod.flash_attn_func = lambda q, k, v, **kw: (calls.append(("dense", kw)) or q, None)
    mod.flash_attn_varlen_func = lambda q, k, v, **kw: (calls.append(("packed", kw)) or q, None)
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", mod)
    run = registry.get("attention").competitors["fa4"]()
    q = torch.randn(1, 4, 2, 8)
    assert run(q, q, q, causal=True, window=3, scale=0.5) is q
    assert calls[-1] == ("dense", dict(softmax_scale=0.5, causal=True, softcap=0.0, window_size=(3, 0),
                                       deterministic=False))
    run(q, q, q, window=3, softcap=2.0)  # without causal the window's right side is open
    assert calls[-1][1]["window_size"] == (3, None) and calls[-1][1]["softcap"] == 2.0
    run(q, q, q)
    assert calls[-1][1]["window_size"] == (None, None)
    cu = torch.tensor([0, 1, 4], dtype=torch.int32)
    run(q[0], q[0], q[0], causal=True, cu_seqlens=cu, max_seqlen=3)
    kind, kw = calls[-1]
    assert kind == "packed" and kw["cu_seqlens_q"] is cu and kw["cu_seqlens_k"] is cu
    assert kw["max_seqlen_q"] == kw["max_seqlen_k"] == 3
    with pytest.raises(NotImplementedError):
        run(q, q, q, return_lse=True)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # not installed: no row
    assert registry.get("attention").competitors["fa4"]() is None


# --- the Gluon dK / dV kernel (hopper_bwd.py) ---

def test_attention_bwd_routes_supported_calls_to_gluon(monkeypatch):
    # Host logic only: with the kernel and its check faked, an eligible backward launches the Gluon dK / dV kernel and
    # the Triton dQ kernel (never the atomic Triton path, never the Triton dK / dV kernel); with GLUON_FUSED_DQ the
    # Gluon kernel takes dQ too, unless deterministic=True; the switch off goes back to the Triton kernels.
    calls = []
    monkeypatch.setattr(bwd_mod, "interpreting", lambda: False)
    monkeypatch.setattr(bwd_mod, "GLUON", True)
    monkeypatch.setattr(hopper_bwd, "supports", lambda *a: True)
    monkeypatch.setattr(hopper_bwd, "dkdv_hopper", lambda q, k, v, do, dk, dv, lse2, delta, causal, scale, dq=None,
                        dq_acc=None:
                        calls.append(("gluon", causal, scale, dq is not None)))
    monkeypatch.setattr(bwd_mod, "launch", lambda kernel, *a, **kw: calls.append(kernel.fn.__name__ if hasattr(
        kernel, "fn") else getattr(kernel, "__name__", str(kernel))))
    q, k, v = _qkv(1, 300, 300, 4, 2, 64, device="cpu")
    o, lse = torch.randn_like(q), torch.randn(1, 4, 300)

    def names(**kw):
        calls.clear()
        bwd_mod.attention_bwd(torch.randn_like(o), None, q, k, v, o, lse, True, None, None, None, 0, 0.125, **kw)
        return [c if isinstance(c, str) else c[0] for c in calls]

    monkeypatch.setattr(bwd_mod, "GLUON_FUSED_DQ", False)
    assert names() == ["attn_bwd_preprocess_kernel", "gluon", "attn_bwd_dq_kernel"], calls
    assert ("gluon", True, 0.125, False) in calls
    monkeypatch.setattr(bwd_mod, "GLUON_FUSED_DQ", True)
    assert names() == ["attn_bwd_preprocess_kernel", "gluon"] and calls[-1] == ("gluon", True, 0.125, True)
    assert names(deterministic=True) == ["attn_bwd_preprocess_kernel", "gluon", "attn_bwd_dq_kernel"], calls
    monkeypatch.setattr(bwd_mod, "GLUON", False)
    names()
    assert not any(isinstance(c, tuple) for c in calls)
    # the default, "auto" (`gluon_auto`): with dQ fused the Gluon kernel at head dims 64 and 128; with the Triton dQ
    # kernel (deterministic) at 128, and at 64 only without the causal mask from GLUON_AUTO_D64_MIN_SEQ tokens, so not
    # for this causal 300-token call
    monkeypatch.setattr(bwd_mod, "GLUON", "auto")
    assert names() == ["attn_bwd_preprocess_kernel", "gluon"] and calls[-1] == ("gluon", True, 0.125, True)
    names(deterministic=True)
    assert not any(isinstance(c, tuple) for c in calls)
    assert bwd_mod.gluon_auto(64, True, 100, 100) and bwd_mod.gluon_auto(128, False, 100, 100)
    assert not bwd_mod.gluon_auto(32, False, 4096, 4096)
    assert bwd_mod.gluon_auto(128, True, 100, 100, fused=False) and bwd_mod.gluon_auto(64, False, 4096, 4096, False)
    assert not bwd_mod.gluon_auto(64, True, 4096, 4096, False) and not bwd_mod.gluon_auto(64, False, 1024, 4096, False)
    monkeypatch.setattr(bwd_mod, "GLUON_AUTO_HEAD_DIMS", (64,))
    assert names(deterministic=True) == ["attn_bwd_preprocess_kernel", "gluon", "attn_bwd_dq_kernel"], calls


_BUILD_BWD = r"""
import json, sys
import torch
from triton.experimental.gluon import language as gl
from kernelkit.ops.attention import hopper, hopper_bwd as B
from kernelkit.testing.compile_check import compile_gluon
d, causal, fused = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3] == "1"
split = int(sys.argv[4]) if len(sys.argv) > 4 else 1
bm = B.BLOCK_M_FUSED[d] if fused else B.BLOCK_M[d]
one_loop = len(sys.argv) > 5 and sys.argv[5] == "1"
q, k = (torch.empty(s, dtype=torch.bfloat16) for s in ((2, 200, 4, d), (2, 300, 2, d)))
lse = torch.empty(2, 4, 200)
n_mb = -(-200 // bm)
dq, dq_desc = B.dq_buffer(2, 4, 200, d, "cpu")
args = dict(q_desc=hopper._desc(q, bm), do_desc=hopper._desc(q, bm), k_desc=hopper._desc(k, B.HALF_N),
            v_desc=hopper._desc(k, B.HALF_N), dk_desc=hopper._desc(k.float() if split > 1 else k, B.HALF_N),
            dv_desc=hopper._desc(k.float() if split > 1 else k, B.HALF_N),
            dq_desc=dq_desc if fused else hopper._desc(k, B.HALF_N),
            lse_desc=B.stats_desc(lse, bm) if fused else hopper._desc(k, B.HALF_N),
            dl_desc=B.stats_desc(lse, bm) if fused else hopper._desc(k, B.HALF_N), LSE2=lse,
            DELTA=lse, stride_lb=lse.stride(0),
            stride_lh=lse.stride(1), n_mb=n_mb, seqlen_q=200, seqlen_k=300, n_heads_k=2, group=2, scale=0.1,
            scale2=0.2)
const = dict(CAUSAL=causal, STAGES=B.STAGES, ROWS_SMEM=gl.NVMMASharedLayout.get_default_for([B.HALF_N, d], gl.bfloat16),
             DS_SMEM=B.DS_SMEM, FUSED_DQ=fused, ONE_LOOP=fused and causal and one_loop,
             CONSUMER_REGS=B.CONSUMER_REGS, PRODUCER_REGS=B.PRODUCER_REGS, SPLIT=split,
             ACC_SMEM=gl.NVMMASharedLayout.get_default_for([B.HALF_N, d], gl.float32) if split > 1 else None)
r = compile_gluon(B.attn_bwd_dkdv_hopper_kernel, args, const)
print(json.dumps({"shared": r["shared"], "ptxas": r["ptxas"], "rc": r["ptxas_rc"]}))
"""


# (d, causal, dq fused) -> spilled bytes allowed. With dQ fused (keys as rows, `_step_keys`: at d128 64 queries a step,
# dK and dV 128 fp32 registers a thread, Sᵀ and dPᵀ 64; at d64 128 queries, 64 + 128; lse2 and delta read from shared
# memory where used) ptxas (Triton 3.6) spills at most 40 bytes at d128, 180 causal; 104 / 244 at d64. A bound, so
# that more fails.
_BWD_BUILDS = {(128, True, False): 0, (64, False, False): 0, (128, True, True): 200, (64, False, True): 130,
               (64, True, True): 270, (128, False, True): 60}
# (d,) -> spilled bytes allowed with `ONE_LOOP` (causal, dQ fused): 68 at d128, 172 at d64.
_ONE_LOOP_BUILDS = {128: 100, 64: 200}


def _check_bwd_build(argv, max_spill, one_loop=False):
    """_BUILD_BWD with `argv` (d, causal, fused[, split]) and `hopper_bwd.ONE_LOOP`: ptxas succeeds, shared memory
    within the SM's 227 KiB, no C7514, and at most `max_spill` bytes spilled."""
    import json

    full = (*argv[:3], argv[3] if len(argv) > 3 else 1, int(one_loop))  # split 1 unless given
    run = compile_check.run_uninterpreted(_BUILD_BWD, full, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["rc"] == 0 and r["shared"] <= 227 * 1024, r["ptxas"]
    assert "C7514" not in r["ptxas"], r["ptxas"]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", r["ptxas"])]
    assert spills and max(spills) <= max_spill, r["ptxas"]


@pytest.mark.parametrize("d,causal,fused", list(_BWD_BUILDS))
def test_sm90_build_of_the_backward_fits_without_spills(d, causal, fused):
    _check_bwd_build((d, int(causal), int(fused)), _BWD_BUILDS[(d, causal, fused)])


@pytest.mark.parametrize("d", list(_ONE_LOOP_BUILDS))
def test_sm90_build_of_the_one_loop_backward(d):
    _check_bwd_build((d, 1, 1), _ONE_LOOP_BUILDS[d], one_loop=True)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
@pytest.mark.parametrize("fused_dq,bm128,one_loop", [(False, 32, False), (False, 64, False), (True, 32, False),
                                                    (True, 32, True)],
                         ids=["dq-triton", "dq-triton-bm64", "dq-fused", "dq-fused-one-loop"])
def test_gpu_gluon_backward_matches_fp64_reference(case, fused_dq, bm128, one_loop, monkeypatch):
    # bm128: queries per step at head dim 128 with the Triton dQ kernel (dQ fused: BLOCK_M_FUSED, keys as rows);
    # one_loop: `hopper_bwd.ONE_LOOP` (dQ fused with the causal mask: one loop, the mask on every step)
    b, sq, sk, hq, hk, d, dtype, causal = case
    if d != 128 and bm128 != 32:
        pytest.skip("bm128 changes head dim 128 only")
    if one_loop and not causal:
        pytest.skip("ONE_LOOP changes causal calls only")
    monkeypatch.setitem(hopper_bwd.BLOCK_M, 128, bm128)
    monkeypatch.setattr(hopper_bwd, "ONE_LOOP", one_loop)
    calls = []
    monkeypatch.setattr(bwd_mod, "GLUON", True)
    monkeypatch.setattr(bwd_mod, "GLUON_FUSED_DQ", fused_dq)
    real = hopper_bwd.dkdv_hopper
    monkeypatch.setattr(hopper_bwd, "dkdv_hopper", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    _check(*_qkv(b, sq, sk, hq, hk, d, dtype), causal=causal).raise_if_failed()
    assert calls, "the Gluon dK / dV kernel did not run"


@pytest.mark.parametrize("n_kv,n_bh,sms,want", [(8, 256, 132, 16), (8, 256, 128, 16), (32, 32, 132, 4),
                                                (128, 16, 132, 2), (3, 7, 132, 7), (40, 7, 132, 7), (32, 31, 132, 1),
                                                (200, 6, 132, 1), (10, 12, 20, 2), (10, 12, 25, 3), (8, 12, 20, 3)])
def test_longest_first_groups_are_whole_and_about_one_wave(n_kv, n_bh, sms, want):
    # the group: the divisor of the heads nearest ceil(sms / key blocks) by ratio (every group whole, so the grid
    # (group, key blocks, n_bh / group) covers each (key block, head) once)
    g = hopper_bwd.heads_per_group(n_kv, n_bh, sms)
    assert g == want and n_bh % g == 0


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("fused_dq", [True, False], ids=["dq-fused", "dq-triton"])
@pytest.mark.parametrize("sms", [20, 1000])
def test_gpu_gluon_backward_longest_first_covers_every_block(fused_dq, sms, monkeypatch):
    # causal key blocks longest first, heads in groups: 2 x 4 heads, 8 key blocks of 128 -> groups of 4 (sms 20:
    # two groups) or of all 8 (one); a block walked twice or never gives wrong dK / dV
    monkeypatch.setattr(bwd_mod, "GLUON", True)
    monkeypatch.setattr(bwd_mod, "GLUON_FUSED_DQ", fused_dq)
    monkeypatch.setattr(hopper_bwd, "LONGEST_FIRST", True)
    monkeypatch.setattr(hopper_bwd, "num_sms", lambda device: sms)
    assert hopper_bwd.heads_per_group(8, 8, sms) == (4 if sms == 20 else 8)
    _check(*_qkv(2, 1000, 1000, 4, 4, 128, torch.bfloat16), causal=True).raise_if_failed()


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("d", [128, 64])
def test_gpu_fused_backward_repeated_matches_triton(d, monkeypatch):
    # dQ = dS K reads both warpgroups' K halves while each warpgroup's epilogue overwrites its half with dK: a race
    # shows up now and then, not every call, so the fused backward runs many times against the Triton one
    q, k, v = _qkv(2, 1000, 1000, 8, 2, d, torch.bfloat16)
    do = torch.randn_like(q)

    def grads(gluon):
        monkeypatch.setattr(bwd_mod, "GLUON", gluon)
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        attention(qq, kk, vv, causal=True).backward(do)
        return qq.grad.float(), kk.grad.float(), vv.grad.float()

    want = grads(False)
    monkeypatch.setattr(bwd_mod, "GLUON_FUSED_DQ", True)
    for _ in range(30):
        got = grads(True)
        err = [float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want)]
        assert max(err) < 2e-2, err


# (d, causal) -> spilled bytes allowed with a GQA group split over 2 programs (dK / dV staged in fp32 and added by TMA
# reduces): at most 120 bytes at d128 causal, 216 at d64 causal (180 / 244 unsplit).
_SPLIT_BUILDS = {(128, True): 150, (64, True): 260}


@pytest.mark.parametrize("d,causal", list(_SPLIT_BUILDS))
def test_sm90_build_of_the_split_backward(d, causal):
    _check_bwd_build((d, int(causal), 1, 2), _SPLIT_BUILDS[(d, causal)])


def test_stats_desc_needs_rows_padded_to_16_bytes():
    # lse2 / delta go to the fused backward by TMA: rows padded to 16 bytes (as attention_bwd allocates them), read as
    # (batch x heads, seq) with 1 x bm boxes; an unpadded or non-fp32 one is refused by name, not read wrong
    good = torch.empty(2, 3, 204)[..., :201]
    d = hopper_bwd.stats_desc(good, 64)
    assert (d.shape, d.strides, d.block_shape, d.base.data_ptr()) == ([6, 201], [204, 1], [1, 64], good.data_ptr())
    for bad in (torch.empty(2, 3, 201), torch.empty(2, 3, 204, dtype=torch.float16)[..., :201],
                torch.empty(3, 2, 204).transpose(0, 1)[..., :201]):
        with pytest.raises(ValueError, match="lse2 / delta"):
            hopper_bwd.stats_desc(bad, 64)


def test_preprocess_zeroes_the_fused_dq_buffer(monkeypatch):
    # The fused backward's fp32 dQ buffer comes from torch.empty and is zeroed by the preprocess kernel (one launch less
    # than a fill): every row a head reads back (below seq_q) must be 0 when the Gluon kernel starts, whatever the
    # memory held; delta and lse2 stay right. The buffer is poisoned here, the Gluon kernel faked (run in the interpreter).
    b, s, hq, hk, d = 2, 70, 3, 1, 64
    seen = {}
    real_buffer = hopper_bwd.dq_buffer

    def poisoned_buffer(*a, **kw):
        acc, desc = real_buffer(*a, **kw)
        return acc.fill_(float("nan")), desc

    def fake_kernel(q, k, v, do, dk, dv, lse2, delta, causal, scale, dq=None, dq_acc=None):
        seen.update(acc=dq_acc[0].clone(), delta=delta.clone(), lse2=lse2.clone())
        dq.zero_(), dk.zero_(), dv.zero_()

    monkeypatch.setattr(bwd_mod, "interpreting", lambda: False)
    monkeypatch.setattr(bwd_mod, "GLUON", True)
    monkeypatch.setattr(hopper_bwd, "supports", lambda *a: True)
    monkeypatch.setattr(hopper_bwd, "dq_buffer", poisoned_buffer)
    monkeypatch.setattr(hopper_bwd, "dkdv_hopper", fake_kernel)
    q, k, v = _qkv(b, s, s, hq, hk, d, device="cpu")
    o, do = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(b, hq, s)
    bwd_mod.attention_bwd(do, None, q, k, v, o, lse, True, None, None, None, 0, 0.125)
    per_head = seen["acc"].view(b * hq, -1, d)
    assert per_head.shape[1] == -(-s // hopper_bwd.BLOCK_M_FUSED[d]) * hopper_bwd.BLOCK_M_FUSED[d]
    assert (per_head[:, :s] == 0).all()
    torch.testing.assert_close(seen["delta"], (o.float() * do.float()).sum(-1).transpose(1, 2))
    torch.testing.assert_close(seen["lse2"], lse * 1.4426950408889634)


@pytest.mark.parametrize("waves", [10 ** 6, 0], ids=["split", "unsplit"])
def test_dkdv_hopper_host_plumbing(waves, monkeypatch):
    # Host logic of the fused backward with the launch faked: the "kernel" writes known values into the buffers its
    # descriptors address (dQ rows by query block, the split's fp32 dK / dV); dkdv_hopper must hand back exactly those
    # in dq / dk / dv (dq cast by the Triton dq_convert_kernel, here in the interpreter, into a row-padded view). dQ's
    # buffer and the split's dK / dV buffers are zeroed and must not overlap.
    b, sq, sk, hq, hk, d = 2, 200, 300, 4, 2, 64
    q, do = torch.randn(b, sq, hq, d, dtype=torch.bfloat16), torch.randn(b, sq, hq, d, dtype=torch.bfloat16)
    k, v = torch.randn(b, sk, hk, d, dtype=torch.bfloat16), torch.randn(b, sk, hk, d, dtype=torch.bfloat16)
    stats = torch.randn(2, b, hq, 204)[..., :sq]
    dq = torch.full((b, sq, hq + 1, d), float("nan"), dtype=torch.bfloat16)[:, :, 1:]
    dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    seen = {}
    real_launch = hopper_bwd.launch

    def fake_launch(kernel, grid, key, *args, **kw):
        if kernel is hopper_bwd.dq_convert_kernel:
            return real_launch(kernel, grid, key, *args, **kw)
        q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, dq_desc, lse_desc, dl_desc = args[:9]
        seen.update(grid=grid, split=kw["SPLIT"], lse=lse_desc, dl=dl_desc)
        bufs = [dq_desc.base] + ([dk_desc.base, dv_desc.base] if kw["SPLIT"] > 1 else [])
        assert all(t.dtype == torch.float32 and not t.any() for t in bufs)  # zeroed
        spans = sorted((t.data_ptr(), t.data_ptr() + 4 * t.numel()) for t in bufs)
        assert all(e <= s2 for (_, e), (s2, _) in zip(spans, spans[1:]))  # disjoint
        g = torch.Generator().manual_seed(3)
        for t in bufs:
            t.copy_(torch.randn(t.shape, generator=g))
        seen["bufs"] = [t.clone() for t in bufs]

    monkeypatch.setattr(hopper_bwd, "launch", fake_launch)
    monkeypatch.setattr(hopper_bwd, "num_sms", lambda device: 132)
    monkeypatch.setattr(hopper_bwd, "SPLIT_WAVES", waves)
    hopper_bwd.dkdv_hopper(q, k, v, do, dk, dv, stats[0], stats[1], True, 0.125, dq=dq)
    bm = hopper_bwd.BLOCK_M_FUSED[d]
    n_mb = -(-sq // bm)
    want_dq = seen["bufs"][0].view(b, hq, n_mb * bm, d)[:, :, :sq].transpose(1, 2)
    # one bf16 step: the interpreter's cast rounds differently from torch's; a row or head out of place is far more
    torch.testing.assert_close(dq.float(), want_dq, rtol=2 ** -7, atol=0)
    assert seen["split"] == (2 if waves else 1)  # a group of 2 query heads: split in 2 programs, or not
    if waves:
        torch.testing.assert_close(dk, seen["bufs"][1].to(dk.dtype), rtol=0, atol=0)
        torch.testing.assert_close(dv, seen["bufs"][2].to(dv.dtype), rtol=0, atol=0)
    assert (seen["lse"].base.data_ptr(), seen["dl"].base.data_ptr()) == (stats[0].data_ptr(), stats[1].data_ptr())
    assert seen["lse"].block_shape == [1, bm] and seen["lse"].shape == [b * hq, sq]


def test_unvalidated_descriptor_matches_gluons():
    # runtime.gluon.descriptor skips TensorDescriptor's checks (host time), not its fields: the launcher reads the same
    TensorDescriptor = hopper_bwd.TensorDescriptor  # Gluon's host descriptor
    t = torch.empty(2, 100, 4, 64, dtype=torch.bfloat16)
    args = (t, [2, 4, 100, 64], [t.stride(0), t.stride(2), t.stride(1), 1], [1, 1, 64, 64],
            gluon_rt.smem_layout((1, 1, 64, 64), t.dtype))
    fast, slow = gluon_rt.descriptor(*args), TensorDescriptor(*args)
    assert type(fast) is TensorDescriptor and vars(fast) == vars(slow)
    assert vars(hopper._desc(t, 64)) == vars(slow)


@pytest.mark.parametrize("group,programs,sms,want", [(4, 128, 132, 4), (4, 1024, 132, 1), (1, 16, 132, 1),
                                                     (8, 100, 132, 4), (6, 50, 132, 6), (4, 200, 132, 2)])
def test_heads_split_fills_the_waves_with_a_divisor(group, programs, sms, want, monkeypatch):
    # the fewest programs per key block's GQA group (a divisor of it) that fill SPLIT_WAVES waves, at most the group;
    # SPLIT_WAVES 0: never split
    monkeypatch.setattr(hopper_bwd, "SPLIT_WAVES", 2)
    assert hopper_bwd.heads_split(group, programs, sms) == want and group % want == 0
    monkeypatch.setattr(hopper_bwd, "SPLIT_WAVES", 0)
    assert hopper_bwd.heads_split(group, programs, sms) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("d,causal", [(128, True), (128, False), (64, True), (64, False)])
@pytest.mark.parametrize("waves", [10 ** 6, 0], ids=["split", "unsplit"])
def test_gpu_gqa_split_backward_matches_fp64_reference(d, causal, waves, monkeypatch):
    # a GQA group of 4 query heads split over 4 programs per key block (dK / dV added into fp32 buffers by TMA
    # reduces) or not split; seq 1000: a ragged last key block; both must match the float64 reference
    monkeypatch.setattr(bwd_mod, "GLUON", True)
    monkeypatch.setattr(bwd_mod, "GLUON_FUSED_DQ", True)
    monkeypatch.setattr(hopper_bwd, "SPLIT_WAVES", waves)
    assert hopper_bwd.heads_split(4, 8 * 2, 132) == (4 if waves else 1)
    _check(*_qkv(1, 1000, 1000, 8, 2, d, torch.bfloat16), causal=causal).raise_if_failed()
