"""kernelkit.moe's grouped GEMMs reading the experts' weights through TMA descriptors (bf16/fp16, K-contiguous,
16-byte aligned rows), against float64 and against the pointer path on the same inputs."""

import pytest
import torch

from kernelkit.ops import _moe_gemm as G
from kernelkit.ops import moe as M
from kernelkit.ops import registry
from kernelkit.testing import check

SPEC = registry.get("moe")


@pytest.fixture
def tma_calls(monkeypatch):
    calls = []
    original = G._b_tma

    def spy(weight):
        got = original(weight)
        calls.append((tuple(weight.shape), got))
        return got

    monkeypatch.setattr(G, "_b_tma", spy)
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
    monkeypatch.setattr(G, "B_TMA", False)
    ptr = M.moe(*args)
    torch.testing.assert_close(tma.float(), ptr.float(), rtol=1e-2, atol=1e-2)


def test_unaligned_expert_weights_take_pointers(device, tma_calls):
    args = _inputs((20, 36, 20, 3, 2), torch.bfloat16, device, seed=3)  # hidden 36: 72-byte rows
    x, router, gate_up, down, k = args
    check(M.moe, M.reference, [x, router, gate_up, down, k], grad_args=(0, 2, 3),
          tol=SPEC.tolerances.get("bfloat16"), run_twice=False).raise_if_failed()
    assert tma_calls[0] == ((3, 36, 40), False)
