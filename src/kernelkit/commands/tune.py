"""`kernelkit tune`: tune kernelkit's kernels ahead of time for the shapes a model will hit, and manage the
persistent tuning cache (`tune/cache.py`).

    kernelkit tune --op rms_norm --shapes '[(8192, 4096)]' --dtype bfloat16
    kernelkit tune --example llama                      # every kernelkit op the built-in example would call
    kernelkit tune --from kernelkit-report              # the kernelkit calls a `kernelkit profile` report names
    kernelkit tune --list | --clear | --export FILE | --import FILE

Tuning runs each op's forward and backward once through the registry (`spec.make_inputs`, `spec.fn`); every
kernel the call launches for the first time is tuned there and stored, or found in the cache. This module is
command code: it reads the registry and the profiler from inside the command, as `kernelkit.commands.cli` does.
"""

from __future__ import annotations

import ast
import dataclasses
import time
from pathlib import Path
from typing import Optional

import typer

DTYPES = ("float32", "bfloat16", "float16")


class _UserError(Exception):
    """A wrong option or input: one red line, exit code 2."""


def _device() -> str | None:
    """Where tuning runs: the GPU, or None (the interpreter keeps one config: nothing to tune)."""
    import torch

    return "cuda" if torch.cuda.is_available() else None


# --- what to tune: (spec, shape, dtype) ---

def op_plan(op: str, shapes: str | None, dtype: str) -> list[tuple]:
    from ..ops import registry

    try:
        spec = registry.get(op)
    except KeyError as e:
        raise _UserError(e.args[0]) from None
    if dtype not in DTYPES:
        raise _UserError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if shapes is None:
        return [(spec, tuple(s), dtype) for s in spec.bench_shapes]
    try:
        parsed = ast.literal_eval(shapes)
        parsed = [parsed] if isinstance(parsed, tuple) else list(parsed)
        if not all(isinstance(s, tuple) for s in parsed):
            raise ValueError
    except (ValueError, SyntaxError, TypeError):
        raise _UserError(f"--shapes {shapes!r}: give a Python list of shape tuples, e.g. '[(8192, 4096)]'") from None
    return [(spec, s, dtype) for s in parsed]


def _calls_plan(calls) -> list[tuple]:
    from ..ops import registry

    specs = registry.all_ops()
    return [(specs[op], tuple(shape), dtype) for op, shape, dtype in calls if op in specs]


def example_plan(name: str) -> list[tuple]:
    """The calls kernelkit would take over in a built-in example: the example built full size on the meta
    device, its step traced for shapes, and the registry's candidates read off as the profiler reads them
    (`profile.analysis.kernel_calls`, the calls `kernelkit profile` times)."""
    from ..profile.analysis import kernel_calls
    from ..profile.examples import build_example
    from ..profile.trace import predict

    try:
        model, inputs = build_example(name, device="meta", tiny=False)
        trace = predict(model, inputs, backward=True)
    except Exception as e:  # an unknown name, transformers missing for hf-llama
        raise _UserError(f"--example {name}: {e}") from None
    return _calls_plan(kernel_calls(trace))


