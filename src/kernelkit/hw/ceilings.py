"""Measured ceilings of the present GPU, cached per device fingerprint.

The datasheet is a promise; the roofline kernelkit draws uses what the card actually does:
copy bandwidth (bytes read + written by a large device-to-device copy), the matrix peak per dtype
through the vendor library, and the launch floor (the time of the smallest kernel).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import subprocess
import tempfile
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

from .specs import GPUSpec, lookup, names

# One step of the measurement: (label, fraction done) for a progress bar.
Progress = Callable[[str], None]


@dataclass
class Ceilings:
    gpu: str
    fingerprint: dict
    copy_gbps: float  # bytes read + written per second, GB/s
    tflops: dict[str, float | None]  # matrix peak per dtype key of specs.DTYPES
    launch_us: float  # median time of the smallest kernel
    l2_bytes: int = 0
    sms: int = 0
    details: dict = field(default_factory=dict)

    def ridge_point(self, dtype: str) -> float | None:
        peak = self.tflops.get(dtype)
        return None if peak is None else peak * 1e12 / (self.copy_gbps * 1e9)

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
                   l2_bytes=int(spec.l2_mb * 1e6), sms=spec.sms)


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
    from .. import __version__  # lazily: kernelkit/__init__ imports the ops, which import hw

    return __version__


def _cache_path(fp: dict) -> Path:
    # kernelkit's own version is in the key: a release that measures differently (another copy size,
    # another matmul) must not read figures the previous one wrote.
    keyed = {**fp, "kernelkit": _kernelkit_version(), "matmul_shapes": [list(s) for s in MATMUL_SHAPES]}
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
    if not (_is_number(d["copy_gbps"]) and d["copy_gbps"] > 0 and _is_number(d["launch_us"])):
        raise ValueError("copy_gbps must be a positive number and launch_us a number")
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
    """Write through a temp file in the same directory and os.replace, so a reader in another
    process sees the old file or the new one, never half of one."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, prefix=path.stem + ".",
                                         suffix=".tmp", delete=False) as f:
            tmp = f.name
            json.dump(ceil.to_json(), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache costs a re-measure next time, not the result in hand
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        warnings.warn(f"kernelkit: could not write the ceilings cache {path} ({e})", stacklevel=3)


def _median_ms(fn, rep_ms: int = 200) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=50, rep=rep_ms, return_mode="median")


def measure_copy_gbps(nbytes: int = 2 << 30) -> float:
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


# The matrix peak is the best of these (m, n, k) products. Square ones alone understate it: cuBLAS runs
# long-k and LM-head shapes faster (H100 bf16: ~730 TF/s at 8192^3 against ~800 on an 8192 x 32000 x 2048
# LM head), and a profiled GEMM must not read far above 100% of a roof measured at an easier shape.
MATMUL_SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (8192, 8192, 32768), (8192, 2048, 32768),
                 (8192, 32000, 2048), (8192, 128256, 4096))
matmul_by_shape: dict[str, dict[str, float]] = {}  # dtype key -> {"MxNxK": TFLOP/s}, of the last measurement


def measure_matmul_tflops(dtype_key: str, shapes=MATMUL_SHAPES) -> float | None:
    """Best of a few products through the vendor library (cuBLAS via torch): squares, long k, an LM head.
    Each shape's figure is kept in `matmul_by_shape[dtype_key]` (the ceilings' details)."""
    import torch

    cap = torch.cuda.get_device_capability()
    if dtype_key == "fp8" and (cap < (8, 9) or not hasattr(torch, "float8_e4m3fn")):
        return None
    if dtype_key == "fp32":
        shapes = shapes[:1]  # plain fp32 is slow; 4096 already fills the chip
    per_shape = matmul_by_shape.setdefault(dtype_key, {})
    per_shape.clear()
    for m, n, k in shapes:
        try:
            if dtype_key == "fp8":
                a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
                b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()  # column-major B
                one = torch.ones((), device="cuda")

                def fn():
                    return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            else:
                dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32,
                      "fp32": torch.float32}[dtype_key]
                a = torch.randn(m, k, device="cuda", dtype=dt)
                b = torch.randn(k, n, device="cuda", dtype=dt)

                def fn():
                    return a @ b

            prev = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = dtype_key == "tf32"
            try:
                ms = _median_ms(fn, rep_ms=300)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = prev
        except torch.cuda.OutOfMemoryError:  # a smaller GPU: the shapes that fit decide
            continue
        finally:
            a = b = None
            torch.cuda.empty_cache()
        per_shape[f"{m}x{n}x{k}"] = 2 * m * n * k / (ms * 1e-3) / 1e12
    return max(per_shape.values(), default=None)


def measure_launch_us() -> float:
    """The floor under any op: the median time of a one-element kernel."""
    import torch

    x = torch.zeros(1, device="cuda")
    return _median_ms(lambda: x.add_(1.0), rep_ms=100) * 1e3


def measure_ceilings(force: bool = False, progress: Progress | None = None) -> Ceilings:
    """Measure (or load from cache) the present GPU's ceilings.

    The cache key is the device fingerprint (GPU, driver, CUDA, torch, Triton) and kernelkit's
    version, so an upgrade of any of them measures again; so does a cache file that cannot be read.
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
    step("copy bandwidth")
    copy = measure_copy_gbps()
    torch.cuda.empty_cache()  # hand the 4 GiB of copy buffers back before the matmuls
    tflops: dict[str, float | None] = {}
    for key in ("bf16", "fp16", "fp8", "tf32", "fp32"):
        step(f"{key} matrix peak")
        tflops[key] = measure_matmul_tflops(key)
        torch.cuda.empty_cache()
    step("launch floor")
    launch = measure_launch_us()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    details = {"matmul_tflops_by_shape": {k: dict(v) for k, v in matmul_by_shape.items() if k in tflops and v}}
    return Ceilings(gpu=props.name, fingerprint=fp, copy_gbps=copy, tflops=tflops, launch_us=launch,
                    l2_bytes=int(getattr(props, "L2_cache_size", 0)), sms=props.multi_processor_count,
                    details=details)


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
