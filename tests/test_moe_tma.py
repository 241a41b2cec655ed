"""kernelkit.moe's grouped GEMMs reading the experts' weights through TMA descriptors (bf16/fp16, K-contiguous,
16-byte aligned rows), against float64 and against the pointer path on the same inputs."""

import pytest
import torch

from kernelkit.ops.gemm import grouped as G
from kernelkit.ops import moe as M
from kernelkit.ops import registry
from kernelkit.testing import check

SPEC = registry.get("moe")


@pytest.fixture
def tma_calls(monkeypatch):
    calls = []
    original = G.tma_weight

    def spy(weight):
        got = original(weight)
        calls.append((tuple(weight.shape), got))
        return got

    monkeypatch.setattr(G, "tma_weight", spy)
    return calls


def _inputs(shape, dtype, device, seed=0):
    args, _ = SPEC.make_inputs(shape, dtype, device, torch.Generator(device=device).manual_seed(seed))
    return list(args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gate_up_and_down_through_tma(dtype, device, tma_calls):
    # hidden 40 and intermediate 24: rows of 80 and 48 bytes; 37 tokens over 5 experts, top 2: partial row tiles,
    # intermediate 24 ends on a partial N box of the gate half (its last columns read up rows, never stored).
    args = _inputs((37, 40, 24, 5, 2), dtype, device, seed=1)
    rep = check(M.moe, M.reference, args, grad_args=(0, 1, 2, 3), tol=SPEC.tolerances.get(str(dtype)[6:]),
                run_twice=False)
    rep.raise_if_failed()
    forward = [got for shape, got in tma_calls[:2]]
    assert forward == [True, True], tma_calls  # gate-up (E, H, 2I) and down (E, I, H) views, K-contiguous
    assert not all(got for _, got in tma_calls), "the dgrads read the weights N-contiguous: pointer loads"


def test_tma_and_pointer_paths_agree(device, monkeypatch):
    args = _inputs((50, 64, 32, 4, 2), torch.bfloat16, device, seed=2)
    tma = M.moe(*args)
    monkeypatch.setattr(G, "GEMM_TMA", False)
    ptr = M.moe(*args)
    torch.testing.assert_close(tma.float(), ptr.float(), rtol=1e-2, atol=1e-2)


def test_unaligned_expert_weights_take_pointers(device, tma_calls):
    args = _inputs((20, 36, 20, 3, 2), torch.bfloat16, device, seed=3)  # hidden 36: 72-byte rows
    x, router, gate_up, down, k = args
    check(M.moe, M.reference, [x, router, gate_up, down, k], grad_args=(0, 2, 3),
          tol=SPEC.tolerances.get("bfloat16"), run_twice=False).raise_if_failed()
    assert tma_calls[0] == ((3, 36, 40), False)


@pytest.fixture
def kernels(monkeypatch):
    launched = []
    original = G.launch

    def spy(kernel, grid, key, *args, **kwargs):
        launched.append((key[0], kwargs.get("EPILOGUE"), kwargs.get("B_KMAJOR"), kwargs.get("GATHER_A")))
        return original(kernel, grid, key, *args, **kwargs)

    monkeypatch.setattr(G, "launch", spy)
    return launched


@pytest.mark.parametrize("gather", ["copy", "loads"])
@pytest.mark.parametrize("routing", ["balanced", "empty_experts", "one_expert", "every_expert"])
def test_persistent_kernel_against_float64(routing, gather, device, kernels, monkeypatch):
    # bf16 with 16-byte rows: every grouped GEMM of the forward and backward runs the persistent TMA kernel (x and
    # dout gathered by a copy first, or in its loads; the dgrads' weights N-contiguous). Odd token counts put expert
    # boundaries inside row tiles (a tile reads the next expert's rows and must not store them); empty experts own
    # no tile.
    monkeypatch.setattr(G, "TMA_GATHER", gather)
    shape = {"balanced": (45, 32, 48, 5, 2), "empty_experts": (41, 40, 24, 6, 2), "one_expert": (23, 32, 32, 4, 1),
             "every_expert": (19, 24, 40, 3, 3)}[routing]
    args = _inputs(shape, torch.bfloat16, device, seed=len(routing))
    x = args[0]
    if routing == "empty_experts":  # experts 1 and 4 rank last for every token (the router is x's first columns)
        x[:, 1], x[:, 4] = -8.0, -7.5
    if routing == "one_expert":
        x[:, 2] = 8.0
    counts = torch.bincount(M.route(x, args[1], args[4])[1].flatten(), minlength=shape[3])
    if routing == "empty_experts":
        assert (counts[[1, 4]] == 0).all()
    if routing == "one_expert":
        assert counts[2] == shape[0]
    rep = check(M.moe, M.reference, args, {"renormalize": shape[4] > 1}, grad_args=(0, 1, 2, 3),
                tol=SPEC.tolerances.get("bfloat16"), run_twice=False)
    rep.raise_if_failed()
    tma = [(epi, kmajor, gathered) for kind, epi, kmajor, gathered in kernels if kind == "gemm_tma"]
    in_loads = gather == "loads"
    assert {("swiglu", True, in_loads), ("none", True, False), ("swiglu_bwd", False, in_loads),
            ("none", False, False)} <= set(tma), kernels
    assert not [k for k in kernels if k[0] == "gemm"], "a grouped GEMM fell back to the pointer kernel"


@pytest.mark.slow  # ~23 s in the interpreter: `make test-all` (CI time)
def test_persistent_and_pointer_kernels_agree(device, monkeypatch):
    # The same layer through both kernels (KERNELKIT_MOE_PERSISTENT=0 keeps the pointer kernel with the gather in
    # its loads): the same products and fp32 sums, so outputs and gradients agree to bf16 rounding.
    args = _inputs((53, 64, 48, 7, 2), torch.bfloat16, device, seed=5)
    got = {}
    for persistent in (True, False):
        monkeypatch.setattr(G, "PERSISTENT", persistent)
        leaves = [a.detach().clone().requires_grad_() for a in args[:4]]
        out = M.moe(*leaves, args[4])
        out.float().square().sum().backward()
        got[persistent] = [out] + [t.grad for t in leaves]
    for a, b in zip(got[True], got[False]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("inter", [12, 16])
def test_column_major_gate_up_weight(inter, device, kernels):
    # Each expert's gate-up weight stored (hidden, 2I)-contiguous (a transposed view): the forward's weight boxes are
    # N-major and the up half's start at column I. 12 bf16 columns are 24 bytes, not a 16-byte boundary (the TMA
    # engine faults on such a box, an illegal instruction under the H100's memcheck): that GEMM takes the pointer
    # kernel; 16 columns stay on the persistent kernel.
    x, router, gu, down, k = _inputs((27, 32, inter, 4, 2), torch.bfloat16, device, seed=inter)
    gu_t = gu.transpose(1, 2).contiguous().transpose(1, 2)
    assert gu_t.stride(1) == 1 and torch.equal(gu_t, gu)
    check(M.moe, M.reference, [x, router, gu_t, down, k], grad_args=(0, 1, 2, 3),
          tol=SPEC.tolerances.get("bfloat16"), run_twice=False).raise_if_failed()
    gate_up = [(kind, kmajor) for kind, epi, kmajor, _ in kernels if epi == "swiglu"]
    assert gate_up == ([("gemm", None)] if inter == 12 else [("gemm_tma", False)]), kernels
