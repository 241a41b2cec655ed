"""Autotuning on top of `triton.autotune`.

`autotune` is `triton.autotune` except under the Triton interpreter (`TRITON_INTERPRET=1`), where
timing a config on the CPU means nothing and costs minutes: there only the first config runs.
`launch` keeps what it tuned on disk (`tune/cache.py`), so the next process starts tuned.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
from typing import Optional

import torch
import triton
from triton import knobs
from triton.runtime.autotuner import Autotuner
from triton.runtime.errors import OutOfResources

from . import cache


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_BUILT_INTERPRETED = interpreting()


def kernels_interpreted() -> bool:
    """Whether kernelkit's kernels run in Triton's interpreter. Triton decides as each kernel is defined,
    so this is TRITON_INTERPRET as kernelkit was imported: setting it later does not make them run on CPU
    tensors (they stay compiled for the GPU)."""
    return _BUILT_INTERPRETED


def autotune(configs: list, key: list[str], **kwargs):
    """`triton.autotune`; one config under the interpreter, and the first config the pruner keeps when
    KERNELKIT_TUNE=first (GPU correctness runs, where timing every config of every shape costs minutes)."""
    untuned = interpreting() or os.environ.get("KERNELKIT_TUNE") == "first"
    failed: Optional[set] = None
    if interpreting():
        configs = configs[:1]
        kwargs.pop("prune_configs_by", None)
    elif untuned:
        prune = (kwargs.get("prune_configs_by") or {}).get("early_config_prune")
        if prune is None:
            configs = configs[:1]
        else:
            # The first config the pruner keeps that has not failed to launch here (see _tune: out of shared
            # memory, which the autotuner's timing would have skipped).
            failed = set()
            kwargs["prune_configs_by"] = {**kwargs["prune_configs_by"], "early_config_prune": lambda *a, **k: (
                [c for c in prune(*a, **k) if str(c) not in failed] or list(prune(*a, **k)))[:1]}
    tuner = triton.autotune(configs=configs, key=key, **kwargs)
    if not untuned:
        return tuner

    def mark(fn):  # its choices are not tunings: `launch` neither looks them up in the cache nor stores them
        kernel = tuner(fn)
        kernel.kernelkit_untuned = True
        kernel.kernelkit_failed = failed
        return kernel

    return mark


def capturing() -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph (`torch.cuda.graph`, torch.compile's
    mode="reduce-overhead"): then nothing may synchronize with the host, and what syncs is skipped or refused."""
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:  # a CPU-only torch build: no stream to capture
        return False


