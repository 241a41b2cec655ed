"""Measured ceilings of the present GPU, cached per device fingerprint.

The datasheet is a promise; the roofline kernelkit draws uses what the card actually does: the memory
roof (the best of a copy, a two-input add and a read-only sum over tensors far larger than L2), the copy
bandwidth on its own (what benchmarks quote as "% of copy"), the matrix peak per dtype through the vendor
library, and the launch floor (the time of the smallest kernel). A ceiling is the best the GPU does, so
that no op of a profile reads above 100% of it: each is the maximum over a sweep, each case timed as the
fastest of a few calls on a rested chip and of a short burst.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import subprocess
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

from .._version import __version__
from .specs import GPUSpec, lookup, names

# One step of the measurement: (label, fraction done) for a progress bar.
Progress = Callable[[str], None]


@dataclass
class Ceilings:
    gpu: str
    fingerprint: dict
    copy_gbps: float  # a device-to-device copy: bytes read + written per second, GB/s ("% of copy")
    tflops: dict[str, float | None]  # matrix peak per dtype key of specs.DTYPES
    launch_us: float  # median time of the smallest kernel
    l2_bytes: int = 0
    sms: int = 0
    details: dict = field(default_factory=dict)
    # The memory roof the roofline places ops under: the best GB/s over the memory patterns (copy, add, sum),
    # at least the copy's. None (a hand-made Ceilings) means the copy's figure.
    mem_gbps: float | None = None

    def __post_init__(self):
        if self.mem_gbps is None:
            self.mem_gbps = self.copy_gbps

    def ridge_point(self, dtype: str) -> float | None:
        peak = self.tflops.get(dtype)
        return None if peak is None else peak * 1e12 / (self.mem_gbps * 1e9)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Ceilings":
        return cls(**d)

    @classmethod
    def from_spec(cls, spec: GPUSpec) -> "Ceilings":
        """Datasheet figures in the shape of measured ones: what `--gpu NAME` predicts with."""
        return cls(gpu=spec.name, fingerprint={"gpu": spec.name, "source": "datasheet"},
                   copy_gbps=spec.mem_gbps, tflops=dict(spec.tflops), launch_us=4.0,
                   l2_bytes=int(spec.l2_mb * 1e6), sms=spec.sms, mem_gbps=spec.mem_gbps)


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import ctypes

        v = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v))
        return f"cuda-driver-api-{v.value}"
    except OSError:
        return "unknown"


def device_fingerprint(device: int | None = None) -> dict:
    """What the measured ceilings depend on: a change in any of these re-measures."""
    import torch
    import triton

    idx = torch.cuda.current_device() if device is None else device
    props = torch.cuda.get_device_properties(idx)
    return {
        "gpu": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sms": props.multi_processor_count,
        "driver": _driver_version(),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }


def cache_dir() -> Path:
    root = os.environ.get("KERNELKIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kernelkit")
    return Path(root)


def _kernelkit_version() -> str:
    return __version__


# Bump when what is measured or how changes (the sweep, the timing, the inputs): figures cached by an older
# method are then measured again. 1 (no number in the key): 300 ms medians of six NN shapes; 2: the fastest
# call of short bursts over both layouts and more shapes; 3: also the fastest call on a rested chip, the LM
# heads' long-k input gradients, and the memory roof as the best of copy, add and sum (mem_gbps).
CACHE_VERSION = 3


def _cache_path(fp: dict) -> Path:
    # Beside the device fingerprint: kernelkit's version (a release that measures differently must not read
    # what the previous one wrote), the cache version (a checkout keeps its version number between releases)
    # and the sweep's cases.
    keyed = {**fp, "kernelkit": _kernelkit_version(), "cache_version": CACHE_VERSION,
             "matmul_cases": {key: [c.label for c in matmul_cases(key)] for key in MATMUL_LAYOUTS}}
    key = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "ceilings" / f"{key}.json"


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _ceilings_from_cache(d, fp: dict) -> Ceilings:
    """A cached file's contents as Ceilings; ValueError saying what is wrong with them otherwise."""
    if not isinstance(d, dict):
        raise ValueError(f"expected a JSON object, found {type(d).__name__}")
    want = {f.name for f in fields(Ceilings)}
    if set(d) != want:
        missing, extra = sorted(want - set(d)), sorted(set(d) - want)
        raise ValueError(f"keys differ from Ceilings' fields (missing {missing}, extra {extra})")
    if not isinstance(d["gpu"], str) or not isinstance(d["fingerprint"], dict) or not isinstance(d["details"], dict):
        raise ValueError("gpu must be a string, fingerprint and details objects")
    if not all(_is_number(d[k]) and d[k] > 0 for k in ("copy_gbps", "mem_gbps")) or not _is_number(d["launch_us"]):
        raise ValueError("copy_gbps and mem_gbps must be positive numbers and launch_us a number")
    if not all(isinstance(d[k], int) and not isinstance(d[k], bool) for k in ("l2_bytes", "sms")):
        raise ValueError("l2_bytes and sms must be integers")
    tflops = d["tflops"]
    if not isinstance(tflops, dict) or not all(isinstance(k, str) and (v is None or _is_number(v))
                                               for k, v in tflops.items()):
        raise ValueError("tflops must map dtype names to numbers or null")
    if d["fingerprint"] != fp:
        raise ValueError("it was measured on another device fingerprint")
    return Ceilings(**d)


