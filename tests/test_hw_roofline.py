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
    monkeypatch.setattr(ceil_mod, "measure_matmul_tflops", lambda k: 100.0)
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
