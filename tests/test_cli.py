import torch
from typer.testing import CliRunner

from kernelkit.cli import app

runner = CliRunner()


def test_doctor_without_gpu_says_so_and_shows_datasheet(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = runner.invoke(app, ["doctor", "--gpu", "a100-80gb", "--json", str(tmp_path / "d.json")])
    assert res.exit_code == 0, res.output
    assert "No CUDA GPU" in res.output and "A100" in res.output and "312" in res.output
    assert (tmp_path / "d.json").exists()


def test_doctor_unknown_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = runner.invoke(app, ["doctor", "--gpu", "voodoo5"])
    assert res.exit_code == 2 and "unknown GPU" in res.output


def test_bench_refuses_without_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = runner.invoke(app, ["bench", "rms_norm"])
    assert res.exit_code == 2 and "needs a CUDA GPU" in res.output


def test_check_runs_the_harness_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    res = runner.invoke(app, ["check", "rms_norm", "--device", "cpu", "--dtype", "float32", "--trials", "1"])
    assert res.exit_code == 0, res.output
    assert "ok" in res.output
