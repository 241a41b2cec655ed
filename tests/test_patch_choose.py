"""kernelkit.patch's measured choice: each switch runs kernelkit only where it measured faster than the model's
own code, per shape; "kernelkit" forces it; the decision is cached, made at trace time under torch.compile,
refused inside a CUDA graph capture, and reported. On the CPU the measurement is replaced (the interpreter
cannot time kernels); the GPU tests time for real."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kernelkit.patch import attention as patch_attention, choose, modules, patch  # noqa: E402
from kernelkit.runtime import interpreting  # noqa: E402
from tests.test_patch import batch, tiny_model  # noqa: E402

KINDS = ("rms_norm", "mlp", "rope", "attention", "cross_entropy")
# The models here are tiny CPU models: their kernels run in the interpreter only (on a GPU machine without
# TRITON_INTERPRET=1 they would fall back to torch, and nothing would be decided)
needs_kernels = pytest.mark.skipif(not interpreting(), reason="tiny CPU models: kernels need TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def _fresh_decisions(monkeypatch):
    choose.forget()
    monkeypatch.setattr(choose, "_file", lambda: None)  # no disk cache unless a test sets one
    yield
    choose.forget()


@pytest.fixture
def fake_timer(monkeypatch):
    """Measurement replaced: `faster[kind]` says which path wins; every measured key is logged."""
    faster = {k: "original" for k in (*KINDS, "moe", "fp8")}
    log: list = []

    def measured(site, key, shape):
        log.append((site.kind, key))
        kk_wins = faster[site.kind] == "kernelkit"
        return choose.Choice(site.kind, shape, site.original, kk_wins, "measured", 1.0 if kk_wins else 2.0,
                             2.0 if kk_wins else 1.0)

    monkeypatch.setattr(choose, "can_measure", lambda: True)
    monkeypatch.setattr(choose, "_measure_choice", measured)
    return faster, log


def test_switch_values():
    assert choose.mode("attention", True) == "auto"
    assert choose.mode("attention", "auto") == "auto"
    assert choose.mode("attention", "kernelkit") == "kernelkit"
    assert choose.mode("attention", False) is None
    with pytest.raises(ValueError, match="attention='fast'"):
        choose.mode("attention", "fast")


def test_bad_switch_value_names_the_argument():
    model = tiny_model("llama", layers=1)
    with pytest.raises(ValueError, match="rms_norm=1"):
        patch(model, rms_norm=1)
    with pytest.raises(ValueError, match="swiglu='yes'"):
        patch(model, swiglu="yes")
    assert "forward" not in vars(model.model.norm)  # nothing patched


def test_bucket():
    assert [choose.bucket(n) for n in (1, 2, 3, 4, 5, 1000, 1024, 1025)] == [1, 2, 4, 4, 8, 1024, 1024, 2048]


@needs_kernels
def test_measured_slower_keeps_the_models_own_code(fake_timer, monkeypatch):
    """Where the model's own code measured faster, it runs: the patched model computes bit for bit what the
    unpatched one does, no kernelkit op is called, and the report says what was kept, per shape."""
    model = tiny_model("llama", dtype=torch.bfloat16, attn="sdpa")
    ref = copy.deepcopy(model)
    for name in ("rms_norm", "rope"):
        monkeypatch.setattr(modules, name, _forbidden(name))
    monkeypatch.setattr(modules.glu, "swiglu", _forbidden("swiglu"))
    report = patch(model)
    ids, labels = batch()
    model.train(), ref.train()
    got, want = model(ids, labels=labels), ref(ids, labels=labels)
    assert got.logits is not None  # the model's own loss ran: it returns the logits
    assert torch.equal(got.loss, want.loss)
    kinds = {c.kind for c in report.choices.values()}
    assert kinds == set(KINDS)
    assert all(not c.use_kernelkit and c.path == c.original for c in report.choices.values())
    text = str(report)
    assert "kept sdpa: 2.00x faster than kernelkit" in text
    assert "kept LlamaRMSNorm.forward" in text


def _forbidden(name):
    def f(*a, **k):
        raise AssertionError(f"kernelkit's {name} ran where the model's own code measured faster")
    return f


@needs_kernels
def test_measured_faster_runs_kernelkit_and_measures_each_key_once(fake_timer):
    faster, log = fake_timer
    faster.update({k: "kernelkit" for k in faster})
    model = tiny_model("llama", dtype=torch.bfloat16, layers=1)
    report = patch(model)
    model.train()
    for seed in (1, 2):
        model(batch(seed)[0], labels=batch(seed)[1]).loss.backward()
    assert len(log) == len(set(log)) == len(report.choices)  # the second step measured nothing new
    assert all(c.use_kernelkit for c in report.choices.values())
    assert report.fallback_count() == 0
    # a new token count in the same power-of-two bucket shares the decision; another bucket is measured
    before = len(log)
    model(*_ids(7))
    assert len(log) == before
    model(*_ids(13))
    assert len(log) > before


def _ids(seq):
    ids = torch.randint(1, 128, (2, seq))
    return ids, ids.clone()


@needs_kernels
def test_forced_mode_never_measures(fake_timer):
    _, log = fake_timer
    model = tiny_model("llama", dtype=torch.bfloat16)
    report = patch(model, rms_norm="kernelkit", mlp="kernelkit", rope="kernelkit", attention="kernelkit",
                   cross_entropy="kernelkit")
    model.train()
    model(*batch())
    assert log == []
    assert {c.source for c in report.choices.values()} == {"forced"}


@needs_kernels
def test_switches_choose_independently(fake_timer):
    faster, _ = fake_timer
    faster["rms_norm"] = "kernelkit"
    model = tiny_model("llama", dtype=torch.bfloat16)
    report = patch(model, attention=False)
    model.train()
    model(*batch())
    paths = {c.kind: c.path for c in report.choices.values()}
    assert paths["rms_norm"] == "kernelkit" and paths["mlp"] == "LlamaMLP.forward"
    assert "attention" not in paths


@needs_kernels
def test_decided_while_tracing_under_compile(fake_timer):
    """Under torch.compile the choice is made once, at trace time, and the graph runs the chosen path."""
    _, log = fake_timer
    model = tiny_model("llama", dtype=torch.bfloat16, layers=1).eval()
    ref = copy.deepcopy(model)
    report = patch(model)
    ids = batch()[0]
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        got, want = compiled(ids).logits, ref(ids).logits
        n = len(log)
        compiled(ids)
    assert n > 0 and len(log) == n
    assert torch.equal(got, want)
    assert report.choices


@needs_kernels
def test_capture_refuses_to_measure(fake_timer, monkeypatch):
    monkeypatch.setattr(choose, "capturing", lambda: True)
    model = tiny_model("llama", dtype=torch.bfloat16, layers=1)
    patch(model)
    with pytest.raises(RuntimeError, match="eagerly at this shape before capturing"):
        model(batch()[0])


def test_disk_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setattr(choose, "_file", lambda: tmp_path / "choices.json")
    monkeypatch.setattr(choose.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("kernelkit.runtime.cache.fingerprint", lambda: {"gpu": "test"})
    c = choose.Choice("rms_norm", "8x64 bfloat16 fwd", "LlamaRMSNorm.forward", False, "measured", 2.0, 1.0)
    ck = choose._cache_key("rms_norm", (8, 64, "bfloat16", False), c.original)
    choose._to_disk(ck, c)
    back = choose._from_disk(ck, "rms_norm", c.shape, c.original)
    assert back.source == "cache" and not back.use_kernelkit and back.ratio == 0.5
    assert choose._from_disk(ck.replace("64", "65"), "rms_norm", c.shape, c.original) is None
    (tmp_path / "choices.json").write_text("{not json")
    assert choose._from_disk(ck, "rms_norm", c.shape, c.original) is None  # a corrupt file is a miss


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_real_measurement_on_the_gpu(tmp_path, monkeypatch):
    """On a GPU the paths are timed: every choice has both times, the step's outputs match the unpatched
    model's, the user's random stream is untouched, and a new process reads the decisions from disk."""
    monkeypatch.setattr(choose, "_file", lambda: tmp_path / "choices.json")
    model = tiny_model("llama", dtype=torch.bfloat16, device="cuda", layers=1)
    ref = copy.deepcopy(model)
    report = patch(model)
    ids, labels = (t.cuda() for t in batch())
    model.train(), ref.train()
    torch.manual_seed(5)
    loss = model(ids, labels=labels).loss
    after = torch.randn(4, device="cuda")
    torch.manual_seed(5)
    want = ref(ids, labels=labels).loss
    assert torch.equal(after, torch.randn(4, device="cuda"))  # measurement drew from its own generator
    torch.testing.assert_close(loss.float(), want.float(), rtol=2e-2, atol=2e-2)
    measured = [c for c in report.choices.values() if c.source == "measured"]
    assert {c.kind for c in measured} == set(KINDS)
    assert all(c.kernelkit_ms > 0 and c.original_ms > 0 for c in measured)
    choose.forget()  # as a new process: the decisions come back from the file
    model2 = tiny_model("llama", dtype=torch.bfloat16, device="cuda", layers=1).train()
    report2 = patch(model2)
    model2(ids, labels=labels)
    assert {c.source for c in report2.choices.values()} == {"cache"}
    assert {(c.kind, c.shape, c.use_kernelkit) for c in report2.choices.values()} == \
        {(c.kind, c.shape, c.use_kernelkit) for c in report.choices.values()}


@needs_kernels
@pytest.mark.parametrize("family", ["gemma2", "phi3", "mixtral"])
def test_every_trial_runs(family, monkeypatch):
    """The real measurement path on the CPU (interpreter kernels, host clock): every switch's trial is built
    at the call's key and both of its paths run forward and backward, for families whose originals differ
    (softcapped eager attention and loss, fused gate-up and partial rotary, MoE experts, 4-D q/k norms); the
    patched step then agrees with the unpatched one whichever paths won."""
    monkeypatch.setattr(choose, "can_measure", lambda: True)
    for name, value in (("BUDGET_MS", 0.0), ("MIN_REPS", 1), ("WARMUP", 0)):  # one timed call: the interpreter is slow
        monkeypatch.setattr(choose, name, value)
    model = tiny_model(family, dtype=torch.bfloat16, layers=1, attn="sdpa" if family != "gemma2" else "eager")
    ref = copy.deepcopy(model)
    report = patch(model)
    model.train(), ref.train()
    ids, labels = batch()
    got, want = model(ids, labels=labels).loss, ref(ids, labels=labels).loss
    got.backward()
    kinds = {c.kind for c in report.choices.values()}
    expected = {"rms_norm", "rope", "attention", "cross_entropy", "moe" if family == "mixtral" else "mlp"}
    assert kinds == expected, report.choices
    assert all(c.source == "measured" and c.kernelkit_ms > 0 and c.original_ms > 0
               for c in report.choices.values())
    assert abs(got.item() - want.item()) <= 2e-2 * abs(want.item())


@needs_kernels
def test_attention_is_timed_in_flight(monkeypatch):
    """The attention trial times patch.attention.IN_FLIGHT calls back to back per sample (a step's host runs ahead of
    the GPU: a call costs the longer of its host and GPU times); the other switches' trials one at a time."""
    seen, kind = [], []
    real_choice = choose._measure_choice

    def measure_choice(site, key, shape):
        kind.append(site.kind)
        return real_choice(site, key, shape)

    def measure(trial):
        seen.append((kind[-1], trial.in_flight))
        return 1.0, 2.0

    monkeypatch.setattr(choose, "can_measure", lambda: True)
    monkeypatch.setattr(choose, "_measure_choice", measure_choice)
    monkeypatch.setattr(choose, "measure", measure)
    model = tiny_model("llama", dtype=torch.bfloat16, layers=1)
    patch(model)
    model.train()
    model(batch()[0], labels=batch()[1]).loss.backward()
    assert patch_attention.IN_FLIGHT > 1
    assert ("attention", patch_attention.IN_FLIGHT) in seen and all(n == 1 for k, n in seen if k != "attention"), seen


