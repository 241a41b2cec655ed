"""The lean launch path of `kernelkit.runtime.launch`: its specialization key must be at least as fine as
Triton's, or a kernel compiled for aligned pointers (or for an int equal to 1) would run on a call that
breaks that assumption."""

import pytest
import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

import kernelkit
from kernelkit import runtime as tune
from kernelkit.ops.rms_norm import reference
from kernelkit.testing import check


def _triton_spec(a):
    return native_specialize_impl(BaseBackend, a, False, True, True)


INTS = [0, 1, 2, 15, 16, 17, 48, -16, -3, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**40 + 3, 2**63, 2**63 + 16]


def test_int_key_separates_what_triton_separates():
    keys = {}
    for v in INTS:
        keys.setdefault(tune._spec((v,), {}, 0), set()).add(_triton_spec(v))
    for k, triton_specs in keys.items():
        assert len(triton_specs) == 1, f"one key {k} covers Triton specializations {triton_specs}"


def test_tensor_key_separates_dtype_and_alignment():
    buf = torch.empty(64, dtype=torch.bfloat16)
    views = [buf, buf[1:], buf[8:], buf[9:], buf.float(), buf.float()[1:], buf.float()[4:]]
    keys = {}
    for t in views:
        keys.setdefault(tune._spec((t,), {}, 0), set()).add(_triton_spec(t))
    assert len(keys) == 4
    for k, triton_specs in keys.items():
        assert len(triton_specs) == 1, f"one key covers Triton specializations {triton_specs}"


def test_tensor_descriptor_key_separates_what_triton_separates():
    """Host TMA descriptors (the fp8 GEMM's) take the lean path: one key per Triton specialization (dtype, box,
    shared layout), and shape, strides and base pointer (read by the launcher on every launch) do not enter."""
    gl = pytest.importorskip("triton.experimental.gluon.language")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    keys = {}
    kinds = ((torch.bfloat16, gl.bfloat16), (torch.float16, gl.float16), (torch.float8_e4m3fn, gl.float8e4nv))
    for dtype, gdt in kinds:
        for box in ([64, 64], [128, 64], [64, 128]):
            layout = gl.NVMMASharedLayout.get_default_for(box, gdt)
            for rows, cols in ((256, 256), (300, 512)):
                t = torch.empty(rows, cols, dtype=dtype)
                d = TensorDescriptor(t, [rows, cols], [cols, 1], box, layout)
                keys.setdefault(tune._spec((d,), {}, 0), set()).add(_triton_spec(d))
    assert None not in keys
    assert len(keys) == 9
    for k, triton_specs in keys.items():
        assert len(triton_specs) == 1, f"one key {k} covers Triton specializations {triton_specs}"


def test_launch_under_dynamo_is_tritons_own_call(monkeypatch):
    """While Dynamo traces, `launch` is `kernel[grid](...)`, which Dynamo records as a kernel call. (Tracing the
    lean path's caches broke the fp8 step's graph and recompiled it to eager: 108 ms against 69 on the H100.)"""
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k)) or "triton"

    monkeypatch.setattr(tune, "_compiling", lambda: True)
    assert tune.launch(Kernel(), (3,), None, 1, 2, BLOCK=4) == "triton"
    assert calls == [((3,), (1, 2), {"BLOCK": 4})]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_quantizers_compile_without_graph_breaks():
    from kernelkit.ops.gemm.fp8 import quantize_cols_t, quantize_rows, quantize_rows_and_cols_t

    def f(x):
        return quantize_rows(x), quantize_cols_t(x), quantize_rows_and_cols_t(x)

    x = torch.randn(300, 272, device="cuda", dtype=torch.bfloat16)
    got = torch.compile(f, fullgraph=True)(x)  # a graph break raises under fullgraph
    want = f(x)
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert torch.equal(g.view(torch.uint8) if g.dtype == torch.float8_e4m3fn else g,
                           w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w)


def test_key_covers_types_keywords_and_device():
    x = torch.empty(4)
    assert tune._spec((x, 1.0), {}, 0) != tune._spec((x, True), {}, 0) != tune._spec((x, None), {}, 0)
    assert tune._spec((x,), {"BLOCK": 64}, 0) != tune._spec((x,), {"BLOCK": 128}, 0)
    assert tune._spec((x,), {}, 0) != tune._spec((x,), {}, 1)
    assert tune._spec((x, object()), {}, 0) is None  # unknown kinds of argument: Triton's own path
    assert tune._spec((x,), {"Y": x}, 0) is None  # tensors by keyword: Triton's own path
    with pytest.raises(TypeError):  # unhashable keyword values: the lookup raises, launch takes Triton's path
        hash(tune._spec((x,), {"A": [1, 2]}, 0))


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 16, 17, 1000, 1024, 1025, 2**20 + 1])
def test_host_helpers_match_triton(n):
    assert tune.next_pow2(n) == triton.next_power_of_2(n) or n == 0  # triton returns 0 for 0
    for d in (1, 3, 16, 128):
        assert tune.cdiv(n, d) == triton.cdiv(n, d)


@pytest.mark.gpu
def test_lean_path_respecializes_on_alignment_and_ints():
    """Aligned, misaligned, aligned again and a one-row input through one kernel: each call correct, and
    the lean cache holds one entry per specialization."""
    torch.manual_seed(0)
    n = 4096 + 8
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    buf = torch.randn(64 * n + 8, device="cuda", dtype=torch.bfloat16)
    view = lambda start, rows: buf[start: start + rows * n].view(rows, n)  # noqa: E731
    inputs = [view(0, 64), view(1, 64), view(0, 64), view(1, 1), view(8, 64)]  # 16-byte aligned at 0 and 8
    for x in inputs:
        for _ in range(2):  # the first call of a specialization fills the cache, the second takes it
            y = kernelkit.rms_norm(x, w)
            torch.testing.assert_close(y.double(), reference(x, w).double(), rtol=2e-2, atol=2e-2)
    from kernelkit.ops.rms_norm import rms_norm_fwd_kernel

    specs = [e for (k, _), e in tune._chosen.items() if k is rms_norm_fwd_kernel]
    assert specs and max(len(e.compiled) for e in specs) >= 2
    assert all(c is not None for e in specs for c in e.compiled.values()), "lean path refused a plain call"


@pytest.mark.gpu
def test_lean_path_matches_triton_path(monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(300, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):
        check(kernelkit.rms_norm, reference, (x, w), grad_args=(0, 1)).raise_if_failed()
    lean = kernelkit.rms_norm(x, w)
    monkeypatch.setattr(tune, "LEAN", False)
    plain = kernelkit.rms_norm(x, w)
    assert torch.equal(lean, plain)


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "layer_norm", "softmax", "log_softmax", "swiglu", "geglu",
                                "rope", "cross_entropy"])
def test_no_grad_path_matches_autograd_path(op, device):
    """Without a gradient to record, the public functions skip autograd.Function: same outputs."""
    from kernelkit.ops import registry

    spec = registry.get(op)
    args, kwargs = spec.make_inputs(spec.test_shapes[0], torch.float32, device)
    grad_args = tuple(a.detach().requires_grad_(i in spec.grad_args) if isinstance(a, torch.Tensor) else a
                      for i, a in enumerate(args))
    with_graph = spec.fn(*grad_args, **kwargs)
    with torch.no_grad():
        without = spec.fn(*args, **kwargs)
    outs = lambda o: o if isinstance(o, (tuple, list)) else (o,)  # noqa: E731
    for a, b in zip(outs(with_graph), outs(without)):
        assert a.requires_grad and not b.requires_grad
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=0, equal_nan=True)
