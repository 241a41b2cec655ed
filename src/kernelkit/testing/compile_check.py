"""Compile every kernel an op launches for a real GPU target, on a machine without a GPU.

Triton's interpreter accepts code the compiler rejects (a plain Python global read inside a kernel,
say), so interpreter tests alone can pass a kernel that never compiles. This module records the
launches the interpreter makes (which kernel, argument types, constexpr values, warps) and then
compiles each one for sm_90 through Triton's full pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin)
in a process that is not interpreting.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import select
import subprocess
import sys
import threading

import torch

_TORCH_TO_TRITON = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
                    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
                    torch.uint8: "u8", torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv",
                    torch.float8_e5m2: "fp8e5"}
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def _describe(value):
    if isinstance(value, torch.Tensor):
        return {"ptr": _TORCH_TO_TRITON[value.dtype]}
    if isinstance(value, bool):
        return {"value": value}
    if isinstance(value, int):
        return {"value": value, "type": "i32" if -(2**31) <= value < 2**31 else "i64"}
    if isinstance(value, float):
        return {"value": value, "type": "fp32"}
    if value is None or isinstance(value, str):  # None, or a string constexpr (an activation's name, say)
        return {"value": value}
    raise TypeError(f"cannot describe kernel argument of type {type(value).__name__}")


@contextlib.contextmanager
def record_launches(records: list):
    """Under TRITON_INTERPRET=1, append a description of every kernel launch to `records`."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def run(self, *args, **kwargs):
        fn = self.fn
        names = list(fn.__code__.co_varnames[: fn.__code__.co_argcount])
        call = dict(zip(names, args))
        call.update({k: v for k, v in kwargs.items() if k in names})
        records.append({"kernel": f"{fn.__module__}:{fn.__qualname__}",
                        "args": {k: _describe(v) for k, v in call.items()},
                        "options": {k: kwargs[k] for k in _OPTIONS if kwargs.get(k) is not None}})
        return original(self, *args, **kwargs)

    InterpretedFunction.run = run
    try:
        yield records
    finally:
        InterpretedFunction.run = original