@needs_kernels
@pytest.mark.parametrize("winner", ["original", "kernelkit"])
def test_fp8_linears_run_in_fp8_only_where_measured_faster(winner, fake_timer, monkeypatch):
    """precision="fp8": each Linear shape is a decision of its own; where bf16 measured faster the model's own
    nn.Linear runs (fp8_linear is never called), else fp8_linear; the trial itself builds and runs both paths."""
    faster, log = fake_timer
    faster["fp8"] = winner
    calls = []
    real = modules.fp8_linear
    monkeypatch.setattr(modules, "fp8_linear", lambda *a: calls.append(a[1].shape) or real(*a))
    model = tiny_model("llama", dtype=torch.bfloat16, layers=1)
    report = patch(model, precision="fp8", rms_norm=False, mlp=False, rope=False, attention=False,
                   cross_entropy=False)
    model.train()
    model(batch()[0], labels=batch()[1]).loss.backward()
    keys = {key for kind, key in log if kind == "fp8"}
    # q/o, k/v, gate/up, down: one decision per (tokens, out, in) shape, not per module; and per whether x's rows
    # were already made (in fp8, k/v and up read the rows q and gate made: gate and up are then two decisions)
    assert {k[1:3] for k in keys} == {(64, 64), (32, 64), (128, 64), (64, 128)}
    assert {k[1:3] for k in keys if k[-1]} == ({(32, 64), (128, 64)} if winner == "kernelkit" else set())
    assert len(keys) == (5 if winner == "kernelkit" else 4)
    assert bool(calls) == (winner == "kernelkit")
    fp8 = [c for c in report.choices.values() if c.kind == "fp8"]
    assert fp8 and all(c.use_kernelkit == (winner == "kernelkit") for c in fp8)
    trial = modules._fp8_trial(None, next(iter(keys)))
    assert trial.wrt and trial.kernelkit().shape == trial.original().shape


