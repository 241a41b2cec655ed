"""CUDA C compiled at run time and launched on torch's current stream: the fp32 ladder's back end.

NVRTC through CuPy (`cupy.RawModule`, its on-disk kernel cache included) when CuPy is importable, else through
cuda-python (`cuda.bindings.nvrtc` to a cubin for this GPU's sm_XY, `cuda.bindings.driver` to load and launch).
Options: `-std=c++17`, and no `--use_fast_math` (a GEMM has no division or transcendental for it to speed up;
it would only flush denormals to zero). FMA contraction is NVRTC's default, as in cuBLAS. The kernels take
(const float* A, const float* B, float* C, int M, int N, int K).
"""

from __future__ import annotations

import atexit
import ctypes

NVRTC_OPTIONS = ("-std=c++17",)
_compiled: dict = {}
# Drop the compiled modules before the interpreter tears CuPy down: unloading them during teardown prints
# "TypeError: 'NoneType' object is not callable" from cupy.cuda.function.Module.__dealloc__.
atexit.register(_compiled.clear)


def _cuda_check(result):
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA error {err!r}")
    return rest[0] if len(rest) == 1 else rest


def nvrtc_cubin(code: str, kernel: str, arch: str) -> bytes:
    """cuda-python: compile `code` for `arch` (e.g. sm_90) to a cubin; raises with NVRTC's log."""
    from cuda.bindings import nvrtc

    prog = _cuda_check(nvrtc.nvrtcCreateProgram(code.encode(), f"{kernel}.cu".encode(), 0, [], []))
    opts = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in NVRTC_OPTIONS)]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if int(err) != 0:
        size = _cuda_check(nvrtc.nvrtcGetProgramLogSize(prog))
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"NVRTC could not compile {kernel}:\n{log.decode(errors='replace')}")
    size = _cuda_check(nvrtc.nvrtcGetCUBINSize(prog))
    cubin = b" " * size
    _cuda_check(nvrtc.nvrtcGetCUBIN(prog, cubin))
    nvrtc.nvrtcDestroyProgram(prog)
    return cubin


def _cupy_binder(code: str, kernel: str, device: int):
    import cupy
    import numpy as np
    import torch

    with cupy.cuda.Device(device):
        fn = cupy.RawModule(code=code, options=NVRTC_OPTIONS).get_function(kernel)

    def bind(grid, block, a, b, c, m, n, k):
        with cupy.cuda.Device(device):
            args = (*(cupy.asarray(t) for t in (a, b, c)), np.int32(m), np.int32(n), np.int32(k))

        def run():
            with cupy.cuda.Device(device), cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                fn(grid, block, args)
        return run
    return bind


def _driver_binder(code: str, kernel: str, device: int):
    import torch
    from cuda.bindings import driver

    major, minor = torch.cuda.get_device_capability(device)
    cubin = nvrtc_cubin(code, kernel, f"sm_{major}{minor}")
    with torch.cuda.device(device):
        _cuda_check(driver.cuInit(0))
        if not int(_cuda_check(driver.cuCtxGetCurrent())):  # torch's runtime uses the primary context
            dev = _cuda_check(driver.cuDeviceGet(device))
            _cuda_check(driver.cuCtxSetCurrent(_cuda_check(driver.cuDevicePrimaryCtxRetain(dev))))
        module = _cuda_check(driver.cuModuleLoadData(cubin))
        fn = _cuda_check(driver.cuModuleGetFunction(module, kernel.encode()))
    types = (ctypes.c_void_p,) * 3 + (ctypes.c_int,) * 3

    def bind(grid, block, a, b, c, m, n, k):
        params = ((a.data_ptr(), b.data_ptr(), c.data_ptr(), m, n, k), types)

        def run():
            stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
            _cuda_check(driver.cuLaunchKernel(fn, *grid, *block, 0, stream, params, 0))
        return run
    return bind


def compiler() -> str:
    """Which NVRTC front end is importable: "cupy", "cuda-python", or a sentence saying neither is."""
    import importlib.util

    if importlib.util.find_spec("cupy") is not None:
        return "cupy"
    if importlib.util.find_spec("cuda") is not None and importlib.util.find_spec("cuda.bindings") is not None:
        return "cuda-python"
    return ("the fp32 rungs compile CUDA C at run time through NVRTC, and neither CuPy nor cuda-python is "
            "importable: pip install cupy-cuda12x (or cupy-cuda13x for CUDA 13) or cuda-python")


def binder(code: str, kernel: str, device: int):
    """Compile `code` (once per process) and return bind(grid, block, a, b, c, m, n, k) -> run(): a launch of
    `kernel`(a, b, c, m, n, k) on torch's current stream."""
    key = (code, kernel, device)
    if key not in _compiled:
        front = compiler()
        if front == "cupy":
            _compiled[key] = _cupy_binder(code, kernel, device)
        elif front == "cuda-python":
            _compiled[key] = _driver_binder(code, kernel, device)
        else:
            raise RuntimeError(front)
    return _compiled[key]
