"""Datasheet figures of common GPUs: the ceilings a vendor promises, before we measure what we get.

Matrix rates are dense (no 2:4 sparsity) tensor-core TFLOP/s with fp32 accumulation, except
`fp32`, which is the plain CUDA-core FMA rate. `None` means the GPU has no such unit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("bf16", "fp16", "fp8", "tf32", "fp32")


@dataclass(frozen=True)
class GPUSpec:
    name: str
    tflops: dict[str, float | None]  # dense peak per dtype key in DTYPES
    mem_gbps: float  # HBM/GDDR bandwidth, GB/s (10^9 bytes)
    sms: int
    l2_mb: float
    smem_per_sm_kb: int
    memory_gb: float
    aliases: tuple[str, ...] = field(default=())

    def ridge_point(self, dtype: str) -> float | None:
        """FLOPs per byte where the roof turns from memory- to compute-bound."""
        peak = self.tflops.get(dtype)
        return None if peak is None else peak * 1e12 / (self.mem_gbps * 1e9)


def _t(bf16, fp16, fp8, tf32, fp32):
    return {"bf16": bf16, "fp16": fp16, "fp8": fp8, "tf32": tf32, "fp32": fp32}


DATASHEETS: dict[str, GPUSpec] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5 column) and the Hopper architecture whitepaper
    # (132 SMs, 50 MB L2, 228 KB shared memory per SM).
    "h100-sxm": GPUSpec("NVIDIA H100 SXM5 80GB", _t(989.4, 989.4, 1978.9, 494.7, 66.9),
                        3350, 132, 50, 228, 80, aliases=("h100", "h100 80gb hbm3", "h100 sxm")),
    # Same datasheet, PCIe column; the PCIe part has 114 SMs.
    "h100-pcie": GPUSpec("NVIDIA H100 PCIe 80GB", _t(756.5, 756.5, 1513.0, 378.0, 51.2),
                         2000, 114, 50, 228, 80, aliases=("h100 pcie",)),
    # NVIDIA H200 datasheet (SXM): H100 SXM compute with 141 GB of HBM3e at 4.8 TB/s. L2 as PyTorch
    # reports it on the H200 (the datasheet does not give it).
    "h200": GPUSpec("NVIDIA H200 SXM 141GB", _t(989.4, 989.4, 1978.9, 494.7, 66.9),
                    4800, 132, 60, 228, 141, aliases=("h200 sxm", "nvidia h200")),
    # NVIDIA A100 datasheet (SXM columns) and the Ampere whitepaper (108 SMs, 40 MB L2, 164 KB smem).
    "a100-80gb": GPUSpec("NVIDIA A100 SXM4 80GB", _t(312, 312, None, 156, 19.5),
                         2039, 108, 40, 164, 80, aliases=("a100", "a100-sxm4-80gb", "a100 80gb")),
    "a100-40gb": GPUSpec("NVIDIA A100 SXM4 40GB", _t(312, 312, None, 156, 19.5),
                         1555, 108, 40, 164, 40, aliases=("a100-sxm4-40gb", "a100 40gb")),
    # NVIDIA HGX B200 datasheet (per GPU, dense = half the sparse figures) and the Blackwell
    # whitepaper (148 SMs, 126 MB L2, 228 KB smem).
    "b200": GPUSpec("NVIDIA B200 180GB", _t(2250, 2250, 4500, 1100, 75),
                    8000, 148, 126, 228, 180, aliases=("nvidia b200",)),
    # NVIDIA L4 datasheet (dense = half the sparse figures) and the Ada whitepaper (58 SMs, 48 MB L2).
    "l4": GPUSpec("NVIDIA L4", _t(121, 121, 242.5, 60, 30.3), 300, 58, 48, 100, 24, aliases=("nvidia l4",)),
    # NVIDIA L40S datasheet (dense) and the Ada whitepaper (142 SMs, 96 MB L2).
    "l40s": GPUSpec("NVIDIA L40S", _t(362.05, 362.05, 733, 183, 91.6), 864, 142, 96, 100, 48,
                    aliases=("nvidia l40s",)),
    # Ada Lovelace whitepaper, appendix (RTX 4090): tensor rates with fp32 accumulation, which
    # GeForce parts run at half the fp16-accumulate rate.
    "rtx4090": GPUSpec("NVIDIA GeForce RTX 4090", _t(165.2, 165.2, 330.3, 82.6, 82.6), 1008, 128, 72, 100, 24,
                       aliases=("4090", "rtx 4090", "geforce rtx 4090")),
}


def _norm(s: str) -> str:
    return " ".join(s.lower().replace("nvidia", "").replace("_", " ").replace("-", " ").split())


def lookup(name: str) -> GPUSpec | None:
    """Find the datasheet of a GPU by table key, alias, or the name CUDA reports for it.

    `torch.cuda.get_device_name()` strings such as "NVIDIA H100 80GB HBM3" resolve too.
    """
    want = _norm(name)
    for key, spec in DATASHEETS.items():
        if want in {_norm(key), _norm(spec.name), *(_norm(a) for a in spec.aliases)}:
            return spec
    # CUDA's names carry memory and packaging words in varying order: match on the model token and
    # prefer the entry whose extra words also appear (PCIe vs SXM, 40GB vs 80GB).
    best, best_score = None, 0
    for key, spec in DATASHEETS.items():
        model = _norm(key).split()[0]
        if model not in want.split():
            continue
        score = 1 + sum(tok in want for tok in _norm(key).split()[1:])
        if score > best_score:
            best, best_score = spec, score
    return best


def names() -> list[str]:
    return list(DATASHEETS)
