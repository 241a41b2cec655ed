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
    # stop 41, 11-23 s each, checks of GPU-side behaviour or of the patched model that the GPU suite runs (its test
    # stage takes the slow tests too); their neighbours in the same files stay in CI
    "tests/test_patch.py::test_a_fallback_under_compile_does_not_recompile_every_call",
    "tests/test_patch_choose.py::test_fp8_trials_of_linears_whose_rows_are_made_upstream_do_not_quantize_them",
    "tests/test_moe.py::test_no_host_sync",
    "tests/test_fp8_linear.py::test_patch_precision_fp8_trains_close_to_bf16",
    "tests/test_patch_decoder.py::test_rms_norm_off_or_fp8_rows_keep_the_add_apart",
    # stop 42: the sm_90 builds of the Gluon backward with dQ fused, d128 causal and d64 non-causal, stay in CI
    "tests/test_attention_hopper.py::test_sm90_build_of_the_backward_fits_without_spills[128-False-True]",
    "tests/test_attention_hopper.py::test_sm90_build_of_the_backward_fits_without_spills[64-True-True]",
)


# Heavily parametrized interpreter tests of which CI runs a pairwise-covering subset (stop 41, CI's 15-minute budget):
# every pair of parameter values any variant takes is still taken by a variant in CI (`_check_thinning` checks it at
# collection), and every variant runs in `make test-all` and the GPU suite.
THINNED = (
    "tests/test_moe.py::test_fp8_backward_against_float64_of_the_quantized_backward",
    "tests/test_moe.py::test_mxfp8_forward_against_float64_of_the_quantized_layer",
    "tests/test_moe.py::test_forward_and_gradients_against_float64",
    "tests/test_norm_wide_rows.py::test_layer_norm_strided_rows_large_mean",
    "tests/test_norm_wide_rows.py::test_rms_norm_strided_rows_weight_offset",
    "tests/test_cross_entropy.py::test_matches_fp64_reference",
    "tests/test_cross_entropy.py::test_each_feature",
    "tests/test_cross_entropy.py::test_class_weights_match_torch_in_float64",
    "tests/test_linear_cross_entropy.py::test_each_feature_over_several_chunks",
    "tests/test_linear_cross_entropy.py::test_class_weights_match_torch",
)
_NOT_PAIRED = ("device",)  # fixtures parametrized by device: one value on the CPU


def _pairs(item) -> set:
    """The (parameter, value) pairs of one variant, two at a time (one at a time for a single parameter)."""
    vals = sorted((n, repr(v)) for n, v in item.callspec.params.items() if n not in _NOT_PAIRED)
    if len(vals) < 2:
        return {tuple(vals)}
    return {(a, b) for i, a in enumerate(vals) for b in vals[i + 1:]}


def _thinnable(items) -> dict:
    """The THINNED tests' variants CI would run without thinning (not slow already), by test."""
    groups: dict = {}
    for item in items:
        base = item.nodeid.split("[")[0]
        if base in THINNED and hasattr(item, "callspec") and item.get_closest_marker("slow") is None \
                and item.nodeid not in SLOW_VARIANTS:
            groups.setdefault(base, []).append(item)
    return groups


def thinned_out(groups: dict) -> set:
    """Node ids of the THINNED tests' variants CI leaves out: of each test (`_thinnable`'s groups), all but a greedy
    pairwise cover of the variants CI would otherwise run, picked in collection order."""
    out = set()
    for variants in groups.values():
        todo = set().union(*(_pairs(v) for v in variants))
        kept = []
        while todo:
            best = max(variants, key=lambda v: len(_pairs(v) & todo))  # the first of the best, in order
            kept.append(best)
            todo -= _pairs(best)
        out |= {v.nodeid for v in variants if v not in kept}
    return out


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    before = _thinnable(items)
    thin = thinned_out(before)
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if item.nodeid in SLOW_VARIANTS or item.nodeid in thin:
            item.add_marker(pytest.mark.slow)
    _check_thinning(before)


def _check_thinning(before: dict) -> None:
    """Every pair of parameter values the variants CI ran before thinning take (`_thinnable`) is taken by a variant
    still in CI."""
    pairs: dict = {}
    for base, variants in before.items():
        for item in variants:
            in_ci = item.get_closest_marker("slow") is None
            for pair in _pairs(item):
                pairs[(base, pair)] = pairs.get((base, pair), False) or in_ci
    missing = [f"{b} {p}" for (b, p), kept in pairs.items() if not kept]
    if missing:
        raise pytest.UsageError("thinned tests leave these parameter values out of CI (tests/conftest.py THINNED): "
                                + "; ".join(missing))


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
