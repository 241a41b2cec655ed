"""`kernelkit profile FILE.py:FUNCTION` / `kernelkit profile --example llama`."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

import typer


def _load(target: str):
    path, _, func = target.partition(":")
    if not func:
        raise typer.BadParameter(f"expected FILE.py:FUNCTION, got {target!r}")
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if spec is None or not Path(path).exists():
        raise typer.BadParameter(f"no such file: {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not hasattr(mod, func):
        raise typer.BadParameter(f"{path} has no function {func!r}")
    got = getattr(mod, func)()
    if not (isinstance(got, tuple) and len(got) == 2):
        raise typer.BadParameter(f"{target} must return (model, inputs); got {type(got).__name__}")
    model, inputs = got
    return model, inputs if isinstance(inputs, tuple) else (inputs,)


def profile_command(
    target: Optional[str] = typer.Argument(None, help="FILE.py:FUNCTION returning (model, inputs)"),
    example: Optional[str] = typer.Option(None, help="built-in example instead of a target: llama"),
    steps: int = typer.Option(3, help="profiled steps (after one warm-up)"),
    backward: bool = typer.Option(True, help="profile the backward too"),
    gpu: Optional[str] = typer.Option(None, help="predict for this GPU's datasheet instead of measuring"),
    out: Path = typer.Option(Path("kernelkit-report"), help="folder for profile.json, roofline.png, report.html"),
    hot: float = typer.Option(2.0, help="an op is hot at this % of the step or more"),
    room: float = typer.Option(1.5, help="room above the floor: measured >= this x floor"),
    max_shapes: int = typer.Option(4, help="stable: at most this many distinct shapes"),
    top: int = typer.Option(25, help="rows in the terminal table"),
):
    """Profile a model step: each op on the roofline with a verdict, fusible chains, launch overhead."""
    from rich.console import Console

    from . import profile
    from .analysis import Thresholds
    from .examples import build_example
    from .report import print_report, write_reports

    console = Console()
    if (target is None) == (example is None):
        raise typer.BadParameter("give FILE.py:FUNCTION or --example NAME (one of them)")
    import torch

    predicted = gpu is not None or not torch.cuda.is_available()
    try:
        # Predicting needs shapes, not numbers: the example is built full size on the meta device.
        model, inputs = (build_example(example, device="meta" if predicted else None, tiny=False if predicted else None)
                         if example else _load(target))
    except typer.BadParameter:
        raise
    except Exception as e:  # the user's code failed: say where, not the profiler's internals
        console.print(f"[red]could not build the model from {target or example!r}[/]: {type(e).__name__}: {e}")
        raise typer.Exit(2) from None
    try:
        rep = profile(model, inputs, steps=steps, backward=backward, gpu=gpu,
                      thresholds=Thresholds(room=room, hot_pct=hot, max_shapes=max_shapes))
    except Exception as e:
        console.print(f"[red]running the model from {target or example!r} failed[/]: {type(e).__name__}: {e}")
        raise typer.Exit(2) from None
    from ..hw.ceilings import ceilings_for

    ceilings, _ = ceilings_for(gpu)
    print_report(rep, console, top=top)
    paths = write_reports(rep, ceilings, out)
    console.print(f"report written: {paths['html']} (also {paths['json'].name}, {paths['png'].name})")
