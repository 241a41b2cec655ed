"""`kernelkit ladder`: every rung checked, then timed side by side with cuBLAS, then profiled.

For each rung, in order: build it (compile; rungs with a sweep time their configs here and keep the fastest),
run it once on NaN-poisoned output and compare with the float64 product of the same inputs (a wrong rung is
reported wrong and not timed), then time it: `triton.testing.do_bench`'s median, L2 flushed before every run.
cuBLAS is `torch.mm` on the same tensors: fp32 with TF32 off for sgemm (true fp32 FMAs, like the rungs),
bf16 for hgemm. Rows: rung, what changed, ms, TFLOP/s, % of cuBLAS, x the previous rung, and the profiler
signature (`signature.py`) unless --no-ncu. Results go to a rich table, and optionally JSON and a bar chart.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

from ..testing.bench import env_fingerprint, time_ms
from . import KINDS, Launch, Rung, rungs
from .signature import describe, find_ncu, profile

# Normwise relative error ||C - C64|| / ||C64|| a correct rung stays under. fp32: summation-order differences
# over K = 4096 give ~1e-6; TF32 (a 10-bit mantissa) would give ~3e-4 and fail. bf16: the output's rounding
# alone is ~3e-3.
TOLERANCE = {"sgemm": 5e-5, "hgemm": 1e-2}
DTYPES = {"sgemm": "float32", "hgemm": "bfloat16"}


@dataclass
class Row:
    rung: str
    what_changed: str
    status: str = "ok"  # ok, wrong, skipped (the shape does not fit), failed (build or launch raised)
    detail: str = ""
    ms: Optional[float] = None
    tflops: Optional[float] = None
    pct_of_cublas: Optional[float] = None
    x_previous: Optional[float] = None
    rel_error: Optional[float] = None
    params: dict = field(default_factory=dict)
    expect: str = ""
    signature: Union[dict, str, None] = None


def cublas_rung(kind: str) -> Rung:
    import torch

    what = ("cuBLAS via torch.mm, fp32 with TF32 off" if kind == "sgemm" else "cuBLAS via torch.mm, bf16")
    return Rung("cublas", what, "the target: compare every signature with this one", "(cuBLAS)",
                build=lambda a, b, c, params=None: Launch(lambda: torch.mm(a, b, out=c)))


@contextlib.contextmanager
def true_fp32():
    """TF32 off for fp32 matmuls (cuBLAS would otherwise be allowed tensor cores at reduced precision)."""
    import torch

    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def make_inputs(kind: str, m: int, n: int, k: int, device="cuda", seed: int = 0):
    """A (M, K) and B (K, N): standard normal, in the ladder's dtype."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    dtype = getattr(torch, DTYPES[kind])
    a = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=gen).to(device=device, dtype=dtype)
    return a, b


def rel_error(c, ref) -> float:
    import torch

    if not torch.isfinite(c).all():
        return float("inf")  # NaN left from the poison: outputs never written
    return ((c.double() - ref).norm() / ref.norm()).item()


def select(kind: str, names: Optional[list[str]]) -> list[Rung]:
    ladder = rungs(kind)
    if not names:
        return ladder
    known = {r.name: r for r in ladder}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise KeyError(f"unknown {kind} rung(s) {', '.join(unknown)}; rungs: {', '.join(known)}")
    return [known[n] for n in names]


