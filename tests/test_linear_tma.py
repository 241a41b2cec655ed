"""kernelkit.linear's Hopper path (linear_tma_kernel: persistent, TMA descriptors) against float64.

The TMA path takes 16-bit inputs with unit inner strides and 16-byte aligned rows; everything else takes
the pointer kernel (tests/test_linear.py covers those shapes). These tests pick aligned shapes, check that
the TMA path ran, and compare it with float64 and with the pointer kernel on the same inputs.
"""

import pytest
import torch

import kernelkit  # noqa: F401  (loads the ops)
from kernelkit.ops import linear as L
from kernelkit.testing.correctness import check


@pytest.fixture
def tma_calls(monkeypatch):
    """Counts the launches that took the TMA path."""
    calls = []
    original = L._tma_layout

    def spy(*args):
        got = original(*args)
        calls.append(got)
        return got

    monkeypatch.setattr(L, "_tma_layout", spy)
    return calls


def _inputs(m, k, n, dtype, device, seed=0, lead=()):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn((*lead, m, k), generator=g, device=device).to(dtype)
    w = (torch.randn((n, k), generator=g, device=device) / k ** 0.5).to(dtype)
    b = (0.1 * torch.randn(n, generator=g, device=device)).to(dtype)
    return x, w, b


@pytest.mark.parametrize("act", L.ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_activation_through_tma(act, dtype, device, tma_calls):
    # M = 37 and N = 40 leave partial tiles (the interpreter's tile is 32): TMA zero-fills the loads past the
    # edge and drops the stores there; K = 72 ends on a partial K box.
    n_out = 40
    x, w, b = _inputs(37, 72, 2 * n_out if act == "swiglu" else n_out, dtype, device)
    r = torch.randn(37, n_out, device=device).to(dtype)
    rep = check(L.linear, L.reference, (x, w, b, act, r), {"scale": 0.75}, grad_args=(0, 1, 2, 4))
    rep.raise_if_failed()
    assert tma_calls and tma_calls[0] == (True, 72), tma_calls


@pytest.mark.parametrize("act", [None, "swiglu"])
def test_transposed_weight_and_matmul_through_tma(act, device, tma_calls):
    """matmul's row-major b reaches the kernel as an N-major weight: (BLOCK_K, BLOCK_N) boxes, no transpose."""
    n_out = 48
    x, w, b = _inputs(70, 136, 2 * n_out if act == "swiglu" else n_out, torch.bfloat16, device, seed=1)
    wt = w.t().contiguous().t()  # same values, (1, N) strides
    check(L.linear, L.reference, (x, wt, b, act), grad_args=(0, 1, 2)).raise_if_failed()
    assert tma_calls[0] == (False, wt.stride(1))
    a, bb = x, w.t().contiguous()
    tma_calls.clear()
    check(L.matmul, lambda p, q: p @ q, (a, bb), grad_args=(0, 1)).raise_if_failed()
    assert tma_calls[0] == (False, bb.stride(0))


def test_row_padded_views_and_leading_dims_through_tma(device, tma_calls):
    """Row-padded x and weight (strides past K, still 16-byte aligned) and an offset view of the weight."""
    x_big, w_big, b = _inputs(33, 96, 56, torch.bfloat16, device, seed=2, lead=(2,))
    x = x_big[..., :64]                     # (2, 33, 64), row stride 96
    w = w_big[8:, 8:72]                     # (48, 64), row stride 96, offset 8 rows + 8 columns (16 bytes)
    bias = b[:48]
    r = torch.randn(2, 33, 48, device=device).to(torch.bfloat16)
    check(L.linear, L.reference, (x, w, bias, "gelu_tanh", r), grad_args=(0, 1, 2, 4)).raise_if_failed()
    assert tma_calls[0] == (True, 96)


def test_unaligned_operands_take_the_pointer_kernel(device, tma_calls):
    x, w, b = _inputs(20, 36, 24, torch.bfloat16, device, seed=3)  # K = 36: rows of 72 bytes
    check(L.linear, L.reference, (x, w, b), grad_args=(0, 1)).raise_if_failed()
    assert tma_calls[0] is None
    x2, w2, _ = _inputs(20, 64, 24, torch.bfloat16, device, seed=3)
    tma_calls.clear()
    check(L.linear, L.reference, (x2[:, 1:57], w2[:, 1:57]), grad_args=(0, 1)).raise_if_failed()  # 2-byte offset
    assert tma_calls[0] is None
    tma_calls.clear()
    check(L.linear, L.reference, (x2.expand(3, 20, 64), w2), grad_args=(0,)).raise_if_failed()
    # Expanded over a new leading dim: no single stride walks the 60 rows, so they are copied (and aligned).
    assert tma_calls[0] is not None


def test_tma_and_pointer_kernels_agree(device, monkeypatch):
    x, w, b = _inputs(65, 128, 96, torch.bfloat16, device, seed=4)
    r = torch.randn(65, 96, device=device).to(torch.bfloat16)
    tma = L.linear_fwd(x, w, b, r, "silu", 1.25)
    monkeypatch.setattr(L, "GEMM_TMA", False)
    ptr = L.linear_fwd(x, w, b, r, "silu", 1.25)
    torch.testing.assert_close(tma.float(), ptr.float(), rtol=1e-2, atol=1e-2)


def test_nan_propagates_through_tma_epilogue(device):
    """relu / relu2 keep NaN (PTX max drops it: the kernels ask for NaN propagation)."""
    x, w, b = _inputs(32, 64, 32, torch.bfloat16, device, seed=5)
    x[3, 5] = float("nan")
    for act in ("relu", "relu2"):
        y = L.linear(x, w, b, act)
        want = L.reference(x.double(), w.double(), b.double(), act)
        assert torch.equal(y.isnan(), want.isnan()), act


@pytest.mark.parametrize("subtile", [False, True])
def test_whole_and_split_tile_stores(subtile, device):
    """The autotuner runs only its first config in the interpreter: both C-store variants launched directly."""

    from kernelkit.runtime import ensure_tma_allocator

    x, w, b = _inputs(37, 72, 40, torch.bfloat16, device, seed=6)
    out = torch.full((37, 40), float("nan"), device=device, dtype=torch.bfloat16)
    if x.is_cuda:
        ensure_tma_allocator()
    grid = (3,)  # persistent: 3 programs walk 2 x 2 tiles of 32 x 32
    L.linear_tma_kernel.fn[grid](x, w, out, b, out, x.stride(0), w.stride(0), out.stride(0), 0, 0, b.stride(0),
                                 37, 40, 72, 64, 1.0, NUM_SMS=3, B_KMAJOR=True, ACTIVATION="gelu", HAS_BIAS=True,
                                 HAS_RESIDUAL=False, HAS_SCALE=False, INPUT_PRECISION=None, BLOCK_M=32, BLOCK_N=32,
                                 BLOCK_K=32, GROUP_M=8, SUBTILE=subtile, WARP_SPECIALIZE=False)
    want = L.reference(x.double(), w.double(), b.double(), "gelu")
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2)