@needs_kernels
def test_fp8_trials_of_linears_whose_rows_are_made_upstream_do_not_quantize_them(fake_timer, monkeypatch):
    """With the fused producers (the norms write q/k/v's and gate/up's rows, the SwiGLU down's), the decision for
    those Linears is its own key, and its trial hands the rows in instead of timing their quantization: timed
    alone, down_proj's fp8 paid a quantization the model does not run and came out level with bf16."""
    from kernelkit.ops import fp8_linear as F8

    faster, log = fake_timer
    faster["fp8"] = "kernelkit"
    monkeypatch.setenv("KERNELKIT_FP8_FUSE", "1")
    model = tiny_model("llama", dtype=torch.bfloat16, layers=1)
    patch(model, precision="fp8", rms_norm="kernelkit", mlp="kernelkit", rope=False, attention=False,
          cross_entropy=False)
    model.train()
    model(batch()[0], labels=batch()[1]).loss.backward()
    made = {(k[1], k[2]): k[-1] for kind, k in log if kind == "fp8"}
    # q and o share a shape: q's rows come from the norm, o's input (attention's output) has none
    assert made[(32, 64)] and made[(128, 64)] and made[(64, 128)], made
    key = next(k for kind, k in log if kind == "fp8" and k[1:3] == (128, 64))
    rows_of_x = []
    real = F8.quantize_rows
    def counted(t):
        if t.shape[0] == key[0]:  # x's rows (tokens first), not the weight's
            rows_of_x.append(t.shape)
        return real(t)

    monkeypatch.setattr(F8, "quantize_rows", counted)
    trial = modules._fp8_trial(None, key)
    rows_of_x.clear()
    with torch.no_grad():
        trial.kernelkit()
    assert rows_of_x == []  # made upstream: the timed call does not quantize x's rows
    unmade = modules._fp8_trial(None, key[:-1] + (False,))
    rows_of_x.clear()
    with torch.no_grad():
        unmade.kernelkit()
    assert len(rows_of_x) == 1


def test_in_flight_trials_time_calls_back_to_back(monkeypatch):
    """Trial.in_flight: each sample runs that many calls between one pair of timestamps and is divided by it."""
    clock = iter(range(0, 10**6, 8))  # each timed sample spans 8 units of the host clock
    monkeypatch.setattr(choose.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(choose.time, "perf_counter", lambda: next(clock) / 1e3)
    for name, value in (("WARMUP", 1), ("MIN_REPS", 3), ("MAX_REPS", 3)):
        monkeypatch.setattr(choose, name, value)
    calls = {"kernelkit": 0, "original": 0}

    def path(name):
        def f():
            calls[name] += 1
            return torch.zeros(1)
        return f

    kk, orig = choose.measure(choose.Trial(path("kernelkit"), path("original"), [], in_flight=4))
    assert calls == {"kernelkit": 1 + 3 * 4, "original": 1 + 3 * 4}
    assert kk == orig == 8 / 4
