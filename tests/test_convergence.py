"""Convergence: a tiny model of each family trained for a few steps on fixed synthetic data, patched and
unpatched from the same weights, in fp32: the loss curves agree step by step and the loss falls.
MoE families agree more loosely: top-k routing is discontinuous, and a near-tie between two experts
broken the other way by a 1e-7 difference changes which experts run from then on.

Marked `convergence` so that it can be deselected (`-m "not convergence"`); `make test` runs it.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from kernelkit.patch import patch  # noqa: E402

from .test_patch import FAMILIES, VOCAB, device, linear_ce, tiny_model  # noqa: E402,F401  (fixtures)

pytestmark = pytest.mark.convergence

# Sized for the Triton interpreter, where each kernel program costs milliseconds: one layer, two heads.
STEPS, BATCH, SEQ, LR = 12, 1, 8, 5e-3
SIZE = dict(num_attention_heads=2, num_key_value_heads=1)
RTOL = {"mixtral": 2e-2, "qwen3_moe": 2e-2}
# Mixtral's two sparse blocks run interpreted grouped GEMMs (about 5 s a step here): fewer steps keep CI short.
FAMILY_STEPS = {"mixtral": 7}


def _data(seed: int = 0):
    """Sequences following one fixed random successor table: learnable, so the loss falls."""
    g = torch.Generator().manual_seed(seed)
    successor = torch.randperm(VOCAB, generator=g)
    ids = torch.empty(BATCH, SEQ, dtype=torch.long)
    ids[:, 0] = torch.randint(1, VOCAB, (BATCH,), generator=g)
    for t in range(1, SEQ):
        ids[:, t] = successor[ids[:, t - 1]]
    return ids


def _curve(model, ids, steps: int = STEPS) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# CI (`make test`) trains Llama (SDPA-shaped attention and SwiGLU; the MoE experts' training step is test_patch_moe's,
# and every family's patched forward and backward against its unpatched model is test_patch's); `make test-all`
# trains every family, Gemma 2 (softcaps, GeGLU, (1 + w) norms: 33 s in the interpreter) included.
CI_FAMILIES = ("llama",)


@pytest.mark.parametrize("family", [f if f in CI_FAMILIES else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])
def test_loss_curves_match(family, device, linear_ce):
    ref = tiny_model(family, device=device, layers=1, **SIZE).train()
    model = copy.deepcopy(ref)
    patch(model)
    ids = _data().to(device)
    steps = FAMILY_STEPS.get(family, STEPS)
    got, want = _curve(model, ids, steps), _curve(ref, ids, steps)
    rtol = RTOL.get(family, 1e-3)
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: patched {a:.6f} vs unpatched {b:.6f}"
    assert want[-1] < 0.8 * want[0], f"the tiny model does not learn: {want[0]:.3f} -> {want[-1]:.3f}"
