import json

import pytest
import torch

from kernelkit.hw import Ceilings, DATASHEETS, lookup
from kernelkit.hw import ceilings as ceil_mod
from kernelkit.roofline import Cost, place


def test_datasheet_lookup_by_cuda_name_and_alias():
    assert lookup("NVIDIA H100 80GB HBM3") is DATASHEETS["h100-sxm"]
    assert lookup("NVIDIA H100 PCIe") is DATASHEETS["h100-pcie"]
    assert lookup("NVIDIA A100-SXM4-40GB") is DATASHEETS["a100-40gb"]
    assert lookup("rtx 4090") is DATASHEETS["rtx4090"]
    assert lookup("no such gpu") is None
    for key in ("h100-sxm", "h100-pcie", "h200", "a100-40gb", "a100-80gb", "b200", "l4", "l40s", "rtx4090"):
        spec = DATASHEETS[key]
        assert spec.mem_gbps > 0 and spec.sms > 0 and spec.tflops["bf16"] > spec.tflops["fp32"]


def test_ridge_point_is_peak_over_bandwidth():
    h100 = DATASHEETS["h100-sxm"]
    assert h100.ridge_point("bf16") == pytest.approx(989.4e12 / 3350e9)
    assert DATASHEETS["a100-80gb"].ridge_point("fp8") is None


def test_ceilings_cache_is_keyed_on_fingerprint(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELKIT_CACHE", str(tmp_path))
    fp = {"gpu": "Fake GPU", "driver": "1.0", "cuda": "13.0", "torch": "x", "triton": "y"}
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ceil_mod, "device_fingerprint", lambda: dict(fp))
    monkeypatch.setattr(ceil_mod, "measure_copy_gbps", lambda: calls.append("copy") or 1000.0)
    monkeypatch.setattr(ceil_mod, "measure_matmul_tflops", lambda k: (100.0, {"8192x8192x8192 NT": 100.0}, []))
    monkeypatch.setattr(ceil_mod, "measure_launch_us", lambda: 5.0)

    class Props:
        name, multi_processor_count, L2_cache_size = "Fake GPU", 10, 1 << 20

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props)
    first = ceil_mod.measure_ceilings()
    again = ceil_mod.measure_ceilings()
    assert calls == ["copy"] and again.copy_gbps == first.copy_gbps == 1000.0
    fp["driver"] = "2.0"  # a driver upgrade measures again
    ceil_mod.measure_ceilings()
    assert calls == ["copy", "copy"]
    assert len(list((tmp_path / "ceilings").glob("*.json"))) == 2
    assert json.loads(next((tmp_path / "ceilings").glob("*.json")).read_text())["tflops"]["bf16"] == 100.0


def _fake_rates(dtype_key, case):
    """A made-up TFLOP/s per case, different for every case: the best is the last case but one (fp32: the second of
    two), neither the first timed nor the last."""
    cases = ceil_mod.matmul_cases(dtype_key)
    i = cases.index(case)
    return 950.0 if i == max(1, len(cases) - 2) else 500.0 + 7 * i


def _fake_ms(dtype_key, case):
    return case.flops / (_fake_rates(dtype_key, case) * 1e12) * 1e3


@pytest.mark.parametrize("key", ["bf16", "fp16", "fp8", "tf32", "fp32"])
def test_matrix_peak_is_the_best_case_of_the_sweep(key, monkeypatch):
    monkeypatch.setattr(ceil_mod, "_has_fp8", lambda: True)
    peak, rates, skipped = ceil_mod.measure_matmul_tflops(key, time_case=_fake_ms)
    cases = ceil_mod.matmul_cases(key)
    assert skipped == [] and set(rates) == {c.label for c in cases}
    want = {c.label: _fake_rates(key, c) for c in cases}
    assert rates == pytest.approx(want)
    assert peak == pytest.approx(max(want.values()))
    assert max(want, key=want.get) != cases[0].label
    labels = set(rates)
    if key == "fp32":
        assert labels == {"4096x4096x4096 NT", "4096x4096x4096 NN"}
    else:
        layouts = ("tensorwise", "rowwise") if key == "fp8" else ("NT", "NN")
        for shape in ("8192x128256x4096", "8192x8192x8192", "16384x16384x16384"):  # LM head, squares
            assert {f"{shape} {lay}" for lay in layouts} <= labels