def report_plan(path: Path) -> list[tuple]:
    """The kernelkit calls a `kernelkit profile` report names. profile.json holds each row's aten-level input
    shapes as text, not the shapes kernelkit's ops are called with, so the plan comes from trace.json, which
    `profile` writes beside it: the registry's candidates for the trace's calls (what the profiler times for
    its projections) and, in a profile of a patched model, the `kernelkit::<op>` calls themselves."""
    from ..ops import registry
    from ..profile.analysis import kernel_calls
    from ..profile.projection import call_shape
    from ..profile.trace import Trace

    path = Path(path)
    trace_path = path if path.name == "trace.json" else (path if path.is_dir() else path.parent) / "trace.json"
    if not trace_path.is_file():
        raise _UserError(f"--from {path}: no trace.json there. profile.json keeps each row's input shapes as text, "
                         f"not the shapes kernelkit's ops are called with; `kernelkit profile` writes trace.json "
                         f"(the records) beside it: point --from at that folder")
    try:
        trace = Trace.load(trace_path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _UserError(f"--from {trace_path}: not a readable kernelkit trace ({e})") from None
    calls = list(kernel_calls(trace))
    specs = registry.all_ops()
    for r in trace.records:
        name = r.op.split("::", 1)[1] if r is not None and r.op.startswith("kernelkit::") else None
        if name not in specs or r.phase != "fwd":
            continue
        if name == "attention" and len(r.shapes) >= 3 and all(len(s) == 4 for s in r.shapes[:3]):
            # kernelkit.attention takes (batch, seq, heads, head_dim); call_shape reads SDPA's (batch, heads, seq,
            # head_dim) and whether the call was causal from its FLOPs, as for an SDPA record
            r = dataclasses.replace(r, shapes=tuple((s[0], s[2], s[1], s[3]) for s in r.shapes[:3]) + r.shapes[3:])
        sd = call_shape(name, specs[name], [r])
        if sd is not None:
            calls.append((name, sd[0], sd[1]))
    return _calls_plan(dict.fromkeys(calls))


# --- tuning ---

def _tensors(tree) -> list:
    import torch
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def run_call(spec, shape: tuple, dtype: str, device: str, backward: bool = True) -> None:
    """One forward (and backward, with random output gradients) of `spec` at `shape`: every kernel it launches
    for the first time in this process is tuned or taken from the cache."""
    import torch

    args, kwargs = spec.make_inputs(shape, getattr(torch, dtype), device)
    args = list(args)
    grads = [i for i in spec.grad_args if isinstance(args[i], torch.Tensor) and args[i].is_floating_point()]
    backward = backward and bool(grads)
    for i in grads:
        args[i] = args[i].detach().requires_grad_(backward)
    with torch.set_grad_enabled(backward):
        out = [t for t in _tensors(spec.fn(*args, **kwargs)) if t.requires_grad]
        if backward and out:
            torch.autograd.backward(out, [torch.randn_like(t) for t in out])
    if device == "cuda":
        torch.cuda.synchronize()


def tune_calls(plan: list[tuple], device: str, backward: bool = True, progress=None) -> list[dict]:
    """Run each (spec, shape, dtype) of `plan` (`progress(index, label)` before each). Per call: {"op", "shape",
    "dtype", "seconds", "launches": the `tune.tune_log` records of the kernels it launched first, "error": why
    it failed, or None}."""
    import torch

    from .. import runtime as tune

    rows = []
    for i, (spec, shape, dtype) in enumerate(plan):
        if progress is not None:
            progress(i, f"{spec.name} {shape} {dtype}")
        first, start, error = len(tune.tune_log), time.perf_counter(), None
        try:
            run_call(spec, shape, dtype, device, backward)
        except Exception as e:  # out of memory, a shape the op refuses: say so and go on
            error = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
        rows.append({"op": spec.name, "shape": shape, "dtype": dtype, "seconds": time.perf_counter() - start,
                     "launches": tune.tune_log[first:], "error": error})
    return rows


# --- the command ---

def _short(v, width: int = 60) -> str:
    s = str(v)
    return s if len(s) <= width else s[: width - 3] + "..."


def _here() -> dict | None:
    from ..runtime import cache

    try:
        return cache.fingerprint() if _device() == "cuda" else None
    except Exception:  # noqa: BLE001 - a GPU that cannot be queried: no entry is "this machine's"
        return None


def _print_list(console) -> None:
    from rich.table import Table

    from ..runtime import cache

    found, here = cache.files(), _here()
    if not found:
        console.print(f"the tuning cache {cache.cache_dir()} is empty")
        return
    for path, fp, entries in found:
        whose = "[green]this machine[/]" if fp == here else "[yellow]another fingerprint: not used here[/]"
        table = Table(title=f"{fp.get('gpu')} ({fp.get('sms')} SMs), driver {fp.get('driver')}, CUDA {fp.get('cuda')}, "
                            f"torch {fp.get('torch')}, Triton {fp.get('triton')}, kernelkit {fp.get('kernelkit')}: "
                            f"{whose}\n{path}", title_justify="left")
        for col in ("kernel", "tuning key", "config", "tuning s", "tuned at"):
            table.add_column(col, justify="right" if col == "tuning s" else "left")
        for e in sorted(entries.values(), key=lambda e: (e["kernel"], e["key"])):
            cfg = cache.describe(cache.config_from_json(e["config"]))
            table.add_row(e["kernel"].rsplit(".", 1)[-1], _short(e["key"]), cfg, f"{e['seconds']:.2f}",
                          str(e.get("tuned_at", "")))
        console.print(table)


def _print_tuned(rows: list[dict], console) -> None:
    from rich.table import Table

    from rich.markup import escape

    table = Table(title="kernelkit tune: the config chosen per kernel and tuning key")
    for col in ("op", "shape", "dtype", "kernel", "tuning key", "config", "from", "tuning s"):
        table.add_column(col, justify="right" if col == "tuning s" else "left")
    for r in rows:
        head = (r["op"], str(r["shape"]), r["dtype"])
        if r["error"]:
            table.add_row(*head, "", "", f"[red]{escape(r['error'])}[/]", "failed", "")
        elif not r["launches"]:
            table.add_row(*head, "", "", "nothing new: heuristic configs, or chosen above", "", "")
        for i, rec in enumerate(r["launches"]):
            table.add_row(*(head if i == 0 else ("", "", "")), rec["kernel"], escape(_short(rec["key"] or "")),
                          rec["config"], rec["source"], f"{rec['seconds']:.1f}" if rec["source"] == "tuned" else "-")
    console.print(table)


def tune_command(
    op: Optional[str] = typer.Option(None, "--op", help="registered op to tune, e.g. rms_norm"),
    shapes: Optional[str] = typer.Option(None, help="with --op: Python list of shape tuples, e.g. '[(8192, 4096)]' "
                                                    "(default: the op's benchmark shapes)"),
    dtype: str = typer.Option("bfloat16", help="with --op: float32, bfloat16 or float16"),
    example: Optional[str] = typer.Option(None, help="every kernelkit op a built-in example calls, at its shapes "
                                                     "(llama, hf-llama)"),
    from_: Optional[Path] = typer.Option(None, "--from", help="the kernelkit calls a `kernelkit profile` report names: "
                                                              "its folder, profile.json or trace.json"),
    backward: bool = typer.Option(True, help="also tune each op's backward (--no-backward: inference only)"),
    list_: bool = typer.Option(False, "--list", help="show the cache's entries"),
    clear: bool = typer.Option(False, "--clear", help="empty the cache (every fingerprint), before anything else"),
    export: Optional[Path] = typer.Option(None, "--export", help="write every entry to this file (after tuning)"),
    import_: Optional[Path] = typer.Option(None, "--import", help="merge entries exported on another machine"),
):
    """Tune kernelkit's kernels for a model's shapes ahead of time and manage the tuning cache.

    Tuned configs are kept per machine fingerprint (GPU, SM count, driver, CUDA, torch, Triton, kernelkit) and
    kernel source under $KERNELKIT_CACHE/tune (default ~/.cache/kernelkit/tune); every later process starts
    tuned. Steps run in this order: --clear, --import, tuning (--op, --example, --from), --export, --list.
    """
    import os

    from rich.console import Console
    from rich.markup import escape

    from ..runtime import cache

    console = Console()

    def fail(msg: str):
        console.print(f"[red]kernelkit tune:[/] {escape(msg)}", soft_wrap=True, highlight=False)
        raise typer.Exit(2)

    if shapes and not op:
        fail("--shapes goes with --op")
    if not (op or example or from_ or list_ or clear or export or import_):
        fail("nothing to do: give --op, --example or --from to tune, or --list, --clear, --export, --import")
    try:
        if clear:
            n = cache.clear()
            console.print(f"cleared the tuning cache {cache.cache_dir()} ({n} entries)")
        if import_:
            counts = cache.import_(import_, _here())
            console.print(f"imported from {import_}: {counts['here']} entries for this machine, {counts['other']} for "
                          f"other fingerprints (kept, never used here), {counts['skipped']} malformed (skipped)")
        plan = (op_plan(op, shapes, dtype) if op else []) + (example_plan(example) if example else []) + \
            (report_plan(from_) if from_ else [])
        if (op or example or from_) and not plan:
            fail("no kernelkit call to tune: the example or report names no registry op")
        if plan:
            _run_plan(plan, backward, console, fail, os.environ)
        if export:
            n = cache.export(export)
            console.print(f"exported {n} entries to {export}")
    except (_UserError, ValueError) as e:
        fail(str(e))
    if list_:
        _print_list(console)


def _run_plan(plan, backward, console, fail, env) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from .. import runtime as tune
    from ..runtime import cache

    if env.get("KERNELKIT_TUNE") == "first":
        fail("KERNELKIT_TUNE=first is set: kernels take their first config and nothing is tuned; unset it")
    if not cache.enabled():
        fail("KERNELKIT_TUNE_CACHE=0 is set: the tuning would not be kept; unset it")
    device = _device()
    if device is None:
        fail("tuning times configs on a CUDA GPU and none is visible (the interpreter keeps one config per kernel)")
    seconds, count = tune.tuning_seconds, tune.tuned_keys
    with Progress(TextColumn("[bold]tuning[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("", total=len(plan))
        prev = tune.on_tune

        def show(event, rec):
            if event == "start":
                bar.update(task, description=f"{rec['kernel']} {_short(rec['key'], 40)}")

        tune.on_tune = show
        try:
            rows = tune_calls(plan, device, backward,
                              progress=lambda i, what: bar.update(task, completed=i, description=what))
        finally:
            tune.on_tune = prev
        bar.update(task, completed=len(plan))
    _print_tuned(rows, console)
    cached = sum(1 for r in rows for rec in r["launches"] if rec["source"] == "cache")
    failed = sum(1 for r in rows if r["error"])
    where = cache.file_for(cache.fingerprint()) if device == "cuda" else cache.cache_dir()
    console.print(f"{tune.tuned_keys - count} kernel keys tuned in {tune.tuning_seconds - seconds:.1f} s, {cached} "
                  f"found in the cache; kept in {where}" + (f"; [red]{failed} call(s) failed[/]" if failed else ""),
                  soft_wrap=True, highlight=False)
    if failed:
        raise typer.Exit(1)
