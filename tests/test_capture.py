"""kernelkit under CUDA graph capture (issue 32 item 2): every public op captures into a `torch.cuda.CUDAGraph`,
forward and backward, and replays new input values to eager's results; a patched model's training step runs under
torch.compile(mode="reduce-overhead"). Nothing in a launch may synchronize with the host, allocate differently
between replays, or tune: a first launch that would time configs raises RuntimeError under capture (run the op
once eagerly first), while a config known already (tuned, cached, or untuned: KERNELKIT_TUNE=first, the
interpreter, a single config) launches as usual.

The capture-detection tests run on the CPU (the interpreter, `torch.cuda.is_current_stream_capturing` replaced);
the captures themselves are `gpu`-marked."""

from __future__ import annotations

import copy

import pytest
import torch
import triton
import triton.language as tl

from kernelkit import runtime
from kernelkit.ops import registry
from kernelkit.runtime import cache, launch


@triton.jit
def _double_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(Y + offs, tl.load(X + offs, mask=mask) * 2.0, mask=mask)


def _tuned_double():
    """A kernel with two configs that Triton's autotuner times on its first launch per n (kernelkit's `autotune`
    would keep one config under the interpreter or KERNELKIT_TUNE=first)."""
    return triton.autotune([triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 128})], key=["n"])(_double_kernel)


def _double(kernel, x, y):
    n = x.numel()
    launch(kernel, lambda meta: (triton.cdiv(n, meta["BLOCK"]),), (n, x.dtype), x, y, n)


@pytest.fixture
def capturing(monkeypatch):
    """Pretend the current stream is being captured (what torch.cuda.graph and cudagraph trees set)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


def _interpreter():
    if not runtime.kernels_interpreted():
        pytest.skip("the CPU capture-detection tests run kernels in the interpreter (TRITON_INTERPRET=1)")


# --- CPU: the capture-detection rule ---

def test_packed_attention_under_capture_needs_max_seqlen(capturing):
    """Without max_seqlen the longest sequence would be read from cu_seqlens on the host: refused under capture,
    naming the argument, before anything reads them; with it the call goes on (here: to the interpreter)."""
    import kernelkit

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU machine the CPU tensors would be refused first
    q = k = v = torch.randn(10, 2, 16, dtype=torch.bfloat16, device=dev)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match="max_seqlen is needed with cu_seqlens inside a CUDA graph capture"):
        kernelkit.attention(q, k, v, cu_seqlens=cu)


def test_not_capturing_outside_a_capture():
    assert runtime.capturing() is False  # also on a CPU-only torch build, whose query raises


def test_a_tuning_launch_under_capture_raises_before_launching(capturing):
    _interpreter()
    kernel = _tuned_double()
    x, y = torch.randn(100), torch.full((100,), float("nan"))
    with pytest.raises(RuntimeError, match="before capturing"):
        _double(kernel, x, y)
    assert y.isnan().all()  # nothing ran, nothing was timed
    assert not kernel.cache


def test_a_known_config_launches_under_capture(capturing):
    """A config the autotuner chose before (here: set as if tuned) is what the capture launches, untimed."""
    _interpreter()
    kernel = _tuned_double()
    x, y = torch.randn(100), torch.full((100,), float("nan"))
    kernel.cache[cache.tuning_key(kernel, (x, y, 100), {})] = kernel.configs[1]
    _double(kernel, x, y)
    assert torch.equal(y, 2 * x)
    entry = runtime._chosen[(kernel, (100, x.dtype))]
    assert entry.cfg is kernel.configs[1]


def test_an_untuned_kernel_launches_under_capture(capturing):
    """kernelkit's `autotune` under the interpreter (as with KERNELKIT_TUNE=first) times nothing: no error."""
    _interpreter()
    kernel = runtime.autotune([triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 128})], key=["n"])(
        _double_kernel)
    x, y = torch.randn(70), torch.empty(70)
    _double(kernel, x, y)
    assert torch.equal(y, 2 * x)


