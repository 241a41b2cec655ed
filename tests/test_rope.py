import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernelkit.ops import registry
from kernelkit.ops.rope import _inv_freq, hf_rope, reference, rope
from kernelkit.testing import check, check_spec
from kernelkit.testing.graph import compile_as_one_node

SPEC = registry.get("rope")


def _qk(B, S, HQ, HK, D, device, dtype=torch.float32, heads_first=False):
    shape = (lambda h: (B, h, S, D)) if heads_first else (lambda h: (B, S, h, D))
    return torch.randn(shape(HQ), device=device, dtype=dtype), torch.randn(shape(HK), device=device, dtype=dtype)


def _table(max_pos, rotary_dim, device, dtype=torch.float32, base=10000.0):
    angle = torch.arange(max_pos).float()[:, None] * _inv_freq(rotary_dim, base, torch.device("cpu"))
    return angle.cos().to(device, dtype), angle.sin().to(device, dtype)


def _bound(**kw):
    return (lambda q, k, cos=None, sin=None: rope(q, k, cos, sin, **kw),
            lambda q, k, cos=None, sin=None: reference(q, k, cos, sin, **kw))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(1, 3, 2, 1, 8), (2, 37, 5, 3, 64), (3, 17, 4, 4, 80)])
def test_matches_fp64_reference(shape, dtype, device):
    # Hugging Face per-token cos/sin (B, S, D), halves rotated, GQA head counts, fwd and bwd.
    check_spec(SPEC, shape, dtype, device=device).raise_if_failed()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("D,rotary_dim", [(64, 64), (80, 32), (40, 24)])
def test_table_with_position_ids_interleaved_and_partial(interleaved, D, rotary_dim, device):
    B, S = 2, 19
    q, k = _qk(B, S, 3, 2, D, device)
    cos, sin = _table(100, rotary_dim, device)
    pos = torch.randint(0, 100, (B, S), device=device)
    fn, ref = _bound(position_ids=pos, rotary_dim=rotary_dim, interleaved=interleaved)
    check(fn, ref, (q, k, cos, sin), grad_args=(0, 1)).raise_if_failed()
    # The pass-through dims are copied bit for bit.
    qo, ko = rope(q, k, cos, sin, position_ids=pos, rotary_dim=rotary_dim, interleaved=interleaved)
    assert torch.equal(qo[..., rotary_dim:], q[..., rotary_dim:])
    assert torch.equal(ko[..., rotary_dim:], k[..., rotary_dim:])


def test_interleaved_pairs_are_adjacent(device):
    # GPT-J: dims (2i, 2i+1) rotate together by angle i; check one pair by hand.
    q, k = _qk(1, 1, 1, 1, 8, device)
    cos, sin = _table(8, 8, device)
    qo, _ = rope(q, k, cos, sin, offset=5, interleaved=True)
    c, s = cos[5, 1], sin[5, 1]
    want = torch.stack([q[0, 0, 0, 2] * c - q[0, 0, 0, 3] * s, q[0, 0, 0, 3] * c + q[0, 0, 0, 2] * s])
    torch.testing.assert_close(qo[0, 0, 0, 2:4], want)


def test_position_ids_broadcast_and_1d(device):
    q, k = _qk(3, 11, 2, 1, 32, device)
    cos, sin = _table(64, 32, device)
    pos = torch.randperm(64, device=device)[:11].to(torch.int32)
    want = reference(q, k, cos, sin, position_ids=pos.long().expand(3, 11))
    for p in (pos, pos[None, :]):
        for got, w in zip(rope(q, k, cos, sin, position_ids=p), want):
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)


