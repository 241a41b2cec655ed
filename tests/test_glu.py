import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import kernelkit
import kernelkit.ops.glu as mod
from kernelkit.ops import registry
from kernelkit.testing import check, check_spec
from kernelkit.testing.graph import compile_as_one_node
from tests.conftest import INTERPRET

SWIGLU, GEGLU = registry.get("swiglu"), registry.get("geglu")
FNS = pytest.mark.parametrize("fn,ref", [(mod.swiglu, mod.swiglu_reference), (mod.geglu, mod.geglu_reference)],
                              ids=["swiglu", "geglu"])


@pytest.mark.parametrize("spec", [SWIGLU, GEGLU], ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (37, 1000), (2, 3, 129)])
def test_separate_gate_up(spec, shape, dtype, device):
    # Contiguous inputs: the flat grid, with a partial last block at every shape here.
    check_spec(spec, shape, dtype, device=device).raise_if_failed()


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_geglu_approximations(approximate, device):
    # Wide inputs reach the tails of both gelus (where tanh's 1 + tanh(u) would cancel).
    g, u = 4.0 * torch.randn(17, 301, device=device), torch.randn(17, 301, device=device)
    check(lambda g, u: mod.geglu(g, u, approximate), lambda g, u: mod.geglu_reference(g, u, approximate),
          (g, u), grad_args=(0, 1)).raise_if_failed()


@FNS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_concatenated_gate_up(fn, ref, dtype, device, monkeypatch):
    # Row x column tiles over the two halves: several rows per tile (h = 5), and several column
    # blocks per row with a partial last one (h = 333 over 128-wide blocks).
    monkeypatch.setattr(mod, "MAX_BLOCK_H", 128)
    for shape in [(2, 19, 2 * 333), (7, 2 * 5)]:
        gu = torch.randn(shape, device=device, dtype=dtype)
        check(lambda gu: fn(gu), lambda gu: ref(gu), (gu,), grad_args=(0,)).raise_if_failed()


def test_geglu_erf_concatenated(device):
    gu = torch.randn(9, 2 * 70, device=device)
    check(lambda gu: mod.geglu(gu, approximate="none"), lambda gu: mod.geglu_reference(gu, approximate="none"),
          (gu,), grad_args=(0,)).raise_if_failed()


def test_non_contiguous_rows(device):
    g = torch.randn(40, 600, device=device)[::2, 100:400]
    u = torch.randn(20, 300, device=device)
    check(mod.swiglu, mod.swiglu_reference, (g, u), grad_args=(0, 1)).raise_if_failed()


def test_expanded_output_gradient(device):
    # .sum() backpropagates a stride-0 gradient: it must be read as the broadcast it is.
    for h in (1, 33):
        g = torch.randn(6, h, device=device, requires_grad=True)
        u = torch.randn(6, h, device=device, requires_grad=True)
        mod.swiglu(g, u).sum().backward()
        gr, ur = g.detach().requires_grad_(True), u.detach().requires_grad_(True)
        (F.silu(gr) * ur).sum().backward()
        torch.testing.assert_close(g.grad, gr.grad)
        torch.testing.assert_close(u.grad, ur.grad)


@FNS
def test_nan_inf_like_torch(fn, ref, device):
    g, u = torch.randn(3, 20, device=device), torch.randn(3, 20, device=device)
    g[0, 1], u[1, 2], g[2, 3], g[2, 4] = float("nan"), float("inf"), float("inf"), -30.0
    got, want = fn(g, u), ref(g, u)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite])


@pytest.mark.parametrize("call,err,match", [
    (lambda d: mod.swiglu(torch.randn(2, 4, device=d), torch.randn(2, 5, device=d)), ValueError,
     "up must have gate's shape"),
    (lambda d: mod.swiglu(torch.randn(2, 5, device=d)), ValueError, "last dim must be even"),
    (lambda d: mod.swiglu(torch.randn(2, 4, device=d), torch.randn(2, 4, device=d, dtype=torch.float16)), TypeError,
     "up has dtype"),
    (lambda d: mod.swiglu(torch.ones(2, 4, dtype=torch.int32, device=d)), TypeError, "gate has dtype int32"),
    (lambda d: mod.swiglu(torch.randn(2, 4, device=d), [1.0]), TypeError, "up must be a torch.Tensor"),
    (lambda d: mod.swiglu(torch.tensor(1.0, device=d)), ValueError, "gate must have at least 1 dimension"),
    (lambda d: mod.geglu(torch.randn(2, 4, device=d), approximate="fast"), ValueError, "approximate must be"),
])
def test_bad_input_names_the_argument(call, err, match, device):
    with pytest.raises(err, match=match):
        call(device)


def test_empty_inputs(device):
    g = torch.randn(0, 4, device=device, requires_grad=True)
    u = torch.randn(0, 4, device=device, requires_grad=True)
    y = mod.swiglu(g, u)
    assert y.shape == (0, 4)
    y.sum().backward()
    assert g.grad.shape == (0, 4) and u.grad.shape == (0, 4)
    assert mod.geglu(torch.randn(3, 0, device=device)).shape == (3, 0)


