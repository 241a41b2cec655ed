"""quack (CuTe DSL) appears as a competitor row of `kernelkit bench` where it imports: the loaders adapt kernelkit's
signatures to quack's, checked here against stand-in modules (quack needs a GPU and its CUTLASS DSL)."""

import sys
import types

import pytest
import torch

from kernelkit.ops import registry


@pytest.fixture
def fake_quack(monkeypatch):
    calls = {}

    def module(name, attr, fn):
        mod = types.ModuleType(name)
        setattr(mod, attr, fn)
        monkeypatch.setitem(sys.modules, name, mod)

    monkeypatch.setitem(sys.modules, "quack", types.ModuleType("quack"))
    module("quack.rmsnorm", "rmsnorm", lambda x, w, eps, weight_offset: calls.setdefault("rms", (x, w, eps, weight_offset)))
    module("quack.softmax", "softmax", lambda x: calls.setdefault("softmax", x) * 0 + 1)
    module("quack.cross_entropy", "cross_entropy",
           lambda x, t, ignore_index, reduction: calls.setdefault("ce", (ignore_index, reduction)))
    return calls


def test_quack_rows_where_it_imports(fake_quack):
    x, w = torch.randn(3, 8), torch.randn(8)
    registry.get("rms_norm").competitors["quack"]()(x, w, 1e-5, 1.0)
    assert fake_quack["rms"][2:] == (1e-5, 1.0)
    y = registry.get("softmax").competitors["quack"]()(torch.randn(2, 3, 8), scale=0.5)
    assert y.shape == (2, 3, 8) and fake_quack["softmax"].shape == (6, 8)  # rows of a 2-D input
    ce = registry.get("cross_entropy").competitors["quack"]()
    ce(x, torch.zeros(3, dtype=torch.long), ignore_index=-1, reduction="sum")
    assert fake_quack["ce"] == (-1, "sum")
    with pytest.raises(NotImplementedError, match="label smoothing"):
        ce(x, torch.zeros(3, dtype=torch.long), label_smoothing=0.1)


def test_no_quack_no_row(monkeypatch):
    monkeypatch.setitem(sys.modules, "quack.softmax", None)  # import fails
    assert registry.get("softmax").competitors["quack"]() is None