def run_ladder(kind: str, shape: tuple[int, int, int], names: Optional[list[str]] = None, ncu: bool = True,
               log: Callable[[str], None] = print) -> list[Row]:
    """Check, time and (with ncu) profile the chosen rungs of `kind` at shape (M, N, K), and cuBLAS (last row)."""
    import torch

    m, n, k = shape
    flops = 2.0 * m * n * k
    chosen = select(kind, names)
    a, b = make_inputs(kind, m, n, k)
    c = torch.empty(m, n, device="cuda", dtype=a.dtype)
    rows: list[Row] = []
    with true_fp32() if kind == "sgemm" else contextlib.nullcontext():
        ref = torch.mm(a.double(), b.double())
        cublas = cublas_rung(kind)
        for i, rung in enumerate([*chosen, cublas]):
            row = Row(rung.name, rung.what_changed, expect=rung.expect)
            rows.append(row)
            if problem := rung.needs(m, n, k):
                row.status, row.detail = "skipped", problem
                log(f"[{i + 1}/{len(chosen) + 1}] {rung.name}: skipped ({problem})")
                continue
            try:
                launch = rung.build(a, b, c)
                row.params = launch.params
                c.fill_(float("nan"))
                launch.run()
                torch.cuda.synchronize()
                row.rel_error = rel_error(c, ref)
                if not row.rel_error <= TOLERANCE[kind]:
                    row.status = "wrong"
                    row.detail = f"relative error {row.rel_error:.2e} > {TOLERANCE[kind]:.0e}: not timed"
                else:
                    row.ms = time_ms(launch.run)
                    row.tflops = flops / (row.ms * 1e-3) / 1e12
            except Exception as e:  # noqa: BLE001 - a rung that fails to compile or launch gets a row saying so
                row.status, row.detail = "failed", f"{type(e).__name__}: {e}"[:300]
            log(f"[{i + 1}/{len(chosen) + 1}] {rung.name}: " + (
                f"{row.ms:.3f} ms, {row.tflops:.1f} TFLOP/s (error {row.rel_error:.1e})" if row.ms
                else f"{row.status}: {row.detail}"))
    base = rows[-1].ms
    previous = None
    for row in rows[:-1]:
        if row.ms:
            row.pct_of_cublas = 100.0 * base / row.ms if base else None
            row.x_previous = previous / row.ms if previous else None
            previous = row.ms
    if base:
        rows[-1].pct_of_cublas = 100.0
    if ncu:
        shared_reason = None  # a reason that holds for every rung (no ncu, no counters): said once
        for row in (r for r in rows if r.ms is not None):
            if shared_reason:
                row.signature = shared_reason
                continue
            if find_ncu() is not None:
                log(f"profiling {row.rung} under ncu")
            row.signature = profile(kind, row.rung, shape, row.params)
            if isinstance(row.signature, str):
                log(f"  no signature: {row.signature}")
                if find_ncu() is None or "ERR_NVGPUCTRPERM" in row.signature:
                    shared_reason = row.signature
    return rows


def _fmt(v, spec: str, suffix: str = "") -> str:
    return "" if v is None else format(v, spec) + suffix


def print_rows(rows: list[Row], kind: str, shape, gpu: str, console) -> None:
    from rich.table import Table

    m, n, k = shape
    table = Table(title=f"{kind} ladder, {DTYPES[kind]}, M={m} N={n} K={k}, on {gpu}")
    for col in ("#", "rung", "what changed", "ms", "TFLOP/s", "% of cuBLAS", "x previous", "check"):
        table.add_column(col, justify="left" if col in ("rung", "what changed", "check") else "right",
                         overflow="fold")
    for i, r in enumerate(rows):
        check = f"ok ({r.rel_error:.1e})" if r.status == "ok" else f"[red]{r.status}[/]: {r.detail}"
        table.add_row("" if r.rung == "cublas" else str(i + 1), r.rung, r.what_changed, _fmt(r.ms, ".3f"),
                      _fmt(r.tflops, ".1f"), _fmt(r.pct_of_cublas, ".1f", "%"), _fmt(r.x_previous, ".2f", "x"),
                      check, style="bold" if r.rung == "cublas" else None)
    console.print(table)
    if any(r.signature is not None for r in rows):
        sig = Table(title="profiler signatures (ncu --clock-control none)")
        for col in ("rung", "should show", "measured"):
            sig.add_column(col, overflow="fold")
        for r in rows:
            if r.signature is not None:
                sig.add_row(r.rung, r.expect, describe(r.signature, kind))
        console.print(sig)


def write_json(rows: list[Row], path: Path, kind: str, shape) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"kind": kind, "dtype": DTYPES[kind], "shape": list(shape), "env": env_fingerprint(),
           "tolerance": TOLERANCE[kind], "rows": [asdict(r) for r in rows]}
    path.write_text(json.dumps(doc, indent=1, default=str))
    return path


