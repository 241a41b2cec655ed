"""`kernelkit check CANDIDATE.py --reference REF.py` and `kernelkit.testing.check_module`: a gallery of broken
candidates (tests/fixtures/verify/), each of which must fail the check named for its exploit, and honest
ones that must pass. CPU, small inputs; the stream exploit and timing need a GPU."""

import json
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kernelkit.commands.cli import app
from kernelkit.testing import check_module
from kernelkit.testing.problem_files import ProblemError, load_problem
from kernelkit.testing.verify import CHECKS, INFO, PASS, SKIP, WARN

FIXTURES = Path(__file__).parent / "fixtures" / "verify"
runner = CliRunner()

# (candidate file, problem, the check that must catch it)
EXPLOITS = [
    ("caches_result", "softmax", "caching"),
    ("skips_rows", "softmax", "poisoned memory"),
    ("returns_empty", "softmax", "poisoned memory"),
    ("aliases_input", "softmax", "aliasing"),
    ("reuses_output_buffer", "softmax", "aliasing"),
    ("mutates_input", "scaled_add", "input mutation"),
    ("nondeterministic", "softmax", "determinism"),
    ("overflows_at_scale", "softmax", "input scales"),
    ("wrong_odd_sizes", "softmax", "sizes"),
    ("hardcodes_batch", "softmax", "sizes"),
]
HONEST = [("softmax_torch", "softmax"), ("softmax_triton", "softmax"), ("scaled_add_torch", "scaled_add")]

# Triton reads TRITON_INTERPRET as it is imported: the Triton candidate runs on the CPU only if it was set then.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="the Triton candidate needs TRITON_INTERPRET=1 on CPU")
HONEST_CPU = [pytest.param(c, p, marks=needs_interpreter, id=c) if "triton" in c else pytest.param(c, p, id=c)
              for c, p in HONEST]



def verify(candidate: str, problem: str, device: str = "cpu", **kw):
    p = load_problem(FIXTURES / f"{candidate}.py", FIXTURES / f"{problem}_ref.py")
    return check_module(p.candidate, p.reference, p.make_inputs, device=device, trials=2, **kw)


def args(candidate: str, problem: str, *extra: str) -> list[str]:
    return ["check", str(FIXTURES / f"{candidate}.py"), "--reference", str(FIXTURES / f"{problem}_ref.py"), *extra]


@pytest.mark.parametrize("candidate,problem,check", EXPLOITS, ids=[e[0] for e in EXPLOITS])
def test_each_exploit_fails_its_named_check(candidate, problem, check):
    report = verify(candidate, problem)
    assert not report.ok
    assert check in report.failed, [(f.check, f.result, f.detail) for f in report.findings]
    assert report.finding(check).detail


@pytest.mark.parametrize("candidate,problem", HONEST_CPU)
def test_honest_candidates_pass_every_check(candidate, problem):
    report = verify(candidate, problem)
    assert report.ok, [(f.check, f.result, f.detail) for f in report.findings]
    assert [f.check for f in report.findings] == list(CHECKS)
    assert {f.result for f in report.findings} <= {PASS, SKIP}
    for gpu_only in ("pending work", "timing"):
        assert report.finding(gpu_only).result == SKIP and "GPU only" in report.finding(gpu_only).detail
    assert report.reference_precision == "float64"
    assert 0 < report.errors["correctness"] < 1e-5


def test_exploits_that_compute_the_right_values_pass_correctness():
    """The exploits the value checks cannot see are each caught by their own check, and only by it."""
    for candidate, problem, check in [("aliases_input", "softmax", "aliasing"),
                                      ("reuses_output_buffer", "softmax", "aliasing"),
                                      ("mutates_input", "scaled_add", "input mutation"),
                                      ("overflows_at_scale", "softmax", "input scales"),
                                      ("wrong_odd_sizes", "softmax", "sizes")]:
        report = verify(candidate, problem)
        assert report.finding("correctness").result == PASS, candidate
        assert check in report.failed, candidate


def test_bitwise_jitter_within_tolerance_is_a_warning():
    report = verify("softmax_bitwise_jitter", "softmax")
    assert report.ok
    assert report.finding("determinism").result == WARN
    assert "within tolerance" in report.finding("determinism").detail


def test_state_dict_is_loaded_into_the_candidate():
    p = load_problem(FIXTURES / "scaled_add_torch.py", FIXTURES / "scaled_add_ref.py")
    assert torch.equal(p.candidate.scale, p.reference.scale)
    assert any("state_dict" in n for n in p.notes)


def test_reference_refusing_float64_runs_in_its_own_dtype():
    def reference(x):
        if x.dtype != torch.float32:
            raise TypeError("float32 only")
        return torch.softmax(x, -1)

    report = check_module(lambda x: torch.softmax(x, -1), reference, lambda: [torch.randn(4, 8)], trials=1)
    assert report.ok
    assert report.reference_precision.startswith("float32") and "refused float64" in report.reference_precision
    assert "float32 (the reference refused float64" in report.finding("correctness").detail


