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
    if interpreting():
        configs = configs[:1]
        kwargs.pop("prune_configs_by", None)
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


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device) -> int:
    """Streaming multiprocessors of `device` (a small stand-in on the CPU interpreter)."""
    if device.type == "cuda":
        return _sms(device.index if device.index is not None else 0)
    return 4