def cdiv(a: int, b: int) -> int:
    """Ceiling division for host code (Triton 3.6's `triton.cdiv` is a constexpr function whose
    wrapper costs microseconds a call on the launch path)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), for host code; see `cdiv`."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


class _Entry:
    """What `launch` keeps per (kernel, key): the tuned config and the compiled kernels it has seen,
    keyed by everything Triton specializes on."""

    __slots__ = ("jit", "cfg", "cfg_kwargs", "compiled")

    def __init__(self, jit, cfg):
        self.jit, self.cfg = jit, cfg
        self.cfg_kwargs = cfg.all_kwargs() if cfg is not None else {}
        self.compiled: dict = {}


_chosen: dict = {}
_MAX_SPECS = 512  # per (kernel, key): past this, launches take Triton's own path (no unbounded growth)
_Tensor = torch.Tensor
_I32_MIN, _I32_MAX, _U64 = -(1 << 31), (1 << 31) - 1, 1 << 63
_PLAIN = (float, bool, type(None))
_MISSING = object()
_driver_fns = None  # (get_current_device, get_current_stream) of Triton's active driver, on first use


_compiling = torch.compiler.is_compiling

# Read once, like Triton decides between JIT and interpreter when a kernel is defined.
LEAN = not interpreting() and os.environ.get("KERNELKIT_LEAN_LAUNCH", "1") != "0"


def _spec(args, kwargs, device):
    """A key at least as fine as Triton's specialization of this call, or None when an argument is of a
    kind it does not model. Triton 3.6 specializes a tensor on its dtype and 16-byte alignment, an int
    on being 1, its divisibility by 16 and its width (i32, i64, u64); floats, bools and None on their
    type; a TensorDescriptor on its dtype, block shape and layout. Keyword arguments (constexprs, launch
    options) enter by value."""
    key = [device]
    put = key.append
    for a in args:  # ints first: most arguments are sizes and strides
        if type(a) is int:
            if a == 1:
                put(1)
            elif _I32_MIN <= a <= _I32_MAX:
                put(2 if a & 15 else 3)
            elif a < _U64:
                put(4 if a & 15 else 5)
            else:
                put(6 if a & 15 else 7)
        elif isinstance(a, _Tensor):
            put(a.dtype)
            put(a.data_ptr() & 15 == 0)
        elif isinstance(a, _PLAIN):
            put(type(a))
        elif type(a).__name__ == "TensorDescriptor" and hasattr(a, "block_shape"):
            # a host TMA descriptor (Triton's or Gluon's): specialized on its dtype, box and shared layout (the
            # launcher builds the CUtensorMap from the object on every launch, shape and strides included)
            try:
                put((type(a), a.base.dtype, tuple(a.block_shape), getattr(a, "layout", None),
                     getattr(a, "padding", None)))
            except (AttributeError, TypeError):
                return None
        else:
            return None
    for item in kwargs.items():
        if isinstance(item[1], _Tensor):  # by value it would pin the tensor and compare tensors on lookup
            return None
        put(item)
    return tuple(key)  # unhashable keyword values make the cache lookup raise TypeError: Triton's path


class _Compiled:
    __slots__ = ("run", "function", "metadata", "tail")

    def __init__(self, ck, tail):
        self.run, self.function, self.metadata = ck.run, ck.function, ck.packed_metadata
        self.tail = tail


def _remember(entry, spec, ck, grid, nargs, kw):
    """After Triton's own path compiled and launched `ck` for `spec`: keep what a direct launch needs,
    or None (meaning: always take Triton's path) when the call does not fit the lean path."""
    compiled = None
    jit = entry.jit
    if ck is not None and not isinstance(ck, bool) and hasattr(ck, "packed_metadata"):
        tail = []
        for p in jit.params[nargs:]:
            if p.name in kw:
                tail.append(kw[p.name])
            elif p.default is not inspect.Parameter.empty:
                tail.append(p.default)
            else:
                tail = None
                break
        if callable(grid):
            try:
                grid(kw)
            except (KeyError, TypeError, IndexError):  # the grid reads positional arguments
                tail = None
        if tail is not None:
            compiled = _Compiled(ck, tuple(tail))
    if len(entry.compiled) < _MAX_SPECS:
        entry.compiled[spec] = compiled


def launch(kernel, grid, key, *args, **kwargs):
    """Launch a Triton kernel (`triton.autotune`d or plain `triton.jit`), tuning on the first call for `key`.

    Afterwards the chosen config goes straight to the JIT function (the autotuner's per-call bookkeeping
    costs more CPU time than a small memory-bound kernel takes on the GPU), and, on the GPU, calls whose
    specialization has been compiled before go straight to the compiled kernel's launcher: Triton's
    `JITFunction.run` re-binds and re-specializes every argument, builds launch metadata and calls its
    (empty) hook chains on every launch, tens of microseconds of host time per call.

    The first call for a `key` takes the config stored by an earlier process for this machine, kernel source and
    tuning key (`tune/cache.py`), and tunes (then stores) only when there is none.
    Under CUDA graph capture (`capturing()`) tuning cannot run (timing configs synchronizes with the host): a first
    call that would tune raises RuntimeError, while one whose config is known (tuned earlier in this process, in
    the persistent cache, or untuned: the interpreter, KERNELKIT_TUNE=first, a single config) launches it as usual.
    So run each op once eagerly at the shapes to capture (the warm-up `torch.cuda.graph` and torch.compile's
    cudagraphs want anyway).
    `key` must cover what the autotuner keys on (its key args and the tensors' dtypes); None for a plain
    JIT kernel. A callable `grid` may read only keyword (constexpr and config) arguments on the lean path
    (checked on first use; other grids take Triton's path). `KERNELKIT_LEAN_LAUNCH=0` (read at import;
    `tune.LEAN` at run time) turns the direct launch off; so do Triton's launch hooks (e.g. proton's).
    """
    if _compiling():
        # Dynamo tracing (kernels launched outside a custom op, e.g. fp8_linear's autograd.Function): Triton's own
        # `kernel[grid](...)`, which it records as a kernel call. Tracing this function's caches instead breaks
        # the graph there and recompiles the frame after it per argument count (the fp8 step under torch.compile
        # fell back to eager: 108 ms against 69).
        return kernel[grid](*args, **kwargs)
    entry = _chosen.get((kernel, key))
    if entry is None:
        if not isinstance(kernel, Autotuner):
            entry = _chosen[(kernel, key)] = _Entry(kernel, None)
        else:
            entry = _known(kernel, key, args, kwargs)
            if entry is None:
                return _tune(kernel, grid, key, args, kwargs)
    kw = {**kwargs, **entry.cfg_kwargs} if entry.cfg is not None else kwargs
    if not LEAN or _hooks_installed():
        return entry.jit[grid](*args, **kw)
    device = _get_device()
    spec = _spec(args, kwargs, device)
    if spec is None:
        return entry.jit[grid](*args, **kw)
    try:
        compiled = entry.compiled.get(spec, _MISSING)
    except TypeError:
        return entry.jit[grid](*args, **kw)
    if compiled is _MISSING:
        ck = entry.jit[grid](*args, **kw)
        _remember(entry, spec, ck, grid, len(args), kw)
        return ck
    if compiled is None:
        return entry.jit[grid](*args, **kw)
    g = grid(kw) if callable(grid) else grid
    n = len(g)
    compiled.run(g[0], g[1] if n > 1 else 1, g[2] if n > 2 else 1, _get_stream(device), compiled.function,
                 compiled.metadata, None, None, None, *args, *compiled.tail)
    return None


# What tuning cost this process, for `kernelkit check` and `bench` to report: seconds spent tuning and
# (kernel, tuning key)s tuned; one record per first launch of an autotuned (kernel, key): {"kernel", "key",
# "config", "seconds" (of that launch, compiling included), "source"}, source "tuned", "cache" (the persistent
# cache) or "untuned" (the interpreter, KERNELKIT_TUNE=first: the first config); and `on_tune(event, record)`,
# when set, called with "start" before a tuning and "done" after it.
tuning_seconds = 0.0
tuned_keys = 0
tune_log: list[dict] = []
on_tune = None


def _tuned(kernel) -> bool:
    """Whether the autotuner times configs at all (not under the interpreter or KERNELKIT_TUNE=first)."""
    return len(kernel.configs) > 1 and not getattr(kernel, "kernelkit_untuned", False)


def _persist() -> bool:
    return cache.enabled() and not interpreting()


def _record(kernel, tkey, cfg, seconds: float, source: str) -> dict:
    rec = {"kernel": kernel.base_fn.__name__, "key": tkey, "config": cache.describe(cfg), "seconds": seconds,
           "source": source}
    tune_log.append(rec)
    return rec


def _known(kernel, key, args, kwargs):
    """The _Entry for a first launch of (kernel, key) whose config needs no tuning: the autotuner chose it in
    this process under another `key`, or the persistent cache holds it. None otherwise."""
    if not _tuned(kernel) or any(c.pre_hook for c in kernel.configs):  # pre_hooks run in Autotuner.run
        return None
    tkey = cache.tuning_key(kernel, args, kwargs)
    cfg = kernel.cache.get(tkey)
    if cfg is None and _persist():
        cfg = cache.lookup(kernel, tkey)
        if cfg is not None:
            kernel.cache[tkey] = cfg  # the autotuner's own state as if it had tuned: Triton's path agrees
            _record(kernel, tkey, cfg, 0.0, "cache")
    if cfg is None:
        return None
    kernel.best_config = cfg
    entry = _chosen[(kernel, key)] = _Entry(kernel.fn, cfg)
    return entry


def _tune(kernel, grid, key, args, kwargs):
    """First launch through the autotuner (which tunes a new tuning key), then store what it chose."""
    global tuning_seconds, tuned_keys
    tkey = cache.tuning_key(kernel, args, kwargs) if _tuned(kernel) else None
    tuning = tkey is not None and tkey not in kernel.cache
    if tuning and capturing():
        raise RuntimeError(
            f"kernelkit: {kernel.base_fn.__name__} would autotune its first launch at tuning key {tkey} inside a CUDA "
            f"graph capture, where timing configs is impossible (it synchronizes): run the op once eagerly at this "
            f"shape and dtype before capturing (the warm-up torch.cuda.graph wants anyway), keep its config in the "
            f"persistent tuning cache, or set KERNELKIT_TUNE=first to launch the first config untimed")
    if tuning and on_tune is not None:
        on_tune("start", {"kernel": kernel.base_fn.__name__, "key": tkey})
    start = time.perf_counter()
    failed = getattr(kernel, "kernelkit_failed", None)
    while True:
        try:
            out = kernel[grid](*args, **kwargs)
            break
        except OutOfResources:
            # KERNELKIT_TUNE=first launches one config untimed: one that does not fit this GPU (which timing
            # would have skipped) is set aside and the pruner's next is tried.
            if failed is None or kernel.best_config is None or str(kernel.best_config) in failed:
                raise
            failed.add(str(kernel.best_config))
            kernel.cache.clear()
    _chosen[(kernel, key)] = _Entry(kernel.fn, kernel.best_config)
    seconds = time.perf_counter() - start
    if tkey is None:
        _record(kernel, None, kernel.best_config, seconds, "untuned")
    elif tuning:
        tuning_seconds += seconds
        tuned_keys += 1
        rec = _record(kernel, tkey, kernel.best_config, seconds, "tuned")
        if _persist():
            cache.store(kernel, tkey, kernel.best_config, seconds)
        if on_tune is not None:
            on_tune("done", rec)
    return out


def _get_device():
    global _driver_fns
    if _driver_fns is None:
        from triton.runtime.driver import driver

        _driver_fns = (driver.active.get_current_device, driver.active.get_current_stream)
    return _driver_fns[0]()


def _get_stream(device):
    return _driver_fns[1](device)


def _hooks_installed() -> bool:
    rt = knobs.runtime
    return bool(rt.launch_enter_hook.calls or rt.launch_exit_hook.calls)


def chosen_configs() -> list[dict]:
    """What `launch` tuned in this process: kernel, key and config, for benchmark logs."""
    out = []
    for (kernel, key), entry in _chosen.items():
        if entry.cfg is None:
            continue
        fn = entry.jit
        out.append({"kernel": getattr(fn, "__name__", str(fn)), "key": repr(key)[:300], "config": str(entry.cfg)})
    return out


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _tma_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_tma_allocator() -> None:
    """Tensor descriptors made inside a kernel (tl.make_tensor_descriptor) live in a global scratch buffer that
    Triton asks its allocator for: set one (a torch allocation) unless the user has set their own."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_tma_scratch)


def tma_device(t: torch.Tensor) -> bool:
    """Whether tensor descriptors can read `t` where it lives: a Hopper-or-newer GPU, or the CPU under the
    interpreter (which emulates them)."""
    if t.is_cuda:
        return torch.cuda.get_device_capability(t.device)[0] >= 9
    return interpreting()


def forget(kernel) -> None:
    """Drop what this process chose for an autotuned `kernel` (its autotuner's cache and `launch`'s entries), so
    that the next launch tunes again over its current `configs` (A/B scripts that swap a kernel's config list)."""
    kernel.cache.clear()
    for key in [k for k in _chosen if k[0] is kernel]:
        del _chosen[key]


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
