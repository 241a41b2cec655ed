"""kernelkit doctor | bench | check | profile | tune"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from .bench_model import bench_model

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Profile-first, roofline-guided GPU kernel work on PyTorch.")
console = Console()


def _tuning_notice(describe):
    """While a command runs: `describe(text)` when the autotuner starts timing configs for a new shape (a first
    call can take seconds to minutes; the persistent cache makes the next process skip it). Returns a function
    giving the summary line: how many kernel keys were tuned and how long it took."""
    from .. import runtime as tune

    before = (tune.tuned_keys, tune.tuning_seconds)
    tune.on_tune = lambda event, rec: describe(f"tuning {rec['kernel']} for a new shape (cached afterwards)") \
        if event == "start" else None

    def summary() -> str:
        tune.on_tune = None
        n, secs = tune.tuned_keys - before[0], tune.tuning_seconds - before[1]
        return f"autotuned {n} kernel key(s) in {secs:.1f} s (kept in the tuning cache)" if n else ""

    return summary


def _usage(msg: str):
    """A bad option value: one red line naming the option and the fix, exit status 2, no traceback."""
    console.print(f"[red]{msg}[/]", soft_wrap=True)
    raise typer.Exit(2)


OP_DTYPES = ("float32", "bfloat16", "float16")
QUICK_DTYPE = "bfloat16"  # check --quick: the dtype models train and serve in
MODES = ("fwd", "bwd", "fwd+bwd")


def _op_dtype(dtype: str, allow_all: bool) -> str:
    """--dtype as the harness names it (fp16 -> float16), or a usage error naming the choices."""
    from ..testing.correctness import DTYPES

    if allow_all and dtype == "all":
        return dtype
    dt = DTYPES.get(dtype.removeprefix("torch."))
    name = str(dt).removeprefix("torch.")
    if name not in OP_DTYPES:
        _usage(f"--dtype {dtype!r}: use {', '.join(OP_DTYPES)}{' or all' if allow_all else ''} "
               f"(or fp32, bf16, fp16).")
    return name


def _specs(op: str, dtype: str) -> list:
    """The registered ops `op` names ('all': every one) that run in `dtype`; a usage error for an unknown op or a
    dtype the op does not run in. 'all' leaves out, and says so, the ops without that dtype."""
    from ..ops import registry

    try:
        specs = [registry.get(n) for n in (sorted(registry.all_ops()) if op == "all" else [op])]
    except KeyError as e:
        _usage(e.args[0])
    if dtype == "all":
        return specs
    without = [s for s in specs if dtype not in s.dtypes]
    if op != "all" and without:
        _usage(f"--dtype {dtype}: {op} runs in {', '.join(without[0].dtypes)} only.")
    if without:
        console.print(f"[dim]--dtype {dtype}: leaving out {', '.join(s.name for s in without)} (not in that dtype)[/]",
                      soft_wrap=True)
    return [s for s in specs if dtype in s.dtypes]


def _fmt(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


@app.command()
def doctor(gpu: Optional[str] = typer.Option(None, help="datasheet to show (and compare with) e.g. h100, a100-80gb"),
           force: bool = typer.Option(False, help="measure again even if cached"),
           json_out: Optional[Path] = typer.Option(None, "--json", help="write the figures to this JSON file"),
           link: bool = typer.Option(True, help="with >= 2 GPUs visible (or under torchrun), also measure the "
                                                "link: all-gather and reduce-scatter from 1 MiB to 1 GiB, bus "
                                                "bandwidth, cached as the ceiling profile sets collectives against")):
    """Measure this GPU's ceilings and compare them with its datasheet (and the link between GPUs)."""
    import json

    import torch

    from .distributed import join_group, leave_group, link_sweep

    group, joined = join_group() if link else (None, False)
    try:
        if group is not None and group.get_rank() != 0:  # under torchrun rank 0 measures its GPU; all sweep the link
            link_sweep(Console(quiet=True), force, group)
            return
        doc = _doctor_gpu(gpu, force)
        if link:
            doc["link"] = link_sweep(console, force, group)
    finally:
        leave_group(group, joined)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(doc, indent=1, default=str))


