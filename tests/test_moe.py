"""kernelkit.moe / nn.MoE: the grouped-GEMM MoE layer against the float64 per-expert loop, forward and backward.

Interpreter shapes are tiny and odd: hidden and intermediate not multiples of the 16-wide interpreter tiles,
experts with more rows than one 16-row tile, empty experts, one expert taking every token."""

import subprocess
import sys
import zlib

import pytest
import torch

import kernelkit
from kernelkit.ops import moe as M
from kernelkit.ops.gemm import grouped as G
from kernelkit.ops.gemm import mx as GMX
from kernelkit.ops import mxfp8 as MX
from kernelkit.ops.moe.fp8 import experts_grads_reference_fp8, reference_fp8, reference_mxfp8
from kernelkit.ops import registry
from kernelkit.testing import check, check_spec, poisoned_outputs

SPEC = registry.get("moe")


def _inputs(shape, dtype, device, seed=0):
    args, _ = SPEC.make_inputs(shape, dtype, device, torch.Generator(device=device).manual_seed(seed))
    return list(args)


def _counts(args, scoring="softmax"):
    x, router, *_rest, k = args
    _, experts = M.route(x.reshape(-1, x.shape[-1]), router, k, scoring)
    return torch.bincount(experts.flatten(), minlength=router.shape[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("softmax", False), ("sigmoid", True),
                                                 ("sigmoid", False)])
def test_forward_and_gradients_against_float64(scoring, renormalize, dtype, device):
    args = _inputs((13, 24, 20, 4, 2), dtype, device, seed=len(scoring) + renormalize)
    rep = check(M.moe, M.reference, args, {"scoring": scoring, "renormalize": renormalize}, grad_args=(0, 1, 2, 3),
                tol=SPEC.tolerances.get(str(dtype)[6:]), run_twice=False)
    rep.raise_if_failed()


@pytest.mark.parametrize("shape", [(37, 24, 20, 4, 2), (5, 16, 12, 3, 1), (7, 16, 12, 5, 5)])
def test_registry_shapes_fp32(shape, device):
    # 37 tokens x 2 slots over 4 experts: ~18 rows an expert, two 16-row tiles each with a ragged tail; top_k = 1
    # and top_k = experts (every expert takes every token).
    check_spec(SPEC, shape, "float32", device, trials=1).raise_if_failed()


def test_empty_experts(device):
    args = _inputs((21, 16, 12, 6, 2), torch.float32, device, seed=3)
    args[0][:, 1] = -8.0  # experts 1 and 4 rank last for every token
    args[0][:, 4] = -7.5
    counts = _counts(args)
    assert counts[1] == 0 and counts[4] == 0 and counts.sum() == 42
    rep = check(M.moe, M.reference, args, grad_args=(0, 1, 2, 3), run_twice=False)
    rep.raise_if_failed()
    gu, d = (args[i].detach().requires_grad_() for i in (2, 3))
    M.moe(args[0], args[1], gu, d, 2).sum().backward()
    for e in (1, 4):  # written (poison would show), and zero
        assert not gu.grad[e].any() and not d.grad[e].any()


@pytest.mark.parametrize("bad", [-1, 4])
def test_expert_id_outside_the_experts_is_an_error(bad, device):
    # Such rows belong to no expert's group and would stay unwritten: an error instead of garbage. Expert
    # parallelism's sentinel id E is one of them. On the GPU it is a device-side assert (no host sync), which
    # leaves the process's CUDA context unusable: it runs in a child process there.
    code = f"""
import torch
from kernelkit.ops import moe as M
dev = {device!r}
x = torch.randn(5, 16, device=dev)
gu, d = torch.randn(4, 24, 16, device=dev), torch.randn(4, 16, 12, device=dev)
ids = torch.tensor([[0, 1], [2, 3], [1, {bad}], [0, 2], [3, 1]], device=dev)
M.moe_experts(x, torch.rand(5, 2, device=dev), gu, d, ids)
if dev == "cuda":
    torch.cuda.synchronize()
"""
    if device != "cuda":  # the ids are on the host: checked there, a ValueError naming them
        with pytest.raises(ValueError, match=rf"experts holds the id {bad}, outside \[0, 4\)"):
            exec(code, {})
        return
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "device-side assert" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("top_k", [1, 2])
def test_all_tokens_to_one_expert(top_k, device):
    args = _inputs((37, 16, 12, 4, top_k), torch.float32, device, seed=5)
    args[0][:, 2] = 6.0  # expert 2 first for every token: 37 rows, three 16-row tiles
    assert _counts(args)[2] == 37
    # The router's gradient sums 37 tokens' softmax-Jacobian terms around one dominant logit: nearly equal
    # products cancel, and under a fresh random grad_output its fp32 error reached 1.14e-5 once (torch's own
    # fp32 router, not a kernel); 3e-5 still fails any wrong routing weight or expert.
    check(M.moe, M.reference, args, {"renormalize": False}, grad_args=(0, 1, 2, 3), run_twice=False,
          grad_tol=3e-5).raise_if_failed()


def test_top1_renormalized_weights_are_one(device):
    # The output is the top expert's alone and the router's gradient is zero up to rounding on both sides.
    args = _inputs((9, 16, 12, 3, 1), torch.float32, device, seed=6)
    rep = check(M.moe, M.reference, args, {"renormalize": True}, grad_args=(0, 2, 3), run_twice=False)
    rep.raise_if_failed()
    r = args[1].detach().requires_grad_()
    M.moe(args[0], r, args[2], args[3], 1).sum().backward()
    assert r.grad.abs().max() < 1e-6


def test_one_token_leading_dims_and_1d(device):
    args = _inputs((1, 24, 20, 4, 2), torch.float32, device, seed=7)
    check(M.moe, M.reference, args, grad_args=(0, 1, 2, 3)).raise_if_failed()
    x = _inputs((6, 24, 20, 4, 2), torch.float32, device, seed=8)[0]
    out = M.moe(x.view(2, 3, 24), *args[1:])
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out.view(6, 24), M.moe(x, *args[1:]), rtol=0, atol=0)
    assert M.moe(args[0][0], *args[1:]).shape == (24,)
    assert M.moe(x[:0], *args[1:]).shape == (0, 24)


def test_outputs_and_workspaces_fully_written(device):
    # Every buffer the launchers allocate starts as NaN here: a row or column a kernel skipped stays NaN.
    x, r, gu, d, k = _inputs((19, 24, 20, 4, 2), torch.float32, device, seed=9)
    weights, experts = M.route(x, r, k)
    with poisoned_outputs():
        out, h, z, order, offs = M.moe_experts_fwd(x, weights, gu, d, experts, False, True)
        grads = M.moe_experts_bwd(torch.randn_like(out), x, weights, gu, d, h, z, order, offs)
    for t in (out, h, z, *grads):
        assert torch.isfinite(t).all()
    assert torch.equal(offs[[0, -1]].long().cpu(), torch.tensor([0, 38]))
    assert torch.equal(order.sort().values.cpu(), torch.arange(38))