# --- GPU: every op captured, replayed with new values, against eager ---

# (op, make_inputs shape): each op's forward, and its backward where it has one (grad_args), at a shape with
# masked tails; two for ops whose modes differ in what they read (packed attention, rope's position table,
# scaled_matmul's recipes).
CASES = [
    ("rms_norm", (37, 1000)), ("add_rms_norm", (37, 1000)), ("layer_norm", (37, 1000)),
    ("softmax", (37, 1000)), ("log_softmax", (37, 1000)), ("swiglu", (37, 1000)), ("geglu", (37, 1000)),
    ("rope", (2, 37, 5, 3, 64)), ("rope", (2, 37, 5, 3, 64, "positions")),
    ("cross_entropy", (37, 1000)), ("linear_cross_entropy", (37, 24, 257)), ("linear", (37, 64, 100)),
    ("attention", (2, 37, 2, 32, True)), ("attention", ((5, 19, 13), 2, 64, True)),
    ("scaled_matmul", (37, 200, 45, "rowwise")), ("scaled_matmul", (37, 256, 45, "blockwise")),
    ("mxfp8_quantize", (37, 96)),
    ("moe", (37, 24, 20, 4, 2)), ("moe_fp8", (37, 24, 20, 4, 2)), ("moe_mxfp8", (37, 64, 32, 4, 2)),
]
# Backwards that need not be bitwise equal run to run compare within a tight tolerance instead: attention's dq
# sums with fp32 atomics; linear_cross_entropy's runs cuBLAS (torch.mm, addmm), whose algorithm may differ under
# capture. Every other op, MoE included (no atomics anywhere), must replay eager's bits.
TOLERANT_BACKWARD = {"attention", "linear_cross_entropy"}


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


def _step(spec, args, kwargs, grad_outputs=None):
    """One call and, where the op has a backward, torch.autograd.grad of its differentiable outputs: returns
    (outputs, grads, differentiable outputs)."""
    outs = _tensors(spec.fn(*args, **kwargs))
    diff = [o for o in outs if o.requires_grad]
    inputs = [args[i] for i in spec.grad_args]
    grads = []
    if inputs and diff:
        if grad_outputs is None:
            grad_outputs = [torch.randn_like(o) for o in diff]
        grads = [g for g in torch.autograd.grad(diff, inputs, grad_outputs, allow_unused=True) if g is not None]
    return outs, grads, grad_outputs


def _leaves(spec, args):
    return [a.detach().clone().requires_grad_(i in spec.grad_args) if isinstance(a, torch.Tensor) else a
            for i, a in enumerate(args)]


def _assert_same(got, want, what, exact):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what}[{i}]"
        if exact:
            assert torch.equal(g, w), f"{what}[{i}]: max |diff| {(g.double() - w.double()).abs().max():.3g}"
        else:
            err = (g.double() - w.double()).abs().max()
            assert err <= 1e-2 * w.double().abs().max() + 1e-6, f"{what}[{i}]: max |diff| {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("name,shape", CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_op_captures_and_replays_new_values(name, shape):
    spec = registry.get(name)
    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda")
    args, kwargs = spec.make_inputs(shape, dtype, "cuda", gen.manual_seed(1))
    new_args, new_kwargs = spec.make_inputs(shape, dtype, "cuda", gen.manual_seed(2))
    static = _leaves(spec, args)

    # Warm-up on a side stream, as torch.cuda.graph asks: autotuning and compiling happen here.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _, _, gouts = _step(spec, static, kwargs)
        _step(spec, static, kwargs, gouts)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs, grads, _ = _step(spec, static, kwargs, gouts)

    # New values into the static inputs (tensor keywords too: rope's positions, cu_seqlens), then replay.
    gouts = gouts or []
    new_gouts = [torch.randn_like(g) for g in gouts]
    with torch.no_grad():
        for s, n in zip([*static, *kwargs.values(), *gouts], [*new_args, *new_kwargs.values(), *new_gouts]):
            if isinstance(s, torch.Tensor):
                s.copy_(n)
    graph.replay()
    torch.cuda.synchronize()

    want_outs, want_grads, _ = _step(spec, _leaves(spec, new_args), new_kwargs, new_gouts)
    _assert_same(outs, want_outs, f"{name} outputs", exact=True)
    _assert_same(grads, want_grads, f"{name} grads", exact=name not in TOLERANT_BACKWARD)
    assert spec.grad_args == () or grads, f"{name} has grad_args but its capture computed no gradient"

    # A second replay of the same values gives the same results (no state carried between replays).
    first = [t.clone() for t in outs + grads]
    graph.replay()
    _assert_same(outs + grads, first, f"{name} replayed twice", exact=name not in TOLERANT_BACKWARD)


