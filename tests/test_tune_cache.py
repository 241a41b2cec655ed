"""The persistent tuning cache (kernelkit.runtime.cache) and `kernelkit tune`.

The interpreter keeps one config per kernelkit kernel, so the launch path is exercised with a kernel built
here: a real `triton.autotune` over two configs that differ in what the kernel writes (y = x * SCALE), tuned
by a stand-in benchmark that runs each config once and calls the last one fastest, with `tune.interpreting`
patched to False so that `launch` takes the path it takes on a GPU. A stored config shows in the output.
"""

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from typer.testing import CliRunner

from kernelkit import runtime as tune
from kernelkit.ops import registry
from kernelkit.ops.registry import OpSpec
from kernelkit.roofline.model import Cost
from kernelkit.runtime import cache
from kernelkit.commands import tune as tune_cli
from tests.conftest import INTERPRET

FP = {"gpu": "Fake GPU", "capability": "9.0", "sms": 132, "driver": "560.35.03", "cuda": "13.0", "torch": "2.13.0",
      "triton": "3.6.0", "kernelkit": "0.1.0"}
OTHER_FP = {**FP, "gpu": "Other GPU", "sms": 114}
REPO = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"  # the `device` fixture's choice


@triton.jit
def scale_kernel(X, Y, N, BLOCK: tl.constexpr, SCALE: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(Y + i, tl.load(X + i, mask=i < N, other=0.0) * SCALE, mask=i < N)


CONFIGS = [triton.Config({"SCALE": 2}, num_warps=4), triton.Config({"SCALE": 3}, num_warps=2, num_stages=2)]


class Bench:
    """do_bench stand-in: runs the config once (the kernel really launches) and calls later configs faster."""

    def __init__(self, fail=False):
        self.calls, self.fail = 0, fail

    def __call__(self, kernel_call, quantiles):
        if self.fail:
            raise AssertionError("tuned although the config was stored")
        self.calls += 1
        kernel_call()
        return [10.0 - self.calls] * len(quantiles)


def make_kernel(bench, configs=CONFIGS):
    return triton.autotune(configs, key=["N"], do_bench=bench)(scale_kernel)


def run(kernel, n=8, key="k"):
    x = torch.arange(1, n + 1, dtype=torch.float32, device=DEVICE)
    y = torch.zeros(n, device=DEVICE)
    tune.launch(kernel, (1,), (key, n), x, y, n, BLOCK=16)
    return (y / x).unique().tolist()  # the SCALE that ran


def restart(kernel):
    """What a new process starts with: no chosen configs, an empty autotuner, nothing read from disk."""
    for k in [k for k in tune._chosen if k[0] is kernel]:
        del tune._chosen[k]
    kernel.cache.clear()
    cache._loaded.clear()


@pytest.fixture
def tuning(tmp_path, monkeypatch, device):
    """A fresh cache folder, this 'machine' = FP, and `launch` on its GPU path (persisting)."""
    monkeypatch.setenv("KERNELKIT_CACHE", str(tmp_path))
    monkeypatch.delenv("KERNELKIT_TUNE_CACHE", raising=False)
    monkeypatch.delenv("KERNELKIT_TUNE", raising=False)  # scripts/gpu_check.sh may run the suite under =first
    monkeypatch.setattr(cache, "fingerprint", lambda: dict(FP))
    monkeypatch.setattr(tune, "interpreting", lambda: False)
    monkeypatch.setattr(cache, "_loaded", {})
    monkeypatch.setattr(cache, "_warned", set())
    return tmp_path


def entries(fp=FP):
    path = cache.file_for(fp)
    return json.loads(path.read_text())["entries"] if path.exists() else {}


# --- the launch path ---

def test_stored_config_is_used_after_a_restart(tuning):
    bench = Bench()
    kernel = make_kernel(bench)
    seconds, count = tune.tuning_seconds, tune.tuned_keys
    assert run(kernel) == [3.0]  # tuned: the second config wins
    assert bench.calls == 2 and tune.tuned_keys == count + 1 and tune.tuning_seconds > seconds
    tkey = (8, "torch.float32", "torch.float32")
    assert tkey in kernel.cache  # the autotuner's own key, computed as Autotuner.run does
    assert cache.tuning_key(kernel, (torch.ones(1), torch.ones(1), 8), {"BLOCK": 16}) == tkey
    (entry,) = entries().values()
    assert entry["key"] == repr(tkey) and entry["config"]["kwargs"] == {"SCALE": 3}
    assert entry["config"]["num_stages"] == 2 and tune.tune_log[-1]["source"] == "tuned"

    restart(kernel)
    bench.fail = True
    assert run(kernel) == [3.0]  # the stored config, not the first one, and no benchmark
    assert tune.tuned_keys == count + 1 and tune.tune_log[-1]["source"] == "cache"
    assert kernel.cache[tkey] is CONFIGS[1] and kernel.best_config is CONFIGS[1]  # the autotuner agrees
    assert run(kernel, key="other") == [3.0]  # another launch key, same tuning key: no tuning either


def test_stored_config_is_used_by_a_new_process(tuning, device):
    run(make_kernel(Bench()))
    code = ("import torch, sys; from kernelkit import runtime as tune; from kernelkit.runtime import cache; "
            "import tests.test_tune_cache as t; "
            "cache.fingerprint = lambda: dict(t.FP); tune.interpreting = lambda: False; "
            "scale = t.run(t.make_kernel(t.Bench(fail=True))); "
            "print(scale, tune.tune_log[-1]['source'], tune.tuned_keys)")
    env = {**os.environ, "KERNELKIT_CACHE": str(tuning), "TRITON_INTERPRET": "1" if device == "cpu" else "0"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["[3.0]", "cache", "0"]


def test_a_new_key_tunes_and_both_are_kept(tuning):
    bench = Bench()
    kernel = make_kernel(bench)
    run(kernel, n=8)
    run(kernel, n=5)
    assert bench.calls == 4 and len(entries()) == 2


@pytest.mark.parametrize("component", sorted(FP), ids=lambda c: f"changed-{c}")
def test_any_fingerprint_change_tunes_again(tuning, monkeypatch, component):
    bench = Bench()
    kernel = make_kernel(bench)
    run(kernel)
    monkeypatch.setattr(cache, "fingerprint", lambda: {**FP, component: "changed"})
    restart(kernel)
    assert run(kernel) == [3.0] and bench.calls == 4  # tuned again, into the other fingerprint's file
    assert cache.file_for({**FP, component: "changed"}) != cache.file_for(FP)
    assert len(entries()) == 1 and len(entries({**FP, component: "changed"})) == 1


def test_fingerprint_reads_every_component(monkeypatch):
    class Props:
        name, major, minor, multi_processor_count = "Fake GPU", 9, 0, 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props)
    monkeypatch.setattr(cache, "_driver_version", lambda: "560.35.03")
    cache._fingerprint.cache_clear()
    try:
        fp = dict(cache._fingerprint(0))
        assert tuple(fp) == cache.FINGERPRINT_KEYS and fp["sms"] == 132 and fp["triton"] == triton.__version__
        Props.multi_processor_count = 114  # an H100 PCIe is an H100 SXM with fewer SMs: another file
        cache._fingerprint.cache_clear()
        assert cache.file_for(dict(cache._fingerprint(0))) != cache.file_for(fp)
    finally:
        cache._fingerprint.cache_clear()


def test_kernel_source_and_config_list_are_in_the_key():
    a = make_kernel(Bench())
    tkey = (8, "torch.float32", "torch.float32")
    assert cache.entry_name(a, tkey) == cache.entry_name(make_kernel(Bench()), tkey)
    assert cache.entry_name(a, tkey) != cache.entry_name(make_kernel(Bench(), CONFIGS[:1]), tkey)
    assert cache.entry_name(a, tkey) != cache.entry_name(a, (16, "torch.float32", "torch.float32"))

    @triton.jit
    def edited(X, Y, N, BLOCK: tl.constexpr, SCALE: tl.constexpr):
        i = tl.arange(0, BLOCK) + 0
        tl.store(Y + i, tl.load(X + i, mask=i < N, other=0.0) * SCALE, mask=i < N)

    b = triton.autotune(CONFIGS, key=["N"])(edited)
    assert cache.source_hash(a) != cache.source_hash(b) and cache.entry_name(a, tkey) != cache.entry_name(b, tkey)
    assert cache.entry_name(a, (object(),)) is None  # a key Triton would hash by identity is not stored
    assert cache.entry_name(make_kernel(Bench(), [triton.Config({"SCALE": 2}, pre_hook=lambda a: None)] + CONFIGS),
                            tkey) is None  # pre_hooks cannot be written down


# --- when nothing is stored ---

def test_untuned_choices_are_not_stored(tuning, monkeypatch):
    monkeypatch.setenv("KERNELKIT_TUNE", "first")
    first = tune.autotune(CONFIGS, key=["N"])(scale_kernel)  # KERNELKIT_TUNE=first: one config
    prune = {"early_config_prune": lambda configs, named, **kw: configs}
    pruned = tune.autotune(CONFIGS, key=["N"], prune_configs_by=prune, do_bench=Bench())(scale_kernel)
    assert run(first) == [2.0] and run(pruned) == [2.0]
    assert pruned.kernelkit_untuned and tune.tune_log[-1]["source"] == "untuned"
    assert not cache.cache_dir().exists()


def test_interpreter_and_switch_off_store_nothing(tuning, monkeypatch):
    monkeypatch.setattr(tune, "interpreting", lambda: True)
    run(make_kernel(Bench()))
    monkeypatch.setattr(tune, "interpreting", lambda: False)
    monkeypatch.setenv("KERNELKIT_TUNE_CACHE", "0")
    bench = Bench()
    run(make_kernel(bench))
    assert bench.calls == 2 and not cache.cache_dir().exists()


# --- bad files, concurrency ---

@pytest.mark.parametrize("text", ["{not json", '{"format": "something else"}', "[]", "\xff\xfe",
                                  json.dumps({"format": cache.FORMAT, "version": 1, "fingerprint": OTHER_FP,
                                              "entries": {}})])
def test_bad_file_warns_once_and_tunes_again(tuning, text):
    path = cache.file_for(FP)
    path.parent.mkdir(parents=True)
    path.write_text(text, encoding="latin-1")
    bench = Bench()
    kernel = make_kernel(bench)
    with pytest.warns(UserWarning, match="ignoring the tuning cache") as caught:
        assert run(kernel) == [3.0]
        run(kernel, n=5)
    assert len([w for w in caught if "tuning cache" in str(w.message)]) == 1
    assert bench.calls == 4 and len(entries()) == 2  # tuned, and the file rewritten whole


def test_malformed_entry_is_dropped_and_tuned_again(tuning):
    kernel = make_kernel(Bench())
    run(kernel)
    doc = json.loads(cache.file_for(FP).read_text())
    (name,) = doc["entries"]
    doc["entries"][name]["config"] = {"kwargs": {"SCALE": 3}, "num_warps": "two"}
    cache.file_for(FP).write_text(json.dumps(doc))
    restart(kernel)
    bench = Bench()
    kernel = make_kernel(bench)
    with pytest.warns(UserWarning, match="malformed"):
        assert run(kernel) == [3.0]
    assert bench.calls == 2 and entries()[name]["config"]["num_warps"] == 2


def test_unwritable_cache_warns_and_runs(tuning, monkeypatch):
    blocker = tuning / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("KERNELKIT_CACHE", str(blocker))
    with pytest.warns(UserWarning, match="could not write the tuning cache"):
        assert run(make_kernel(Bench())) == [3.0]


def _writer(root: str, who: int, n: int) -> None:
    os.environ["KERNELKIT_CACHE"] = root
    cache._loaded.clear()
    for i in range(n):
        cache.merge(dict(FP), {f"k{who}:{i}": {"kernel": "k", "key": f"({who}, {i})", "seconds": 0.1,
                                                "config": cache.config_json(CONFIGS[i % 2])}})


def test_concurrent_writers_keep_every_entry(tmp_path):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), who, 30)) for who in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    doc = json.loads((tmp_path / "tune" / f"{cache.digest(FP)}.json").read_text())
    assert doc["fingerprint"] == FP and len(doc["entries"]) == 60
    assert not list((tmp_path / "tune").glob("*.tmp"))