def _read_cache(path: Path, fp: dict) -> Ceilings | None:
    """The cached ceilings, or None (a miss) when there are none or they cannot be trusted."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        reason = e
    else:
        try:
            return _ceilings_from_cache(json.loads(text), fp)
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            reason = e
    warnings.warn(f"kernelkit: ignoring unreadable ceilings cache {path} ({reason}); measuring again",
                  stacklevel=3)
    return None


def _write_cache(path: Path, ceil: Ceilings) -> None:
    _atomic_write(path, ceil.to_json())


def _atomic_write(path: Path, doc: dict) -> None:
    """Write `doc` as JSON through a temp file in the same directory and os.replace, so a reader in another
    process sees the old file or the new one, never half of one."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, prefix=path.stem + ".",
                                         suffix=".tmp", delete=False) as f:
            tmp = f.name
            json.dump(doc, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache costs a re-measure next time, not the result in hand
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        warnings.warn(f"kernelkit: could not write the ceilings cache {path} ({e})", stacklevel=4)


def _median_ms(fn, rep_ms: int = 200) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=50, rep=rep_ms, return_mode="median")


# Every case of a ceiling is timed two ways, and the faster counts. Isolated: the fastest of ISOLATED_CALLS
# calls, each after the GPU has idled for REST_S, which is how a profile sees a GEMM: one call between a model's
# memory-bound kernels, on a chip below its power limit. Burst: the fastest call of a short run back to back,
# where the card reaches its power limit and lowers its clocks. On the H100 the bursts gave bf16 798 TF/s at
# best (8192x32000x2048: 730, 8192x2048x32768: 784) while a profile of the llama example ran its LM head's
# input gradient (8192x2048x32000) at ~856 (issue 26). The details keep both figures of every case.
REST_S = 0.02
ISOLATED_CALLS = 5
# A spin of ~0.1 ms on one SM ahead of each timed call holds the stream while the host enqueues the start
# event and the call, so the call's launch latency (10-20 us, up to 5% of a 1 GiB memory pattern) is not
# timed. One spinning thread draws next to no power: the chip stays rested.
GUARD_CYCLES = 200_000


