"""One rung, one profiled launch: `python -m kernelkit.ladder.run_one --kind K --rung NAME --shape M,N,K`.

`signature.profile` runs this under ncu with --profile-from-start off: the rung is built and launched once
outside the profiled range (compilation, autotuning, first-launch costs), then launched once between
cudaProfilerStart and cudaProfilerStop, which is the launch ncu measures. --params fixes the configuration
(the one the timed run chose), so a rung with a sweep does not re-time its configs here.
"""

from __future__ import annotations

import argparse
import contextlib
import json

from . import get
from .run import cublas_rung, make_inputs, true_fp32


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernelkit.ladder.run_one", description=__doc__.splitlines()[0])
    parser.add_argument("--kind", required=True, choices=("sgemm", "hgemm"))
    parser.add_argument("--rung", required=True, help="a rung's name, or cublas")
    parser.add_argument("--shape", required=True, help="M,N,K")
    parser.add_argument("--params", default="{}", help="the rung's configuration as JSON ({}: its own choice)")
    args = parser.parse_args(argv)

    import torch

    m, n, k = (int(v) for v in args.shape.split(","))
    rung = cublas_rung(args.kind) if args.rung == "cublas" else get(args.kind, args.rung)
    a, b = make_inputs(args.kind, m, n, k)
    c = torch.empty(m, n, device="cuda", dtype=a.dtype)
    with true_fp32() if args.kind == "sgemm" else contextlib.nullcontext():
        launch = rung.build(a, b, c, json.loads(args.params) or None)
        launch.run()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        launch.run()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