# --- export, import, clear ---

def test_export_import_round_trip(tuning, monkeypatch):
    kernel = make_kernel(Bench())
    run(kernel)
    monkeypatch.setattr(cache, "fingerprint", lambda: dict(OTHER_FP))
    run(make_kernel(Bench()), n=5)
    exported = tuning / "cluster.json"
    assert cache.export(exported) == 2
    assert cache.clear() == 2 and cache.files() == []
    assert cache.import_(exported, here=FP) == {"here": 1, "other": 1, "skipped": 0}
    assert len(entries(FP)) == 1 and len(entries(OTHER_FP)) == 1  # the foreign one kept in its own file

    monkeypatch.setattr(cache, "fingerprint", lambda: dict(FP))
    restart(kernel)
    kernel = make_kernel(Bench(fail=True))
    assert run(kernel) == [3.0] and tune.tune_log[-1]["source"] == "cache"

    doc = json.loads(exported.read_text())
    doc["files"][0]["entries"]["bad"] = {"kernel": "k"}
    doc["files"].append({"fingerprint": {"gpu": "half a fingerprint"}, "entries": {"x": {}}})
    exported.write_text(json.dumps(doc))
    assert cache.import_(exported, here=FP) == {"here": 1, "other": 1, "skipped": 2}
    exported.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a kernelkit tuning export"):
        cache.import_(exported, here=FP)