def test_no_host_sync(device, monkeypatch):
    # Nothing on the host reads device data: no .item()/.tolist()/bool()/int() of a tensor, no copy to the CPU.
    x, r, gu, d, k = (a.requires_grad_() if isinstance(a, torch.Tensor) else a
                      for a in _inputs((11, 16, 12, 4, 2), torch.float32, device, seed=10))
    # The quantized paths at MX-sized dims (hidden and intermediate multiples of 32).
    q_args = [a.requires_grad_() if isinstance(a, torch.Tensor) else a
              for a in _inputs((11, 32, 32, 4, 2), torch.float32, device, seed=10)]
    precisions = ("fp8", "mxfp8") if device == "cpu" or torch.cuda.get_device_capability() >= (8, 9) else ()

    def quantized_calls():
        for precision in precisions:
            with M.keep_quantized_weights():
                M.moe(*q_args, precision=precision).sum().backward()

    M.moe(x, r, gu, d, k).sum().backward()  # first calls: autotuning may synchronize (on the GPU)
    quantized_calls()
    state = {"armed": True}
    real_launch = G.launch

    def launch(*a, **kw):  # the interpreter itself reads its arguments on the host: disarm inside a launch
        state["armed"] = False
        try:
            return real_launch(*a, **kw)
        finally:
            state["armed"] = True

    def guarded(name):
        real = getattr(torch.Tensor, name)

        def method(self, *a, **kw):
            if state["armed"]:
                raise AssertionError(f"host sync: Tensor.{name} called by kernelkit.moe")
            return real(self, *a, **kw)
        return method

    monkeypatch.setattr(G, "launch", launch)
    monkeypatch.setattr(GMX, "launch", launch)  # the MXFP8 quantizer's launches
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, guarded(name))
    y = M.moe(x, r, gu, d, k)
    torch.autograd.backward(y, torch.ones_like(y))
    quantized_calls()
    w, idx = M.route(x, r, k, "sigmoid", expert_bias=torch.zeros(4, device=device), n_group=2, topk_group=1)
    M.load_balancing_loss(x, r, idx).backward()
    state["armed"] = False
    assert x.grad is not None and torch.isfinite(gu.grad).all()


def test_bad_inputs_name_the_argument(device):
    x, r, gu, d, k = _inputs((4, 16, 12, 3, 2), torch.float32, device)
    cases = [
        (lambda: M.moe(x[:, :15], r, gu, d, k), ValueError, r"router_weight must have shape \(experts, 15\)"),
        (lambda: M.moe(x, r[:, :15], gu, d, k), ValueError, r"router_weight must have shape \(experts, 16\)"),
        (lambda: M.moe(x, r.view(-1), gu, d, k), ValueError, "router_weight must have shape"),
        (lambda: M.moe(x, r, gu[0], d, k), ValueError, r"gate_up_weight must have shape \(3, 2 \* intermediate, 16\)"),
        (lambda: M.moe(x, r, gu[:, :23], d, k), ValueError, "gate_up_weight must have shape"),
        (lambda: M.moe(x, r, gu[:2], d, k), ValueError, "gate_up_weight must have shape"),
        (lambda: M.moe(x, r, gu, d[:, :, :11], k), ValueError, r"down_weight must have shape \(3, 16, 12\)"),
        (lambda: M.moe(x, r, gu, d[0], k), ValueError, "down_weight must have shape"),
        (lambda: M.moe(x, r, gu.bfloat16(), d, k), TypeError, "gate_up_weight has dtype"),
        (lambda: M.moe(x, r, gu, d.half(), k), TypeError, "down_weight has dtype"),
        (lambda: M.moe(x.long(), r, gu, d, k), TypeError, "x has dtype int64"),
        (lambda: M.moe(x, r, gu, d, 4), ValueError, r"top_k must be between 1 and the number of experts \(3\)"),
        (lambda: M.moe(x, r, gu, d, 0), ValueError, "top_k must be between 1"),
        (lambda: M.moe(x, r, gu, d, 2.0), TypeError, "top_k must be an int"),
        (lambda: M.moe(x, r, gu, d, True), TypeError, "top_k must be an int"),
        (lambda: M.moe(x, r, gu, d, k, scoring="softmax_topk"), ValueError, "scoring must be one of"),
        (lambda: M.moe(x, r, gu, d, k, renormalize=1), TypeError, "renormalize must be a bool"),
        (lambda: M.moe(x, "r", gu, d, k), TypeError, "router_weight must be a torch.Tensor"),
        (lambda: kernelkit.nn.MoE(16, 12, 3, 4), ValueError, "top_k must be between 1 and experts"),
        (lambda: kernelkit.nn.MoE(16, 12, 3, 2, scoring="relu"), ValueError, "scoring must be one of"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()


def test_nn_moe_state_dict_and_forward(device):
    torch.manual_seed(0)
    mod = kernelkit.nn.MoE(24, 20, 4, 2, scoring="sigmoid").to(device)
    shapes = {k: tuple(v.shape) for k, v in mod.state_dict().items()}
    assert shapes == {"gate.weight": (4, 24), "experts.gate_up_proj": (4, 40, 24), "experts.down_proj": (4, 24, 20)}
    x = torch.randn(2, 5, 24, device=device, requires_grad=True)
    y = mod(x)
    want = kernelkit.moe(x, mod.gate.weight, mod.experts.gate_up_proj, mod.experts.down_proj, 2, scoring="sigmoid")
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    y.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in mod.parameters())
    assert "scoring='sigmoid'" in repr(mod)


def test_nn_moe_matches_transformers_mixtral_block(device):
    # Same state_dict as transformers' fused-experts Mixtral block, same output (softmax, top-k, renormalize).
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    from transformers import MixtralConfig

    cfg = MixtralConfig(hidden_size=16, intermediate_size=12, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(1)
    block = mixtral.MixtralSparseMoeBlock(cfg).to(device).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    mod = kernelkit.nn.MoE(16, 12, 4, 2).to(device)
    mod.load_state_dict(block.state_dict())
    x = torch.randn(1, 9, 16, device=device)
    with torch.no_grad():
        torch.testing.assert_close(mod(x), block(x), rtol=1e-5, atol=1e-5)


def test_no_grad_path_matches_autograd_path(device):
    args = _inputs((13, 24, 20, 4, 2), torch.float32, device, seed=11)
    with torch.no_grad():
        plain = M.moe(*args)
    graph = M.moe(args[0].requires_grad_(), *args[1:])
    assert graph.requires_grad and not plain.requires_grad
    torch.testing.assert_close(graph.detach(), plain, rtol=0, atol=0)


def test_custom_op_path(device):
    # The torch.compile route: the custom op, its fake implementation, and its registered autograd.
    x, r, gu, d, k = _inputs((9, 16, 12, 3, 2), torch.float32, device, seed=12)
    out = M.moe(x.to("meta"), r.to("meta"), gu.to("meta"), d.to("meta"), k)
    assert out.device.type == "meta" and out.shape == (9, 16)
    leaves = [t.clone().requires_grad_() for t in (x, r, gu, d)]
    weights, experts = M.route(leaves[0], leaves[1], k)
    y = M._moe_experts_op(leaves[0], weights, leaves[2], leaves[3], experts, False, True, "bf16", "bf16")[0]
    y.backward(torch.ones_like(y))
    refs = [t.double().requires_grad_() for t in (x, r, gu, d)]
    M.reference(*refs, k).backward(torch.ones(9, 16, dtype=torch.float64, device=device))
    for got, want in zip(leaves, refs):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-5, atol=1e-6)
    # MXFP8: the fake returns no h (the forward keeps it quantized) and the backward recomputes it from z.
    x, r, gu, d, k = _inputs((9, 32, 32, 3, 2), torch.float32, device, seed=13)
    meta = M._moe_experts_op(x.to("meta"), torch.rand(9, 2, device="meta"), gu.to("meta"), d.to("meta"),
                             torch.zeros(9, 2, dtype=torch.long, device="meta"), False, True, "mxfp8", "bf16")
    real = M._moe_experts_op(x, *M.route(x, r, k)[:1], gu, d, M.route(x, r, k)[1], False, True, "mxfp8", "bf16")
    assert [t.shape for t in meta] == [t.shape for t in real]
    leaves = [t.clone().requires_grad_() for t in (x, gu, d)]
    weights, experts = M.route(leaves[0], r, k)
    M._moe_experts_op(leaves[0], weights, leaves[1], leaves[2], experts, False, True, "mxfp8", "fp8")[0].sum().backward()
    eager = [t.clone().requires_grad_() for t in (x, gu, d)]
    M.moe(eager[0], r, eager[1], eager[2], k, precision="mxfp8", backward_precision="fp8").sum().backward()
    for got, want in zip(leaves, eager):  # (the fp8 backward through the custom op as eagerly)
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)