def _timed_call_ms(fn, start, end) -> float:
    import torch

    torch.cuda._sleep(GUARD_CYCLES)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _isolated_ms(fn, calls: int = ISOLATED_CALLS, rest_s: float = REST_S) -> float:
    """The fastest of `calls` calls, each timed alone after the GPU has idled `rest_s` seconds. The rest is a
    host sleep after a synchronize: a GPU-side spin over the whole chip would keep it busy, not rested."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(calls):
        torch.cuda.synchronize()
        time.sleep(rest_s)
        best = min(best, _timed_call_ms(fn, start, end))
    return best


def _burst_ms(fn, min_reps: int = 3, max_reps: int = 10, rep_ms: float = 25.0) -> float:
    """The fastest call of a burst, each call timed alone and the next one started at once: at least
    `min_reps` calls, at most `max_reps`, stopping once `rep_ms` of them have run."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best, spent = math.inf, 0.0
    for i in range(max_reps):
        ms = _timed_call_ms(fn, start, end)
        best, spent = min(best, ms), spent + ms
        if i + 1 >= min_reps and spent >= rep_ms:
            break
    return best


def time_calls(fn) -> dict[str, float]:
    """Milliseconds of `fn`'s fastest call timed both ways, {"isolated": ms, "burst": ms}, after one untimed
    call (cuBLAS picks its algorithm and allocates its workspace there). The isolated calls run first, before
    the burst has warmed the chip."""
    import torch

    fn()
    torch.cuda.synchronize()
    return {"isolated": _isolated_ms(fn), "burst": _burst_ms(fn)}


