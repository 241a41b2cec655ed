"""Every environment switch kernelkit reads, in one table, read in one place.

A module that depends on a switch asks `value(name)` or `on(name)`; nothing else in kernelkit reads
`os.environ` for a KERNELKIT_* variable. Switches marked "import" are read once when the module that uses
them is imported (a kernel variant chosen for the process); "call" switches are read at each use.
`python -m kernelkit.switches` prints the table as markdown (the README's table is this output).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Switch:
    name: str
    default: str
    choices: tuple[str, ...]  # empty: any value (a path)
    read: str  # "import" or "call"
    doc: str


SWITCHES = {s.name: s for s in (
    Switch("KERNELKIT_CACHE", "", (), "call",
           "folder of the ceilings and tuning caches (default: $XDG_CACHE_HOME/kernelkit or ~/.cache/kernelkit)"),
    Switch("KERNELKIT_TUNE", "", ("", "first"), "import",
           "`first`: every autotuned kernel runs the first config its pruner keeps, timing none (correctness runs)"),
    Switch("KERNELKIT_TUNE_CACHE", "1", ("0", "1"), "call",
           "`0`: neither read nor write the persistent tuning cache (every process tunes afresh)"),
    Switch("KERNELKIT_LEAN_LAUNCH", "1", ("0", "1"), "import",
           "`0`: launch through Triton's own `JITFunction.run` instead of the lean launcher (diagnosis)"),
    Switch("KERNELKIT_GEMM_TMA", "1", ("0", "1"), "import",
           "`0`: the GEMM engine loads operands with pointer loads instead of TMA descriptors on Hopper"),
    Switch("KERNELKIT_FP8_GLUON", "1", ("0", "1"), "import",
           "`0`: scaled_matmul's precise fp8 path uses the Triton kernel instead of the Gluon warp-specialized one"),
    Switch("KERNELKIT_ATTENTION_GLUON", "1", ("0", "1"), "import",
           "`0`: attention's forward on Hopper uses the Triton kernel instead of the Gluon warp-specialized one"),
    Switch("KERNELKIT_ATTENTION_GLUON_BWD", "auto", ("auto", "0", "1"), "import",
           "attention's backward on Hopper through the Gluon warp-specialized kernel (dQ fused by TMA reduces): "
           "`auto` at head dims 64 and 128 (on the H100 1.05-1.12x cuDNN's backward at d64, 0.94-1.02x at d128, "
           "kernels alone, stop 46; with `deterministic=True`, dQ from the Triton kernel: at 128, and at 64 without "
           "the causal mask from 4k tokens), `1` everywhere it applies, `0` never (the Triton kernels; "
           "docs/ops/attention.md)"),
    Switch("KERNELKIT_MOE_WGRAD", "grouped_mm", ("grouped_mm", "triton"), "import",
           "MoE bf16 weight gradients: torch's grouped GEMM (cuBLAS) or kernelkit's Triton kernel"),
    Switch("KERNELKIT_MOE_KEEP_SAVED", "0", ("0", "1"), "import",
           "`1`: the MoE backward keeps its saved gate/up pre-activations (a second backward, retain_graph=True) instead of freeing them once read"),
    Switch("KERNELKIT_MX_MODE", "upcast", ("upcast", "dequant", "dot_scaled", "promote"), "import",
           "how the MXFP8 MoE multiplies: dequantize to bf16 first (`upcast`) or inside the grouped GEMM's K loop"),
    Switch("KERNELKIT_MOE_PERSISTENT", "1", ("0", "1"), "import",
           "`0`: bf16/fp16/fp8 grouped GEMMs take the pointer kernel instead of the persistent TMA kernel"),
    Switch("KERNELKIT_MOE_GATHER", "auto", ("auto", "copy", "loads"), "import",
           "how the persistent grouped GEMM gathers routed rows: a copy first, in its loads, or `auto` (by width)"),
    Switch("KERNELKIT_FP8_DY_ONE_READ", "1", ("0", "1"), "import",
           "`0`: fp8_linear's backward quantizes dy's rows and columns apart (four reads of dy) instead of together "
           "(two)"),
    Switch("KERNELKIT_FP8_CE_FUSE", "1", ("0", "1"), "call",
           "`0`: the fp8 LM head (`linear_cross_entropy(precision='fp8')`) quantizes dlogits with a quantize_rows pass "
           "instead of in the cross-entropy kernel that writes them (A/B)"),
    Switch("KERNELKIT_FP8_FUSE", "1", ("0", "1"), "call",
           "`0`: `kernelkit.patch(precision='fp8')` (read when it patches) neither shares an input's fp8 quantization among the Linears that read it nor has the RMSNorms and SwiGLUs write it (A/B)"),
    Switch("KERNELKIT_PATCH_FUSE_ADD", "1", ("0", "1"), "call",
           "`0`: `kernelkit.patch` (read when it patches) leaves the decoder layers' forward alone instead of fusing the post-attention residual add into the RMSNorm (A/B)"),
    Switch("KERNELKIT_PATCH_CHOICE", "auto", ("auto", "kernelkit"), "call",
           "what a `kernelkit.patch` switch left True means: `auto` (kernelkit only where measured faster, per shape) or `kernelkit` (always)"),
    Switch("KERNELKIT_NCU", "", (), "call", "path of Nsight Compute's `ncu` for `kernelkit ladder` (default: on PATH)"),
)}


def value(name: str) -> str:
    """The switch's value: the environment's, else its default; a value outside its choices is an error
    that names the switch and its choices (a typo must not silently select the default)."""
    sw = SWITCHES[name]
    got = os.environ.get(name, sw.default)
    if sw.choices and got not in sw.choices:
        raise ValueError(f"{name}={got!r} is not one of {', '.join(repr(c) for c in sw.choices)}: {sw.doc}")
    return got


def on(name: str) -> bool:
    """A 0/1 switch as a bool."""
    return value(name) != "0"


def interpreting() -> bool:
    """Whether TRITON_INTERPRET asks for Triton's CPU interpreter (Triton's own switch, read here too)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def markdown() -> str:
    rows = ["| variable | default | values | read | what it does |", "|---|---|---|---|---|"]
    for s in SWITCHES.values():
        values = ", ".join(f"`{c}`" if c else "(unset)" for c in s.choices) or "a path"
        rows.append(f"| `{s.name}` | {f'`{s.default}`' if s.default else '(unset)'} | {values} | at {s.read} | {s.doc} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown())