def test_decode_offset_and_duplicated_table(device):
    # Decode: one new token per sequence at position offset; a duplicated (max_pos, D) table works too.
    q, k = _qk(4, 1, 8, 2, 64, device)
    half_cos, half_sin = _table(300, 64, device)
    dup_cos, dup_sin = torch.cat((half_cos, half_cos), -1), torch.cat((half_sin, half_sin), -1)
    want = reference(q, k, half_cos, half_sin, offset=257)
    for got in (rope(q, k, half_cos, half_sin, offset=257), rope(q, k, dup_cos, dup_sin, offset=257),
                rope(q, k, dup_cos, dup_sin, offset=257, rotary_dim=64)):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_angles_computed_from_base(interleaved, device):
    # No cache: Hugging Face's fp32 angles, sin/cos in-kernel; equal to the table path to fp32 rounding.
    q, k = _qk(2, 23, 3, 1, 48, device)
    pos = torch.randint(0, 2000, (2, 23), device=device)
    fn, ref = _bound(position_ids=pos, rotary_dim=32, interleaved=interleaved, base=500000.0)
    check(fn, ref, (q, k), grad_args=(0, 1), tol=1e-5).raise_if_failed()
    cos, sin = _table(2000, 32, device, base=500000.0)
    for a, b in zip(rope(q, k, position_ids=pos, rotary_dim=32, interleaved=interleaved, base=500000.0),
                    rope(q, k, cos, sin, position_ids=pos, interleaved=interleaved)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_heads_first_layout_and_output_keeps_layout(device):
    # Hugging Face hands (B, H, S, D) views of (B, S, H, D) memory; outputs keep the input's layout.
    B, S, HQ, HK, D = 2, 9, 4, 2, 32
    q = torch.randn(B, S, HQ, D, device=device).transpose(1, 2)
    k = torch.randn(B, S, HK, D, device=device).transpose(1, 2)
    cos, sin = SPEC.make_inputs((B, S, HQ, HK, D), torch.float32, device)[0][2:]
    fn, ref = _bound(layout="bhsd")
    check(fn, ref, (q, k, cos, sin), grad_args=(0, 1)).raise_if_failed()
    qo, ko = rope(q, k, cos, sin, layout="bhsd")
    assert qo.stride() == q.stride() and ko.stride() == k.stride()
    hq, hk = hf_rope(q, k, cos, sin, layout="bhsd")
    torch.testing.assert_close(qo, hq, rtol=1e-5, atol=1e-5)
    # Contiguous (B, H, S, D) memory works the same.
    qc, kc = q.contiguous(), k.contiguous()
    torch.testing.assert_close(rope(qc, kc, cos, sin, layout="bhsd")[0], qo, rtol=0, atol=0)


def test_fused_qkv_slices_and_strided_head_dim(device):
    B, S, HQ, HK, D = 2, 7, 4, 1, 16
    qkv = torch.randn(B, S, (HQ + 2 * HK) * D, device=device)
    q = qkv[..., : HQ * D].view(B, S, HQ, D)
    k = qkv[..., HQ * D: (HQ + HK) * D].view(B, S, HK, D)
    cos, sin = _table(S, D, device)
    check(*_bound(offset=0), (q, k, cos, sin), grad_args=(0, 1)).raise_if_failed()
    wide = torch.randn(B, S, HQ, 2 * D, device=device)
    check(*_bound(), (wide[..., ::2], k.contiguous(), cos, sin)).raise_if_failed()  # copied to a unit stride


def test_mqa_and_more_kv_heads_than_q(device):
    for hq, hk in ((7, 1), (2, 5)):
        q, k = _qk(1, 5, hq, hk, 16, device)
        cos, sin = _table(5, 16, device)
        check(*_bound(), (q, k, cos, sin), grad_args=(0, 1)).raise_if_failed()


def test_backward_is_the_inverse_rotation(device):
    q, k = _qk(2, 6, 3, 1, 32, device)
    q.requires_grad_(True)
    k.requires_grad_(True)
    pos = torch.randint(0, 50, (2, 6), device=device)
    qo, ko = rope(q, k, position_ids=pos)
    dq, dk = torch.autograd.grad((qo, ko), (q, k), (qo.detach(), ko.detach()))
    torch.testing.assert_close(dq, q.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dk, k.detach(), rtol=1e-5, atol=1e-5)


def test_nan_propagates_and_out_of_table_positions_are_nan(device):
    q, k = _qk(1, 4, 2, 1, 16, device)
    q[0, 1, 0, 3] = float("nan")
    cos, sin = _table(8, 16, device)
    got, want = rope(q, k, cos, sin), reference(q, k, cos, sin)
    assert torch.equal(torch.isnan(got[0]), torch.isnan(want[0])) and torch.isnan(got[0]).sum() == 2
    pos = torch.tensor([[0, 1, 8, 2]], device=device)  # 8 is past the 8-row table
    qo, ko = rope(q.nan_to_num(), k, cos, sin, position_ids=pos)
    assert torch.isnan(qo[0, 2]).all() and torch.isnan(ko[0, 2]).all() and not torch.isnan(qo[0, [0, 1, 3]]).any()


def test_empty_inputs(device):
    q, k = _qk(2, 0, 3, 1, 16, device)
    qo, ko = rope(q, k)
    assert qo.shape == q.shape and ko.shape == k.shape


@pytest.mark.parametrize("call,match", [
    (lambda q, k, c, s: rope(q, k.double(), c, s), "k has dtype"),
    (lambda q, k, c, s: rope(q.int(), k, c, s), "q has dtype int32"),
    (lambda q, k, c, s: rope(q, k[:, :3], c, s), "agree in batch, seq and head_dim"),
    (lambda q, k, c, s: rope(q[None], k, c, s), "must be 4-D"),
    (lambda q, k, c, s: rope(q[0], k, c, s), "q must have at least 4"),
    (lambda q, k, c, s: rope(q, k, c, None), "both cos and sin"),
    (lambda q, k, c, s: rope(q, k, c, s, rotary_dim=7), "rotary_dim must be an even int"),
    (lambda q, k, c, s: rope(q, k, c, s, rotary_dim=32), "rotary_dim must be an even int"),
    (lambda q, k, c, s: rope(q, k, c[:, :5], s[:, :5], rotary_dim=16), "last dim must be"),
    (lambda q, k, c, s: rope(q, k, c, s, offset=60), "exceeds the cos/sin table"),
    (lambda q, k, c, s: rope(q, k, c, s, offset=-1), "offset must be"),
    (lambda q, k, c, s: rope(q, k, c, s, position_ids=torch.zeros(2, 3, dtype=torch.long, device=q.device)), "position_ids must have"),
    (lambda q, k, c, s: rope(q, k, c, s, position_ids=torch.zeros(2, 5, device=q.device)), "int32 or int64"),
    (lambda q, k, c, s: rope(q, k, c, s, position_ids=torch.zeros(2, 5, dtype=torch.long, device=q.device), offset=1), "not both"),
    (lambda q, k, c, s: rope(q, k, c[None, :5].expand(2, 5, 8), s[None, :5].expand(2, 5, 8),
                             position_ids=torch.zeros(2, 5, dtype=torch.long, device=q.device)), "already hold"),
    (lambda q, k, c, s: rope(q, k, c, s, layout="sbhd"), "layout must be"),
])
def test_bad_input_names_the_argument(call, match, device):
    q, k = _qk(2, 5, 3, 1, 16, device)
    cos, sin = _table(64, 16, device)
    with pytest.raises((TypeError, ValueError), match=match):
        call(q, k, cos.to(device), sin.to(device))


def test_custom_op_schema_fake_and_single_graph_node(device):
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k = _qk(2, 5, 3, 1, 16, device)
    cos, sin = _table(8, 16, device)
    pos = torch.randint(0, 8, (2, 5), device=device)
    for args in ((q, k, cos, sin, pos, 0, 16, False, 10000.0, False, False),
                 (q.transpose(1, 2), k.transpose(1, 2), None, None, None, 3, 8, True, 500.0, True, True)):
        torch.library.opcheck(torch.ops.kernelkit.rope.default, args, test_utils=("test_schema", "test_faketensor"))
    gm = make_fx(lambda q, k, c, s, p: torch.ops.kernelkit.rope(q, k, c, s, p, 0, 16, False, 1e4, False, False),
                 tracing_mode="fake")(q, k, cos, sin, pos)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "getitem" not in str(n.target)]
    assert len(calls) == 1 and "kernelkit.rope" in str(calls[0].target)

    q.requires_grad_(True)
    k.requires_grad_(True)
    qo, ko = compile_as_one_node(lambda q, k: rope(q, k, cos, sin, position_ids=pos), (q, k), "rope")
    torch.testing.assert_close(qo, reference(q, k, cos, sin, position_ids=pos)[0], rtol=1e-5, atol=1e-5)


