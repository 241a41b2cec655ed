"""Every file in scripts/ runs here (a tiny CPU case each), so a rename inside kernelkit cannot break one silently;
a new script comes with its case below."""

import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernelkit.testing import results
from tests.conftest import INTERPRET

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TESTED = {"gpu_check.sh", "host_time.py", "multi_gpu_check.sh", "results_table.py", "coop_sanitize.py",
          "fp8_table.sh", "memcheck_attention_bwd.py", "attention_session.sh", "install_fa4.sh"}


def run_script(name: str, *argv: str) -> int:
    """Run scripts/<name> as `python scripts/<name> argv...` would, in this process; its exit status."""
    old = sys.argv
    sys.argv = [str(SCRIPTS / name), *argv]
    try:
        runpy.run_path(str(SCRIPTS / name), run_name="__main__")
    except SystemExit as e:
        return e.code or 0
    finally:
        sys.argv = old
    return 0


def test_every_script_has_a_case_here():
    assert {p.name for p in SCRIPTS.iterdir() if p.is_file()} == TESTED


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is gpu_check.sh's sanitize stage")
def test_coop_sanitize_says_it_needs_a_gpu():
    assert "needs a CUDA GPU" in str(run_script("coop_sanitize.py"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is gpu_check.sh's sanitize stage")
def test_memcheck_attention_bwd_says_it_needs_a_gpu():
    assert "needs a CUDA GPU of sm_90" in str(run_script("memcheck_attention_bwd.py"))


def test_gpu_check_parses_and_every_script_it_runs_exists():
    subprocess.run(["bash", "-n", str(SCRIPTS / "gpu_check.sh")], check=True)
    text = (SCRIPTS / "gpu_check.sh").read_text()
    paths = set(re.findall(r"\b((?:scripts|benchmarks)/[\w./-]+\.py)\b", text))
    assert "scripts/host_time.py" in paths and "benchmarks/gemm.py" in paths
    assert [p for p in sorted(paths) if not (SCRIPTS.parent / p).is_file()] == []


def test_attention_session_parses_and_runs_what_exists():
    subprocess.run(["bash", "-n", str(SCRIPTS / "attention_session.sh")], check=True)
    text = (SCRIPTS / "attention_session.sh").read_text()
    paths = set(re.findall(r"\b((?:scripts|benchmarks|tests)/[\w./-]+\.py)\b", text))
    assert paths == {"benchmarks/attention_vs_cudnn.py", "scripts/memcheck_attention_bwd.py",
                     "tests/test_attention_hopper.py"}
    assert all((SCRIPTS.parent / p).is_file() for p in paths)


def test_install_fa4_parses_and_rejects_unknown_steps():
    subprocess.run(["bash", "-n", str(SCRIPTS / "install_fa4.sh")], check=True)
    run = subprocess.run(["bash", str(SCRIPTS / "install_fa4.sh"), "nonsense"], capture_output=True, text=True)
    assert run.returncode == 2 and "stage|install" in run.stderr


def test_fp8_table_parses_and_runs_known_variants():
    """Issue 30's table script: bash syntax, the module it runs, and every default variant is one model_bench has."""
    from kernelkit.testing.model_bench import VARIANTS

    subprocess.run(["bash", "-n", str(SCRIPTS / "fp8_table.sh")], check=True)
    text = (SCRIPTS / "fp8_table.sh").read_text()
    assert "-m kernelkit.testing.model_bench" in text
    default = re.search(r"VARIANTS:-([^}]*)}", text).group(1).split()
    assert default and set(default) <= set(VARIANTS)


def test_multi_gpu_check_parses_and_its_modules_exist():
    """Its torchrun modules; the checks themselves run on CPU in tests/test_distributed.py."""
    subprocess.run(["bash", "-n", str(SCRIPTS / "multi_gpu_check.sh")], check=True)
    text = (SCRIPTS / "multi_gpu_check.sh").read_text()
    modules = set(re.findall(r"-m ((?:tests|kernelkit)\.[\w.]+)", text))
    assert modules == {"tests.test_distributed", "kernelkit.testing.fsdp_bench", "kernelkit.commands.cli"}
    for m in modules:
        path = SCRIPTS.parent / ("src/" if m.startswith("kernelkit") else "") / (m.replace(".", "/") + ".py")
        assert path.is_file(), m
    # the doctor and profile stages' options are the CLI's
    from typer.testing import CliRunner

    from kernelkit.commands.cli import app

    for cmd in ("doctor", "profile"):
        line = re.search(rf"kernelkit\.commands\.cli {cmd} (.*?)>", text, re.S).group(1)
        helptext = CliRunner().invoke(app, [cmd, "--help"], env={"COLUMNS": "400"}).output
        for flag in re.findall(r"(--[\w-]+)", line):
            assert flag in helptext, (cmd, flag)
    assert "hf-llama3-8b" in text


def _row(impl, metric, value, unit, shape="16384x4096", timestamp="2026-11-23T12:00:00Z", op="rms_norm"):
    return {"op": op, "impl": impl, "shape": shape, "dtype": "bfloat16", "mode": "fwd", "metric": metric,
            "value": value, "unit": unit, "gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0",
            "commit": "cc58d02", "timestamp": timestamp}


def test_results_table_prints_markdown_from_the_newest_rows(tmp_path, capsys):
    table = tmp_path / "h100.csv"
    results.append(table, [_row("kernelkit", "ms", 0.1, "ms"), _row("eager", "ms", 0.25, "ms"),
                           _row("kernelkit", "ms", 0.5, "ms", timestamp="2026-11-20T12:00:00Z"),  # older
                           _row("kernelkit", "gbps", 2000.0, "GB/s"), _row("eager", "gbps", 800.0, "GB/s"),
                           _row("kernelkit", "pct_roof", 66.2, "%"),
                           _row("kernelkit", "tflops", 400.0, "TFLOP/s", op="attention", shape="1x4096x16x128"),
                           _row("kernelkit", "gbps", 30.0, "GB/s", op="attention", shape="1x4096x16x128")])
    assert run_script("results_table.py", str(table), "--op", "rms_norm") == 0
    out = capsys.readouterr().out
    assert "| shape | mode | kernelkit GB/s | eager GB/s | kernelkit % roof | vs eager |" in out
    assert "| 16384x4096 | fwd | 2000 | 800 | 66.2 | 2.50x |" in out and "attention" not in out
    assert "NVIDIA H100 80GB HBM3, torch 2.11.0, Triton 3.6.0; measured 2026-11-23 at cc58d02;" in out
    assert run_script("results_table.py", str(table), "--op", "attention") == 0
    assert "| 1x4096x16x128 | fwd | 400.0 | — |" in capsys.readouterr().out  # above the ridge: TFLOP/s
    assert run_script("results_table.py", str(table), "--geomean", "--min-ms", "0.01") == 0
    assert capsys.readouterr().out.strip() == "vs eager: geomean 2.500x over 1 rows"
    assert run_script("results_table.py", str(table), "--op", "softmax") == 1
    assert "no rows of softmax" in capsys.readouterr().err


@pytest.mark.skipif(not INTERPRET, reason="runs kernelkit's kernels: TRITON_INTERPRET=1")
def test_host_time_runs_an_op_on_the_interpreter(capsys):
    assert run_script("host_time.py", "rms_norm", "--device", "cpu", "--calls", "1", "--repeats", "1") == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"== rms_norm \(2, 3, 129\) fwd [\d.]+ us, fwd\+grad-record [\d.]+ us, bwd [\d.]+ us", line)


def test_attention_vs_cudnn_knobs_set_and_restore():
    """The benchmark's variants set the backward's knobs they name and every other knob to its shipped value, so a
    variant timed after another is its own (a misspelt knob or one left out would time the wrong kernel)."""
    sys.path.insert(0, str(SCRIPTS.parent / "benchmarks"))
    try:
        import attention_vs_cudnn as bench
    finally:
        sys.path.pop(0)
    from kernelkit.ops.attention import backward as bwd_mod, hopper_bwd

    shipped = dict(bench.SHIPPED_BWD)
    names = bench.impls(False, bwd_variants=True)
    assert {"kernelkit", "cudnn", "fa2", "eager", "kk-bwd-fused", "kk-bwd-launch-order", "kk-bwd-unsplit",
            "kk-bwd-one-loop"} <= set(names)
    try:
        bench._bwd_state(gluon=True, longest_first=False, split_waves=0, bm128=64, one_loop=not shipped["one_loop"])
        assert bwd_mod.GLUON is True and hopper_bwd.LONGEST_FIRST is False
        assert hopper_bwd.ONE_LOOP is not shipped["one_loop"]
        assert hopper_bwd.SPLIT_WAVES == 0 and hopper_bwd.BLOCK_M[128] == 64
        bench._bwd_state()
        assert (bwd_mod.GLUON, hopper_bwd.LONGEST_FIRST) == (shipped["gluon"], shipped["longest_first"])
        assert (hopper_bwd.SPLIT_WAVES, hopper_bwd.BLOCK_M[128]) == (shipped["split_waves"], shipped["bm128"])
        assert hopper_bwd.ONE_LOOP is shipped["one_loop"]
    finally:
        bench._bwd_state()
