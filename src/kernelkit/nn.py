"""Drop-in `nn.Module`s backed by kernelkit ops (same constructors and state_dicts as torch's)."""

from .ops.cross_entropy import CrossEntropyLoss
from .ops.layer_norm import LayerNorm
from .ops.linear import Linear
from .ops.linear_cross_entropy import LinearCrossEntropyLoss
from .ops.moe import MoE
from .ops.rms_norm import RMSNorm

__all__ = ["CrossEntropyLoss", "LayerNorm", "Linear", "LinearCrossEntropyLoss", "MoE", "RMSNorm"]
