"""Version floors: declared in pyproject.toml, checked at import by kernelkit._requirements."""

import re
import sys
from pathlib import Path

import pytest
import torch
import triton

from kernelkit import _requirements as req


@pytest.fixture(params=["packaging", "fallback parser"])
def parser(request, monkeypatch):
    if request.param == "fallback parser":  # as if packaging were not installed
        monkeypatch.setitem(sys.modules, "packaging", None)
        monkeypatch.setitem(sys.modules, "packaging.version", None)
    return request.param


def _versions(monkeypatch, torch_v, triton_v):
    monkeypatch.setattr(torch, "__version__", torch_v)
    monkeypatch.setattr(triton, "__version__", triton_v)


@pytest.mark.parametrize("torch_v, triton_v", [
    ("2.11.0", "3.6.0"),
    ("2.11.0+cu130", "3.6.0"),
    ("2.13.0+cpu", "3.6.0"),
    ("2.11.0.dev20260101+cu130", "3.6.0+git1a2b3c4"),
    ("2.11.0a0+git1a2b3c4", "3.6.0rc1"),
    ("2.11", "3.6"),
    ("3.0.0", "4.0.0"),
    ("not a version", "3.6.0"),  # cannot be proven old: let through
])
def test_supported_versions_pass(parser, monkeypatch, torch_v, triton_v):
    _versions(monkeypatch, torch_v, triton_v)
    req.check_versions()


@pytest.mark.parametrize("torch_v, triton_v, named", [
    ("2.4.0", "3.6.0", ["torch>=2.11 (found 2.4.0)"]),
    ("2.10.1+cu128", "3.6.0", ["torch>=2.11 (found 2.10.1+cu128)"]),
    ("2.11.0", "3.0.0", ["triton>=3.6 (found 3.0.0)"]),
    ("2.11.0", "3.5.1", ["triton>=3.6 (found 3.5.1)"]),
    ("2.9.0.dev20250101", "3.4.0", ["torch>=2.11 (found 2.9.0.dev20250101)", "triton>=3.6 (found 3.4.0)"]),
])
def test_old_versions_raise_naming_required_and_found(parser, monkeypatch, torch_v, triton_v, named):
    _versions(monkeypatch, torch_v, triton_v)
    with pytest.raises(ImportError) as e:
        req.check_versions()
    for n in named:
        assert n in str(e.value)
    assert "pip install -U" in str(e.value)


def test_installed_stack_passes():
    req.check_versions()


def test_pyproject_declares_the_same_floors():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    deps = pyproject["project"]["dependencies"]
    floors = {m.group(1): m.group(2) for d in deps if (m := re.fullmatch(r"(torch|triton)>=([\d.]+)", d))}
    assert floors == {"torch": req.TORCH_MIN, "triton": req.TRITON_MIN}
