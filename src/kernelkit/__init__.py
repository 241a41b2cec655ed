"""kernelkit: profile-first, roofline-guided GPU kernel work on PyTorch.

The bytes, not the FLOPs, are the job: kernelkit measures your GPU's ceilings, places each op of
your model on its roofline, and swaps in Triton kernels that move every byte once.
"""

__version__ = "0.1.0"

from . import nn  # noqa: E402
from .ops.rms_norm import rms_norm  # noqa: E402

__all__ = ["nn", "rms_norm", "__version__"]