def unique(records: list) -> list:
    seen, out = set(), []
    for r in records:
        key = json.dumps(r, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def _jit_function(kernel: str):
    module, qualname = kernel.split(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    while not hasattr(obj, "params"):  # unwrap triton.autotune / heuristics layers
        obj = obj.fn
    return obj


def _tail(msg: str) -> str:
    """A compile error's source excerpt is long and its reason comes last: keep the start and the end."""
    return msg if len(msg) <= 1200 else msg[:400] + " [...] " + msg[-800:]


def compile_records(records: list, arch: int = 90) -> list[str]:
    """Compile each recorded launch for `arch` in this (non-interpreting) process; return failures."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failures = []
    for r in records:
        try:
            fn = _jit_function(r["kernel"])
            signature, constexprs = {}, {}
            for p in fn.params:
                d = r["args"].get(p.name)
                if d is None:
                    continue
                if p.is_constexpr:
                    signature[p.name] = "constexpr"
                    constexprs[p.name] = d["value"]
                elif "ptr" in d:
                    signature[p.name] = "*" + d["ptr"]
                elif d["value"] is None:
                    signature[p.name] = "constexpr"
                    constexprs[p.name] = None
                else:
                    signature[p.name] = "i1" if isinstance(d["value"], bool) else d["type"]
            src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
            triton.compile(src, target=GPUTarget("cuda", arch, 32), options=r["options"])
        except Exception as e:  # noqa: BLE001 - every failure is reported with its kernel
            failures.append(f"{r['kernel']} {r['options']}: {type(e).__name__}: {_tail(str(e))}")
    return failures


# The loop of the process `run_uninterpreted` keeps: one JSON request a line (code, argv, stdin text, environment),
# one JSON answer a line (rc, stdout, stderr). Answers travel on a duplicate of fd 1; fd 1 itself is pointed at fd 2,
# so output written below Python (a C library's printf) cannot corrupt them.
_SERVE = r"""
import contextlib, io, json, os, sys, traceback
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
requests = sys.stdin
for line in requests:
    req = json.loads(line)
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(req["env"])
    sys.argv = ["-c", *req["argv"]]
    sys.stdin = io.StringIO(req["input"])
    out, err, rc = io.StringIO(), io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            exec(compile(req["code"], "<uninterpreted>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        err.write(traceback.format_exc())
        rc = 1
    finally:
        sys.stdin = requests
        os.environ.clear()
        os.environ.update(saved)
    answers.write(json.dumps({"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}) + "\n")
    answers.flush()
"""
_server: list = []  # the one kept process, while it lives
_server_lock = threading.Lock()


@atexit.register
def _stop_server() -> None:
    """End the kept process with this one: its loop ends when its stdin closes."""
    for proc in _server:
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
        proc.stdout.close()
    _server.clear()


def _fresh(cmd: list, code_input: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, input=code_input, capture_output=True, text=True, env=env, timeout=timeout)


def run_uninterpreted(code: str, argv=(), input: str = "", timeout: float = 900) -> subprocess.CompletedProcess:
    """Run `code` as `python -c code *argv` would, with `input` on stdin, in a Python that is not interpreting
    (Triton's kernels real JITFunctions, built for a GPU target). The process is kept and reused: importing torch,
    Triton and kernelkit takes seconds, and CI's sm_90 build checks would pay it per check. Each run sees this
    process's environment less TRITON_INTERPRET and its own sys.argv and stdin; what it imports stays imported
    (these runs build kernels, they do not change module state). A run past `timeout` kills the process
    (subprocess.TimeoutExpired); a process that dies mid-run is replaced, and the run repeated in a fresh one for
    its full error. KERNELKIT_FRESH_COMPILE=1: a fresh process per run."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-c", code, *map(str, argv)]
    if os.environ.get("KERNELKIT_FRESH_COMPILE", "0") not in ("", "0"):
        return _fresh(cmd, input, env, timeout)
    req = json.dumps({"code": code, "argv": [str(a) for a in argv], "input": input, "env": env}) + "\n"
    with _server_lock:
        if not _server or _server[0].poll() is not None:
            _server[:] = [subprocess.Popen([sys.executable, "-c", _SERVE], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)]
        proc = _server[0]
        try:
            proc.stdin.write(req)
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], timeout)
            line = proc.stdout.readline() if ready else None
        except OSError:  # BrokenPipeError: it died
            line = ""
        if line is None:
            proc.kill()
            proc.wait()
            _server.clear()
            raise subprocess.TimeoutExpired(cmd, timeout)
        if not line:
            proc.wait()
            _server.clear()
            return _fresh(cmd, input, env, timeout)
    got = json.loads(line)
    return subprocess.CompletedProcess(cmd, got["rc"], got["stdout"], got["stderr"])


def compile_in_subprocess(records: list, arch: int = 90, timeout: int = 900) -> list[str]:
    """`compile_records` in a Python without TRITON_INTERPRET (the kernels must be real JITFunctions): the process
    `run_uninterpreted` keeps."""
    code = ("import json, sys; from kernelkit.testing.compile_check import compile_records; "
            f"print(json.dumps(compile_records(json.load(sys.stdin), {arch})))")
    out = run_uninterpreted(code, input=json.dumps(records), timeout=timeout)
    if out.returncode != 0:
        return [f"compile subprocess failed: {out.stderr[-2000:]}"]
    return json.loads(out.stdout.strip().splitlines()[-1])


def compile_gluon(fn, args: dict, constexprs: dict, num_warps: int = 4, arch: int = 90) -> dict:
    """Build a Gluon kernel for sm_`arch` without a GPU (Gluon has no interpreter to record launches from):
    `args` maps each runtime parameter to an example value (tensors, gluon TensorDescriptors over CPU
    tensors, ints), `constexprs` the rest. Returns its shared memory, PTX and ptxas' resource report (register
    count, spills, and notes such as C7514: wgmma serialized). Call it in a process that is not interpreting."""
    import subprocess as sp
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    sig = {**{name: mangle_type(v) for name, v in args.items()}, **{c: "constexpr" for c in constexprs}}
    const = {(list(sig).index(c),): v for c, v in constexprs.items()}
    kernel = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=const),
                            target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    ptx = kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        ptxas = sp.run([get_ptxas(arch).path, f"-arch=sm_{arch}a", "-v", f.name, "-o", os.devnull],
                       capture_output=True, text=True)
    return {"shared": kernel.metadata.shared, "ptx": ptx, "ptxas": ptxas.stderr, "ptxas_rc": ptxas.returncode}
