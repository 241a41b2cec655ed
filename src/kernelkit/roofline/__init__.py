"""The ceiling: FLOPs and ideal bytes per op, bound regime, % of roof."""

from .model import Cost, Placement, dtype_key, place

__all__ = ["Cost", "Placement", "dtype_key", "place"]
