"""`kernelkit bench model`: a Hugging Face causal LM's training step per variant, on one GPU (each variant in a
process of its own, `testing.model_bench`) or under torchrun on N GPUs with FSDP2 (`testing.fsdp_bench`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

SINGLE_GPU_DEFAULT = "eager,torch.compile,liger,kernelkit,kernelkit+compile"


def bench_model(console: Console, *, example: str, config: Optional[Path], layers: Optional[int], batch: int,
                seq: int, steps: int, precision: str, nproc: int, variants: str, out: Path,
                kernel_time: bool) -> None:
    import torch

    from ..testing.model_bench import VARIANTS, fp8_variants, print_rows, run_model_bench

    if not torch.cuda.is_available():
        console.print("[red]kernelkit bench model needs a CUDA GPU[/].")
        raise typer.Exit(2)
    if nproc > 1:
        _nproc(console, nproc, layers, batch, seq, steps, variants, out)
        return
    chosen = tuple(v.strip() for v in variants.split(",") if v.strip())
    if precision not in ("bf16", "fp8"):
        console.print(f"[red]--precision {precision!r}[/]: one of 'bf16', 'fp8'")
        raise typer.Exit(2)
    if precision == "fp8":
        chosen = fp8_variants(chosen)
    bad = [v for v in chosen if v not in VARIANTS]
    if bad:
        console.print(f"[red]unknown variant(s) {bad}[/]; known: {', '.join(VARIANTS)}")
        raise typer.Exit(2)
    with console.status("") as status:
        rows = run_model_bench(example, str(config) if config else None, layers or None, batch, seq,
                               steps=steps, variants=chosen, out=out, kernels=kernel_time,
                               progress=lambda v: status.update(f"[bold]bench model[/]: {v} (own process)"))
    print_rows(rows, console)
    console.print(f"wrote {out / 'model.json'} and {out / 'model.png'}")


def _nproc(console: Console, nproc: int, layers: Optional[int], batch: int, seq: int, steps: int, variants: str,
           out: Path) -> None:
    from ..testing.fsdp_bench import run_nproc

    try:
        with console.status("") as status:
            doc = run_nproc(nproc, layers or 2, batch, seq, steps, out,
                            progress=lambda v: status.update(f"[bold]bench model --nproc {nproc}[/]: {v}"),
                            variants="all" if variants == SINGLE_GPU_DEFAULT else variants)
    except (ValueError, RuntimeError) as e:
        console.print(f"[red]kernelkit bench model --nproc {nproc}:[/] {e}")
        raise typer.Exit(2)
    for r in doc["rows"]:
        head = f"{r['world_size']} GPU(s)  {r['variant']:<18}"
        if "step_ms" not in r:
            console.print(f"{head} {r.get('skipped') or r.get('error')}")
            continue
        eff = "-" if r["scaling_efficiency"] is None else f"{r['scaling_efficiency']:.2f}"
        mfu = "-" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
        console.print(f"{head} {r['step_ms']:8.1f} ms/step  {r['tokens_per_s_per_gpu']:10.0f} tok/s/GPU  "
                      f"{r['tokens_per_s_total']:10.0f} tok/s  MFU {mfu}  scaling {eff}  "
                      f"peak {r.get('peak_gib_max', 0):.1f} GiB/rank  loss {r['first_loss']:.3f} -> "
                      f"{r['last_loss']:.3f}")
    console.print(f"wrote {out / 'model-nproc.json'}")
