"""kernelkit: profile-first, roofline-guided GPU kernel work on PyTorch.

The bytes, not the FLOPs, are the job: kernelkit measures your GPU's ceilings, places each op of
your model on its roofline, and swaps in Triton kernels that move every byte once.
"""

from ._version import __version__  # noqa: F401

from ._requirements import check_versions  # noqa: E402

check_versions()  # a clear ImportError naming the versions, before an older Triton fails deep inside

from . import nn  # noqa: E402
from .ops.attention import attention  # noqa: E402
from .ops.cross_entropy import cross_entropy  # noqa: E402
from .ops.glu import geglu, swiglu  # noqa: E402
from .ops.layer_norm import layer_norm  # noqa: E402
from .ops.linear import linear, matmul  # noqa: E402
from .ops.linear_cross_entropy import linear_cross_entropy  # noqa: E402
from .ops.moe import moe  # noqa: E402
from .ops.mxfp8 import mxfp8_dequantize, mxfp8_quantize  # noqa: E402
from .ops.rms_norm import add_rms_norm, rms_norm  # noqa: E402
from .ops.rope import rope  # noqa: E402
from .ops.scaled_matmul import scaled_matmul  # noqa: E402
from .ops.softmax import log_softmax, softmax  # noqa: E402
from .patch import patch, unpatch  # noqa: E402  (the functions; the package stays importable as kernelkit.patch.*)
from .profile import profile  # noqa: E402  (the function; the package stays importable as kernelkit.profile.*)

__all__ = ["nn", "attention", "rms_norm", "layer_norm", "add_rms_norm", "softmax", "log_softmax", "swiglu", "geglu", "cross_entropy", "linear_cross_entropy", "linear", "matmul", "moe", "scaled_matmul",
           "rope", "mxfp8_quantize", "mxfp8_dequantize", "patch", "unpatch", "profile", "__version__"]