def test_declared_op_gradients_eager_and_compiled(device):
    """One declaration serves both routes: eager autograd runs its Function, torch.compile's backward graph the
    forward op itself rotating by -theta (kernelkit::rope with inverse=True). Both give the fp64 reference's
    gradients."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    q, k = _qk(2, 7, 3, 1, 24, device)
    cos, sin = _table(16, 16, device)
    pos = torch.randint(0, 16, (2, 7), device=device)
    gq, gk = torch.randn(q.shape, dtype=torch.float64, device=device), torch.randn(k.shape, dtype=torch.float64,
                                                                                   device=device)

    def loss(qo, ko):
        return (qo.double() * gq).sum() + (ko.double() * gk).sum()

    ref = [x.double().requires_grad_() for x in (q, k)]
    want = torch.autograd.grad(loss(*reference(*ref, cos.double(), sin.double(), position_ids=pos, rotary_dim=16)),
                               ref)
    run = lambda q, k: rope(q, k, cos, sin, position_ids=pos, rotary_dim=16)  # noqa: E731
    backward_graph = []

    def bw_compiler(gm, _):
        backward_graph.extend(n for n in gm.graph.nodes if "kernelkit.rope" in str(n.target))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    compiled = torch.compile(run, fullgraph=True,
                             backend=aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=bw_compiler))
    for route in (run, compiled):
        args = [x.clone().requires_grad_() for x in (q, k)]
        qo, ko = route(*args)
        if route is run:
            assert type(qo.grad_fn).__name__.startswith("rope_function"), type(qo.grad_fn)
        got = torch.autograd.grad(loss(qo, ko), args)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)
    assert len(backward_graph) == 1 and backward_graph[0].args[-1] is True, backward_graph  # inverse=True


@settings(max_examples=8, deadline=None)
@given(B=st.integers(1, 3), S=st.integers(1, 12), hq=st.integers(1, 5), hk=st.integers(1, 3),
       half=st.integers(1, 20), tail=st.integers(0, 9), interleaved=st.booleans(), table=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_random_shapes(B, S, hq, hk, half, tail, interleaved, table, dtype):
    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    rd = 2 * half
    q, k = _qk(B, S, hq, hk, rd + tail, device, dtype)
    cos, sin = _table(S + 3, rd, device) if table else (None, None)
    fn, ref = _bound(offset=3, rotary_dim=rd, interleaved=interleaved)
    check(fn, ref, (q, k, cos, sin), grad_args=(0, 1)).raise_if_failed()


def test_cost_counts_ideal_bytes():
    (q, k, cos, sin), kw = SPEC.make_inputs((4, 4096, 32, 8, 128), torch.bfloat16, "meta")
    qk = (q.numel() + k.numel()) * 2
    assert SPEC.cost(q, k, cos, sin).bytes == 2 * qk + 2 * 4 * 4096 * 64 * 2
    assert SPEC.cost(q, k, cos, sin, backward=True).bytes == SPEC.cost(q, k, cos, sin).bytes
    assert SPEC.cost(q, k).bytes == 2 * qk  # angles computed in-kernel read nothing
    assert math.isclose(SPEC.cost(q, k).flops, 3.0 * (q.numel() + k.numel()))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4, 4096, 32, 8, 128), (1, 16384, 32, 8, 128), (8, 2048, 32, 32, 128),
                                   (64, 1, 32, 8, 128), (2, 1000, 40, 8, 96)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_gpu_large_shapes(shape, dtype):
    check_spec(SPEC, shape, dtype, device="cuda", trials=1).raise_if_failed()


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True])
def test_gpu_long_positions_table_and_computed(interleaved):
    q, k = _qk(2, 8192, 32, 8, 128, "cuda", torch.bfloat16)
    pos = torch.arange(8192, device="cuda").expand(2, -1) + 100000
    cos, sin = _table(120000, 128, "cuda")
    fn, ref = _bound(position_ids=pos, interleaved=interleaved, base=10000.0)
    check(fn, ref, (q, k, cos, sin), grad_args=(0, 1)).raise_if_failed()
    check(fn, ref, (q, k), grad_args=(0, 1)).raise_if_failed()


@pytest.mark.gpu
def test_gpu_matches_liger_when_installed():
    liger = SPEC.competitors["liger"]()
    if liger is None:
        pytest.skip("liger-kernel is not installed")
    (q, k, cos, sin), _ = SPEC.make_inputs((2, 512, 32, 8, 128), torch.bfloat16, "cuda")
    ours = rope(q, k, cos, sin)
    theirs = liger(q.clone(), k.clone(), cos, sin)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
