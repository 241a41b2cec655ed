"""The 80%: correctness harness and bench harness that every op, test and suite uses."""

from .correctness import TOLERANCES, CheckReport, as_dtype, check, check_spec, compare, rel_error
from .poison import empty, empty_like, poisoned_outputs

__all__ = ["TOLERANCES", "CheckReport", "as_dtype", "check", "check_spec", "compare", "rel_error", "empty",
           "empty_like", "poisoned_outputs"]