def _doctor_gpu(gpu: Optional[str], force: bool) -> dict:
    """The one-GPU part of doctor: measured ceilings (or a datasheet) as a table; the JSON document."""
    import torch

    from ..hw import DATASHEETS, lookup, measure_ceilings

    measured = None
    if torch.cuda.is_available():
        from rich.progress import BarColumn, Progress, TextColumn

        steps = ["memory bandwidth", "bf16", "fp16", "fp8", "tf32", "fp32", "launch floor"]
        with Progress(TextColumn("[bold]measuring[/] {task.description}"), BarColumn(), console=console,
                      transient=True) as bar:
            task = bar.add_task("", total=len(steps))
            measured = measure_ceilings(force=force, progress=lambda s: bar.update(task, description=s, advance=1))
        spec = lookup(gpu or measured.gpu)
        console.print(f"[bold]{measured.gpu}[/]  ({measured.sms} SMs, L2 {measured.l2_bytes / 1e6:.0f} MB)  "
                      f"driver {measured.fingerprint.get('driver')}, CUDA {measured.fingerprint.get('cuda')}, "
                      f"torch {measured.fingerprint.get('torch')}, Triton {measured.fingerprint.get('triton')}")
    else:
        spec = lookup(gpu or "h100")
        if spec is None:
            console.print(f"[red]unknown GPU {gpu!r}[/]; known: {', '.join(DATASHEETS)}")
            raise typer.Exit(2)
        console.print(f"[yellow]No CUDA GPU is visible here[/]: nothing can be measured. "
                      f"Showing the datasheet of [bold]{spec.name}[/] (pick another with --gpu).")

    table = Table(title="ceilings: datasheet vs measured")
    for col in ("ceiling", "datasheet", "measured", "% of datasheet", "ridge (FLOP/B)"):
        table.add_column(col, justify="left" if col == "ceiling" else "right")
    bw_ds = spec.mem_gbps if spec else None
    for label, bw_me in (("memory GB/s (roof: best of copy, add, sum)", measured.mem_gbps if measured else None),
                         ("memory GB/s (copy, read+write)", measured.copy_gbps if measured else None)):
        table.add_row(label, _fmt(bw_ds, ".0f"), _fmt(bw_me, ".0f"),
                      _fmt(100 * bw_me / bw_ds if bw_me and bw_ds else None), "")
    for key in ("bf16", "fp16", "fp8", "tf32", "fp32"):
        ds = spec.tflops.get(key) if spec else None
        me = measured.tflops.get(key) if measured else None
        ridge = measured.ridge_point(key) if measured else (spec.ridge_point(key) if spec else None)
        table.add_row(f"{key} TFLOP/s", _fmt(ds), _fmt(me), _fmt(100 * me / ds if me and ds else None),
                      _fmt(ridge, ".0f"))
    if measured:
        table.add_row("launch floor (us)", "", _fmt(measured.launch_us, ".2f"), "", "")
    console.print(table)
    return {"datasheet": spec.__dict__ if spec else None, "measured": measured.to_json() if measured else None}