def _by_timing(rates: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """{case: {timing: rate}} -> {timing: {case: rate}}, as the details keep them."""
    out: dict[str, dict[str, float]] = {}
    for label, by in rates.items():
        for timing, r in by.items():
            out.setdefault(timing, {})[label] = r
    return out


# The memory roof is the best the memory does, not the copy alone: a profile's elementwise ops read two inputs
# per output and reductions only read, both faster than a copy's one read per write (on the H100 aten::add of
# 4x2048x2048 bf16 ran at ~3350 GB/s of ideal bytes against a 3018 GB/s copy). Every tensor of a pattern has
# MEMORY_BYTES, 20x the H100's 50 MB L2, so the cache helps none of them; each pattern runs in a 2-byte and a
# 4-byte dtype (torch vectorizes their loads differently).
MEMORY_BYTES = 1 << 30
MEMORY_PATTERNS = {"copy": (1, 1), "add": (2, 1), "sum": (1, 0)}  # tensors read, tensors written
MEMORY_DTYPES = ("bf16", "fp32")


def memory_call(pattern: str, dtype_key: str, nbytes: int = MEMORY_BYTES, device="cuda", seed: int = 0):
    """(fn, operands): a zero-argument call of `pattern` over tensors of `nbytes` each, and those tensors.
    copy: out.copy_(x); add: out = x + y; sum: x.sum() (its one-element result is not counted)."""
    import torch

    dt = getattr(torch, _DTYPES[dtype_key])
    gen = torch.Generator(device=device).manual_seed(seed)
    n = nbytes // dt.itemsize
    x = torch.empty(n, device=device, dtype=dt).uniform_(-1, 1, generator=gen)
    if pattern == "sum":
        return (lambda: x.sum()), (x,)
    out = torch.empty_like(x)
    if pattern == "copy":
        return (lambda: out.copy_(x)), (x, out)
    if pattern == "add":
        y = torch.empty_like(x).uniform_(-1, 1, generator=gen)
        return (lambda: torch.add(x, y, out=out)), (x, y, out)
    raise ValueError(f"pattern={pattern!r}: one of {', '.join(MEMORY_PATTERNS)}")


def time_memory_pattern(pattern: str, dtype_key: str) -> dict[str, float]:
    """Milliseconds of `pattern`'s fastest call on the present GPU, both ways (see `time_calls`)."""
    import torch

    try:
        fn, operands = memory_call(pattern, dtype_key)
        return time_calls(fn)
    finally:
        fn = operands = None
        torch.cuda.empty_cache()


def measure_memory_gbps(time_pattern=None) -> tuple[float, float, dict[str, dict[str, float]]]:
    """(the memory roof, the copy's GB/s, {"copy bf16": {timing: GB/s}, ...}): the best rate over every pattern
    and dtype, and over the copies alone. GB/s count the bytes a pattern reads and writes, MEMORY_BYTES a tensor.
    `time_pattern(pattern, dtype_key)` (default `time_memory_pattern`) returns milliseconds per timing."""
    time_pattern = time_pattern or time_memory_pattern
    rates: dict[str, dict[str, float]] = {}
    for pattern, (reads, writes) in MEMORY_PATTERNS.items():
        for key in MEMORY_DTYPES:
            moved = (reads + writes) * MEMORY_BYTES
            rates[f"{pattern} {key}"] = {timing: moved / (ms * 1e-3) / 1e9
                                         for timing, ms in time_pattern(pattern, key).items()}
    best = {label: max(by.values()) for label, by in rates.items()}
    copy = max(v for label, v in best.items() if label.startswith("copy "))
    return max(best.values()), copy, rates


# The matrix peak is the best rate the vendor library (cuBLAS, through torch) reaches over a sweep of large
# products, each in both layouts a model runs: "NT" is x @ W.T (F.linear's forward: b the transpose of a
# row-major (n, k) weight), "NN" a @ b with b row-major (k, n) (the input gradient). A profiled GEMM must not
# read above 100% of a roof measured at an easier shape or in a slower way. On the H100 six shapes timed as
# 300 ms medians of back-to-back calls gave bf16 683-738 TF/s (benchmarks/results/h100/doctor.json), while
# in a profile of the llama example the same LM-head GEMMs ran at 775-844 (experiments/h100/profile-llama):
# a long run of GEMMs on random data holds the card at its power limit, at lower clocks, where one GEMM
# between a model's other ops starts from a cooler chip. Hence `time_calls`: rested calls beside a burst.
MATMUL_SHAPES = (  # (m, n, k), the most telling first (a dtype's time budget may cut the tail)
    (8192, 128256, 4096),  # Llama-3's LM head: 8192 tokens x 128256 vocabulary x 4096 hidden
    (8192, 2048, 32000),  # an LM head's input gradient (long k): the profile example's, dlogits @ W
    (8192, 4096, 128256),  # Llama-3's
    (128256, 4096, 8192),  # Llama-3's weight gradient: vocabulary x hidden, summed over the tokens
    (8192, 32000, 2048),  # TinyLlama's / Llama-2's LM head (the profile example)
    (8192, 2048, 32768),  # long k
    (8192, 8192, 8192), (12288, 12288, 12288), (16384, 16384, 16384), (4096, 4096, 4096))
# cuBLAS's fp8 GEMM takes b column-major only (NT): its variants are the scale recipes instead.
MATMUL_LAYOUTS = {"bf16": ("NT", "NN"), "fp16": ("NT", "NN"), "tf32": ("NT", "NN"), "fp32": ("NT", "NN"),
                  "fp8": ("tensorwise", "rowwise")}
MATMUL_BUDGET_S = 4.0  # per dtype: the cases left when it is spent are skipped (a slow GPU; the H100: ~3 s)
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "tf32": "float32", "fp32": "float32", "fp8": "bfloat16"}


@dataclass(frozen=True)
class MatmulCase:
    """One product of the sweep: out (m, n) = a (m, k) @ b (k, n), b laid out as `layout` says."""
    m: int
    n: int
    k: int
    layout: str

    @property
    def label(self) -> str:
        return f"{self.m}x{self.n}x{self.k} {self.layout}"

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


def matmul_cases(dtype_key: str) -> list[MatmulCase]:
    """The sweep of one dtype key, in the order it is timed. Plain fp32 runs on the CUDA cores (slow, and
    4096^3 already fills the chip): that one shape only."""
    shapes = MATMUL_SHAPES[-1:] if dtype_key == "fp32" else MATMUL_SHAPES
    return [MatmulCase(m, n, k, layout) for m, n, k in shapes for layout in MATMUL_LAYOUTS[dtype_key]]


