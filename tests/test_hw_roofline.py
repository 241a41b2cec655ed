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
    monkeypatch.setattr(ceil_mod, "measure_memory_gbps", lambda: calls.append("copy") or (1100.0, 1000.0, {}))
    monkeypatch.setattr(ceil_mod, "measure_matmul_tflops",
                        lambda k: (100.0, {"8192x8192x8192 NT": {"isolated": 100.0, "burst": 90.0}}, []))
    monkeypatch.setattr(ceil_mod, "measure_launch_us", lambda: 5.0)

    class Props:
        name, multi_processor_count, L2_cache_size = "Fake GPU", 10, 1 << 20

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props)
    first = ceil_mod.measure_ceilings()
    again = ceil_mod.measure_ceilings()
    assert calls == ["copy"] and again.copy_gbps == first.copy_gbps == 1000.0 and again.mem_gbps == 1100.0
    fp["driver"] = "2.0"  # a driver upgrade measures again
    ceil_mod.measure_ceilings()
    assert calls == ["copy", "copy"]
    assert len(list((tmp_path / "ceilings").glob("*.json"))) == 2
    assert json.loads(next((tmp_path / "ceilings").glob("*.json")).read_text())["tflops"]["bf16"] == 100.0


def _fake_rates(dtype_key, case):
    """Made-up TFLOP/s per case and timing, different for every case. The best burst is the last case but one
    (fp32: the second of two), neither the first timed nor the last; the best of all is the second case's
    isolated calls (fp32: the first's), above every burst, as a rested chip runs faster."""
    cases = ceil_mod.matmul_cases(dtype_key)
    i = cases.index(case)
    burst = 950.0 if i == max(1, len(cases) - 2) else 500.0 + 7 * i
    isolated = 990.0 if i == (0 if dtype_key == "fp32" else 1) else burst - 3.0
    return {"isolated": isolated, "burst": burst}


def _fake_ms(dtype_key, case):
    return {timing: case.flops / (r * 1e12) * 1e3 for timing, r in _fake_rates(dtype_key, case).items()}


@pytest.mark.parametrize("key", ["bf16", "fp16", "fp8", "tf32", "fp32"])
def test_matrix_peak_is_the_best_case_of_the_sweep(key, monkeypatch):
    monkeypatch.setattr(ceil_mod, "_has_fp8", lambda: True)
    peak, rates, skipped = ceil_mod.measure_matmul_tflops(key, time_case=_fake_ms)
    cases = ceil_mod.matmul_cases(key)
    assert skipped == [] and set(rates) == {c.label for c in cases}
    want = {c.label: _fake_rates(key, c) for c in cases}
    assert rates == {label: pytest.approx(by) for label, by in want.items()}
    assert peak == pytest.approx(990.0)  # the best over both timings: an isolated figure
    best_burst = max(want, key=lambda label: want[label]["burst"])
    assert best_burst != cases[0].label and want[best_burst]["burst"] < peak
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
    monkeypatch.setattr(ceil_mod, "measure_launch_us", lambda: 5.0)
    monkeypatch.setattr(ceil_mod, "_has_fp8", lambda: True)
    monkeypatch.setattr(ceil_mod, "time_matmul_case", _fake_ms)
    monkeypatch.setattr(ceil_mod, "time_memory_pattern", _fake_memory_ms)

    class Props:
        name, multi_processor_count, L2_cache_size = "Fake GPU", 10, 1 << 20

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props)
    c = ceil_mod.measure_ceilings()
    d = c.details
    by_case = d["matmul_tflops_by_shape"]
    assert set(by_case) == set(c.tflops) == {"bf16", "fp16", "fp8", "tf32", "fp32"}
    for key, rates in by_case.items():
        cases = ceil_mod.matmul_cases(key)
        assert len(rates) == len(cases)
        assert c.tflops[key] == max(rates.values()) == pytest.approx(990.0)
        for case in cases:  # both timings of every case, so a reader sees what the burst's clocks cost
            want = _fake_rates(key, case)
            assert d["matmul_tflops_isolated"][key][case.label] == pytest.approx(want["isolated"])
            assert d["matmul_tflops_burst"][key][case.label] == pytest.approx(want["burst"])
            assert rates[case.label] == pytest.approx(max(want.values()))
    assert c.mem_gbps == pytest.approx(MEM_BEST) and c.copy_gbps == pytest.approx(COPY_BEST)
    assert set(d["memory_gbps_isolated"]) == set(d["memory_gbps_burst"]) == set(d["memory_gbps_by_pattern"])
    assert c.ridge_point("bf16") == pytest.approx(990.0e12 / (MEM_BEST * 1e9))


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


