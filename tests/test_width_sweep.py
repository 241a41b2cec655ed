"""benchmarks/width_sweep.py's table and plots from a sweep JSON (the sweep itself needs a GPU)."""

import importlib.util
import json
from pathlib import Path

SWEEP = Path(__file__).resolve().parents[1] / "benchmarks" / "width_sweep.py"


def _module():
    spec = importlib.util.spec_from_file_location("width_sweep", SWEEP)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sweep(tmp_path):
    rows = [{"op": "softmax", "dtype": "bfloat16", "N": n, "M": 64 // n, "mode": mode, "impl": impl, "gbps": g,
             "pct_copy": g / 30}
            for n in (4, 16) for mode in ("fwd", "bwd")
            for impl, g in (("kernelkit", 2000.0), ("quack", 2500.0), ("eager", 1000.0))]
    rows.append({"op": "softmax", "dtype": "bfloat16", "N": 32, "M": 2, "error": "boom"})
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"rows": rows, "copy_gbps": 3000.0, "env": {"gpu": "H100"},
                                "config": {"elements": 64}}))
    return path


def test_table_has_the_ratio_to_quack_and_the_best_other(tmp_path):
    table = _module()._table([str(_sweep(tmp_path))])
    lines = table.splitlines()
    assert len(lines) == 2 + 4  # header, rule, 2 widths x 2 modes; the failed width has no row
    assert "| softmax | bfloat16 | fwd | 4 | 2000 | 67% | 2500 | **0.80** | eager 1000 |" in lines


def test_plot_writes_one_figure_per_op_and_dtype(tmp_path):
    written = _module()._plot(str(_sweep(tmp_path)), str(tmp_path / "img"))
    assert [p.name for p in written] == ["width-softmax-bfloat16.png"] and written[0].stat().st_size > 1000