def plot(rows: list[Row], path: Path, kind: str, shape, gpu: str) -> Path:
    """Horizontal bars of TFLOP/s per rung, labelled with % of cuBLAS; cuBLAS as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ladder = [r for r in rows if r.rung != "cublas"]
    cublas = rows[-1].tflops
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(ladder) + 1.6))
    ys = list(range(len(ladder)))[::-1]
    ax.barh(ys, [r.tflops or 0 for r in ladder], color=["C0" if r.status == "ok" else "C3" for r in ladder])
    for y, r in zip(ys, ladder):
        label = (f" {r.pct_of_cublas:.0f}% of cuBLAS" if r.pct_of_cublas else
                 f" {r.tflops:.1f} TFLOP/s" if r.tflops else f" {r.status}")
        ax.text(r.tflops or 0, y, label, va="center", fontsize=8)
    if cublas:
        ax.axvline(cublas, color="k", ls="--", lw=1, label=f"cuBLAS {cublas:.1f} TFLOP/s")
        ax.legend(fontsize=8, loc="lower right")
    ax.set_yticks(ys)
    ax.set_yticklabels([r.rung for r in ladder])
    ax.set_xlabel("TFLOP/s")
    m, n, k = shape
    ax.set_title(f"{kind} ladder ({DTYPES[kind]}, {m}x{n}x{k}) on {gpu}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def print_list(kinds, console) -> None:
    """The rungs of each ladder and what each changes (no GPU needed)."""
    from rich.table import Table

    for kind in kinds:
        table = Table(title=f"{kind} ladder ({DTYPES[kind]})")
        for col in ("#", "rung", "what changed", "the profiler should show"):
            table.add_column(col, overflow="fold")
        for i, r in enumerate(rungs(kind)):
            table.add_row(str(i + 1), r.name, r.what_changed, r.expect)
        console.print(table)


def main(kind: Optional[str], size: int, json_out: Optional[Path], plot_out: Optional[Path], ncu: bool,
         names: Optional[str], list_only: bool, console) -> int:
    """The `kernelkit ladder` command; returns the exit status (0 ok, 1 a rung wrong or failed, 2 usage)."""
    if kind is not None and kind not in KINDS:
        console.print(f"[red]unknown ladder {kind!r}[/]: choose one of {', '.join(KINDS)}")
        return 2
    if list_only:
        print_list([kind] if kind else KINDS, console)
        return 0
    if kind is None:
        console.print(f"name a ladder: kernelkit ladder {{{'|'.join(KINDS)}}} (or --list)")
        return 2
    import torch

    if not torch.cuda.is_available():
        console.print("[red]kernelkit ladder needs a CUDA GPU[/]: timings mean nothing in the interpreter. "
                      "`kernelkit ladder --list` shows the rungs without one.", soft_wrap=True)
        return 2
    if size < 1:
        console.print(f"[red]--size must be positive[/], got {size}")
        return 2
    if kind == "sgemm":
        from .nvrtc import compiler

        front = compiler()
        if front not in ("cupy", "cuda-python"):
            console.print(f"[red]{front}[/]", soft_wrap=True)
            return 2
    chosen = [s.strip() for s in names.split(",") if s.strip()] if names else None
    try:
        select(kind, chosen)
    except KeyError as e:
        console.print(f"[red]{e.args[0]}[/]", soft_wrap=True)
        return 2
    shape = (size, size, size)
    gpu = torch.cuda.get_device_name()
    rows = run_ladder(kind, shape, chosen, ncu=ncu, log=lambda s: console.print(s, soft_wrap=True, highlight=False))
    print_rows(rows, kind, shape, gpu, console)
    if json_out:
        console.print(f"wrote {write_json(rows, json_out, kind, shape)}")
    if plot_out:
        console.print(f"wrote {plot(rows, plot_out, kind, shape, gpu)}")
    return 1 if any(r.status in ("wrong", "failed") for r in rows) else 0