def test_compiles_without_graph_breaks(device):
    x, r, gu, d, k = _inputs((5, 16, 12, 3, 2), torch.float32, device, seed=13)
    torch._dynamo.reset()
    fn = torch.compile(M.moe, backend="aot_eager", fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (x, r, gu, d)]
    y = fn(*leaves, k, scoring="sigmoid")
    y.sum().backward()
    want = M.reference(x.double(), r.double(), gu.double(), d.double(), k, scoring="sigmoid")
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-6)
    assert all(t.grad is not None for t in leaves)


def _break(monkeypatch, how):
    """Simulate the kernel bugs the tests must catch, at the launchers' boundary."""
    real_gemm, real_permute = M.grouped_gemm, M._permute
    if how == "expert_offset":  # every expert's first row one too late
        def permute(experts, n):
            order, offs = real_permute(experts, n)
            offs = offs.clone()
            offs[1:-1] += 1
            return order, offs
        monkeypatch.setattr(M, "_permute", permute)
        return

    def gemm(a, weight, c, offs, n, **kw):
        if how == "gate_up_split" and kw.get("epilogue") == "swiglu":  # up read from the gate rows
            weight = weight[:, :, :n].repeat(1, 1, 2)
        if how == "routing_weight" and kw.get("epilogue", "none") == "none" and kw.get("scale") is not None:
            kw["scale"] = torch.ones_like(kw["scale"])
        if how == "dgrad_scale" and kw.get("epilogue") == "swiglu_bwd":
            kw["scale"] = torch.ones_like(kw["scale"])
        return real_gemm(a, weight, c, offs, n, **kw)
    monkeypatch.setattr(M, "grouped_gemm", gemm)


@pytest.mark.parametrize("how", ["expert_offset", "gate_up_split", "routing_weight", "dgrad_scale"])
def test_a_broken_kernel_fails_the_check(how, device, monkeypatch):
    _break(monkeypatch, how)
    args = _inputs((13, 16, 12, 4, 2), torch.float32, device, seed=14)
    rep = check(M.moe, M.reference, args, grad_args=(0, 1, 2, 3), run_twice=False)
    assert not rep.ok, f"breaking '{how}' went unnoticed: {rep.errors}"


def test_registry_cost():
    (x, r, gu, d, k), kw = SPEC.make_inputs((64, 32, 48, 8, 2), torch.bfloat16, "cpu")
    c = SPEC.cost(x, r, gu, d, k, **kw)
    assert c.flops == 2 * 64 * 2 * (2 * 48 * 32 + 48 * 32) and c.dtype == "bf16"
    assert c.bytes == 2 * (2 * 64 * 32 + 8 * 32 + 8 * 96 * 32 + 8 * 32 * 48)
    assert SPEC.cost(x, r, gu, d, k, backward=True, **kw).flops == 2 * c.flops
    (xm, *_), _ = SPEC.make_inputs((8192, 7168, 2048, 256, 8), torch.bfloat16, "meta")
    assert xm.device.type == "meta"


def test_make_inputs_routing_margins():
    # Neighbouring logits at least one level (4 / next_pow2(E)) apart, up to the small dense part.
    for shape in SPEC.test_shapes:
        x, r, *_rest, k = _inputs(shape, torch.bfloat16, "cpu")
        logits = (x.double() @ r.double().T).sort(dim=1).values
        level = 4.0 / (1 << (shape[3] - 1).bit_length())
        assert (logits.diff(dim=1) > 0.5 * level).all()


# --- on the GPU ---

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(512, 256, 384, 8, 2), (300, 192, 96, 64, 8), (257, 128, 160, 16, 1)])
def test_gpu_medium_shapes(shape, dtype):
    check_spec(SPEC, shape, dtype, "cuda", trials=2).raise_if_failed()


@pytest.mark.gpu
def test_gpu_skewed_routing_and_no_sync():
    args = _inputs((1000, 256, 192, 32, 4), torch.bfloat16, "cuda", seed=15)
    args[0][:700, 3] = 8.0  # 700 of 1000 tokens pick expert 3 first
    check(M.moe, M.reference, args, grad_args=(0, 1, 2, 3), tol=SPEC.tolerances["bfloat16"]).raise_if_failed()
    leaves = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
    M.moe(*leaves).sum().backward()  # tuned, so the timed call below launches without autotuning's syncs
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        M.moe(*leaves).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# --- precision="fp8": rowwise-scaled float8_e4m3fn forward GEMMs ---

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(37, 48, 40, 4, 2), (29, 32, 24, 3, 1)])
def test_fp8_forward_against_float64_of_the_quantized_layer(shape, dtype, device):
    # Odd token counts, a top-1 and a top-2 routing, experts of several 16-row tiles; the output must be the
    # quantized layer's (dequantization scales applied per token, per h row and per expert channel).
    x, router, gu, down, k = _inputs(shape, dtype, device, seed=shape[0])
    weights, experts = M.route(x, router, k)
    want = reference_fp8(x, router, gu, down, k).double()
    got = M.moe_experts(x, weights, gu, down, experts, precision="fp8")
    assert got.dtype == dtype and torch.isfinite(got).all()
    err = ((got.double() - want).norm() / want.norm()).item()
    # bf16: h is rounded to bf16 before its quantization, so a 1-ulp difference in h (fp32 vs float64 sums)
    # moves ~1/16 of h's elements to the neighbouring e4m3 value (2^-4 apart): ~1.5e-2 in norm. fp32: exact
    # sums in the interpreter; on the GPU the fp8 MMAs sum in ~14 bits (fast accumulation, 1.5-2.9e-3 seen).
    assert err < (3e-2 if dtype == torch.bfloat16 else 5e-3 if device == "cuda" else 1e-4), err
    # ... and near the unquantized layer: e4m3 keeps 3 mantissa bits (2^-4 relative per element).
    exact = M.reference(x.double(), router.double(), gu.double(), down.double(), k)
    assert ((got.double() - exact).norm() / exact.norm()).item() < 8e-2


def test_fp8_gradients_flow_through_the_saved_activations(device):
    # The backward runs in x's dtype on the fp8 forward's saved h and pre-activations (straight-through): its
    # gradients track the unquantized layer's within the quantization error.
    args = _inputs((21, 32, 24, 4, 2), torch.float32, device, seed=3)
    leaves = [a.detach().clone().requires_grad_() for a in args[:4]]
    M.moe(*leaves, args[4], precision="fp8").square().sum().backward()
    _grads_track_the_unquantized_layer(leaves, args)