def test_tolerances_rtol_and_atol_relax_the_comparison():
    reference = lambda x: torch.softmax(x, -1)  # noqa: E731
    inputs = lambda: [torch.randn(4, 8)]  # noqa: E731
    off_by_relative = lambda x: torch.softmax(x, -1) * (1 + 1e-4)  # noqa: E731
    assert "correctness" in check_module(off_by_relative, reference, inputs, trials=1).failed
    assert check_module(off_by_relative, reference, inputs, trials=1, rtol=1e-3).ok
    off_by_absolute = lambda x: torch.softmax(x, -1) + 1e-5  # noqa: E731
    assert "correctness" in check_module(off_by_absolute, reference, inputs, trials=1).failed
    assert check_module(off_by_absolute, reference, inputs, trials=1, atol=1e-4).ok


def test_a_candidate_may_alias_its_input_where_the_reference_does():
    report = check_module(lambda x: x.reshape(-1), lambda x: x.view(-1), lambda: [torch.randn(4, 8)], trials=1)
    assert report.finding("aliasing").result == PASS
    assert "view of its input" in report.finding("aliasing").detail


def _softmax(x):
    return torch.softmax(x, -1)


def _two(x):
    return torch.softmax(x, -1), torch.log_softmax(x, -1)


# (candidate, reference, what the finding must say): the output rule, KernelBench's: the same structure.
STRUCTURE_MISMATCHES = [
    (lambda x: (_softmax(x),), _softmax, "out is a tuple of 1 (tensor,), the reference's is a tensor"),
    (lambda x: [_softmax(x)], _softmax, "out is a list of 1 (tensor,), the reference's is a tensor"),
    (_softmax, lambda x: (_softmax(x),), "out is a tensor, the reference's is a tuple of 1 (tensor,)"),
    (lambda x: (*_two(x), x.sum(-1)), _two, "out is a tuple of 3 (tensor, tensor, tensor), the reference's is a "
                                            "tuple of 2 (tensor, tensor)"),
    (lambda x: _two(x)[:1], _two, "out is a tuple of 1 (tensor,), the reference's is a tuple of 2"),
    (lambda x: (_softmax(x), None), _two, "out[1] is None, the reference's is a tensor"),
    (lambda x: (_softmax(x), (x, None)), lambda x: (_softmax(x), (x, x * 1)), "out[1][1] is None"),
]


@pytest.mark.parametrize("case", range(len(STRUCTURE_MISMATCHES)))
def test_output_structure_must_match_the_reference(case):
    candidate, reference, says = STRUCTURE_MISMATCHES[case]
    report = check_module(candidate, reference, lambda: [torch.randn(4, 8)], trials=1)
    assert "output structure" in report.failed, [(f.check, f.result, f.detail) for f in report.findings]
    detail = report.finding("output structure").detail
    assert says in detail and "correctness trial 0" in detail, detail


def test_a_list_and_a_tuple_of_the_same_outputs_are_alike():
    report = check_module(lambda x: list(_two(x)), _two, lambda: [torch.randn(4, 8)], trials=1)
    assert report.ok, [(f.check, f.result, f.detail) for f in report.findings]
    assert report.finding("output structure").result == PASS
    assert "(tensor, tensor)" in report.finding("output structure").detail


def test_cli_output_structure_mismatch_fails_saying_what_differs(tmp_path):
    wrapped = tmp_path / "wrapped.py"
    wrapped.write_text("import torch\nclass ModelNew(torch.nn.Module):\n"
                       "    def forward(self, x):\n        return (torch.softmax(x, -1),)\n")
    out = tmp_path / "report.json"
    res = runner.invoke(app, ["check", str(wrapped), "--reference", str(FIXTURES / "softmax_ref.py"), "--device",
                              "cpu", "--json", str(out)])
    assert res.exit_code == 1, res.output
    assert "1 check(s) failed: output structure" in res.output
    detail = {f["check"]: f["detail"] for f in json.loads(out.read_text())["findings"]}["output structure"]
    assert "out is a tuple of 1 (tensor,), the reference's is a tensor" in detail, detail
    help_text = " ".join(runner.invoke(app, ["check", "--help"]).output.split())
    assert "(out,)" in help_text and "structure" in help_text


def test_problem_errors():
    with pytest.raises(ProblemError, match="neither ModelNew nor Model"):
        load_problem(FIXTURES / "no_model.py", FIXTURES / "softmax_ref.py")
    with pytest.raises(ProblemError, match="defines no Model, get_inputs, get_init_inputs"):
        load_problem(FIXTURES / "softmax_torch.py", FIXTURES / "softmax_torch.py")
    with pytest.raises(ProblemError, match="no such file"):
        load_problem(FIXTURES / "missing.py", FIXTURES / "softmax_ref.py")