@app.command()
def bench(op: str = typer.Argument(..., help="registered op name, e.g. rms_norm; 'all' for every op"),
          dtype: str = typer.Option("bfloat16", help="float32, bfloat16 or float16 (fp32, bf16, fp16)"),
          modes: str = typer.Option("fwd,bwd", help="comma list of fwd, bwd, fwd+bwd"),
          out: Path = typer.Option(Path("benchmarks/results/local"), help="folder for JSON and PNG"),
          no_compile: bool = typer.Option(False, help="skip the torch.compile row"),
          quick: bool = typer.Option(False, help="only the first bench shape"),
          shapes: Optional[str] = typer.Option(None, help="Python list of shape tuples, e.g. '[(4, 4096, 16, 128, True)]', "
                                                       "instead of the op's bench shapes"),
          latency: bool = typer.Option(True, help="also time the op's decode-size (latency) shapes"),
          kernel_time: bool = typer.Option(False, help="also record each call's summed kernel time from the "
                                                       "profiler (GPU side, host time excluded); bench model: "
                                                       "each variant's kernel time per step by family"),
          table: bool = typer.Option(True, help="append the rows to the GPU's results table, "
                                                "benchmarks/results/<gpu>.csv, in a source checkout"),
          example: str = typer.Option("llama", help="bench model: built-in config (llama: Llama-3-8B's layer shapes; llama-1b: Llama-3.2-1B's)"),
          config: Optional[Path] = typer.Option(None, help="bench model: a Hugging Face config.json instead"),
          layers: Optional[int] = typer.Option(2, help="bench model: decoder layers (default 2; 0 keeps the config's)"),
          batch: int = typer.Option(4, help="bench model: sequences per step"),
          seq: int = typer.Option(2048, help="bench model: tokens per sequence"),
          steps: int = typer.Option(5, min=1, help="bench model: timed steps per variant (the median is reported)"),
          precision: str = typer.Option("bf16", help="bench model: fp8 adds, after each kernelkit variant, the same "
                                                      "with kernelkit.patch(model, precision='fp8') and with "
                                                      "torchao's float8 training (rowwise) as the anchor"),
          nproc: int = typer.Option(1, min=1, help="bench model: GPUs of this host; above 1, the FSDP2 training step "
                                                   "(AdamW) per variant under torchrun on N GPUs and on one: tokens/s "
                                                   "per GPU and in total, MFU, scaling efficiency, peak memory per rank "
                                                   "(Llama-3-8B layer shapes); variants: eager, compile, liger, "
                                                   "kernelkit, kernelkit+compile, kernelkit-fp8, torchtitan (default: "
                                                   "all)"),
          variants: str = typer.Option("eager,torch.compile,liger,kernelkit,kernelkit+compile",
                                       help="bench model: comma list of variants (also kernelkit-always, "
                                            "kernelkit-always+compile: every switch forced to kernelkit; "
                                            "kernelkit-fp8, torchao-fp8 and their +compile)")):
    """Side-by-side benchmark of an op: kernelkit vs eager vs torch.compile vs anchors.

    `kernelkit bench model` times a Hugging Face causal LM instead: one training step and one prefill per
    variant (eager, torch.compile, Liger, kernelkit.patch, kernelkit.patch + torch.compile), each in its
    own process, with tokens/s, peak memory and loss/gradient agreement with eager."""
    import torch

    if op == "model":
        bench_model(console, example=example, config=config, layers=layers, batch=batch, seq=seq, steps=steps,
                    precision=precision, nproc=nproc, variants=variants, out=out, kernel_time=kernel_time)
        return

    from ..hw import measure_ceilings
    from ..testing.bench import append_to_table, plot, print_table, write_json
    from ..testing.suite import run_suite

    # Every option is checked before anything runs: a typo is a one-line usage error, not a traceback later.
    dtype = _op_dtype(dtype, allow_all=False)
    mode_list = tuple(m.strip() for m in modes.split(",") if m.strip())
    if not mode_list or set(mode_list) - set(MODES):
        _usage(f"--modes {modes!r}: a comma list of {', '.join(MODES)}.")
    chosen_shapes = None
    if shapes:
        import ast

        try:
            parsed = ast.literal_eval(shapes)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            parsed = None
        if not (isinstance(parsed, list) and parsed and all(isinstance(s, tuple) for s in parsed)):
            _usage(f"--shapes {shapes!r}: a Python list of shape tuples, e.g. '[(4096, 4096)]'.")
        chosen_shapes = parsed
    specs = _specs(op, dtype)
    if not torch.cuda.is_available():
        console.print("[red]kernelkit bench needs a CUDA GPU[/] (timings on the interpreter mean nothing).")
        raise typer.Exit(2)
    ceilings = measure_ceilings()
    tuning = _tuning_notice(lambda text: console.print(f"[dim]{text}[/]"))
    for spec in specs:
        name = spec.name
        chosen = chosen_shapes or (spec.bench_shapes[:1] if quick else None)
        rows = run_suite(spec, ceilings, shapes=chosen, dtype=dtype, modes=mode_list,
                         compile=not no_compile, latency=latency and not quick, kernel_time=kernel_time)
        print_table(rows, title=f"{name} ({dtype}) on {ceilings.gpu}: copy {ceilings.copy_gbps:.0f} GB/s, "
                                f"bf16 {ceilings.tflops.get('bf16') or 0:.0f} TF", console=console)
        path = write_json(rows, out / f"{name}.json", ceilings, op=name, dtype=dtype)
        from ..runtime import chosen_configs

        (out / f"{name}.configs.json").write_text(json.dumps(chosen_configs(), indent=1))
        big = [r for r in rows if r.mode == "fwd" or r.mode == "bwd"]
        compute = any(r.regime == "compute" for r in rows if r.impl == "kernelkit")
        plot(big, out / f"{name}.png", metric="tflops" if compute else "gbps",
             ceiling=None if compute else ceilings.copy_gbps, title=f"{name} {dtype} on {ceilings.gpu}")
        console.print(f"wrote {path} and {path.with_suffix('.png')}")
        if table and (csv := append_to_table(rows, ceilings)):
            console.print(f"appended to {csv}")
    if msg := tuning():
        console.print(msg)