@pytest.mark.parametrize("wgrads", ["fp8", "bf16"])
@pytest.mark.parametrize("routing", ["balanced", "one expert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 48, 40, 4, 2), (29, 32, 24, 5, 1)])
def test_fp8_backward_against_float64_of_the_quantized_backward(shape, dtype, routing, wgrads, device, monkeypatch):
    # backward_precision="fp8": both dgrads on fp8 operands (dout per token, d(gate, up) per row, the weights per
    # input channel through the transposed quantization). Every gradient against the float64 backward on the same
    # quantized operands, at odd token counts, top-1 and top-2, and with every pair on one expert (the others
    # empty: their weight gradients must come back as zeros).
    # fp8 weight gradients from FP8_WGRAD_MIN_ROWS rows an expert (the test shapes have a few dozen): both ways
    monkeypatch.setattr(M, "FP8_WGRAD_MIN_ROWS", 0 if wgrads == "fp8" else 10 ** 9)
    x, router, gu, down, k = _inputs(shape, dtype, device, seed=shape[0] + 5)
    weights, experts = M.route(x, router, k)
    if routing == "one expert":
        experts = torch.full_like(experts, shape[3] - 2)
    leaves = [t.detach().clone().requires_grad_() for t in (x, weights, gu, down)]
    out = M.moe_experts(*leaves, experts, backward_precision="fp8")
    dout = torch.randn(out.shape, device=device).to(dtype)
    out.backward(dout)
    want = experts_grads_reference_fp8(dout, x, weights, gu, down, experts, fp8_wgrads=wgrads == "fp8")
    # bf16: d(gate, up) is rounded to bf16 before its quantization, so fp32-vs-float64 sums move some elements to
    # the neighbouring e4m3 value (as in the forward's test); fp32 on the GPU: the fp8 MMAs' fast accumulation.
    tol = 3e-2 if dtype == torch.bfloat16 else 5e-3 if device == "cuda" else 1e-4
    for name, leaf, w in zip(("x", "weights", "gate_up", "down"), leaves, want):
        assert leaf.grad.dtype == leaf.dtype and torch.isfinite(leaf.grad).all(), name
        err = ((leaf.grad.double() - w).norm() / w.norm()).item()
        assert err < tol, (name, err)
    # ... and within the quantization error of the unquantized layer's gradients
    exact = [t.detach().double().requires_grad_() for t in (x, weights, gu, down)]
    M.experts_reference(*exact, experts).backward(dout.double())
    for name, leaf, w in zip(("x", "weights", "gate_up", "down"), leaves, exact):
        assert ((leaf.grad.double() - w.grad).norm() / w.grad.norm()).item() < 0.1, name


def test_fp8_backward_is_validated_and_runs_the_fp8_dgrads(device, monkeypatch):
    args = _inputs((21, 32, 24, 4, 2), torch.float32, device, seed=4)
    with pytest.raises(ValueError, match="backward_precision must be one of 'bf16', 'fp8', got 'fp16'"):
        M.moe(*args, backward_precision="fp16")
    with pytest.raises(ValueError, match="backward_precision must be one of"):
        M.MoE(16, 12, 2, 1, backward_precision="e5m2")
    # The two dgrads get fp8 operands with rowwise scales; the forward and the wgrads do not.
    calls = []
    real = M.grouped_gemm
    monkeypatch.setattr(M, "grouped_gemm", lambda a, *r, **kw: calls.append((a.dtype, kw.get("epilogue"),
                                                                                kw.get("a_scale") is not None))
                        or real(a, *r, **kw))
    leaves = [a.clone().requires_grad_() for a in args[:4]]
    M.moe(*leaves, args[4], backward_precision="fp8").sum().backward()
    fp8 = torch.float8_e4m3fn
    assert calls == [(torch.float32, "swiglu", False), (torch.float32, None, False), (fp8, "swiglu_bwd", True),
                     (fp8, None, True)], calls
    # nn.MoE passes it on
    layer = M.MoE(32, 24, 4, 2, device=device, backward_precision="fp8")
    assert layer.backward_precision == "fp8"
    calls.clear()
    layer(args[0].clone().requires_grad_()).sum().backward()
    assert [c[0] for c in calls] == [torch.float32, torch.float32, fp8, fp8]


def _grads_track_the_unquantized_layer(leaves, args):
    """The straight-through gradients in `leaves` (after backward of the squared sum) are within 15% (norm) of the
    float64 unquantized layer's."""
    ref = [a.detach().double().requires_grad_() for a in args[:4]]
    M.reference(*ref, args[4]).square().sum().backward()
    for got, want in zip(leaves, ref):
        assert torch.isfinite(got.grad).all()
        assert ((got.grad.double() - want.grad).norm() / want.grad.norm()).item() < 0.15


def test_fp8_quantize_rows_and_precision_errors(device):
    t = torch.randn(5, 7, 40, device=device, dtype=torch.bfloat16) * 3
    t[1, 2] = 0.0
    assert (M.quantize_rows_reference(t[1:2, 2:3].half())[0].float() == 0).all()  # fp16: a normal scale, not 0/0
    q, s = M.quantize_rows_reference(t)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 7) and s.dtype == torch.float32
    back = q.float() * s[..., None]
    assert (back[1, 2] == 0).all() and q.float().abs().amax() <= 448
    assert ((back - t.float()).abs() <= t.float().abs() * 2 ** -4 + s[..., None] * 2 ** -9).all()
    args = _inputs((5, 16, 12, 2, 1), torch.bfloat16, device)
    with pytest.raises(ValueError, match="precision must be one of 'bf16', 'fp8', 'mxfp8'"):
        M.moe(*args, precision="fp4")
    with pytest.raises(ValueError, match="precision must be one of"):
        M.MoE(16, 12, 2, 1, precision="int8")
    with pytest.raises(ValueError, match="hidden .*divisible by the MX block size 32, got 16"):
        M.moe(*args, precision="mxfp8")
    args = _inputs((5, 32, 12, 2, 1), torch.bfloat16, device)
    with pytest.raises(ValueError, match="intermediate divisible by the MX block size 32, got 12"):
        M.moe(*args, precision="mxfp8")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 5, 7), (37, 4111), (2, 9000), (1, 1)])
def test_quantize_rows_kernel_matches_its_definition(shape, dtype):
    # The Triton kernel (GPU only: the interpreter's fp8 casts truncate) against quantize_rows_reference, bit
    # for bit: rows longer than one 4096-wide block, a zero row, a NaN row, a strided input.
    t = (torch.randn(shape, device="cuda") * 30).to(dtype)
    t.view(-1, shape[-1])[0] = 0
    if t.view(-1, shape[-1]).shape[0] > 1:
        t.view(-1, shape[-1])[-1, shape[-1] // 2] = float("nan")
    for x in (t, t.transpose(0, -1).contiguous().transpose(0, -1)):
        q, s = M.quantize_rows(x)
        qr, sr = M.quantize_rows_reference(x)
        assert q.shape == x.shape and s.shape == x.shape[:-1]
        torch.testing.assert_close(s, sr, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(q.view(torch.uint8)[~torch.isnan(q.float())], qr.view(torch.uint8)[~torch.isnan(qr.float())])
        assert torch.equal(torch.isnan(q.float()), torch.isnan(qr.float()))


def test_quantize_rows_kernel_compiles_for_sm90():
    # It never runs in the interpreter (see above): CI builds it for the H100 instead.
    from kernelkit.testing import compile_check

    records = [{"kernel": "kernelkit.ops.gemm.fp8:quantize_rows_kernel",
                "args": {"X": {"ptr": dt}, "Q": {"ptr": "fp8e4nv"}, "S": {"ptr": "fp32"},
                         "N": {"value": 4111, "type": "i32"}, "stride_x": {"value": 4111, "type": "i32"},
                         "stride_q": {"value": 4111, "type": "i32"}, "tiny": {"value": 1e-38, "type": "fp32"},
                         "BLOCK_N": {"value": 4096}},
                "options": {"num_warps": 8}} for dt in ("bf16", "fp32")]
    assert not compile_check.compile_in_subprocess(records)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 70, 37), (4111, 65), (2, 1, 130), (1, 1), (8192, 4096), (5000, 300)])
