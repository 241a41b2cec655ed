"""The CLI under torch.distributed: joining torchrun's group, and doctor's link sweep (all-gather and
reduce-scatter over 1 MiB..1 GiB, hw/collectives.py) on the GPUs of this host."""

from __future__ import annotations

import os

from rich.table import Table


def torchrun_world() -> int:
    """Ranks torchrun started (its WORLD_SIZE); 1 outside torchrun."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def join_group():
    """(torch.distributed, joined here) with its default group: the one already joined, or, under torchrun
    (WORLD_SIZE > 1), joined here (NCCL with this rank's GPU, LOCAL_RANK, where CUDA is; gloo otherwise), to leave
    with `leave_group`. (None, False) outside both."""
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        return None, False
    if dist.is_initialized():
        return dist, False
    if torchrun_world() <= 1:
        return None, False
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist, True


def leave_group(group, joined: bool) -> None:
    if group is not None and joined:
        group.destroy_process_group()


def _skip_reason(group) -> str | None:
    import torch

    if group is not None:
        return None if group.get_world_size() > 1 else "a process group of 1 rank has no link to measure"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    n = torch.cuda.device_count()
    if n < 2:
        return (f"{n} GPU visible: all-gather and reduce-scatter need >= 2 (make more visible with "
                f"CUDA_VISIBLE_DEVICES, or run under torchrun --nproc_per_node=N)")
    return None


def _sweep_in_group(group, console) -> dict:
    """Every rank of torchrun's group sweeps together; rank 0 draws the progress bar."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from ..hw.collectives import SWEEP_BYTES, SWEPT, sweep

    if group.get_rank() != 0:
        return sweep()
    with Progress(TextColumn("[bold]link sweep[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("", total=len(SWEPT) * len(SWEEP_BYTES))
        return sweep(progress=lambda text: bar.update(task, description=text, advance=1))


def _sweep_spawned(n: int, console) -> dict:
    """One NCCL rank per GPU of this host, spawned (torch.multiprocessing); rank 0's document."""
    from ..hw.collectives import sweep_on_rank
    from ..testing.distributed import spawn

    with console.status(f"[bold]link sweep[/]: all-gather and reduce-scatter, 1 MiB..1 GiB, on {n} GPUs "
                        f"({n} NCCL ranks spawned; ~10-30 s)"):
        return spawn(sweep_on_rank, n, backend="nccl", timeout_s=300.0)[0]


def link_sweep(console, force: bool = False, group=None) -> dict | None:
    """The link's ceiling for doctor: measured (or, outside torchrun, read from the cache unless `force`),
    printed on rank 0 and cached on GPUs; None, with a line saying why, where there is no link to measure."""
    import torch

    from ..hw.ceilings import device_fingerprint
    from ..hw.collectives import load_link, save_link

    why = _skip_reason(group)
    if why:
        console.print(f"link sweep skipped: {why}", soft_wrap=True)
        return None
    rank = group.get_rank() if group is not None else 0
    on_gpu = torch.cuda.is_available() and (group is None or group.get_backend() == "nccl")
    n = group.get_world_size() if group is not None else torch.cuda.device_count()
    # Under torchrun every rank must take the same branch: each sweeps, none reads the cache.
    cached = load_link(n) if on_gpu and group is None and not force else None
    link = cached or (_sweep_in_group(group, console) if group is not None else _sweep_spawned(n, console))
    if on_gpu and rank == 0 and cached is None:
        save_link(link, device_fingerprint())
    if rank == 0:
        print_link(link, console, cached=cached is not None)
    return link


def print_link(link: dict, console, cached: bool = False) -> None:
    t = Table(title=f"link: {link['ranks']} ranks, {link['backend']}{' (cached; --force measures again)' if cached else ''}",
              title_justify="left")
    for col in ("collective", "size", "ms", "algbw GB/s", "busbw GB/s"):
        t.add_column(col, justify="left" if col == "collective" else "right")
    for r in link["rows"]:
        t.add_row(r["collective"].replace("_", "-"), f"{r['bytes'] / 2**20:g} MiB", f"{r['ms']:.3f}",
                  f"{r['algbw_gbps']:.1f}", f"{r['busbw_gbps']:.1f}")
    console.print(t)
    peaks = ", ".join(f"{k.replace('_', '-')} {v:.1f}" for k, v in link["peak_busbw_gbps"].items())
    console.print(f"link ceiling: {link['busbw_gbps']:.1f} GB/s bus bandwidth (the best of the sweep; {peaks}); "
                  f"busbw = algbw x (n-1)/n, nccl-tests' convention", soft_wrap=True)