# --- kernelkit tune ---

def _scale_op(x, n_block=16):
    y = torch.empty_like(x)
    tune.launch(_CLI_KERNEL, (1,), ("cli", x.numel()), x, y, x.numel(), BLOCK=n_block)
    return y


_CLI_KERNEL = None
runner = CliRunner()


@pytest.fixture
def cli_app(tuning, monkeypatch):
    """`kernelkit tune` as the lead registers it, with a registry op that launches the test kernel."""
    import typer

    global _CLI_KERNEL
    _CLI_KERNEL = make_kernel(Bench())
    registry.all_ops()
    monkeypatch.setitem(registry._REGISTRY, "scale_test", OpSpec(
        name="scale_test", fn=_scale_op, reference=lambda x: 3 * x, cost=lambda *a, **k: Cost(0, 0, "fp32"),
        make_inputs=lambda shape, dtype, device, generator=None: ((torch.ones(shape, dtype=dtype, device=device),), {}),
        bench_shapes=[(8,)]))
    monkeypatch.setattr(tune_cli, "_device", lambda: DEVICE)
    monkeypatch.setattr(tune_cli, "_here", lambda: dict(FP))
    app = typer.Typer()
    app.command("tune")(tune_cli.tune_command)
    app.command("other")(lambda: None)  # two commands: `tune` is a subcommand, as in kernelkit's app
    return app