@needs_interpreter
def test_cli_honest_candidate_passes_with_a_table():
    res = runner.invoke(app, args("softmax_triton", "softmax", "--device", "cpu"))
    assert res.exit_code == 0, res.output
    for name in CHECKS:
        assert name in res.output
    assert "every check passed" in res.output and "float64" in res.output


def test_cli_exploit_fails_naming_the_check_and_writes_json(tmp_path):
    out = tmp_path / "report.json"
    res = runner.invoke(app, args("overflows_at_scale", "softmax", "--device", "cpu", "--json", str(out)))
    assert res.exit_code == 1, res.output
    assert "1 check(s) failed: input scales" in res.output
    doc = json.loads(out.read_text())
    assert doc["ok"] is False and doc["failed"] == ["input scales"]
    assert {f["check"]: f["result"] for f in doc["findings"]}["correctness"] == PASS
    assert doc["reference_precision"] == "float64" and doc["candidate"].endswith("overflows_at_scale.py")


def test_cli_rtol_relaxes(tmp_path):
    noisy = tmp_path / "noisy.py"
    noisy.write_text("import torch\nclass ModelNew(torch.nn.Module):\n"
                     "    def forward(self, x):\n        return torch.softmax(x, -1) * (1 + 1e-4)\n")
    res = runner.invoke(app, ["check", str(noisy), "--reference", str(FIXTURES / "softmax_ref.py"), "--device", "cpu"])
    assert res.exit_code == 1 and "correctness" in res.output
    res = runner.invoke(app, ["check", str(noisy), "--reference", str(FIXTURES / "softmax_ref.py"), "--device", "cpu",
                              "--rtol", "1e-3"])
    assert res.exit_code == 0, res.output


def test_cli_candidate_that_does_not_import_fails(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('no such extension')\n")
    res = runner.invoke(app, ["check", str(broken), "--reference", str(FIXTURES / "softmax_ref.py"), "--device", "cpu"])
    assert res.exit_code == 1, res.output
    assert "load" in res.output and "no such extension" in res.output


@pytest.mark.parametrize("argv,message", [
    (["check", str(FIXTURES / "softmax_torch.py")], "--reference"),
    (["check", str(FIXTURES / "missing.py"), "--reference", str(FIXTURES / "softmax_ref.py")], "no such file"),
    (["check", str(FIXTURES / "no_model.py"), "--reference", str(FIXTURES / "softmax_ref.py")], "neither ModelNew"),
    (["check", str(FIXTURES / "softmax_torch.py"), "--reference", str(FIXTURES / "softmax_torch.py")], "defines no"),
    (["check", "rms_norm", "--reference", str(FIXTURES / "softmax_ref.py")], "apply to a candidate file"),
    (["check", str(FIXTURES / "softmax_torch.py"), "--reference", str(FIXTURES / "softmax_ref.py"), "--dtype",
      "float16"], "apply to op checks"),
])
def test_cli_usage_errors_exit_2(argv, message):
    res = runner.invoke(app, [*argv, "--device", "cpu"])
    assert res.exit_code == 2, res.output
    assert message in res.output


def test_cli_triton_candidate_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    res = runner.invoke(app, args("softmax_triton", "softmax", "--device", "cpu"))
    assert res.exit_code == 2 and "TRITON_INTERPRET=1" in res.output, res.output
    res = runner.invoke(app, args("softmax_torch", "softmax", "--device", "cpu"))  # plain PyTorch needs nothing
    assert res.exit_code == 0, res.output


@pytest.mark.gpu
def test_gpu_side_stream_exploit_fails_pending_work():
    report = verify("side_stream", "softmax", device="cuda")
    assert "pending work" in report.failed, [(f.check, f.result, f.detail) for f in report.findings]
    # Read as the call returned, the output is unwritten. (On the H100, after a device synchronize 144 of the
    # 528 elements still differed, so the finding says so instead of naming another stream; unexplained.)
    assert "as the call returned" in report.finding("pending work").detail
    assert "non-finite" in report.finding("pending work").detail
    assert report.finding("timing").result == SKIP  # its events would time the launch, not the work


@pytest.mark.gpu
@pytest.mark.parametrize("candidate,problem", HONEST, ids=[h[0] for h in HONEST])
def test_gpu_honest_candidates_pass_and_are_timed(candidate, problem):
    report = verify(candidate, problem, device="cuda")
    assert report.ok, [(f.check, f.result, f.detail) for f in report.findings]
    assert report.finding("pending work").result == PASS
    assert report.finding("timing").result == INFO and "candidate" in report.timings_ms


@pytest.mark.gpu
@pytest.mark.parametrize("candidate,problem,check", EXPLOITS, ids=[e[0] for e in EXPLOITS])
def test_gpu_each_exploit_fails_its_named_check(candidate, problem, check):
    report = verify(candidate, problem, device="cuda", timing=False)
    assert check in report.failed, [(f.check, f.result, f.detail) for f in report.findings]
    assert report.finding("timing").result == SKIP