def test_autocast_casts_like_f_linear(device):
    """Under torch.autocast an fp32 model's x, weight and bias go to the autocast dtype (it raised TypeError
    for mixed dtypes); gradients reach the fp32 master weight; a residual's dtype promotes the output."""
    dev = "cuda" if device == "cuda" else "cpu"
    x, w, b = _inputs(24, 64, 40, torch.float32, device, seed=7)
    w.requires_grad_()
    r = torch.randn(24, 40, device=device)
    with torch.autocast(dev, dtype=torch.bfloat16):
        y = L.linear(x, w, b, "gelu")
        want = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b))
        yr = L.linear(x, w, b, "gelu", residual=r)
        lin = L.Linear(64, 40, device=device)
        z = lin(x)
    assert y.dtype == want.dtype == torch.bfloat16 and yr.dtype == torch.float32 and z.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(yr, want.float() + r, rtol=2e-2, atol=2e-2)
    y.float().sum().backward()
    assert w.grad is not None and w.grad.dtype == torch.float32


def test_matmul_errors_name_a_and_b(device):
    a = torch.randn(5, 8, device=device)
    with pytest.raises(ValueError, match=r"a's last dim \(8\) must equal b's first dim \(6\)"):
        L.matmul(a, torch.randn(6, 4, device=device))
    with pytest.raises(TypeError, match="b has dtype"):
        L.matmul(a, torch.randn(8, 4, device=device, dtype=torch.bfloat16))