class _FakeGPU:
    """CUDA events, synchronize, torch.cuda._sleep and time.sleep on a fake clock; each call of `fn` takes the next
    of `durations` ms. `log` records what happens in order: "sync", "rest <s>" (a host sleep), "spin" (the guard
    ahead of a timed call), "call"."""

    def __init__(self, monkeypatch, durations):
        self.now, self.log, self.durations = 0.0, [], iter(durations)
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                self.t = gpu.now

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return end.t - self.t

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: self.log.append("sync"))
        monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: self.log.append("spin"))
        monkeypatch.setattr(ceil_mod.time, "sleep", lambda s: self.log.append(f"rest {s}"))

    def fn(self):
        self.log.append("call")
        self.now += next(self.durations)


def test_a_case_counts_its_fastest_rested_call_and_its_fastest_burst_call(monkeypatch):
    # One untimed call (cuBLAS choosing its algorithm), then 5 isolated calls, each after a synchronize and a 20 ms
    # host sleep (the GPU idles), then a burst: at least 3 calls back to back, until 25 ms of them have run.
    # Neither the untimed call (fastest of all) nor a slow call counts.
    gpu = _FakeGPU(monkeypatch, [0.1, 9.0, 6.0, 7.5, 6.5, 8.0,  # untimed, isolated
                                 9.0, 7.0, 8.0, 9.5, 0.2])  # burst (stops after 33.5 ms), never run
    ms = ceil_mod.time_calls(gpu.fn)
    assert ms == {"isolated": 6.0, "burst": 7.0}
    assert next(gpu.durations) == 0.2
    rested = ["sync", f"rest {ceil_mod.REST_S}", "spin", "call"]
    assert gpu.log == ["call", "sync"] + rested * 5 + ["spin", "call"] * 4
    assert ceil_mod.REST_S == 0.02 and ceil_mod.ISOLATED_CALLS == 5


def _fake_memory_ms(pattern, dtype_key):
    """Milliseconds per timing of a memory pattern at made-up GB/s (MEM_RATES), over this test's own byte counts."""
    moved = {"copy": 2, "add": 3, "sum": 1}[pattern] * ceil_mod.MEMORY_BYTES
    return {timing: moved / (gbps * 1e9) * 1e3 for timing, gbps in MEM_RATES[f"{pattern} {dtype_key}"].items()}


# The best copy is a burst; the best of all a read-only sum on a rested chip; the add beats every copy.
MEM_RATES = {"copy bf16": {"isolated": 2990.0, "burst": 3018.0}, "copy fp32": {"isolated": 3001.0, "burst": 2950.0},
             "add bf16": {"isolated": 3150.0, "burst": 3100.0}, "add fp32": {"isolated": 3120.0, "burst": 3090.0},
             "sum bf16": {"isolated": 3210.0, "burst": 3200.0}, "sum fp32": {"isolated": 3290.0, "burst": 3240.0}}
MEM_BEST, COPY_BEST = 3290.0, 3018.0


def test_memory_roof_is_the_best_pattern_and_copy_the_best_copy():
    timed = []

    def time_pattern(pattern, key):
        timed.append(f"{pattern} {key}")
        return _fake_memory_ms(pattern, key)

    mem, copy, rates = ceil_mod.measure_memory_gbps(time_pattern)
    assert sorted(timed) == sorted(MEM_RATES)
    assert rates == {label: pytest.approx(by) for label, by in MEM_RATES.items()}
    assert mem == pytest.approx(MEM_BEST) and copy == pytest.approx(COPY_BEST)
    assert ceil_mod.MEMORY_BYTES >= 16 * 50e6  # every tensor far larger than an H100's L2


