"""GroupedMode / GroupedTmaMode: the grouped kernels' constexpr modes as one record each, from which the autotune
key, the launch key and a launch's constexpr keywords are derived (CPU only, no kernel runs)."""
import dataclasses
import inspect

import pytest

from kernelkit.ops.gemm import grouped as G

# constexprs that are not modes: the tile config (autotuned) and the expert count's power of two (a size)
NOT_MODES = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "E_P2"}
SIZES = ["ROWS_BUCKET", "N", "K", "E"]


def _constexprs(kernel):
    fn = kernel.fn  # the autotuner's JITFunction
    sig = inspect.signature(fn.fn)
    return [p for p in fn.arg_names if "constexpr" in str(sig.parameters[p].annotation)]


@pytest.mark.parametrize("record, kernel", [(G.GroupedMode, G.moe_grouped_gemm_kernel),
                                            (G.GroupedTmaMode, G.moe_grouped_tma_kernel)])
def test_record_is_the_kernels_modes(record, kernel):
    names = [f.name for f in dataclasses.fields(record)]
    modes = [p for p in _constexprs(kernel) if p not in NOT_MODES]
    assert sorted(names) == sorted(modes)
    # the autotuner keys on the sizes and on the record's tuned fields, in the record's order
    assert list(kernel.keys) == SIZES + record.tuned_fields()
    assert set(record.tuned_fields()) <= set(names)


@pytest.mark.parametrize("record", [G.GroupedMode, G.GroupedTmaMode])
def test_keys_and_constexprs_derive_from_every_field(record):
    base = record()
    flipped = {}
    for f in dataclasses.fields(record):
        # a value other than the default for each field: the launch key and the keywords must both change
        other = {bool: lambda v: not v, str: lambda v: v + "x"}.get(type(f.default), lambda v: "ieee")(f.default)
        m = dataclasses.replace(base, **{f.name: other})
        assert m.constexprs[f.name] == other and base.constexprs[f.name] == f.default
        assert m.key != base.key, f.name
        flipped[f.name] = other
    assert list(base.constexprs) == [f.name for f in dataclasses.fields(record)]
    assert len(base.key) == len(dataclasses.fields(record))
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.EPILOGUE = "swiglu"


def test_launch_passes_the_records_keywords(monkeypatch):
    """grouped_gemm's launch: the keywords are the record's constexprs, the launch key ends in the record's key."""
    import torch
    seen = []
    monkeypatch.setattr(G, "launch", lambda kernel, grid, key, *args, **kw: seen.append((kernel, key, kw)))
    e, k, n = 3, 32, 16
    a = torch.randn(10, k)
    w = torch.randn(e, n, k).transpose(1, 2)
    c = torch.empty(10, n)
    offs = torch.tensor([0, 4, 4, 10], dtype=torch.int32)
    G.grouped_gemm(a, w, c, offs, n, scale=torch.rand(10))
    (kernel, key, kw), = seen
    record = G.GroupedTmaMode if kernel is G.moe_grouped_tma_kernel else G.GroupedMode
    names = [f.name for f in dataclasses.fields(record)]
    mode = record(**{k: kw[k] for k in names})
    assert mode.HAS_SCALE and key[-len(names):] == mode.key
    assert set(kw) == set(names) | {"E_P2"}


def test_gemm_switches_read_in_one_place():
    """The engine's and the GEMM ops' KERNELKIT_* switches go through kernelkit.switches (no os.environ), and
    KERNELKIT_GEMM_TMA is read once (gemm/tiles.py) for linear and the grouped kernels."""
    import re
    from pathlib import Path

    import kernelkit.ops as ops
    from kernelkit.ops import linear
    from kernelkit.ops.gemm import tiles
    root = Path(ops.__file__).parent
    files = [*(root / "linear").glob("*.py"), root / "scaled_matmul.py", root / "mxfp8.py",
             *(root / "gemm").glob("*.py"), *(root / "moe").glob("*.py")]
    for f in files:
        assert not re.search(r"environ\S*\(?\s*[\"']KERNELKIT_", f.read_text()), f"{f.name} reads os.environ"
    readers = [f.name for f in files if "KERNELKIT_GEMM_TMA\")" in f.read_text()]
    assert readers == ["tiles.py"]
    assert G.GEMM_TMA is tiles.GEMM_TMA and linear.GEMM_TMA is tiles.GEMM_TMA