def _flat(text: str) -> str:
    """CLI output with whitespace collapsed: rich wraps long lines (temporary paths) at the terminal width."""
    return " ".join(text.split())


def test_cli_tunes_lists_exports_clears_imports(cli_app, tuning):
    res = runner.invoke(cli_app, ["tune", "--op", "scale_test", "--shapes", "[(8,), (5,)]", "--dtype", "float32"],
                        env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "scale_kernel" in _flat(res.output) and "SCALE=3" in _flat(res.output) and "2 kernel keys tuned" in _flat(res.output)
    assert len(entries()) == 2

    restart(_CLI_KERNEL)
    res = runner.invoke(cli_app, ["tune", "--op", "scale_test", "--shapes", "[(8,)]", "--dtype", "float32"],
                        env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "cache" in _flat(res.output) and "0 kernel keys tuned" in _flat(res.output), res.output

    res = runner.invoke(cli_app, ["tune", "--list"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "this machine" in _flat(res.output) and _flat(res.output).count("scale_kernel") == 2, res.output

    out = tuning / "exported.json"
    res = runner.invoke(cli_app, ["tune", "--export", str(out)])
    assert res.exit_code == 0 and "exported 2 entries" in _flat(res.output) and out.exists()
    res = runner.invoke(cli_app, ["tune", "--clear", "--list"])
    assert res.exit_code == 0 and "2 entries" in _flat(res.output) and "is empty" in _flat(res.output), res.output
    res = runner.invoke(cli_app, ["tune", "--import", str(out)], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "2 entries for this machine" in _flat(res.output), res.output
    assert len(entries()) == 2


@pytest.mark.parametrize("args, env, says", [
    ([], {}, "nothing to do"),
    (["--shapes", "[(8,)]"], {}, "--shapes goes with --op"),
    (["--op", "no_such_op"], {}, "no op named"),
    (["--op", "scale_test", "--shapes", "8x8"], {}, "Python list of shape tuples"),
    (["--op", "scale_test", "--dtype", "int8"], {}, "--dtype"),
    (["--op", "scale_test"], {"KERNELKIT_TUNE": "first"}, "KERNELKIT_TUNE=first"),
    (["--op", "scale_test"], {"KERNELKIT_TUNE_CACHE": "0"}, "KERNELKIT_TUNE_CACHE=0"),
    (["--from", "no/such/folder"], {}, "no trace.json"),
    (["--import", "no/such/file.json"], {}, "cannot read"),
])
def test_cli_refuses_clearly(cli_app, monkeypatch, args, env, says):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    res = runner.invoke(cli_app, ["tune", *args], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and says in _flat(res.output), res.output


def test_cli_without_gpu_says_so(cli_app, monkeypatch):
    monkeypatch.setattr(tune_cli, "_device", lambda: None)
    res = runner.invoke(cli_app, ["tune", "--op", "scale_test"], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "CUDA GPU" in _flat(res.output)


def test_plans_from_the_example_and_a_profile_report(tmp_path):
    from kernelkit.profile.examples import build_example
    from kernelkit.profile.trace import OpRecord, predict

    plan = {(s.name, shape, dt) for s, shape, dt in tune_cli.example_plan("llama")}
    assert ("rms_norm", (8192, 2048), "bfloat16") in plan
    assert ("attention", (4, 2048, 16, 128, True, 2048, 4), "bfloat16") in plan
    assert ("cross_entropy", (8192, 32000), "float32") in plan

    model, inputs = build_example("llama", device="meta", tiny=False)
    trace = predict(model, inputs, backward=True)
    # a patched model's own calls: kernelkit.attention takes (batch, seq, heads, head_dim)
    trace.records += [OpRecord(op="kernelkit::rms_norm", module="m", phase="fwd", step=0, shapes=((2, 64, 512), (512,)),
                               dtypes=("float16", "float16"), flops=0.0, bytes=0.0, dtype_key="fp16"),
                      OpRecord(op="kernelkit::attention", module="a", phase="fwd", step=0,
                               shapes=((2, 256, 8, 64), (2, 256, 2, 64), (2, 256, 2, 64)),
                               dtypes=("float16",) * 3, flops=4 * 2 * 8 * 256 * 256 * 64, bytes=0.0, dtype_key="fp16")]
    trace.save(tmp_path / "trace.json")
    (tmp_path / "profile.json").write_text("{}")
    got = {(s.name, shape, dt) for s, shape, dt in tune_cli.report_plan(tmp_path / "profile.json")}
    assert plan <= got
    assert ("rms_norm", (128, 512), "float16") in got
    assert ("attention", (2, 256, 8, 64, False, 256, 2), "float16") in got


# --- on the GPU (scripts/gpu_check.sh) ---

@pytest.mark.gpu
def test_gpu_rms_norm_tuning_survives_a_restart(tmp_path, monkeypatch):
    import kernelkit
    from kernelkit.ops import rms_norm as rn

    monkeypatch.setenv("KERNELKIT_CACHE", str(tmp_path))
    monkeypatch.delenv("KERNELKIT_TUNE", raising=False)
    if getattr(rn.rms_norm_fwd_kernel, "kernelkit_untuned", False):
        pytest.skip("kernels were defined under KERNELKIT_TUNE=first")
    x = torch.randn(4096, 3072, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3072, device="cuda", dtype=torch.bfloat16)
    restart(rn.rms_norm_fwd_kernel)  # earlier tests of this session may have tuned this shape
    count = tune.tuned_keys
    want = kernelkit.rms_norm(x, w)
    assert tune.tuned_keys == count + 1 and len(cache.files()) == 1
    restart(rn.rms_norm_fwd_kernel)
    torch.testing.assert_close(kernelkit.rms_norm(x, w), want, rtol=0, atol=0)
    assert tune.tuned_keys == count + 1 and tune.tune_log[-1]["source"] == "cache"


@pytest.mark.gpu
@pytest.mark.alone
def test_gpu_first_call_latency_cold_vs_warm(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import tune_latency
    finally:
        sys.path.pop(0)
    cold = tune_latency.run_case("rms_norm", str(tmp_path / "kk"), str(tmp_path / "triton"))
    warm = tune_latency.run_case("rms_norm", str(tmp_path / "kk"), str(tmp_path / "triton"))
    assert "error" not in cold and "error" not in warm, (cold, warm)
    assert cold["tuned"] >= 1 and warm["tuned"] == 0 and warm["from_cache"] >= 1
    assert warm["first_s"] < cold["first_s"]


def test_forget_drops_the_choices_of_one_kernel():
    # tune.forget (A/B scripts swapping a kernel's configs): this kernel's autotuner cache and launch entries go,
    # another kernel's stay.
    class Kernel:
        def __init__(self):
            self.cache = {("key",): "config"}

    mine, other = Kernel(), Kernel()
    saved = dict(tune._chosen)
    try:
        tune._chosen[(mine, ("a",))] = tune._chosen[(mine, ("b",))] = tune._chosen[(other, ("a",))] = object()
        tune.forget(mine)
        assert mine.cache == {} and other.cache
        assert not any(k[0] is mine for k in tune._chosen) and (other, ("a",)) in tune._chosen
    finally:
        tune._chosen.clear()
        tune._chosen.update(saved)