@pytest.mark.parametrize("dtype_key", ["bf16", "fp32"])
@pytest.mark.parametrize("pattern", ["copy", "add", "sum"])
def test_memory_patterns_compute_what_they_are_named_on_random_data(pattern, dtype_key):
    nbytes = 4096 * 4
    fn, ops = ceil_mod.memory_call(pattern, dtype_key, nbytes=nbytes, device="cpu")
    x = ops[0]
    assert x.numel() * x.element_size() == nbytes and x.dtype == (torch.bfloat16 if dtype_key == "bf16" else torch.float32)
    assert x.float().unique().numel() > 100 and 0.4 < x.float().std().item() < 0.75  # U(-1, 1), not constant
    if pattern == "sum":
        assert len(ops) == 1
        torch.testing.assert_close(fn().double(), x.double().sum(), rtol=2e-2, atol=0.5)
        return
    out = ops[-1]
    assert out.numel() == x.numel() and out.data_ptr() not in {t.data_ptr() for t in ops[:-1]}
    out.fill_(float("nan"))
    fn()
    want = x.double() if pattern == "copy" else x.double() + ops[1].double()
    assert len(ops) == (2 if pattern == "copy" else 3)
    torch.testing.assert_close(out.double(), want, rtol=1e-2 if dtype_key == "bf16" else 1e-6, atol=1e-2)
    with pytest.raises(ValueError, match="pattern='scale'"):
        ceil_mod.memory_call("scale", dtype_key, nbytes=nbytes, device="cpu")


def test_the_sweep_has_the_lm_heads_long_k_input_gradients_in_both_layouts():
    # The profile's lm_head backward aten::mm (8192x32000 @ 32000x2048) ran at ~856 TF/s where the sweep's best
    # was 798: dlogits @ W is a long-k product the sweep must time as torch runs it.
    for key in ("bf16", "fp16", "tf32"):
        labels = [c.label for c in ceil_mod.matmul_cases(key)]
        for shape in ("8192x2048x32000", "8192x4096x128256"):
            assert {f"{shape} NT", f"{shape} NN"} <= set(labels)
    assert {"8192x2048x32000 tensorwise", "8192x2048x32000 rowwise"} <= {c.label for c in ceil_mod.matmul_cases("fp8")}


def test_doctor_time_on_an_h100_stays_under_25_s():
    # cases x (untimed call + isolated calls with their rests + a burst of >= 3 calls or 25 ms) at H100 rates
    # (bf16 ~800 TF/s, fp8 ~1300, tf32 ~400, fp32 ~51, memory ~3200 GB/s), plus the memory patterns.
    rate = {"bf16": 800, "fp16": 780, "fp8": 1300, "tf32": 400, "fp32": 51}

    def case_s(t_ms):
        burst = max(3 * t_ms, 25.0) + t_ms
        return (t_ms + ceil_mod.ISOLATED_CALLS * (ceil_mod.REST_S * 1e3 + t_ms) + burst) / 1e3

    total = 0.0
    for key, r in rate.items():
        spent = 0.0
        for case in ceil_mod.matmul_cases(key):
            if spent <= ceil_mod.MATMUL_BUDGET_S:
                spent += case_s(case.flops / (r * 1e12) * 1e3)
        total += spent
    total += sum(case_s(sum(rw) * ceil_mod.MEMORY_BYTES / 3.2e12 * 1e3)
                 for rw in ceil_mod.MEMORY_PATTERNS.values() for _ in ceil_mod.MEMORY_DTYPES)
    assert 8.0 < total < 20.0, total  # + CUDA start-up and operand generation: under 25 s


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
    assert not measured and c.copy_gbps == c.mem_gbps == 3350
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


def test_place_uses_the_memory_roof_not_the_copy():
    # mem_gbps (the best of copy, add, sum) is the roof; copy_gbps stays what "% of copy" means.
    c = Ceilings(gpu="Fake GPU", fingerprint={}, copy_gbps=3000.0, tflops={"bf16": 800.0}, launch_us=4.0,
                 mem_gbps=3300.0)
    add = Cost(flops=4 * 2048 * 2048, bytes=3 * 4 * 2048 * 2048 * 2)  # aten::add of 4x2048x2048 bf16
    p = place(add, c, measured_ms=add.bytes / 3350e9 * 1e3)
    assert p.regime == "memory" and p.memory_ms == pytest.approx(add.bytes / 3300e9 * 1e3)
    assert p.pct_of_roof == pytest.approx(100 * 3350 / 3300)
    assert c.ridge_point("bf16") == pytest.approx(800e12 / 3300e9)
    assert Ceilings(gpu="g", fingerprint={}, copy_gbps=3000.0, tflops={}, launch_us=4.0).mem_gbps == 3000.0


def test_cost_arithmetic_intensity_and_sum():
    a, b = Cost(100, 10), Cost(50, 40)
    assert a.arithmetic_intensity == 10 and (a + b).bytes == 50