@app.command()
def check(op: str = typer.Argument(..., help="registered op name, or 'all'; or a candidate CANDIDATE.py "
                                             "(with --reference)"),
          dtype: str = typer.Option("all", help="float32, bfloat16, float16 or all"),
          device: Optional[str] = typer.Option(None, help="cuda or cpu (cpu needs TRITON_INTERPRET=1)"),
          trials: Optional[int] = typer.Option(None, min=1, help="fresh random inputs per op, dtype and shape "
                                                                 "(at least 1; default 2, 1 with --quick)"),
          small: bool = typer.Option(False, help="only the small test shapes, also on the GPU (for the sanitizer)"),
          quick: bool = typer.Option(False, "--quick", help="one small shape per kernel path of each op, in "
                                     f"{QUICK_DTYPE} (else the op's first dtype), 1 trial, no layouts: each path "
                                     "compiled and checked once (make demo); without it, every test shape and dtype"),
          layouts: Optional[bool] = typer.Option(None, "--layouts/--no-layouts",
                                                 help="also pass every tensor argument as a row-padded, column-major, "
                                                      "stepped, offset, misaligned and broadcast view (default: on, "
                                                      "off with --quick)"),
          reference: Optional[Path] = typer.Option(None, "--reference", help="candidate files: the reference file "
                                                   "(KernelBench: Model, get_inputs, get_init_inputs)"),
          rtol: Optional[float] = typer.Option(None, min=0.0, help="candidate files: relative-norm tolerance instead "
                                                                   "of the output dtype's (float32: 1e-5)"),
          atol: Optional[float] = typer.Option(None, min=0.0, help="candidate files: also pass outputs within "
                                                                   "|out - ref| <= atol + rtol |ref| everywhere"),
          json_out: Optional[Path] = typer.Option(None, "--json", help="candidate files: write the report here"),
          jobs: int = typer.Option(0, min=0, help="'all': ops checked side by side, each in its own process "
                                                  "(compiling is CPU-bound); 0 picks min(6, CPUs / 2) on a GPU, 1 on the CPU"),
          rows_out: Optional[Path] = typer.Option(None, "--rows-json", hidden=True,
                                                  help="write the result rows here (check all --jobs)")):
    """Check an op against its float64 reference on fresh random inputs (poisoned outputs, grads, races).

    `kernelkit check CANDIDATE.py --reference REFERENCE.py` verifies any candidate kernel instead: the
    reference file defines Model, get_inputs() and get_init_inputs() (KernelBench), the candidate ModelNew
    (or Model). The candidate must return what the reference returns, structure included: a tensor where the
    reference returns a tensor (a 1-tuple (out,) for out fails), a tuple or list (the two alike) of as many
    where it returns a tuple or list, None where it returns None; shapes and dtypes equal.
    Exit status 0 when every check passes, 1 when one fails, 2 for usage errors."""
    import os

    started = time.perf_counter()
    if op.endswith(".py") or Path(op).is_file():
        op_only = [n for n, v in (("--dtype", dtype != "all"), ("--small", small), ("--quick", quick),
                                  ("--layouts/--no-layouts", layouts is not None)) if v]
        _check_files(Path(op), reference, device, 2 if trials is None else trials, rtol, atol, json_out,
                     op_only=op_only)
        return
    trials = trials or (1 if quick else 2)
    layouts = (not quick) if layouts is None else layouts
    given = [n for n, v in (("--reference", reference), ("--rtol", rtol), ("--atol", atol), ("--json", json_out))
             if v is not None]
    if given:
        console.print(f"[red]{', '.join(given)}[/] apply to a candidate file (CANDIDATE.py --reference "
                      f"REFERENCE.py), not to the op {op!r}.", soft_wrap=True)
        raise typer.Exit(2)

    import torch

    dtype = _op_dtype(dtype, allow_all=True)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not (device == "cpu" or device.startswith("cuda")):
        console.print(f"[red]--device {device!r}[/]: use cuda or cpu.", soft_wrap=True)
        raise typer.Exit(2)
    if device.startswith("cuda") and not torch.cuda.is_available():
        console.print(f"[red]--device {device}: no CUDA GPU is visible[/]; "
                      "run on a GPU, or use --device cpu with TRITON_INTERPRET=1.", soft_wrap=True)
        raise typer.Exit(2)
    from ..runtime import kernels_interpreted

    if device == "cpu" and (os.environ.get("TRITON_INTERPRET", "0") in ("", "0") or not kernels_interpreted()):
        console.print("[red]--device cpu runs the kernels in Triton's interpreter[/]: "
                      "set TRITON_INTERPRET=1 before the process starts (e.g. TRITON_INTERPRET=1 kernelkit check ...); "
                      "Triton reads it as kernelkit is imported.", soft_wrap=True)
        raise typer.Exit(2)
    specs = _specs(op, dtype)

    if jobs == 0:
        # H100 host, 16 CPUs, cold caches: 4 side by side 173 s, 6 154 s (no out-of-memory at 6)
        jobs = max(1, min(6, (os.cpu_count() or 2) // 2)) if device.startswith("cuda") else 1
    if op == "all" and jobs > 1 and rows_out is None:
        flags = ["--dtype", dtype, "--device", device, "--trials", str(trials)] + ["--small"] * small + \
            ["--quick"] * quick + ["--layouts" if layouts else "--no-layouts"]
        rows = _check_side_by_side([s.name for s in specs], flags, jobs)
    else:
        rows = _check_here(specs, dtype, device, trials, small, layouts, quick)
    if rows_out is not None:
        rows_out.write_text(json.dumps(rows))
        return
    _check_summary(rows, device, trials, time.perf_counter() - started, quick)


def _check_here(specs, dtype: str, device: str, trials: int, small: bool, layouts: bool, quick: bool = False
                ) -> list[dict]:
    """Run the checks of `specs` in this process, one progress line per op; returns one row per check."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from ..testing import check_spec
    from ..testing.correctness import quick_shapes
    from ..testing.layouts import check_layouts, layout_shape

    plan = []  # (spec, dtype, shape): one check each
    for spec in specs:
        shapes = spec.test_shapes if device == "cpu" or small else (spec.test_shapes + spec.bench_shapes[:1])
        dtypes = spec.dtypes if dtype == "all" else (dtype,)
        if quick:
            shapes = quick_shapes(spec)
            dtypes = dtypes if dtype != "all" else (QUICK_DTYPE if QUICK_DTYPE in spec.dtypes else spec.dtypes[0],)
        for dt in dtypes:
            plan += [(spec, dt, shape) for shape in shapes]
            if layouts:
                plan.append((spec, dt, "layouts"))
    rows = []
    with Progress(TextColumn("[bold]checking[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("", total=len(plan))
        tuning = _tuning_notice(lambda text: bar.update(task, description=text))
        ops = list(dict.fromkeys(p[0].name for p in plan))
        current, started, op_failed = None, 0.0, 0

        def op_done():  # one line per op as it finishes: in a log (no live bar there) the run never looks hung
            _op_line(current, sum(1 for p in plan if p[0].name == current), op_failed, time.perf_counter() - started)

        for spec, dt, shape in plan:
            if spec.name != current:
                if current is not None:
                    op_done()
                current, started, op_failed = spec.name, time.perf_counter(), 0
                if not console.is_terminal:
                    console.print(f"checking {current} ({ops.index(current) + 1} of {len(ops)}) ...", soft_wrap=True)
            bar.update(task, description=f"{spec.name} {dt} {shape}")
            cases, is_layout = 0, shape == "layouts"
            if is_layout:
                rep, cases = check_layouts(spec, dt, device)
                shape = f"{cases} layouts of {layout_shape(spec)}"
            else:
                rep = check_spec(spec, shape, dt, device=device, trials=trials)
            op_failed += not rep.ok
            rows.append({"op": spec.name, "dtype": dt, "shape": str(shape), "ok": rep.ok,
                         "failure": None if rep.ok else rep.failures[0], "layouts": is_layout, "layout_cases": cases,
                         "worst": max(rep.errors.values(), default=0.0)})
            bar.advance(task)
        if current is not None:
            op_done()
    if msg := tuning():
        console.print(msg)
    return rows


def _op_line(name: str, checks: int, failed: int, seconds: float, extra: str = "") -> None:
    console.print(f"  {name}: {checks} checks, {'[red]' + str(failed) + ' failed[/]' if failed else '[green]ok[/]'} "
                  f"in {seconds:.1f} s{extra}", soft_wrap=True)


def _check_side_by_side(names: list[str], flags: list[str], jobs: int) -> list[dict]:
    """`check all --jobs N`: each op in a child `kernelkit check OP` process, N at a time (a cold start spends
    most of its time compiling kernels, which is CPU-bound and serial within one process). A child that dies
    (a crash, a CUDA error) is a failed row carrying the end of its output, never a skipped op."""
    import subprocess
    import sys
    import tempfile
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    def one(name: str, tmp: Path):
        out = tmp / f"{name}.json"
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "kernelkit.commands.cli", "check", name, *flags, "--rows-json", str(out)],
                           capture_output=True, text=True)
        secs = time.perf_counter() - t0
        if r.returncode == 0 and out.is_file():
            return json.loads(out.read_text()), secs, r
        tail = " | ".join((r.stdout + r.stderr).strip().splitlines()[-4:])[-600:]
        return [{"op": name, "dtype": "-", "shape": "-", "ok": False, "layouts": False, "layout_cases": 0, "worst": 0.0,
                 "failure": f"the check process exited {r.returncode}: {tail}", "crashed": True}], secs, r

    results = {}
    console.print(f"checking {len(names)} ops, {jobs} side by side (each in its own process)", soft_wrap=True)
    with tempfile.TemporaryDirectory(prefix="kernelkit-check-") as tmp, \
            Progress(TextColumn("[bold]checking[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                     TimeElapsedColumn(), console=console, transient=True) as bar, \
            ThreadPoolExecutor(jobs) as pool:
        task = bar.add_task(", ".join(names[:jobs]), total=len(names))
        futures = {pool.submit(one, name, Path(tmp)): name for name in names}
        for fut in as_completed(futures):
            name = futures[fut]
            rows, secs, r = fut.result()
            results[name] = rows
            tuned = [ln.strip() for ln in r.stdout.splitlines() if ln.strip().startswith("autotuned ")]
            _op_line(name, sum(1 for row in rows if not row.get("crashed")), sum(not row["ok"] for row in rows),
                     secs, f" ({tuned[-1]})" if tuned else "")
            bar.update(task, description=", ".join(n for f, n in futures.items() if not f.done()) or "done")
            bar.advance(task)
    return [row for name in names for row in results[name]]


def _check_summary(rows: list[dict], device: str, trials: int, seconds: float | None = None,
                   quick: bool = False) -> None:
    table = Table(title=f"kernelkit check on {device}")
    for col in ("op", "dtype", "shape", "result", "worst rel. error"):
        table.add_column(col)
    for row in rows:
        table.add_row(row["op"], row["dtype"], row["shape"], "[green]ok[/]" if row["ok"] else f"[red]{row['failure']}[/]",
                      f"{row['worst']:.2e}")
    console.print(table)
    failed = sum(not row["ok"] for row in rows)
    n_layout = sum(1 for row in rows if row["layouts"])
    layout_cases = sum(row["layout_cases"] for row in rows)
    n_shape = len(rows) - n_layout
    colour = "red" if failed or not rows else "green"
    took = f" in {seconds:.0f} s" if seconds is not None else ""
    console.print(f"[{colour}]{n_shape} checks (op x dtype x shape), {trials} trial(s) each, "
                  f"{n_shape * trials} trials in all; {n_layout} layout checks, {layout_cases} layout cases: "
                  f"{failed} failed[/]{took}", soft_wrap=True)
    if quick:
        console.print(f"quick: one shape per kernel path of each op, {trials} trial(s), "
                      f"{'with' if n_layout else 'no'} layout fuzz; `kernelkit check all` runs every test shape, "
                      f"dtype and layout.", soft_wrap=True)
    if failed or not rows:  # a check that ran nothing has passed nothing
        raise typer.Exit(1)


_RESULT_STYLE = {"pass": "green", "fail": "bold red", "warn": "yellow", "skip": "dim", "info": "cyan"}


def _check_files(candidate: Path, reference: Optional[Path], device: Optional[str], trials: int,
                 rtol: Optional[float], atol: Optional[float], json_out: Optional[Path], op_only: list[str]) -> None:
    """`kernelkit check CANDIDATE.py --reference REFERENCE.py`: every check of testing.verify, as a table."""
    import os
    import re

    from rich.markup import escape

    def usage(msg: str):
        console.print(msg, soft_wrap=True)
        raise typer.Exit(2)

    if reference is None:
        usage(f"[red]{candidate} is a candidate file[/]: name its reference with --reference REFERENCE.py "
              "(it defines Model, get_inputs and get_init_inputs).")
    if op_only:
        usage(f"[red]{', '.join(op_only)}[/] apply to op checks; a candidate file runs on the reference's own inputs.")
    for path in (candidate, reference):
        if not path.is_file():
            usage(f"[red]{path}: no such file[/]")

    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not (device == "cpu" or device.startswith("cuda")):
        usage(f"[red]--device {device!r}[/]: use cuda or cpu.")
    if device.startswith("cuda") and not torch.cuda.is_available():
        usage(f"[red]--device {device}: no CUDA GPU is visible[/]; run on a GPU, or use --device cpu.")
    # Triton reads TRITON_INTERPRET as it imports (its own tl.* helpers are jitted then): too late to set it here.
    if device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and \
            re.search(r"^\s*(import|from)\s+triton\b", candidate.read_text(errors="replace"), re.M):
        usage("[red]--device cpu runs the candidate's Triton kernels in Triton's interpreter[/]: "
              "set TRITON_INTERPRET=1 (e.g. TRITON_INTERPRET=1 kernelkit check ...).")
    notes = []

    from ..testing.problem_files import CandidateError, ProblemError, load_problem
    from ..testing.verify import CHECKS, FAIL, Finding, VerifyReport, check_module

    try:
        problem = load_problem(candidate, reference)
        notes += problem.notes
        with Progress(TextColumn("[bold]verifying[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                      console=console, transient=True) as bar:
            task = bar.add_task("", total=len(CHECKS))
            report = check_module(problem.candidate, problem.reference, problem.make_inputs, device=device,
                                  trials=trials, rtol=rtol, atol=atol,
                                  progress=lambda name: bar.update(task, description=name,
                                                                   completed=CHECKS.index(name)))
    except ProblemError as e:
        usage(f"[red]{escape(str(e))}[/]")
    except CandidateError as e:  # a candidate that does not even load fails, it is not a usage error
        report = VerifyReport(findings=[Finding("load", FAIL, str(e))], device=device)
    except ValueError as e:  # the reference fails on its own inputs
        usage(f"[red]{reference}: {escape(str(e))}[/]")
    report.notes = notes + report.notes

    table = Table(title=f"kernelkit check {candidate.name} against {reference.name} on {device}")
    for col in ("check", "result", "detail"):
        table.add_column(col, overflow="fold")
    for f in report.findings:
        style = _RESULT_STYLE.get(f.result, "")
        table.add_row(f.check, f"[{style}]{f.result}[/]", escape(f.detail))
    console.print(table)
    for note in report.notes:
        console.print(f"[dim]note: {escape(note)}[/]", soft_wrap=True)
    if report.reference_precision:
        console.print(f"reference computed in {escape(report.reference_precision)}", soft_wrap=True)
    if json_out:
        doc = {"candidate": str(candidate), "reference": str(reference), **report.to_json()}
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(doc, indent=1, default=str))
    if report.ok:
        warned = [f.check for f in report.findings if f.result == "warn"]
        console.print("[green]every check passed[/]" + (f" (warnings: {', '.join(warned)})" if warned else ""),
                      soft_wrap=True)
        return
    console.print(f"[red]{len(report.failed)} check(s) failed: {', '.join(report.failed)}[/]", soft_wrap=True)
    raise typer.Exit(1)


@app.command()
def ladder(kind: Optional[str] = typer.Argument(None, help="sgemm (fp32 on the CUDA cores) or hgemm (bf16 on the "
                                                         "tensor cores)"),
           size: int = typer.Option(4096, help="M = N = K"),
           json_out: Optional[Path] = typer.Option(None, "--json", help="write the rows (and signatures) here"),
           plot: Optional[Path] = typer.Option(None, "--plot", help="write a bar chart of the rungs (PNG) here"),
           no_ncu: bool = typer.Option(False, "--no-ncu", help="skip the Nsight Compute signatures"),
           rungs: Optional[str] = typer.Option(None, "--rungs", help="comma list of rungs (default: all)"),
           list_rungs: bool = typer.Option(False, "--list", help="print the rungs and what each changes (no GPU "
                                                                 "needed)")):
    """The matmul optimization ladder: each rung a real kernel, checked against float64, timed next to cuBLAS,
    with the profiler counters that show its step landed. Exit 1 when a rung is wrong or fails, 2 for usage."""
    from ..ladder.run import main

    code = main(kind, size, json_out, plot, not no_ncu, rungs, list_rungs, console)
    if code:
        raise typer.Exit(code)


from .tune import tune_command  # noqa: E402

app.command("tune")(tune_command)

try:  # the profiler registers its own command when its package is present
    from .profile import profile_command

    app.command("profile")(profile_command)
except ImportError:  # pragma: no cover
    pass


if __name__ == "__main__":
    app()