def test_quantize_cols_t_kernel_matches_its_definition(shape, dtype):
    # The transposed quantization against quantize_rows_reference of the transpose, bit for bit: columns longer
    # than one 64-row block, column counts off the 64-wide block, a zero column, a NaN, strided inputs (an
    # expert weight's column-major copy, a sliced view).
    t = (torch.randn(shape, device="cuda") * 30).to(dtype)
    t[..., 0] = 0
    if t.shape[-1] > 2:
        t[..., t.shape[-2] // 2, 2] = float("nan")
    for x in (t, t.transpose(-1, -2).contiguous().transpose(-1, -2), t[..., : max(1, shape[-2] - 1), :]):
        q, s = M.quantize_cols_t(x)
        qr, sr = M.quantize_cols_t_reference(x)
        assert q.shape == x.transpose(-1, -2).shape and q.is_contiguous() and s.shape == x.shape[:-2] + x.shape[-1:]
        torch.testing.assert_close(s, sr, rtol=0, atol=0, equal_nan=True)
        nan = torch.isnan(qr.float())
        assert torch.equal(torch.isnan(q.float()), nan)
        assert torch.equal(q.view(torch.uint8)[~nan], qr.view(torch.uint8)[~nan])


def test_quantize_cols_t_reference_and_compile_for_sm90(device):
    w = torch.randn(3, 40, 24, device=device, dtype=torch.bfloat16)
    q, s = M.quantize_cols_t_reference(w)
    assert q.shape == (3, 24, 40) and q.is_contiguous() and s.shape == (3, 24)
    assert ((q.float() * s[..., None]).transpose(1, 2) - w.float()).abs().max() <= w.float().abs().max() * 2 ** -4
    # The kernel never runs in the interpreter (its fp8 casts truncate): CI builds it for the H100 instead.
    from kernelkit.ops.gemm import fp8 as F8
    from kernelkit.testing import compile_check

    i32 = lambda v: {"value": v, "type": "i32"}  # noqa: E731
    records = [{"kernel": "kernelkit.ops.gemm.fp8:quantize_cols_t_kernel",
                "args": {"X": {"ptr": dt}, "Q": {"ptr": "fp8e4nv"}, "S": {"ptr": "fp32"}, "R": i32(4096),
                         "C": i32(14336), "stride_xb": i32(4096 * 14336), "stride_xr": i32(14336), "stride_xc": i32(1),
                         "tiny": {"value": 1e-38, "type": "fp32"}, "BLOCK_R": {"value": F8.COLS_T_TILE[0]},
                         "BLOCK_C": {"value": F8.COLS_T_TILE[1]}},
                "options": {"num_warps": F8.COLS_T_TILE[2]}} for dt in ("bf16", "fp32")]
    # and the row-chunked pair that one dense matrix takes
    common = {"X": {"ptr": "bf16"}, "P": {"ptr": "fp32"}, "R": i32(8192), "C": i32(4096), "ROWS_PER": i32(1024),
              "stride_xb": i32(8192 * 4096), "stride_xr": i32(4096), "stride_xc": i32(1),
              "BLOCK_R": {"value": F8.COLS_T_TILE[0]}, "BLOCK_C": {"value": F8.COLS_T_TILE[1]}}
    records += [{"kernel": "kernelkit.ops.gemm.fp8:quantize_cols_t_amax_kernel", "args": common,
                 "options": {"num_warps": F8.COLS_T_TILE[2]}},
                {"kernel": "kernelkit.ops.gemm.fp8:quantize_cols_t_chunk_kernel",
                 "args": {**common, "Q": {"ptr": "fp8e4nv"}, "S": {"ptr": "fp32"},
                          "tiny": {"value": 1e-38, "type": "fp32"}},
                 "options": {"num_warps": F8.COLS_T_TILE[2]}}]
    assert not compile_check.compile_in_subprocess(records)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("gather", [False, True])
def test_quantize_segments_t_kernel_matches_its_definition(dtype, gather):
    # The fp8 wgrad's operands: per expert segment, per column, transposed into 128-padded, zero-filled segments.
    # Bit for bit against the torch definition: empty experts, segments of 1, 127, 128, 129 and 300 rows, a gather
    # with a row scale, a zero column, a NaN, a column count off the 64-wide block.
    counts = torch.tensor([3, 0, 127, 128, 1, 0, 129, 300])
    offs = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32).cuda()
    rows, c = int(counts.sum()), 75
    t = (torch.randn(rows + 7, c, device="cuda") * 30).to(dtype)
    t[:, 4] = 0
    t[5, 9] = float("nan")
    idx = torch.randint(0, rows + 7, (rows,), device="cuda") if gather else None
    scale = torch.rand(rows, device="cuda") if gather else None
    x = t if gather else t[:rows]
    q, s, poffs = M.quantize_segments_t(x, offs, idx, scale)
    qr, sr, pr = M.quantize_segments_t_reference(x, offs, idx, scale)
    assert torch.equal(poffs, pr) and q.shape == qr.shape and (poffs % 128 == 0).all()
    torch.testing.assert_close(s, sr, rtol=0, atol=0, equal_nan=True)
    end = int(poffs[-1])  # past it: the upper bound's slack, never read
    got, want = q[:, :end].view(torch.uint8), qr[:, :end].view(torch.uint8)
    nan = torch.isnan(qr[:, :end].float())
    bad = (torch.isnan(q[:, :end].float()) != nan) | ((got != want) & ~nan)
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} differ, first at (col, pos) "
                           f"{bad.nonzero()[:5].tolist()}: got {got[bad][:5].tolist()} want {want[bad][:5].tolist()}")


@pytest.mark.gpu
def test_quantize_segments_t_reads_its_index_tensors_as_given():
    # offs, idx, row_scale and poffs are read by index in the kernel: stepped views (poison between the elements)
    # must give what their contiguous copies give, bit for bit.
    from kernelkit.ops.gemm.fp8 import padded_offsets

    counts = torch.tensor([3, 0, 127, 129, 40])
    offs = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32).cuda()
    rows = int(counts.sum())
    x = torch.randn(rows + 7, 75, device="cuda").bfloat16()
    idx = torch.randint(0, rows + 7, (rows,), device="cuda")
    scale = torch.rand(rows, device="cuda")

    def stepped(t, poison):
        return torch.stack([t, torch.full_like(t, poison)], 1).flatten()[::2]

    want = M.quantize_segments_t(x, offs, idx, scale)
    poffs = padded_offsets(offs)
    got = M.quantize_segments_t(x, stepped(offs, 1 << 30), stepped(idx, 1 << 40), stepped(scale, float("nan")),
                                poffs=stepped(poffs, 1 << 30))
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.uint8) if g.dtype == torch.float8_e4m3fn else g,
                           w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w)


def _launch_recording_inputs():
    """(args, leaves) of a small bf16 layer for the sm_90 compile tests, which record the launches the interpreter
    makes (skipped outside it)."""
    from tests.conftest import INTERPRET

    if not INTERPRET:
        pytest.skip("records launches through the Triton interpreter")
    args = _inputs((9, 64, 64, 4, 2), torch.bfloat16, "cpu")
    return args, [a.clone().requires_grad_() for a in args[:4]]


def test_fp8_wgrad_kernels_compile_for_sm90(monkeypatch):
    # The fp8 wgrad as the fp8 backward launches it, at Hopper tiles, and the segment quantizer (GPU-only at run
    # time: the interpreter's fp8 casts truncate) in its gather / row-scale variants, built for sm_90.
    from kernelkit.testing import compile_check

    args, leaves = _launch_recording_inputs()
    records = []
    monkeypatch.setattr(M, "FP8_WGRAD_MIN_ROWS", 0)
    with compile_check.record_launches(records):
        M.moe(*leaves, args[4], backward_precision="fp8").float().square().sum().backward()
    launches = [r for r in compile_check.unique(records) if r["kernel"].endswith("moe_wgrad_fp8_kernel")]
    assert len(launches) >= 1, [r["kernel"] for r in records]
    variants = [{**r, "args": {**r["args"], "BLOCK_M": {"value": bm}, "BLOCK_N": {"value": bn},
                               "BLOCK_K": {"value": 128}},
                 "options": {"num_warps": 8, "num_stages": 3}} for r in launches for bm, bn in ((128, 128), (128, 256))]
    i32 = lambda v: {"value": v, "type": "i32"}  # noqa: E731
    for dt in ("bf16", "fp32"):
        for gather in (False, True):
            variants.append({"kernel": "kernelkit.ops.gemm.fp8:quantize_segments_t_kernel",
                             "args": {"X": {"ptr": dt}, "X_IDX": {"ptr": "i64" if gather else "i32"},
                                      "ROW_SCALE": {"ptr": "fp32"}, "Q": {"ptr": "fp8e4nv"}, "S": {"ptr": "fp32"},
                                      "OFFS": {"ptr": "i32"}, "POFFS": {"ptr": "i32"}, "C": i32(4096),
                                      "stride_xr": i32(4096), "stride_xc": i32(1), "stride_q": i32(98304),
                                      "tiny": {"value": 1e-38, "type": "fp32"}, "GATHER": {"value": gather},
                                      "HAS_SCALE": {"value": gather}, "BLOCK_R": {"value": 128},
                                      "BLOCK_C": {"value": 64}},
                             "options": {"num_warps": 8}})
    failures = compile_check.compile_in_subprocess(variants)
    assert not failures, "\n".join(failures)