def matmul_call(dtype_key: str, case: MatmulCase, device="cuda", seed: int = 0):
    """(fn, operands): a zero-argument call computing `case` as a model would, and the tensors it reads.
    Operands are N(0, 1) draws, never constants: the H100 runs a GEMM of zeros (less switching, less power)
    faster than one of real data. fp8 goes through torch._scaled_mm (e4m3, bf16 out) with one scale per
    operand (tensorwise) or per row of a and column of b (rowwise)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    dt = getattr(torch, _DTYPES[dtype_key])

    def randn(*shape):
        return torch.randn(shape, device=device, dtype=dt, generator=gen)

    if dtype_key == "fp8":
        a = randn(case.m, case.k).to(torch.float8_e4m3fn)
        b = randn(case.n, case.k).to(torch.float8_e4m3fn).t()  # column-major, as cuBLAS takes it
        if case.layout == "tensorwise":
            sa, sb = (torch.rand((), device=device, generator=gen) + 0.5 for _ in range(2))
        else:
            sa = torch.rand((case.m, 1), device=device, generator=gen) + 0.5
            sb = torch.rand((1, case.n), device=device, generator=gen) + 0.5

        def fn():
            return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

        return fn, (a, b, sa, sb)
    a = randn(case.m, case.k)
    b = randn(case.n, case.k).t() if case.layout == "NT" else randn(case.k, case.n)

    def fn():
        return a @ b

    return fn, (a, b)


def time_matmul_case(dtype_key: str, case: MatmulCase) -> dict[str, float]:
    """Milliseconds of the fastest call of `case` on the present GPU, both ways (see `time_calls`)."""
    import torch

    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype_key == "tf32"
    try:
        fn, operands = matmul_call(dtype_key, case)
        return time_calls(fn)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
        fn = operands = None
        torch.cuda.empty_cache()


def sweep_matmul(dtype_key: str, cases, time_case=None, budget_s: float = MATMUL_BUDGET_S,
                 clock=time.perf_counter) -> tuple[dict[str, dict[str, float]], list[str]]:
    """TFLOP/s of each case per timing ({label: {"isolated": rate, "burst": rate}}) and the labels skipped:
    those that did not fit in memory, and all that were left when `budget_s` seconds had gone.
    `time_case(dtype_key, case)` returns milliseconds per timing."""
    import torch

    time_case = time_case or time_matmul_case
    rates: dict[str, dict[str, float]] = {}
    skipped: list[str] = []
    t0 = clock()
    for case in cases:
        if clock() - t0 > budget_s:
            skipped.append(case.label)
            continue
        try:
            ms = time_case(dtype_key, case)
        except torch.cuda.OutOfMemoryError:  # a smaller GPU: the shapes that fit decide
            skipped.append(case.label)
            continue
        rates[case.label] = {timing: case.flops / (t * 1e-3) / 1e12 for timing, t in ms.items()}
    return rates, skipped


def _has_fp8() -> bool:
    import torch

    return hasattr(torch, "float8_e4m3fn") and torch.cuda.get_device_capability() >= (8, 9)


def measure_matmul_tflops(dtype_key: str, time_case=None) -> tuple[float | None, dict[str, dict[str, float]],
                                                                     list[str]]:
    """(the matrix peak of `dtype_key`, TFLOP/s per case and timing, cases skipped): the best rate over
    `matmul_cases` and both timings. None where the GPU has no such unit (fp8 before sm_89) or no case fit.
    `time_case` (default `time_matmul_case`) as in `sweep_matmul`."""
    if dtype_key == "fp8" and not _has_fp8():
        return None, {}, []
    rates, skipped = sweep_matmul(dtype_key, matmul_cases(dtype_key), time_case)
    return max((r for by in rates.values() for r in by.values()), default=None), rates, skipped


def measure_launch_us() -> float:
    """The floor under any op: the median time of a one-element kernel."""
    import torch

    x = torch.zeros(1, device="cuda")
    return _median_ms(lambda: x.add_(1.0), rep_ms=100) * 1e3


def measure_ceilings(force: bool = False, progress: Progress | None = None) -> Ceilings:
    """Measure (or load from cache) the present GPU's ceilings.

    The cache key is the device fingerprint (GPU, driver, CUDA, torch, Triton), kernelkit's version and
    CACHE_VERSION, so an upgrade of any of them measures again; so does a cache file that cannot be read.
    `force=True` ignores the cache.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU is visible: measure_ceilings() needs one "
                           "(use Ceilings.from_spec(lookup(name)) to plan from a datasheet)")
    fp = device_fingerprint()
    path = _cache_path(fp)
    if not force:
        cached = _read_cache(path, fp)
        if cached is not None:
            return cached
    ceil = _measure(fp, progress)
    _write_cache(path, ceil)
    return ceil


