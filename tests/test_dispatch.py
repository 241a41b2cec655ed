"""The one way in, for every registered op: double backward, meta tensors, the public API, and the
errors torch habits used to get silent nonsense for."""

import re
from pathlib import Path

import pytest
import torch

import kernelkit
from kernelkit.ops import registry
from kernelkit.testing.correctness import to_reference
from kernelkit.testing.layouts import layout_shape

GRAD_OPS = sorted(n for n, s in registry.all_ops().items() if s.grad_args)


def _flat(out):
    return [out] if isinstance(out, torch.Tensor) else [o for o in out if isinstance(o, torch.Tensor)]


def _penalty(fn, args, kwargs, grad_args, gen_seed):
    """A gradient-penalty loss: sum of squared first-order gradients, built with create_graph=True. The
    loss is quadratic in the outputs, so that even a linear op (RoPE) has gradients that depend on its
    inputs, through the incoming gradient."""
    outs = [o for o in _flat(fn(*args, **kwargs)) if o.requires_grad]
    gen = torch.Generator().manual_seed(gen_seed)
    s = sum((o.double() ** 2 * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)).sum() for o in outs)
    grads = torch.autograd.grad(s, [args[i] for i in grad_args], create_graph=True, allow_unused=True)
    return sum((g.double() ** 2).sum() for g in grads if g is not None)


@pytest.mark.parametrize("name", GRAD_OPS)
def test_double_backward_is_right_or_refused(name, device):
    # create_graph=True used to return first-order gradients with no graph: a gradient-penalty loss then
    # trained on the first-order term alone. Now each op computes the second-order term or raises.
    spec = registry.get(name)
    dtype = torch.float32 if "float32" in spec.dtypes else torch.bfloat16
    args, kwargs = spec.make_inputs(layout_shape(spec), dtype, device, torch.Generator(device=device).manual_seed(0))
    args = [a.detach().requires_grad_(i in spec.grad_args) if isinstance(a, torch.Tensor) and a.is_floating_point()
            else a for i, a in enumerate(args)]
    ref_args = [to_reference(a) for a in args]
    try:
        got = torch.autograd.grad(_penalty(spec.fn, args, kwargs, spec.grad_args, 1),
                                  [args[i] for i in spec.grad_args], allow_unused=True)
    except RuntimeError as e:
        assert re.search(r"kernelkit\.\S+ has no double backward", str(e)), e
        return
    want = torch.autograd.grad(_penalty(spec.reference, ref_args, kwargs, spec.grad_args, 1),
                               [ref_args[i] for i in spec.grad_args], allow_unused=True)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for i, g, w in zip(spec.grad_args, got, want):
        if w is None or not w.abs().sum():
            continue
        assert g is not None, f"{name}: second-order gradient of args[{i}] dropped"
        err = ((g.double().cpu() - w.cpu()).norm() / w.norm()).item()
        assert err < tol, f"{name}: second-order gradient of args[{i}] off by {err:.3g}"


@pytest.mark.parametrize("name", sorted(registry.all_ops()))
def test_meta_inputs_give_meta_outputs(name):
    # Like torch ops: meta tensors in eager mode produce meta outputs of the right shapes and dtypes.
    spec = registry.get(name)
    dtype = torch.float32 if "float32" in spec.dtypes else torch.bfloat16
    args, kwargs = spec.make_inputs(layout_shape(spec), dtype, "cpu", torch.Generator().manual_seed(0))
    want = _flat(spec.reference(*args, **kwargs))
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    kw = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    got = _flat(spec.fn(*meta, **kw))
    assert [g.device.type for g in got] == ["meta"] * len(got)
    assert [(tuple(g.shape), g.dtype) for g in got] == [(tuple(w.shape), w.dtype) for w in want]


def test_every_name_in_the_readme_api_table_is_importable():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    table = readme[readme.index("| registry op | call (essentials) |"):]
    table = table[:table.index("\n\n")]
    names = []
    for row in table.splitlines()[2:]:
        call = row.split("|")[2]
        names += re.findall(r"(?:^|[\s`=])([a-z_][a-z0-9_]*)\(", call) + re.findall(r"`(nn\.[A-Za-z]+)`", call)
    assert len(names) >= 10
    for name in names:
        obj = kernelkit
        for part in name.split("."):
            assert hasattr(obj, part), f"kernelkit.{name} is in the README's ops table but not importable"
            obj = getattr(obj, part)


def test_torch_habits_are_errors_or_torch_semantics(device):
    x = torch.randn(4, 6, device=device)
    torch.testing.assert_close(kernelkit.softmax(x, 0), torch.softmax(x, 0))
    torch.testing.assert_close(kernelkit.log_softmax(x, 0), torch.log_softmax(x, 0))
    torch.testing.assert_close(kernelkit.softmax(x, -1), torch.softmax(x, -1))
    with pytest.raises(TypeError, match="dim must be an int"):
        kernelkit.softmax(x, 0.5)
    with pytest.raises(TypeError, match="no normalized_shape"):
        kernelkit.layer_norm(x, (6,), torch.ones(6, device=device))
    with pytest.raises(TypeError, match="eps must be a number"):
        kernelkit.rms_norm(x, torch.ones(6, device=device), eps=None)
    with pytest.raises(ValueError, match=r"RMSNorm\(\(64,\)\) got an input of shape \(4, 48\)"):
        kernelkit.nn.RMSNorm(64)(torch.randn(4, 48, device=device))
    with pytest.raises(ValueError, match=r"LayerNorm\(\(64,\)\) got an input of shape \(4, 48\)"):
        kernelkit.nn.LayerNorm(64)(torch.randn(4, 48, device=device))


@pytest.mark.parametrize("module", ["RMSNorm", "LayerNorm"])
def test_modules_run_the_kernel(module, device, monkeypatch):
    # The modules fall back to torch on a CPU tensor outside the interpreter; here they must not.
    from kernelkit.ops import layer_norm as ln
    from kernelkit.ops import rms_norm as rn

    mod = rn if module == "RMSNorm" else ln
    calls = []
    real = mod.launch  # the op's launchers look it up at each call (the op holds the launchers themselves)
    monkeypatch.setattr(mod, "launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    m = getattr(kernelkit.nn, module)((3, 5)).to(device)
    with torch.no_grad():
        m.weight.normal_()
    x = torch.randn(2, 3, 5, device=device)
    y = m(x)
    assert calls, f"nn.{module} did not run kernelkit's kernel"
    want = getattr(torch.nn, module)((3, 5)).to(device)
    want.load_state_dict(m.state_dict())
    torch.testing.assert_close(y, want(x), rtol=1e-5, atol=1e-5)