# --- precision="mxfp8": E8M0 scales per 32 elements along K, h quantized in the SwiGLU epilogue ---

@pytest.mark.parametrize("mode", ["upcast", "dequant", "promote"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# The 8-expert, top-8 shape takes ~11 s per case in the interpreter: `make test-all` (CI time).
@pytest.mark.parametrize("shape", [(37, 64, 32, 4, 2), (29, 32, 96, 3, 1),
                                   pytest.param((9, 96, 64, 8, 8), marks=pytest.mark.slow)])
def test_mxfp8_forward_against_float64_of_the_quantized_layer(shape, dtype, mode, device, monkeypatch):
    monkeypatch.setattr(G, "MX_MODE", mode)
    # Odd token counts, top-1, top-2 and every expert for every token; experts of several 16-row tiles, K of
    # one to three MX blocks, intermediate of one to three 32-column quantization tiles.
    x, router, gu, down, k = _inputs(shape, dtype, device, seed=shape[0])
    kw = {"renormalize": k > 1}
    want = reference_mxfp8(x, router, gu, down, k, **kw).double()
    got = M.moe(x, router, gu, down, k, precision="mxfp8", **kw)
    assert got.dtype == dtype and torch.isfinite(got).all()
    err = ((got.double() - want).norm() / want.norm()).item()
    # fp32: the interpreter's sums differ from float64 only in rounding (4e-8 measured); the GPU's bf16 products
    # are exact and its fp32 sums may flip an element of h to its e4m3 neighbour. bf16: one output rounding.
    assert err < (1e-2 if dtype == torch.bfloat16 else 2e-3 if device == "cuda" else 1e-5), err
    exact = M.reference(x.double(), router.double(), gu.double(), down.double(), k, **kw)
    assert ((got.double() - exact).norm() / exact.norm()).item() < 1.2e-1


def test_mxfp8_epilogue_quantizes_h_like_the_quantizer(device):
    # The gate-up GEMM's MXFP8 output (bits and E8M0 codes) against mxfp8's reference conversion of the same
    # GEMM's fp32 h: a scale written to the wrong block, a wrong amax or rounding shows as a mismatch.
    x, router, gu, _down, k = _inputs((37, 64, 96, 4, 2), torch.float32, device, seed=11)
    weights, experts = M.route(x, router, k)
    order, offs = M._permute(experts, 4)
    tokens = order // k
    xq, xs = M.mxfp8_quantize(x)
    guq, gus = M.mxfp8_quantize(gu)
    rows = tokens.shape[0]
    h = torch.empty((rows, 96), device=device)
    M.grouped_gemm(xq, guq.transpose(1, 2), h, offs, 96, a_idx=tokens, epilogue="swiglu", a_scale=xs, b_scale=gus,
                    mx=True)
    hq = torch.full((rows, 96), 0x7E, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)  # poison
    hs = torch.full((rows, 3), 7, dtype=torch.uint8, device=device)
    M.grouped_gemm(xq, guq.transpose(1, 2), hq, offs, 96, a_idx=tokens, epilogue="swiglu", a_scale=xs,
                    b_scale=gus, mx=True, c_scales=hs)
    want_q, want_s = MX.reference_quantize(h)
    assert torch.equal(hs, want_s)
    same = hq.view(torch.uint8) == want_q.view(torch.uint8)
    assert same.all() if device != "cuda" else same.float().mean() > 0.999, same.float().mean()
    # h itself is the exact layer's, within e4m3 of the dequantized operands
    xd = MX.reference_dequantize(xq, xs, torch.float64)
    gud = MX.reference_dequantize(guq, gus, torch.float64)
    for r in (0, rows // 2, rows - 1):
        e = int(torch.searchsorted(offs.long(), torch.tensor(r, device=device), right=True)) - 1
        gate, up = (xd[tokens[r]] @ gud[e].T).chunk(2)
        torch.testing.assert_close(h[r].double(), torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_mxfp8_gradients_and_inputs(device):
    # Straight-through backward in x's dtype; h recomputed from the saved pre-activations. Strided, offset views
    # of x and of the weights go through the quantizers.
    args = _inputs((21, 32, 32, 4, 2), torch.float32, device, seed=3)
    big = torch.randn(4, 2 * 32 + 5, 40, device=device)
    big[:, 3:3 + 64, 4:36] = args[2]
    gu_view = big[:, 3:3 + 64, 4:36]
    leaves = [args[0].detach().clone().requires_grad_(), args[1].detach().clone().requires_grad_(),
              gu_view.detach().requires_grad_(), args[3].detach().clone().requires_grad_()]
    out = M.moe(*leaves, args[4], precision="mxfp8")
    torch.testing.assert_close(out, M.moe(*args, precision="mxfp8"), rtol=0, atol=0)
    out.square().sum().backward()
    _grads_track_the_unquantized_layer(leaves, args)


def test_mxfp8_nan_in_x_spreads_like_torch(device):
    # A NaN element of x makes its 32-block's scale NaN: that token's output is NaN (as the unquantized layer's
    # would be), the other tokens stay finite.
    x, router, gu, down, k = _inputs((13, 64, 32, 4, 2), torch.float32, device, seed=4)
    weights, experts = M.route(x, router, k)
    x = x.clone()
    x[5, 40] = float("nan")
    out = M.moe_experts(x, weights, gu, down, experts, precision="mxfp8")
    assert torch.isnan(out[5]).all()
    keep = torch.arange(13, device=device) != 5
    assert torch.isfinite(out[keep]).all()


def test_keep_quantized_weights_reuses_until_the_weight_changes(device, monkeypatch):
    args = _inputs((13, 32, 32, 4, 2), torch.float32, device, seed=5)
    x, router, gu, down, k = args
    calls = []
    real = M.quantized_weight.__globals__["quantize_rows"]
    monkeypatch.setitem(M.quantized_weight.__globals__, "quantize_rows", lambda t: calls.append(t.shape) or real(t))
    gu = torch.nn.Parameter(gu.clone())
    with M.keep_quantized_weights():
        first = M.moe(x, router, gu, down, k, precision="fp8")
        again = M.moe(x, router, gu, down, k, precision="fp8")
        assert len(calls) == 2, calls  # each weight quantized once
        torch.testing.assert_close(first, again, rtol=0, atol=0)
        with torch.no_grad():
            gu.mul_(-1.0)  # an optimizer-style in-place update: the version counter moves
        flipped = M.moe(x, router, gu, down, k, precision="fp8")
        assert len(calls) == 3
    torch.testing.assert_close(flipped, M.moe(x, router, gu, down, k, precision="fp8"), rtol=0, atol=0)
    assert not torch.allclose(flipped, first)
    assert not M.quantized_weight.__globals__["_KEPT"]  # dropped when the block closed


def test_deepseek_routing_options_match_reference_and_transformers(device):
    x, router, gu, down, _k = _inputs((19, 32, 16, 16, 4), torch.float32, device, seed=6)
    bias = torch.randn(16, device=device) * 0.05
    kw = {"scoring": "sigmoid", "expert_bias": bias, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}
    check(M.moe, M.reference, [x, router, gu, down, 4], kw, grad_args=(0, 1, 2, 3),
          run_twice=False).raise_if_failed()
    w, idx = M.route(x, router, 4, "sigmoid", expert_bias=bias, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    groups = (idx // 4)
    assert all(len(set(g.tolist())) <= 2 for g in groups)  # only topk_group groups chosen from
    counts = M.expert_counts(idx, 16)
    assert counts.sum() == 19 * 4 and torch.equal(counts, torch.bincount(idx.flatten(), minlength=16))
    loss = M.load_balancing_loss(x, router, idx, "sigmoid")
    assert loss.requires_grad is False and loss > 0
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    cfg = ds.DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                              routed_scaling_factor=2.5, norm_topk_prob=True)
    hf = ds.DeepseekV3TopkRouter(cfg).to(device)
    with torch.no_grad():
        hf.weight.copy_(router)
        hf.e_score_correction_bias.copy_(bias)
    _, w_hf, idx_hf = hf(x)
    mine, theirs = idx.sort(1), idx_hf.sort(1)
    assert torch.equal(mine.values, theirs.values)
    torch.testing.assert_close(w.gather(1, mine.indices), w_hf.gather(1, theirs.indices), rtol=1e-6, atol=1e-6)


def test_routing_options_are_validated(device):
    args = _inputs((5, 16, 12, 4, 2), torch.float32, device)
    for kw, match in (({"n_group": 3}, "n_group must be a positive int dividing"),
                      ({"n_group": 2}, "topk_group must be an int between 1 and n_group"),
                      ({"n_group": 2, "topk_group": 3}, "topk_group must be"),
                      ({"topk_group": 2}, "needs n_group > 1"),
                      ({"expert_bias": torch.zeros(3, device=device)}, "expert_bias must be a float tensor of shape")):
        with pytest.raises(ValueError, match=match):
            M.moe(*args, **kw)
    with pytest.raises(ValueError, match="top_k .* more experts than"):
        M.moe(*args[:4], 3, n_group=4, topk_group=1)
    with pytest.raises(TypeError, match="routed_scaling_factor must be a number"):
        M.moe(*args, routed_scaling_factor="2")
    with pytest.raises(ValueError, match="routed_scaling_factor must be finite, got nan"):
        M.moe(*args, routed_scaling_factor=float("nan"))


def test_moe_experts_validates_the_routing(device):
    # Issue 26: ids (T, 3) with weights (T, 2) raised a bare IndexError from inside the launcher.
    x = torch.randn(5, 16, device=device)
    gu, d = torch.randn(4, 24, 16, device=device), torch.randn(4, 16, 12, device=device)
    ids = torch.tensor([[0, 1, 2], [2, 3, 0], [1, 0, 3], [0, 2, 1], [3, 1, 2]], device=device)
    w = torch.rand(5, 3, device=device)
    cases = [
        ((x, w[:, :2], gu, d, ids), ValueError, r"weights must have experts' shape \(5, 3\).* got \(5, 2\)"),
        ((x, w, gu, d, ids[:4]), ValueError, r"experts must have shape \(5, top_k\).* got \(4, 3\)"),
        ((x, w[:, 0], gu, d, ids[:, 0]), ValueError, r"experts must have shape \(5, top_k\).* got \(5,\)"),
        ((x, w, gu, d, ids.float()), TypeError, "experts has dtype float32; expert ids must be int64 or int32"),
        ((x, w, gu, d, ids.tolist()), TypeError, "experts must be a torch.Tensor of expert ids, got list"),
        ((x, (w * 4).int(), gu, d, ids), TypeError, "weights has dtype int32; supported: float32"),
        ((x, w, gu, d, ids.masked_fill(ids == 3, 4)), ValueError, r"experts holds the id 4, outside \[0, 4\)"),
        ((x, w, gu, d, ids - 1), ValueError, r"experts holds the id -1, outside \[0, 4\)"),
        ((x[None], w, gu, d, ids), ValueError, r"x must be \(tokens, hidden\), got shape \(1, 5, 16\)"),
        ((x, w, gu[:, :, :15], d, ids), ValueError, r"gate_up_weight must have shape \(experts, 2 \* inter"),
        ((x, w, gu, d[:3], ids), ValueError, r"down_weight must have shape \(4, 16, 12\)"),
        ((x, w, gu.double(), d.double(), ids), TypeError, "gate_up_weight has dtype"),
        ((x, w, gu, d, ids.to("meta")), ValueError, "experts is on meta but x is on"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            M.moe_experts(*args)
    for w_ok, ids_ok in ((w.double(), ids.int()), (w.half(), ids)):  # what the docstring accepts
        got = M.moe_experts(x, w_ok, gu, d, ids_ok)
        want = M.experts_reference(x.double(), w_ok.double(), gu.double(), d.double(), ids_ok.long())
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_nn_moe_validates_its_sizes():
    for args, exc, match in (((16, 12, 4, 2.5), TypeError, "top_k must be an int, got float"),
                             ((16, -12, 4, 2), ValueError, "intermediate must be >= 1, got -12"),
                             ((16, 12, "4", 2), TypeError, "experts must be an int, got str"),
                             ((0, 12, 4, 2), ValueError, "hidden must be >= 1, got 0")):
        with pytest.raises(exc, match=match):
            kernelkit.nn.MoE(*args)


def test_router_in_float64_is_taken(device):
    # The docstring says float32, bfloat16, float16 or float64 for the router, whatever x's dtype; others refused.
    x, r, gu, d, k = _inputs((9, 16, 12, 4, 2), torch.float32, device, seed=2)
    check(M.moe, M.reference, [x, r.double(), gu, d, k], grad_args=(0, 1, 2, 3), run_twice=False).raise_if_failed()
    with pytest.raises(TypeError, match="router_weight has dtype int32; supported: float32, bfloat16, float16, "
                                        "float64"):
        M.moe(x, r.int(), gu, d, k)


# --- the kernel path's router (`route`) against the reference's, written from the definition ---

def _untied_logits(t, n_exp, n_group, bias, scoring, gen, margin=1e-3):
    """(t, E) logits whose routing scores (probabilities plus the bias) and group scores (each group's two best
    summed) differ by more than `margin` within every row: no top-k or group choice can flip on rounding."""
    rows = []
    while sum(len(r) for r in rows) < t:
        logits = torch.randn(4 * t, n_exp, generator=gen, dtype=torch.float64) * 2
        probs = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
        choice = probs + bias
        group = choice.view(-1, n_group, n_exp // n_group).sort(-1, descending=True).values[..., :2].sum(-1)
        ok = torch.ones(len(logits), dtype=torch.bool)
        for v in (choice, group) if n_group > 1 else (choice,):
            ok &= v.sort(-1).values.diff(dim=-1).min(-1).values > margin
        rows.append(logits[ok])
    return torch.cat(rows)[:t].float()


ROUTINGS = {"plain": {}, "bias": {"expert_bias": True}, "groups": {"n_group": 4, "topk_group": 2},
            "groups_of_one": {"n_group": 16, "topk_group": 9}, "scaled": {"routed_scaling_factor": 0.4},
            "deepseek": {"expert_bias": True, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}}


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("softmax", False), ("sigmoid", True),
                                                 ("sigmoid", False)])
@pytest.mark.parametrize("top_k", [1, 6])
def test_route_matches_the_reference_routing(routing, scoring, renormalize, top_k):
    # Expert ids exactly, weights and their gradients (to x and the router) to fp32 rounding; the router is the
    # identity, so the logits are the untied ones drawn.
    gen = torch.Generator().manual_seed(zlib.crc32(f"{routing} {scoring} {renormalize} {top_k}".encode()))
    kw = dict(ROUTINGS[routing])
    bias = torch.randn(16, generator=gen, dtype=torch.float64) * 0.1 if kw.get("expert_bias") else torch.zeros(16)
    if "expert_bias" in kw:
        kw["expert_bias"] = bias.float()
    x = _untied_logits(23, 16, kw.get("n_group", 1), bias.double(), scoring, gen).requires_grad_()
    router = torch.eye(16, requires_grad=True)
    w, idx = M.route(x, router, top_k, scoring, renormalize, **kw)
    xd, rd = (t.detach().double().requires_grad_() for t in (x, router))
    w_ref, idx_ref = M.reference_route(xd, rd, top_k, scoring, renormalize, **kw)
    assert torch.equal(idx, idx_ref)
    torch.testing.assert_close(w.double(), w_ref, rtol=2e-6, atol=1e-7)
    dw = torch.randn(w.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(w, (x, router), dw.float())
    want = torch.autograd.grad(w_ref, (xd, rd), dw)
    for g, r in zip(got, want):
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-6)


def test_mxfp8_kernels_compile_for_sm90_at_hopper_tiles(monkeypatch):
    # The MXFP8 grouped GEMM (every K-step variant: kernelkit's dequantization, tl.dot_scaled, promotion) with the
    # Hopper tiles the autotuner picks from, compiled for sm_90: the interpreter runs only 16-row tiles.
    from kernelkit.testing import compile_check
    from tests.conftest import INTERPRET

    if not INTERPRET:
        pytest.skip("records launches through the Triton interpreter")
    monkeypatch.setattr(G, "MX_MODE", "dequant")  # the launches with MX operands ("upcast" multiplies bf16 ones)
    records = []
    args = _inputs((9, 64, 64, 4, 2), torch.bfloat16, "cpu")
    with compile_check.record_launches(records):
        M.moe(*args, precision="mxfp8")
    gemms = [r for r in compile_check.unique(records) if r["kernel"].endswith("moe_grouped_gemm_kernel")]
    assert len(gemms) == 2 and all(r["args"]["SCALES"]["value"] == "mx" for r in gemms)
    variants = []
    for r in gemms:
        for mode in ("dequant", "dot_scaled", "promote"):  # the K-loop modes; "upcast" runs the bf16 kernel
            v = {**r, "args": {**r["args"], "MX_MODE": {"value": mode}, "BLOCK_M": {"value": 128},
                               "BLOCK_N": {"value": 128}, "BLOCK_K": {"value": 64}},
                 "options": {"num_warps": 8, "num_stages": 3}}
            variants.append(v)
    failures = compile_check.compile_in_subprocess(variants)
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(37, 64, 48, 6, 2), (301, 128, 96, 16, 4)])
def test_gpu_wgrads_through_grouped_mm_match_the_triton_kernel(shape, monkeypatch):
    # bf16 on Hopper: the weight gradients come from torch._grouped_mm; odd token counts (group boundaries at any
    # row) and two experts left empty, whose gradients must be exactly zero (written, not left as poison).
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the torch._grouped_mm wgrads run on sm_90 only")
    args = _inputs(shape, torch.bfloat16, "cuda", seed=shape[0])
    args[0][:, 1] = -8.0
    args[0][:, 4] = -7.5
    assert (_counts(args)[[1, 4]] == 0).all()
    grads = {}
    monkeypatch.setattr(M, "CUBLAS_WGRAD_MIN", 0)  # these experts are below the size that picks it
    for path in ("grouped_mm", "triton"):
        monkeypatch.setattr(M, "CUBLAS_WGRADS", path == "grouped_mm")
        leaves = [a.detach().clone().requires_grad_() for a in args[:4]]
        with poisoned_outputs():
            M.moe(*leaves, args[4]).float().square().sum().backward()
        grads[path] = [leaves[2].grad, leaves[3].grad]
    for got, want in zip(grads["grouped_mm"], grads["triton"]):
        assert not got[[1, 4]].any() and torch.isfinite(got).all()
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2


def test_nn_moe_deepseek_routing(device):
    # DeepSeek-V3's options on the module: HF's bias buffer name, the routing as `route`'s, the reference's output.
    m = M.MoE(32, 16, 8, 2, scoring="sigmoid", device=device, expert_bias=True, n_group=4, topk_group=2,
              routed_scaling_factor=2.5)
    assert "gate.e_score_correction_bias" in m.state_dict() and not m.gate.e_score_correction_bias.any()
    with torch.no_grad():
        m.gate.e_score_correction_bias.copy_(torch.randn(8, device=device) * 0.05)
    x = torch.randn(13, 32, device=device)
    want = M.reference(x.double(), m.gate.weight.double(), m.experts.gate_up_proj.double(),
                       m.experts.down_proj.double(), 2, scoring="sigmoid",
                       expert_bias=m.gate.e_score_correction_bias.double(), n_group=4, topk_group=2,
                       routed_scaling_factor=2.5)
    torch.testing.assert_close(m(x).double(), want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="n_group must be a positive int dividing"):
        M.MoE(32, 16, 8, 2, n_group=3)


@pytest.mark.slow  # about 30 s of sm_90 compiles on the CPU; the GPU tests launch the same kernels
def test_persistent_kernel_compiles_for_sm90_at_hopper_tiles(monkeypatch):
    # The persistent TMA grouped GEMM as the forward, the backward's dgrads and fp8 launch it (K-major and
    # N-major weight descriptors, every epilogue), at the Hopper tiles its autotuner picks from, for sm_90.
    from kernelkit.testing import compile_check

    args, leaves = _launch_recording_inputs()
    records = []
    with compile_check.record_launches(records):
        for gather in ("copy", "loads"):
            monkeypatch.setattr(G, "TMA_GATHER", gather)
            M.moe(*leaves, args[4]).float().square().sum().backward()
            M.moe(*leaves, args[4], backward_precision="fp8").float().square().sum().backward()
            M.moe(*args, precision="fp8")
            M.moe(args[0], args[1], args[2].transpose(1, 2).contiguous().transpose(1, 2), *args[3:])  # N-major
    launches = [r for r in compile_check.unique(records) if r["kernel"].endswith("moe_grouped_tma_kernel")]
    kinds = {(r["args"]["EPILOGUE"]["value"], r["args"]["B_KMAJOR"]["value"], r["args"]["SCALES"]["value"],
              r["args"]["GATHER_A"]["value"]) for r in launches}
    assert kinds == {("swiglu", True, "", False), ("none", True, "", False), ("swiglu_bwd", False, "", False),
                     ("none", False, "", False), ("swiglu", True, "rowwise", False), ("none", True, "rowwise", False),
                     ("swiglu", True, "", True), ("swiglu_bwd", False, "", True), ("swiglu", True, "rowwise", True),
                     ("swiglu", False, "", False), ("swiglu", False, "", True), ("swiglu_bwd", True, "rowwise", False),
                     ("swiglu_bwd", True, "rowwise", True)}, kinds
    variants = []
    for r in launches:
        a = r["args"]
        tiles = [(128, 128, 64, 8), (64, 128, 64, 4)] if a["EPILOGUE"]["value"] == "swiglu" else [(128, 256, 64, 8)]
        if a["SCALES"]["value"] == "rowwise":
            tiles = [(bm, bn, 128, w) for bm, bn, _, w in tiles]
        for bm, bn, bk, warps in tiles:
            variants.append({**r, "args": {**a, "BLOCK_M": {"value": bm}, "BLOCK_N": {"value": bn},
                                           "BLOCK_K": {"value": bk}, "NUM_SMS": {"value": 132}},
                             "options": {"num_warps": warps, "num_stages": 3}})
    failures = compile_check.compile_in_subprocess(variants)
    assert not failures, "\n".join(failures)


def test_saved_activations_are_freed_by_the_backward(device, monkeypatch):
    # The forward keeps z (gate | up) and not h; the backward writes h again in its SwiGLU epilogue and frees z
    # before the weight gradients. A second backward through the graph then says so, unless KEEP_SAVED.
    args = _inputs((29, 32, 24, 4, 2), torch.float32, device, seed=21)
    leaves = [a.clone().requires_grad_() for a in args[:4]]
    out = M.moe(*leaves, args[4])
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward.*KERNELKIT_MOE_KEEP_SAVED"):
        out.sum().backward()
    monkeypatch.setattr(M, "KEEP_SAVED", True)
    leaves = [a.clone().requires_grad_() for a in args[:4]]
    out = M.moe(*leaves, args[4])
    out.sum().backward(retain_graph=True)
    first = [t.grad.clone() for t in leaves]
    out.sum().backward()
    for t, g in zip(leaves, first):
        torch.testing.assert_close(t.grad, 2 * g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_down_weight_gradient_alone(dtype, device):
    # Only the down weight requires grad: no SwiGLU backward runs, so h comes from z in torch.
    x, router, gu, down, k = _inputs((31, 32, 40, 5, 2), dtype, device, seed=22)
    d = down.clone().requires_grad_()
    M.moe(x, router, gu, d, k).float().square().sum().backward()
    dd = down.double().requires_grad_()
    M.reference(x.double(), router.double(), gu.double(), dd, k).square().sum().backward()
    err = ((d.grad.double() - dd.grad).norm() / dd.grad.norm()).item()
    assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), err
