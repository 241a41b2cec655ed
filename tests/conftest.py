import os
import random
import zlib

import numpy as np
import pytest
import torch
from hypothesis import settings

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Hypothesis draws its examples from a seed of its own: derandomized, a property test sees the same shapes
# on every run and every worker, as the fixture below makes every test's random tensors the same.
settings.register_profile("kernelkit", derandomize=True)
settings.load_profile("kernelkit")


# Variants of tests whose other variants stay in CI, moved to the slow set for CI's 15-minute budget (stop 40: each
# 10-15 s in the interpreter on a slow day). The GPU suite and `pytest -m slow` run them.
SLOW_VARIANTS = (
    "tests/test_fp8_linear.py::test_patch_fp8_runs_the_lm_head_in_fp8_unless_told_not_to[False]",
    "tests/test_patch_moe.py::test_training_step_matches_unpatched[qwen3_moe-False]",
    "tests/test_patch_decoder.py::test_fused_add_norm_computes_what_the_layer_does[qwen3-dtype1]",
    "tests/test_layouts.py::test_every_layout_on_cooperative_rows[add_rms_norm]",
    # stop 41, each 7-18 s: rms_norm's cooperative rows, the other quantizer shapes, the bf16 MoE backward, the
    # other masked-query variants and moe_fp8's layouts stay in CI
    "tests/test_layouts.py::test_every_layout_on_cooperative_rows[layer_norm]",
    "tests/test_fp8_fusion.py::test_rows_and_cols_t_are_both_quantizations_bit_for_bit[dtype9-shape9]",
    "tests/test_moe.py::test_fp8_backward_against_float64_of_the_quantized_backward[shape0-dtype1-balanced-bf16]",
    "tests/test_moe.py::test_fp8_backward_against_float64_of_the_quantized_backward[shape0-dtype1-balanced-fp8]",
    "tests/test_patch.py::test_fully_masked_queries_answer_as_the_original_attention[eager-dtype1]",
    "tests/test_layouts.py::test_arguments_beyond_make_inputs[moe_experts]",  # 10-18 s; moe_fp8's layouts stay
)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if item.nodeid in SLOW_VARIANTS:
            item.add_marker(pytest.mark.slow)


def node_seed(nodeid: str) -> int:
    """The seed of one test: a hash of its node id, so a test's inputs are the same on every run, alone or
    in any order, on any xdist worker (Python's hash() of a str changes with every process)."""
    return zlib.crc32(nodeid.encode())


@pytest.fixture(autouse=True)
def _seed_every_test(request):
    """Seed torch (CPU and every GPU), random and numpy before each test: an unseeded torch.randn in a test
    draws the same numbers every run, so a test that catches a bug catches it every time."""
    seed = node_seed(request.node.nodeid)
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


@pytest.fixture(autouse=True)
def _patch_runs_kernelkit(request, monkeypatch):
    """kernelkit.patch's switches measure kernelkit against the model's code per shape and may keep the
    model's: tests written to exercise the kernels force them (KERNELKIT_PATCH_CHOICE=kernelkit), except
    the tests of that choice."""
    if not request.node.nodeid.startswith("tests/test_patch_choose.py"):
        monkeypatch.setenv("KERNELKIT_PATCH_CHOICE", "kernelkit")


@pytest.fixture
def device():
    """Where kernel tests run: the GPU when present, else the CPU through the Triton interpreter."""
    if torch.cuda.is_available() and not INTERPRET:
        return "cuda"
    if not INTERPRET:
        pytest.skip("kernel tests need a GPU or TRITON_INTERPRET=1")
    return "cpu"