def test_measured_ceilings_carry_every_case_and_the_best_of_each_dtype(tmp_path, monkeypatch):
    # The whole measurement with the GPU parts faked: each dtype's ceiling is the best of its sweep, which the
    # details keep case by case (what `kernelkit doctor --json` writes).
    monkeypatch.setenv("KERNELKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ceil_mod, "device_fingerprint", lambda: {"gpu": "Fake GPU"})
    monkeypatch.setattr(ceil_mod, "measure_copy_gbps", lambda: 1000.0)
    monkeypatch.setattr(ceil_mod, "measure_launch_us", lambda: 5.0)
    monkeypatch.setattr(ceil_mod, "_has_fp8", lambda: True)
    monkeypatch.setattr(ceil_mod, "time_matmul_case", _fake_ms)

    class Props:
        name, multi_processor_count, L2_cache_size = "Fake GPU", 10, 1 << 20

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props)
    c = ceil_mod.measure_ceilings()
    by_case = c.details["matmul_tflops_by_shape"]
    assert set(by_case) == set(c.tflops) == {"bf16", "fp16", "fp8", "tf32", "fp32"}
    for key, rates in by_case.items():
        assert len(rates) == len(ceil_mod.matmul_cases(key))
        assert c.tflops[key] == max(rates.values())


def test_sweep_skips_what_does_not_fit_and_stops_when_its_time_is_spent():
    cases = ceil_mod.matmul_cases("bf16")[:6]
    now = [0.0]
    timed = []

    def time_case(key, case):
        timed.append(case.label)
        now[0] += 1.0  # one second a case
        if case is cases[1]:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return _fake_ms(key, case)

    rates, skipped = ceil_mod.sweep_matmul("bf16", cases, time_case, budget_s=2.5, clock=lambda: now[0])
    assert timed == [c.label for c in cases[:3]]  # the budget is spent after the third
    assert list(rates) == [cases[0].label, cases[2].label]
    assert skipped == [cases[1].label] + [c.label for c in cases[3:]]


def test_a_case_counts_its_fastest_call_after_an_untimed_one(monkeypatch):
    # CUDA events on a fake clock: each call of fn takes the next duration. The first call (cuBLAS choosing its
    # algorithm) is not timed even when fastest; at least 3 calls are, until 25 ms of them have run.
    now = [0.0]
    durations = iter([1.0, 9.0, 7.0, 8.0, 9.5, 0.5])

    def fn():
        now[0] += next(durations)

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = now[0]

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert ceil_mod._best_ms(fn, min_reps=3, max_reps=10, rep_ms=25.0) == 7.0
    assert next(durations) == 0.5  # stopped once 33.5 ms had run


@pytest.mark.parametrize("key,layout", [("bf16", "NT"), ("bf16", "NN"), ("fp16", "NT"), ("tf32", "NN"),
                                        ("fp32", "NT"), ("fp8", "tensorwise"), ("fp8", "rowwise")])
def test_sweep_operands_are_random_and_laid_out_as_a_model_runs_them(key, layout):
    # Zeros (or any constant) run faster on the H100 than real data: the sweep must time N(0, 1) draws. NT is
    # x @ W.T (b the transpose of a row-major weight), NN a row-major b; fp8 b is column-major (cuBLAS's).
    case = ceil_mod.MatmulCase(48, 40, 64, layout)
    fn, ops = ceil_mod.matmul_call(key, case, device="cpu")
    a, b = ops[:2]
    assert a.shape == (48, 64) and b.shape == (64, 40)
    assert b.stride() == ((1, 64) if layout != "NN" else (40, 1))
    for t in (a, b):
        v = t.float()
        assert v.unique().numel() > 20 and 0.7 < v.std().item() < 1.3 and abs(v.mean().item()) < 0.2
    want = a.double() @ b.double()
    if key == "fp8":
        sa, sb = ops[2:]
        assert sa.shape == sb.shape == () if layout == "tensorwise" else (sa.shape, sb.shape) == ((48, 1), (1, 40))
        want = want * sa.double() * sb.double()
    got = fn()
    assert got.dtype == (torch.bfloat16 if key == "fp8" else a.dtype)
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_ceilings_for_without_gpu_uses_the_named_datasheet(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    c, measured = ceil_mod.ceilings_for("h100")
    assert not measured and c.copy_gbps == 3350
    with pytest.raises(ValueError, match="gpu='tpu'"):
        ceil_mod.ceilings_for("tpu")


H100 = Ceilings.from_spec(DATASHEETS["h100-sxm"])


def test_place_regimes():
    n = 8192
    gemm = Cost(flops=2 * n**3, bytes=3 * n * n * 2, dtype="bf16")
    assert place(gemm, H100).regime == "compute"
    norm = Cost(flops=4 * 16384 * 4096, bytes=2 * 16384 * 4096 * 2)
    p = place(norm, H100, measured_ms=0.1)
    assert p.regime == "memory"
    assert p.achieved_gbps == pytest.approx(norm.bytes / 1e-4 / 1e9)
    assert p.pct_of_roof == pytest.approx(100 * p.floor_ms / 0.1)
    tiny = Cost(flops=16, bytes=128)
    assert place(tiny, H100, measured_ms=0.005).regime == "overhead"


def test_cost_arithmetic_intensity_and_sum():
    a, b = Cost(100, 10), Cost(50, 40)
    assert a.arithmetic_intensity == 10 and (a + b).bytes == 50
