"""`kernelkit profile FILE.py:FUNCTION` / `kernelkit profile --example llama` [--patch: then under kernelkit.patch]."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Optional

import typer


class _UserError(Exception):
    """The user's file, function or model failed: reported in one paragraph, no traceback."""


def _why(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:600]}{'...' if len(msg) > 600 else ''}"


def load_target(target: str):
    """(model, inputs) from FILE.py:FUNCTION; any failure is a _UserError naming the file and function."""
    path, sep, func = target.rpartition(":")
    if not sep or not path or not func:
        raise _UserError(f"expected FILE.py:FUNCTION, got {target!r}")
    if not Path(path).is_file():
        raise _UserError(f"no such file: {path}")
    try:
        spec = importlib.util.spec_from_file_location(f"kernelkit_target_{Path(path).stem}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(Path(path).resolve().parent))  # the file's own imports of its neighbours
        try:
            spec.loader.exec_module(mod)
        finally:
            sys.path.pop(0)
    except Exception as e:
        raise _UserError(f"importing {path} failed: {_why(e)}") from None
    fn = getattr(mod, func, None)
    if not callable(fn):
        raise _UserError(f"{path} has no function {func!r}")
    try:
        got = fn()
    except Exception as e:
        raise _UserError(f"{path}:{func}() failed while building the model: {_why(e)}") from None
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise _UserError(f"{path}:{func}() must return (model, inputs); it returned {type(got).__name__}")
    model, inputs = got
    if not callable(model):
        raise _UserError(f"{path}:{func}() returned a model that is not callable ({type(model).__name__})")
    return model, inputs if isinstance(inputs, (tuple, list, dict)) else (inputs,)


def profile_command(
    target: Optional[str] = typer.Argument(None, help="FILE.py:FUNCTION returning (model, inputs)"),
    example: Optional[str] = typer.Option(None, help="a built-in example instead of a target: llama (written out), "
                                                          "hf-llama (transformers' LlamaForCausalLM, same sizes)"),
    steps: int = typer.Option(3, help="profiled steps (after one warm-up step)"),
    backward: bool = typer.Option(True, help="profile the backward too"),
    gpu: Optional[str] = typer.Option(None, help="predict for this GPU instead of measuring (h100, a100, ...)"),
    out: str = typer.Option("kernelkit-report", help="folder for profile.json, trace.json, roofline.png, report.html"),
    hot: float = typer.Option(2.0, help="(b) hot: at least this % of the step's GPU time"),
    room: float = typer.Option(1.5, help="(a) room: measured time at least this x the roofline floor"),
    max_shapes: int = typer.Option(4, help="(c) stable: at most this many distinct shapes across steps"),
    overhead: float = typer.Option(10.0, help="launch overhead is a finding above this % of idle GPU time"),
    json_only: bool = typer.Option(False, "--json-only", help="write profile.json and trace.json only, print no table"),
    top: int = typer.Option(25, help="rows in the terminal table"),
    patch: bool = typer.Option(False, "--patch", help="then profile under kernelkit.patch (all of it, then each "
                               "switch alone) and set each projection against the time it saved (GPU only; a "
                               "Hugging Face model: --example llama becomes hf-llama)"),
    measure_overhead: bool = typer.Option(True, help="where the timeline shows launch overhead, time the step "
                                          "without the profiler and in CUDA graphs, and report the measured "
                                          "saving beside the projected one (GPU only)"),
    time_kernels: bool = typer.Option(True, help="time kernelkit's kernels at the model's shapes for the "
                                      "projections (GPU only; else the benchmark tables or 90% of the roof)"),
    precision: str = typer.Option("bf16", help="--patch: fp8 adds a run under kernelkit.patch(model, "
                                  "precision='fp8') and its row against the bf16 patch (step and GPU time)"),
    fsdp: Optional[bool] = typer.Option(None, "--fsdp/--no-fsdp", help="under torchrun (>= 2 ranks): wrap the "
                                        "model in FSDP2 (fully_shard each decoder layer, then the root; a Hugging "
                                        "Face model: --example llama becomes hf-llama). Default: on under torchrun"),
):
    """Profile a model step: each op on the roofline with a verdict, fusible chains, launch overhead; under
    torchrun each rank's step with its NCCL kernels, their bus bandwidth and the communication left exposed."""
    from rich.console import Console
    from rich.markup import escape

    from .distributed import join_group, leave_group

    # Logs and pipes get a wide table; a terminal gets its own width.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    err = Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, width=200)

    def fail(msg: str, code: int = 2):
        err.print(f"[red]kernelkit profile{where}:[/] {escape(msg)}", highlight=False)
        raise typer.Exit(code)

    group, joined = join_group()
    rank, world = (group.get_rank(), group.get_world_size()) if group is not None else (0, 1)
    where = f" (rank {rank})" if world > 1 else ""
    try:
        _profile(console, err, fail, group, rank, world, target=target, example=example, steps=steps,
                 backward=backward, gpu=gpu, out=out, hot=hot, room=room, max_shapes=max_shapes, overhead=overhead,
                 json_only=json_only, top=top, patch=patch, measure_overhead=measure_overhead,
                 time_kernels=time_kernels, fsdp=fsdp, precision=precision)
    finally:
        leave_group(group, joined)


def _profile(console, err, fail, group, rank: int, world: int, target, example, steps, backward, gpu, out, hot,
             room, max_shapes, overhead, json_only, top, patch, measure_overhead, time_kernels, fsdp,
             precision="bf16"):
    """The body of `profile_command`, on one rank of `world` (1 outside torchrun)."""
    from rich.console import Console

    from ..hw.ceilings import ceilings_for
    from ..profile.analysis import Thresholds, analyze, time_calls
    from ..profile.examples import build_example
    from ..profile.projection import patch_coverage
    from ..profile.report import print_patch_comparison, print_report, write_reports
    from ..profile.trace import measure, predict

    if rank != 0:  # rank 0 prints; every rank writes its files
        console = Console(quiet=True)
    fsdp = world > 1 if fsdp is None else fsdp
    if fsdp and world < 2:
        fail("--fsdp shards the model over the ranks of a process group: run under torchrun --nproc_per_node=N "
             "(N >= 2), e.g. torchrun --nproc_per_node=4 -m kernelkit.commands.cli profile --example hf-llama3-8b")
    if precision not in ("bf16", "fp8"):
        fail(f"--precision {precision!r}: one of 'bf16', 'fp8'")
    if precision == "fp8" and not patch:
        fail("--precision fp8 compares kernelkit.patch's fp8 run with its bf16 one: add --patch")
    if patch and world > 1:
        fail("--patch under torchrun is not supported: profile one GPU with --patch")

    if (target is None) == (example is None):
        fail("give FILE.py:FUNCTION or --example NAME (one of them)")
    try:
        ceilings, measured = ceilings_for(gpu)
    except ValueError as e:
        fail(str(e))
    if patch and not measured:
        fail("--patch measures the model before and after kernelkit.patch: it needs a CUDA GPU (and no --gpu)")
    if patch and example == "llama":
        example = "hf-llama"  # kernelkit.patch takes Hugging Face models: the same sizes as LlamaForCausalLM
        console.print("note: --patch profiles --example llama as transformers' LlamaForCausalLM (hf-llama): "
                      "kernelkit.patch swaps modules of Hugging Face models", highlight=False)
    if fsdp and example == "llama":
        example = "hf-llama"  # fully_shard_model shards a Hugging Face model's decoder layers
        console.print("note: --fsdp profiles --example llama as transformers' LlamaForCausalLM (hf-llama)",
                      highlight=False)
    what = target or f"--example {example}"
    try:
        if example:
            # Predicting needs shapes, not numbers: the example is built full size on the meta device (tiny on
            # the CPU under FSDP2, whose collectives need real tensors).
            device, tiny = (None, None) if measured else (("cpu", True) if fsdp else ("meta", False))
            model, inputs = build_example(example, device=device, tiny=tiny)
        else:
            model, inputs = load_target(target)
        if fsdp:
            from ..testing.distributed import fully_shard_model

            fully_shard_model(model)
    except _UserError as e:
        fail(str(e))
    except ValueError as e:
        fail(str(e))
    try:
        trace = measure(model, inputs, steps=steps, backward=backward) if measured else \
            predict(model, inputs, backward=backward)
    except Exception as e:  # the model failed: say where, not the profiler's internals
        how = "measuring on the GPU" if measured else f"predicting for {ceilings.gpu}"
        fail(f"running the model from {what} failed ({how}, one forward{' and backward' if backward else ''}): "
             f"{_why(e)}. Check that the model and its inputs are on the same device and that model(*inputs) "
             f"runs on its own.")
    trace.patch = patch_coverage(model)
    if world > 1:
        trace.distributed = _rank_info(group, fsdp, measured)
    if measured and time_kernels:
        trace.kernel_times = time_calls(trace)
    th = Thresholds(room=room, hot_pct=hot, max_shapes=max_shapes, overhead_pct=overhead)
    rep = analyze(trace, ceilings, th)
    rep.trace = trace
    if world > 1 and measured and rep.overhead.get("bound") and measure_overhead:
        rep.notes.append("launch overhead was not timed without the profiler: under torchrun a CUDA graph would "
                         "capture the step's collectives on every rank")
    if measured and rep.overhead.get("bound") and measure_overhead and world == 1:
        from ..profile.findings import findings
        from ..profile.overhead import combine, measure_overhead as time_overhead

        try:
            timed = time_overhead(model, inputs, backward=backward,
                                  progress=lambda text: err.print(text, highlight=False))
        except Exception as e:
            timed = {"graph_errors": [f"timing the step without the profiler failed: {_why(e)}"]}
        rep.overhead = combine(rep.overhead, timed)
        rep.findings = findings(rep, th)
    if not json_only:
        print_report(rep, console, top=top)
    after = None
    if patch:
        from ..profile.compare import patch_comparison

        try:
            rep.patch, after = patch_comparison(model, inputs, ceilings, rep, th, steps=steps, backward=backward,
                                                progress=lambda label: err.print(f"profiling {label}", highlight=False),
                                                precision=precision)
        except Exception as e:
            fail(f"profiling {what} under kernelkit.patch failed: {_why(e)}")
        if measured and after.overhead.get("bound") and measure_overhead:
            from ..patch import patch as kpatch, unpatch
            from ..profile.findings import findings
            from ..profile.overhead import combine, measure_overhead as time_overhead

            kpatch(model)
            try:
                timed = time_overhead(model, inputs, backward=backward,
                                      progress=lambda text: err.print(f"{text} (patched)", highlight=False))
            except Exception as e:
                timed = {"graph_errors": [f"timing the step without the profiler failed: {_why(e)}"]}
            finally:
                unpatch(model)
            after.overhead = combine(after.overhead, timed)
            after.findings = findings(after, th)
        if not json_only:
            print_patch_comparison(rep.patch, console)
            print_report(after, console, top=top, title="under kernelkit.patch(model)")
    suffix = f"-rank{rank}" if world > 1 else ""
    paths = write_reports(rep, ceilings, out, trace=trace, json_only=json_only or rank != 0, suffix=suffix)
    if world > 1:
        print_ranks(group.all_gather_object, rep, world, console)
    if after is not None:
        write_reports(after, ceilings, Path(out) / "patched", trace=after.trace, json_only=json_only)
    main = paths.get("html", paths["json"])
    others = [p.name for p in paths.values() if p != main] + (["patched/ (the run under kernelkit.patch)"]
                                                              if after is not None else [])
    console.print(f"report written: {main}" + (f" (also {', '.join(others)})" if others else ""), highlight=False)


def _rank_info(group, fsdp: bool, measured: bool) -> dict:
    """Trace.distributed: this rank, the group, and the link's ceiling for this many GPUs (doctor's sweep)."""
    from ..hw.collectives import load_link

    world, backend = group.get_world_size(), group.get_backend()
    link = load_link(world) if measured and backend == "nccl" else None
    return {"rank": group.get_rank(), "world_size": world, "backend": backend, "fsdp": fsdp, "link": link}


def print_ranks(all_gather_object, rep, world: int, console) -> None:
    """Rank 0's summary of every rank: step time, NCCL time and the exposed part (ranks wait for the slowest)."""
    from rich.table import Table

    mine = {"rank": rep.distributed.get("rank", 0), "step_ms": rep.step_ms, "gpu_ms": rep.gpu_ms,
            "comm_ms": rep.communication.get("comm_ms"), "exposed_ms": rep.communication.get("exposed_ms"),
            "exposed_pct": rep.communication.get("exposed_pct")}
    rows = [None] * world
    all_gather_object(rows, mine)
    t = Table(title=f"{world} ranks", title_justify="left")
    for col in ("rank", "step ms", "GPU ms", "NCCL ms", "exposed ms", "exposed %"):
        t.add_column(col, justify="right")
    f = lambda v, spec=".2f": "-" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        t.add_row(str(r["rank"]), f(r["step_ms"]), f(r["gpu_ms"]), f(r["comm_ms"]), f(r["exposed_ms"]),
                  f(r["exposed_pct"], ".1f"))
    console.print(t)
