"""Autotuning on top of `triton.autotune`.

`autotune` is `triton.autotune` except under the Triton interpreter (`TRITON_INTERPRET=1`), where
timing a config on the CPU means nothing and costs minutes: there only the first config runs.
"""

from __future__ import annotations

import functools
import os

import triton


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def autotune(configs: list, key: list[str], **kwargs):
    """`triton.autotune`; one config under the interpreter, and the first config the pruner keeps when
    KERNELKIT_TUNE=first (GPU correctness runs, where timing every config of every shape costs minutes)."""
    if interpreting():
        configs = configs[:1]
        kwargs.pop("prune_configs_by", None)
    elif os.environ.get("KERNELKIT_TUNE") == "first":
        prune = (kwargs.get("prune_configs_by") or {}).get("early_config_prune")
        if prune is None:
            configs = configs[:1]
        else:
            kwargs["prune_configs_by"] = {**kwargs["prune_configs_by"],
                                          "early_config_prune": lambda *a, **k: list(prune(*a, **k))[:1]}
    return triton.autotune(configs=configs, key=key, **kwargs)


_chosen: dict = {}


def launch(kernel, grid, key: tuple, *args, **kwargs):
    """Launch a `triton.autotune`d kernel, tuning on the first call for `key`.

    Afterwards the chosen config goes straight to the JIT function: the autotuner's per-call
    bookkeeping costs more CPU time than a small memory-bound kernel takes on the GPU.
    `key` must cover what the autotuner keys on (its key args and the tensors' dtypes).
    """
    cfg = _chosen.get((kernel, key))
    if cfg is None:
        out = kernel[grid](*args, **kwargs)
        _chosen[(kernel, key)] = kernel.best_config
        return out
    return kernel.fn[grid](*args, **kwargs, **cfg.all_kwargs())


def chosen_configs() -> list[dict]:
    """What `launch` tuned in this process: kernel, key and config, for benchmark logs."""
    out = []
    for (kernel, key), cfg in _chosen.items():
        fn = getattr(kernel, "fn", kernel)
        out.append({"kernel": getattr(fn, "__name__", str(fn)), "key": repr(key)[:300], "config": str(cfg)})
    return out


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device) -> int:
    """Streaming multiprocessors of `device` (a small stand-in on the CPU interpreter)."""
    if device.type == "cuda":
        return _sms(device.index if device.index is not None else 0)
    return 4


def row_tile_configs(rows=(1, 2, 4, 8, 16), warps=(4, 8, 16, 32)) -> list:
    """Configs for row-wise kernels: ROWS rows of one BLOCK_N-wide row per program, `num_warps` warps."""
    return [triton.Config({"ROWS": r}, num_warps=w) for r in rows for w in warps]


def prune_row_tiles(max_per_thread: int, max_tile: int = 16384):
    """An `early_config_prune` for row-wise kernels keyed on the BLOCK_N kwarg.

    Keeps tiles of at most `max_tile` elements (one row if a row alone is larger), with 2 to
    `max_per_thread` elements per thread: fewer leaves threads idle, more spills registers.
    """

    def prune(configs, named_args, **kwargs):
        block_n = kwargs.get("BLOCK_N", named_args.get("BLOCK_N"))
        keep = [c for c in configs
                if (c.kwargs["ROWS"] * block_n <= max_tile or c.kwargs["ROWS"] == 1)
                and 2 <= c.kwargs["ROWS"] * block_n / (c.num_warps * 32) <= max_per_thread]
        if not keep:
            one_row = [c for c in configs if c.kwargs["ROWS"] == 1]
            widest = max(one_row, key=lambda c: c.num_warps)
            if block_n / (widest.num_warps * 32) > max_per_thread:  # long rows: one row, spread widest
                keep = [widest]
            else:  # tiny rows: the most rows per program, fewest warps
                keep = [min(configs, key=lambda c: (-c.kwargs["ROWS"], c.num_warps))]
        return keep

    return prune
