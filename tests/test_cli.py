import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kernelkit.commands.cli import app
from tests.conftest import INTERPRET

runner = CliRunner()
# check's device for the tests that run kernels: the interpreter when the suite runs under it, else the GPU
DEV = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"


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


def test_check_runs_the_harness(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    res = runner.invoke(app, ["check", "rms_norm", "--device", DEV, "--dtype", "float32", "--trials", "1"])
    assert res.exit_code == 0, res.output
    assert "ok" in res.output


def test_python_dash_m_kernelkit_runs_the_cli():
    res = subprocess.run([sys.executable, "-m", "kernelkit", "--help"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "check" in res.stdout and "doctor" in res.stdout


@pytest.mark.parametrize("trials", ["0", "-1"])
def test_check_refuses_fewer_than_one_trial(monkeypatch, trials):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    res = runner.invoke(app, ["check", "rms_norm", "--device", DEV, "--dtype", "float32", "--trials", trials])
    assert res.exit_code == 2, res.output
    assert "--trials" in res.output and "ok" not in res.output


def test_check_spec_refuses_fewer_than_one_trial():
    from kernelkit.ops import registry
    from kernelkit.testing import check_spec

    spec = registry.get("rms_norm")
    with pytest.raises(ValueError, match="trials=0"):
        check_spec(spec, spec.test_shapes[0], "float32", device="cpu", trials=0)


def test_check_reports_how_many_checks_trials_and_failures(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernelkit.ops import registry

    n = len(registry.get("rms_norm").test_shapes)
    res = runner.invoke(app, ["check", "rms_norm", "--device", DEV, "--small", "--dtype", "float32",
                              "--trials", "1"])
    assert res.exit_code == 0, res.output
    # a line as each op starts and ends: in a log, where no live progress bar shows, the run never looks hung
    assert "checking rms_norm (1 of 1) ..." in res.output and re.search(r"rms_norm: \d+ checks, ok in", res.output)
    assert re.search(rf"{n} checks \(op x dtype x shape\), 1 trial\(s\) each, {n} trials in all; 1 layout checks, "
                     rf"[1-9]\d* layout cases: 0 failed", res.output), res.output


def test_check_counts_failures_and_exits_1(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import kernelkit.testing as testing
    from kernelkit.testing.correctness import CheckReport

    monkeypatch.setattr(testing, "check_spec", lambda *a, **k: CheckReport(failures=["out: mismatch"]))
    res = runner.invoke(app, ["check", "rms_norm", "--device", DEV, "--dtype", "float32", "--trials", "3",
                              "--no-layouts"])
    assert res.exit_code == 1, res.output
    assert re.search(r"(\d+) checks .*3 trial\(s\) each, \d+ trials in all; 0 layout checks, 0 layout cases: \1 failed",
                     res.output), res.output


@pytest.mark.slow  # ~23 s in the interpreter: `make test-all` (CI time)
def test_check_all_side_by_side_collects_each_process_rows_and_a_dead_one_fails(monkeypatch):
    # check all --jobs N: ops in child processes. A child that dies (here: an op name it refuses, exit 2) is a
    # failed row with the end of its output, not a silently missing op.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernelkit.commands import cli
    from kernelkit.ops import registry

    flags = ["--dtype", "float32", "--device", DEV, "--trials", "1", "--small", "--no-layouts"]
    rows = cli._check_side_by_side(["softmax", "no_such_op"], flags, 2)
    good = [r for r in rows if r["op"] == "softmax"]
    assert len(good) == len(registry.get("softmax").test_shapes) and all(r["ok"] for r in good), good
    bad = [r for r in rows if r["op"] == "no_such_op"]
    assert len(bad) == 1 and not bad[0]["ok"] and "exited 2" in bad[0]["failure"], bad
    with pytest.raises(cli.typer.Exit):
        cli._check_summary(rows, DEV, 1)


def test_check_cuda_without_gpu_is_a_usage_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = runner.invoke(app, ["check", "rms_norm", "--device", "cuda", "--dtype", "float32", "--trials", "1"])
    assert res.exit_code == 2, res.output
    assert "no CUDA GPU is visible" in res.output and len(res.output.strip().splitlines()) == 1


@pytest.mark.parametrize("value", [None, "", "0"])
def test_check_cpu_without_interpreter_says_to_set_it(monkeypatch, value):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    for args in (["--device", "cpu"], []):  # without a GPU, cpu is the default
        res = runner.invoke(app, ["check", "rms_norm", *args, "--dtype", "float32", "--trials", "1"])
        assert res.exit_code == 2, res.output
        assert "TRITON_INTERPRET=1" in res.output and len(res.output.strip().splitlines()) == 1


def test_check_cpu_with_kernels_built_for_the_gpu_says_so(monkeypatch):
    # TRITON_INTERPRET set after kernelkit was imported: Triton compiled the kernels for the GPU already
    from kernelkit import runtime as tune

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(tune, "kernels_interpreted", lambda: False)
    res = runner.invoke(app, ["check", "rms_norm", "--device", "cpu", "--trials", "1"])
    assert res.exit_code == 2 and "before the process starts" in " ".join(res.output.split()), res.output


def test_check_unknown_op_or_device_is_a_usage_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    res = runner.invoke(app, ["check", "no_such_op", "--device", DEV])
    assert res.exit_code == 2 and "no op named 'no_such_op'" in res.output
    res = runner.invoke(app, ["check", "rms_norm", "--device", "tpu"])
    assert res.exit_code == 2 and "use cuda or cpu" in res.output


@pytest.mark.parametrize("argv,says", [
    (["check", "rms_norm", "--dtype", "int8"], "--dtype 'int8': use float32, bfloat16, float16 or all"),
    (["check", "all", "--dtype", "float64"], "--dtype 'float64': use float32, bfloat16, float16 or all"),
    (["check", "attention", "--dtype", "float32"], "--dtype float32: attention runs in bfloat16, float16 only"),
    (["check", "attention", "--dtype", "fp32"], "--dtype float32: attention runs in bfloat16, float16 only"),
    (["bench", "rms_norm", "--dtype", "int8"], "--dtype 'int8': use float32, bfloat16, float16 (or fp32"),
    (["bench", "rms_norm", "--modes", "fwd,bwdd"], "--modes 'fwd,bwdd': a comma list of fwd, bwd, fwd+bwd"),
    (["bench", "rms_norm", "--shapes", "[(1,"], "--shapes '[(1,': a Python list of shape tuples"),
    (["bench", "rms_norm", "--shapes", "(4096, 4096)"], "a Python list of shape tuples"),
    (["bench", "no_such_op"], "no op named 'no_such_op'"),
    (["bench", "attention", "--dtype", "float32"], "attention runs in bfloat16, float16 only"),
])
def test_bad_option_values_are_one_line_usage_errors(monkeypatch, argv, says):
    # Checked before anything runs (bench: before it looks for a GPU): no traceback, exit status 2.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = runner.invoke(app, [*argv, *(["--device", "cpu"] if argv[0] == "check" else [])])
    assert isinstance(res.exception, (SystemExit, type(None))), res.exception  # no traceback
    assert res.exit_code == 2, res.output
    assert says in " ".join(res.output.split()) and len(res.output.strip().splitlines()) == 1, res.output


def test_dtype_aliases_and_all_leave_out_ops_without_the_dtype(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import kernelkit.testing as testing
    from kernelkit.testing.correctness import CheckReport

    ran = []
    monkeypatch.setattr(testing, "check_spec",
                        lambda spec, shape, dt, **k: ran.append((spec.name, dt)) or CheckReport())
    res = runner.invoke(app, ["check", "all", "--device", DEV, "--dtype", "fp32", "--trials", "1", "--no-layouts",
                              "--jobs", "1"])
    assert res.exit_code == 0, res.output
    assert "leaving out attention (not in that dtype)" in " ".join(res.output.split())
    assert ran and {dt for _, dt in ran} == {"float32"} and "attention" not in {n for n, _ in ran}


def test_check_quick_runs_one_shape_per_kernel_path_of_every_op(monkeypatch):
    # make demo's check: every op, one small shape per kernel path, bf16 (else the op's first dtype), 1 trial,
    # no layout fuzz; the full run stays `check all`.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import kernelkit.testing as testing
    from kernelkit.ops import registry
    from kernelkit.testing.correctness import CheckReport, quick_shapes

    ran = []
    monkeypatch.setattr(testing, "check_spec",
                        lambda spec, shape, dt, trials, **k: ran.append((spec.name, shape, dt, trials))
                        or CheckReport())
    res = runner.invoke(app, ["check", "all", "--quick", "--device", DEV, "--jobs", "1"])
    assert res.exit_code == 0, res.output
    specs = registry.all_ops()
    want = [(name, shape, "bfloat16" if "bfloat16" in spec.dtypes else spec.dtypes[0], 1)
            for name, spec in sorted(specs.items()) for shape in quick_shapes(spec)]
    assert ran == want
    assert len(ran) < sum(len(s.test_shapes) * len(s.dtypes) for s in specs.values()) / 3
    out = " ".join(res.output.split())
    assert re.search(rf"{len(want)} checks \(op x dtype x shape\), 1 trial\(s\) each, {len(want)} trials in all; "
                     r"0 layout checks, 0 layout cases: 0 failed in \d+ s", out), out
    assert "quick: one shape per kernel path" in out and "`kernelkit check all` runs every test shape" in out


def test_quick_shapes_take_one_small_shape_per_kernel_path():
    from types import SimpleNamespace

    from kernelkit.testing.correctness import quick_shapes

    spec = SimpleNamespace(test_shapes=[(1, 1), (3, 7), (37, 1000), (2, 3, 129), (1, 64, 8, "rowwise"),
                                        (37, 200, 45, "rowwise"), (5, 9, 33, "tensorwise"), (2, 5, 4, True),
                                        (2, 5, 4, True, 23), ((9, 0, 23), 4, True)])
    assert quick_shapes(spec) == [(3, 7), (37, 200, 45, "rowwise"), (5, 9, 33, "tensorwise"), (2, 5, 4, True),
                                  (2, 5, 4, True, 23), ((9, 0, 23), 4, True)]


def test_check_quick_on_one_op_end_to_end(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    res = runner.invoke(app, ["check", "rms_norm", "--quick", "--device", DEV])
    assert res.exit_code == 0, res.output
    assert re.search(r"1 checks \(op x dtype x shape\), 1 trial\(s\) each, 1 trials in all; 0 layout checks",
                     res.output)
    assert "rms_norm: 1 checks, ok" in res.output and "bfloat16" in res.output


def test_op_check_options_are_refused_for_candidate_files(tmp_path):
    fixtures = Path(__file__).parent / "fixtures" / "verify"
    for extra in (["--quick"], ["--no-layouts"], ["--dtype", "float16"]):
        res = runner.invoke(app, ["check", str(fixtures / "softmax_torch.py"), "--reference",
                                  str(fixtures / "softmax_ref.py"), "--device", "cpu", *extra])
        assert res.exit_code == 2 and "apply to op checks" in res.output, (extra, res.output)
    res = runner.invoke(app, ["check", str(fixtures / "softmax_torch.py"), "--reference",
                              str(fixtures / "softmax_ref.py"), "--device", "cpu", "--rtol", "-1"])
    assert res.exit_code == 2 and isinstance(res.exception, (SystemExit, type(None))), res.output
