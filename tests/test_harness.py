import json
import random
import zlib

import numpy as np
import pytest
import torch

from kernelkit.hw import DATASHEETS, Ceilings
from kernelkit.testing import check, empty_like, poisoned_outputs, rel_error
from kernelkit.testing.bench import Row, plot, print_table, rotation_count, write_json
from tests.conftest import node_seed


def ref_scale(x):
    return x * 2


def good(x):
    out = empty_like(x)
    out.copy_(x * 2)
    return out


def test_correct_function_passes():
    rep = check(good, ref_scale, (torch.randn(5, 7),), grad_args=())
    assert rep.ok, rep.failures
    assert rep.errors["out"] < 1e-6


def test_unwritten_element_is_caught_by_poison():
    def forgets_last(x):
        out = empty_like(x)
        out.view(-1)[:-1] = (x * 2).view(-1)[:-1]
        return out

    rep = check(forgets_last, ref_scale, (torch.randn(5, 7),))
    assert not rep.ok and "non-finite" in rep.failures[0]


def test_poison_only_inside_the_context():
    from kernelkit.runtime import alloc as poison

    x = torch.zeros(3)
    with poisoned_outputs():
        assert poison.enabled() and torch.isnan(empty_like(x)).all()
        assert (poison.empty((4,), dtype=torch.int32, device="cpu") == -1).all()
    assert not poison.enabled()


def test_wrong_values_and_wrong_gradients_are_caught():
    rep = check(lambda x: x * 2.01, ref_scale, (torch.randn(64),))
    assert not rep.ok and "relative error" in rep.failures[0]

    class BadGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 3

    rep = check(BadGrad.apply, ref_scale, (torch.randn(64),), grad_args=(0,))
    assert not rep.ok and any("grad[0]" in f for f in rep.failures)


def test_run_twice_flags_results_that_change():
    state = {"n": 0}

    def racy(x):
        state["n"] += 1
        return x * 2 + (1e-7 if state["n"] % 2 == 0 else 0.0)

    rep = check(racy, ref_scale, (torch.randn(64),))
    assert not rep.ok and "differs between two identical calls" in rep.failures[-1]


def test_output_structure_must_be_the_references():
    # A 1-tuple is not the tensor it holds; a list and a tuple of the same outputs are alike.
    rep = check(lambda x: (x * 2,), ref_scale, (torch.randn(8),))
    assert not rep.ok and rep.failures == ["output structure: out is a tuple of 1 (tensor,), the reference's is "
                                           "a tensor"]
    two = lambda x: (x * 2, x * 3)  # noqa: E731
    assert check(lambda x: [x * 2, x * 3], two, (torch.randn(8),)).ok
    rep = check(lambda x: (x * 2, None), two, (torch.randn(8),))
    assert rep.failures == ["output structure: out[1] is None, the reference's is a tensor"]


def test_every_test_starts_from_its_own_seed(request):
    # conftest seeds torch, random and numpy from the test's node id: the same numbers on every run and worker,
    # whatever ran before in the process.
    seed = node_seed(request.node.nodeid)
    assert seed == zlib.crc32(b"tests/test_harness.py::test_every_test_starts_from_its_own_seed")
    assert torch.initial_seed() == seed
    assert torch.equal(torch.randn(5), torch.randn(5, generator=torch.Generator().manual_seed(seed)))
    assert random.random() == random.Random(seed).random()
    assert np.random.rand() == np.random.RandomState(seed).rand()


def test_nan_in_reference_must_match():
    x = torch.randn(8)
    x[3] = float("nan")
    assert check(lambda x: x * 2, ref_scale, (x,)).ok
    rep = check(lambda x: torch.nan_to_num(x * 2), ref_scale, (x,))
    assert not rep.ok


def test_tolerance_sits_on_top_of_what_the_output_dtype_can_hold():
    from kernelkit.testing import CheckReport, compare
    # Mostly values fp16 flushes to zero beside a few it holds: the best fp16 answer is 30% off.
    want = torch.cat([torch.full((1000,), 1e-8, dtype=torch.float64), torch.full((1,), 1e-6, dtype=torch.float64)])
    best = want.to(torch.float16)
    rep = CheckReport()
    compare(best, want, 2e-3, "g", rep)
    assert rep.ok and rep.errors["g"] > 0.1
    # ... but a kernel error on top of that floor is still caught, and the message names the floor.
    off = want.clone()
    off[-1:] *= 1.5
    rep = CheckReport()
    compare(off.to(torch.float16), want, 2e-3, "g", rep)
    assert not rep.ok and "cannot represent" in rep.failures[0]
    # Where the dtype holds the reference, the floor is zero and the tolerance is the tolerance.
    rep = CheckReport()
    x = torch.randn(100, dtype=torch.float64)
    compare((x * (1 + 3e-5)).float(), x, 1e-5, "y", rep)
    assert not rep.ok


def test_rel_error_and_rotation_count():
    assert rel_error(torch.ones(4), torch.ones(4)) == 0
    assert rotation_count(10 << 20, 50 << 20) == 8  # small inputs rotate
    assert rotation_count(40 << 20, 50 << 20) == 3
    assert rotation_count(1 << 30, 50 << 20) == 1


def test_reports_write_json_table_and_plot(tmp_path):
    rows = [Row("op", "4x4", "bfloat16", "fwd", "kernelkit", 0.1, 2000.0, 0.1, 66.0, 1.2, "memory"),
            Row("op", "4x4", "bfloat16", "fwd", "eager", None, error="RuntimeError: boom")]
    c = Ceilings.from_spec(DATASHEETS["h100-sxm"])
    p = write_json(rows, tmp_path / "r.json", c, op="op")
    doc = json.loads(p.read_text())
    assert doc["rows"][0]["gbps"] == 2000.0 and doc["env"]["ceilings"]["copy_gbps"] == 3350
    print_table(rows, title="t")
    assert plot(rows, tmp_path / "r.png", ceiling=3000).stat().st_size > 1000


@pytest.mark.gpu
def test_bench_suite_runs_on_gpu(tmp_path):
    from kernelkit.hw import measure_ceilings
    from kernelkit.ops import registry
    from kernelkit.testing.suite import run_suite

    rows = run_suite(registry.get("rms_norm"), measure_ceilings(), shapes=[(1024, 1000)], modes=("fwd", "bwd"))
    assert {r.impl for r in rows} >= {"kernelkit", "eager", "torch.compile"}
    assert all(r.ms and r.ms > 0 for r in rows if r.impl in ("kernelkit", "eager"))
