"""Roofline placement of one op: its floor time, regime and % of roof against given ceilings."""

from __future__ import annotations

from dataclasses import dataclass

from ..hw.ceilings import Ceilings


@dataclass(frozen=True)
class Cost:
    """Work of one op call. `bytes` is the ideal traffic: each input read once, each output written once."""

    flops: float
    bytes: float
    dtype: str = "bf16"  # which matrix peak bounds the FLOPs (a key of hw.specs.DTYPES)

    @property
    def arithmetic_intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.bytes + other.bytes, self.dtype)


def dtype_key(dtype) -> str:
    """torch dtype -> the key of the matrix peak that bounds it."""
    name = str(dtype).replace("torch.", "")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8",
            "float8_e5m2": "fp8"}.get(name, "fp32")


@dataclass(frozen=True)
class Placement:
    floor_ms: float  # max(bytes / bandwidth, flops / peak): no version runs much faster
    # (for an overhead-bound op the launch floor binds first: its % of roof stays small by design)
    memory_ms: float
    compute_ms: float
    regime: str  # "memory", "compute" or "overhead"
    pct_of_roof: float | None  # floor / measured, in %; None without a measurement
    achieved_gbps: float | None
    achieved_tflops: float | None


def place(cost: Cost, ceilings: Ceilings, measured_ms: float | None = None,
          overhead_factor: float = 2.0) -> Placement:
    """Place one op on the roofline.

    The regime is whichever floor is larger, except that an op whose floor is under
    `overhead_factor` x the launch floor and whose measured time is near the launch floor is
    overhead-bound: no kernel makes it faster, only fewer launches do.

    The memory roof is `ceilings.mem_gbps`, the best the memory does (a copy, an add or a read-only sum,
    whichever is fastest), not `copy_gbps`: an op that reads two bytes per byte written outruns a copy.
    """
    memory_ms = cost.bytes / (ceilings.mem_gbps * 1e9) * 1e3
    peak = ceilings.tflops.get(cost.dtype) or ceilings.tflops.get("fp32") or 0.0
    compute_ms = cost.flops / (peak * 1e12) * 1e3 if peak else 0.0
    floor = max(memory_ms, compute_ms)
    regime = "memory" if memory_ms >= compute_ms else "compute"
    launch_ms = ceilings.launch_us * 1e-3
    if floor < overhead_factor * launch_ms and (measured_ms is None or measured_ms < 4 * overhead_factor * launch_ms):
        regime = "overhead"
    pct = gbps = tfl = None
    if measured_ms:
        pct = 100.0 * floor / measured_ms
        gbps = cost.bytes / (measured_ms * 1e-3) / 1e9
        tfl = cost.flops / (measured_ms * 1e-3) / 1e12
    return Placement(floor, memory_ms, compute_ms, regime, pct, gbps, tfl)
