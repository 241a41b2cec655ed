"""Host (CPU) time of an op's call path, where a small-shape benchmark is launch-bound: per op and mode,
microseconds of CPU per call for kernelkit with its lean launch path (`tune.launch` calling the compiled
kernel) and with Triton's own `JITFunction.run`, next to the other rows of the benchmark (eager,
torch.compile, Liger where installed); then a cProfile of kernelkit's call path (cumulative).

    python benchmarks/experiments/h100/launch/diag_host.py rope layer_norm softmax   # prints per op
"""
import cProfile
import io
import pstats
import sys

import torch

from kernelkit import tune
from kernelkit.ops import registry
from kernelkit.testing.suite import _call, implementations

from diagnose_launch import cpu_us  # this folder is on sys.path when run as a script


def main(ops):
    torch._dynamo.config.cache_size_limit = 64
    for op in ops:
        spec = registry.get(op)
        shape = spec.test_shapes[-1]
        args, kwargs = spec.make_inputs(shape, torch.bfloat16, "cuda")
        args = tuple(a.requires_grad_(True) if i in spec.grad_args else a for i, a in enumerate(args))
        impls = {name: f for name, f in implementations(spec).items() if callable(f)}
        for mode in ("fwd", "bwd"):
            if mode == "bwd" and not spec.grad_args:
                continue
            row = {}
            for lean in (True, False):
                tune.LEAN = lean
                row["kernelkit lean" if lean else "kernelkit triton-run"] = cpu_us(_call(spec.fn, args, kwargs, mode))
            tune.LEAN = True
            for name, f in impls.items():
                if name != "kernelkit":
                    try:
                        row[name] = cpu_us(_call(f, args, kwargs, mode))
                    except Exception as e:  # noqa: BLE001 - a competitor that cannot run this shape
                        print(f"   {name}: {type(e).__name__}: {str(e)[:100]}")
            print(f"== {op} {shape} {mode}, us CPU per call: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in row.items()))
            fn = _call(spec.fn, args, kwargs, mode)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(22)
            print("\n".join(line for line in s.getvalue().splitlines()[6:] if line.strip()))


if __name__ == "__main__":
    main(sys.argv[1:] or ["rope", "layer_norm", "softmax", "rms_norm"])