def test_cpu_tensor_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="gate is on cpu"):
        kernelkit.swiglu(torch.ones(2, 8), torch.ones(2, 8))


@pytest.mark.parametrize("name,fn,extra,act", [("swiglu", mod.swiglu, (), mod.SILU),
                                                ("geglu", mod.geglu, ("none",), mod.GELU_ERF)])
def test_custom_op_schema_fake_trace_and_compile(name, fn, extra, act, device):
    from torch.fx.experimental.proxy_tensor import make_fx

    op, bwd = getattr(torch.ops.kernelkit, name).default, getattr(torch.ops.kernelkit, f"{name}_bwd").default
    g, u, gu = torch.randn(3, 40, device=device), torch.randn(3, 40, device=device), torch.randn(3, 80, device=device)
    for args in ((g, u, *extra), (gu, None, *extra)):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    # The backward returns [dgate, dup], or [dgate] alone for the concatenated layout: the fake must agree.
    for args in ((torch.randn_like(g), g, u, act), (torch.randn_like(g), gu, None, act)):
        torch.library.opcheck(bwd, args, test_utils=("test_schema", "test_faketensor"))
    gm = make_fx(lambda g, u: fn(g, u, *extra), tracing_mode="fake")(g, u)
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert calls == [op], calls

    g.requires_grad_(True)
    u.requires_grad_(True)
    y = compile_as_one_node(lambda g, u: fn(g, u, *extra), (g, u), name)
    ref = mod.swiglu_reference if name == "swiglu" else mod.geglu_reference
    torch.testing.assert_close(y, ref(g, u, *extra))


def test_backward_saves_only_the_inputs(device):
    g = torch.randn(4, 50, device=device, requires_grad=True)
    u = torch.randn(4, 50, device=device, requires_grad=True)
    y = mod.geglu(g, u)
    saved = y.grad_fn.saved_tensors
    assert [t.data_ptr() for t in saved] == [g.data_ptr(), u.data_ptr()]


@settings(max_examples=6, deadline=None)
@given(rows=st.integers(1, 5), h=st.integers(1, 700), gelu=st.booleans(), concat=st.booleans())
def test_random_shapes(rows, h, gelu, concat):
    device = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    spec = GEGLU if gelu else SWIGLU
    if not concat:
        check_spec(spec, (rows, h), "bfloat16", device=device, trials=1).raise_if_failed()
        return
    gu = torch.randn(rows, 2 * h, device=device, dtype=torch.bfloat16)
    check(spec.fn, spec.reference, (gu,), grad_args=(0,)).raise_if_failed()


def test_cost_counts_ideal_bytes():
    g = torch.empty(8192, 14336, dtype=torch.bfloat16)
    assert SWIGLU.cost(g, g).bytes == 3 * g.numel() * 2  # gate and up read, out written
    assert SWIGLU.cost(g, g, backward=True).bytes == 5 * g.numel() * 2
    gu = torch.empty(8192, 2 * 14336, dtype=torch.bfloat16)
    assert SWIGLU.cost(gu).bytes == SWIGLU.cost(g, g).bytes
    assert math.isclose(GEGLU.cost(g, g).arithmetic_intensity, 6 / 6)


@pytest.mark.skipif(not INTERPRET, reason="records launches through the Triton interpreter")
def test_every_layout_and_activation_compiles_for_sm90():
    # tests/test_compile_sm90.py compiles the flat path of the default activations; this covers the
    # tiled path and the erf GeGLU too.
    from kernelkit.testing import compile_check

    records = []
    with compile_check.record_launches(records):
        for approximate in ("tanh", "none"):
            gu = torch.randn(3, 80, dtype=torch.bfloat16, requires_grad=True)
            for gate, up in [(gu, None), (gu[:, :40], gu[:, 40:])]:  # one tensor, or two strided views
                y = mod.geglu(gate, up, approximate)
                y.backward(torch.randn_like(y))
    records = compile_check.unique(records)
    assert {r["args"]["FLAT"]["value"] for r in records} == {False}
    failures = compile_check.compile_in_subprocess(records)
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [SWIGLU, GEGLU], ids=lambda s: s.name)
@pytest.mark.parametrize("shape", [(8192, 14336), (4096, 11008), (3, 5000), (1, 14336)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_large_shapes(spec, shape, dtype):
    check_spec(spec, shape, dtype, device="cuda", trials=2).raise_if_failed()


@pytest.mark.gpu
@FNS
def test_gpu_concatenated_llm_shape(fn, ref):
    gu = torch.randn(4096, 2 * 11008, device="cuda", dtype=torch.bfloat16)
    check(lambda gu: fn(gu), lambda gu: ref(gu), (gu,), grad_args=(0,)).raise_if_failed()


@pytest.mark.gpu
def test_gpu_compile_fullgraph():
    g = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    u = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    f = torch.compile(lambda g, u: kernelkit.swiglu(g, u).float().square().sum(), fullgraph=True)
    f(g, u).backward()
    assert g.grad is not None and u.grad is not None and torch.isfinite(g.grad).all()