@pytest.mark.gpu
def test_first_launch_at_a_new_shape_raises_under_capture_then_captures_after_warmup(monkeypatch):
    """The rule: tuning inside a capture is refused with the fix in the message; after one eager call at the
    shape the capture launches the tuned config."""
    monkeypatch.setenv("KERNELKIT_TUNE_CACHE", "0")  # no config from an earlier process
    kernel = _tuned_double()
    x, y = torch.randn(1000, device="cuda"), torch.empty(1000, device="cuda")
    with pytest.raises(RuntimeError, match="before capturing"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            _double(kernel, x, y)
    _double(kernel, x, y)  # eager: tunes
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _double(kernel, x, y)
    x.copy_(torch.randn(1000, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, 2 * x)


@pytest.mark.gpu
def test_a_tensor_eps_under_capture_names_the_fix():
    """A 0-dim CUDA tensor for a scalar option would be read with .item(): refused under capture, before any sync."""
    x, w = torch.randn(4, 64, device="cuda"), torch.ones(64, device="cuda")
    eps = torch.tensor(1e-6, device="cuda")  # made before the capture: making it inside is a host-to-device copy
    registry.get("rms_norm").fn(x, w, 1e-6)  # warm: the refusal is not about tuning
    with pytest.raises(RuntimeError, match="pass a Python number"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            registry.get("rms_norm").fn(x, w, eps)


# --- GPU: a patched Hugging Face model's training step under torch.compile(mode="reduce-overhead") ---

@pytest.mark.gpu
def test_patched_model_training_steps_under_reduce_overhead():
    pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    from kernelkit.patch import patch
    from tests.test_patch import batch, close, tiny_model

    eager = tiny_model("mistral", device="cuda", dtype=torch.bfloat16, layers=1).train()
    compiled = copy.deepcopy(eager)
    patch(eager)
    report = patch(compiled)
    torch._dynamo.reset()
    counters.clear()
    run = torch.compile(compiled, mode="reduce-overhead")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled)]
    for step in range(3):  # warm-up, record, replay
        ids, labels = (t.cuda() for t in batch(seed=10 + step))
        results = []
        for model, fn, opt in zip((eager, compiled), (eager, run), opts):
            torch.compiler.cudagraph_mark_step_begin()
            opt.zero_grad(set_to_none=True)
            loss = fn(ids, labels=labels).loss
            loss.backward()
            results.append((loss.detach().clone(), [p.grad.clone() for p in model.parameters()]))
            opt.step()
        (want, want_grads), (got, got_grads) = results
        close(got, want, rtol=2e-2, what=f"step {step} loss")
        for i, (g, w) in enumerate(zip(got_grads, want_grads)):
            close(g, w, rtol=5e-2, what=f"step {step} grad {i}")
    assert counters["inductor"]["cudagraph_skips"] == 0, "cudagraphs were skipped: see TORCH_LOGS=perf_hints"
    assert report.fallback_count() == 0, report.fallbacks
