"""The machine: datasheet specs of known GPUs and the measured ceilings of the present one."""

from .ceilings import Ceilings, ceilings_for, device_fingerprint, measure_ceilings
from .specs import DATASHEETS, DTYPES, GPUSpec, lookup

__all__ = ["Ceilings", "ceilings_for", "device_fingerprint", "measure_ceilings", "DATASHEETS", "DTYPES",
           "GPUSpec", "lookup"]