def _measure(fp: dict, progress: Progress | None = None) -> Ceilings:
    import torch

    step = progress or (lambda label: None)
    step("memory bandwidth")
    mem, copy, mem_rates = measure_memory_gbps()
    tflops: dict[str, float | None] = {}
    mm_rates: dict[str, dict[str, dict[str, float]]] = {}
    skipped: dict[str, list[str]] = {}
    for key in ("bf16", "fp16", "fp8", "tf32", "fp32"):
        step(f"{key} matrix peak")
        tflops[key], rates, left = measure_matmul_tflops(key)
        if rates:
            mm_rates[key] = rates
        if left:
            skipped[key] = left
        torch.cuda.empty_cache()
    step("launch floor")
    launch = measure_launch_us()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    details = {"memory_gbps_by_pattern": {label: max(by.values()) for label, by in mem_rates.items()},
               "memory_timing": f"tensors of {MEMORY_BYTES >> 20} MiB; GB/s of the bytes read and written (copy: "
                                "1 tensor + 1, add: 2 + 1, sum: 1 + 0); mem_gbps the best pattern, copy_gbps the best "
                                "copy",
               "matmul_tflops_by_shape": {key: {label: max(by.values()) for label, by in rates.items()}
                                          for key, rates in mm_rates.items()},
               "matmul_skipped": skipped,
               "matmul_timing": "cuBLAS via torch, N(0, 1) inputs; the peak is the best case",
               "timing": f"a case's figure is the faster of two timings, both kept below: isolated, the fastest of "
                         f"{ISOLATED_CALLS} calls each after {REST_S * 1e3:.0f} ms of idle GPU (how a profile sees a "
                         "GEMM); burst, the fastest of 3-10 calls back to back (power-limited clocks)"}
    for timing, r in _by_timing(mem_rates).items():
        details[f"memory_gbps_{timing}"] = r
    for key, rates in mm_rates.items():
        for timing, r in _by_timing(rates).items():
            details.setdefault(f"matmul_tflops_{timing}", {})[key] = r
    return Ceilings(gpu=props.name, fingerprint=fp, copy_gbps=copy, tflops=tflops, launch_us=launch,
                    l2_bytes=int(getattr(props, "L2_cache_size", 0)), sms=props.multi_processor_count,
                    details=details, mem_gbps=mem)


def ceilings_for(gpu: str | None = None) -> tuple[Ceilings, bool]:
    """The ceilings to judge against: measured on the present GPU, or a named datasheet.

    Returns (ceilings, measured). With a GPU present and no name, measures (cached).
    """
    if gpu is None:
        import torch

        if torch.cuda.is_available():
            return measure_ceilings(), True
        gpu = "h100"
    spec = lookup(gpu)
    if spec is None:
        raise ValueError(f"gpu={gpu!r} is not in the datasheet table; known: {', '.join(names())}")
    return Ceilings.from_spec(spec), False
