"""The 80%: correctness harness and bench harness that every op, test and suite uses."""

from .correctness import TOLERANCES, CheckReport, as_dtype, check, check_spec, compare, rel_error
from ..runtime.alloc import empty, empty_like, poisoned_outputs
from .verify import Finding, VerifyReport, check_module

__all__ = ["TOLERANCES", "CheckReport", "as_dtype", "check", "check_spec", "compare", "rel_error", "empty",
           "empty_like", "poisoned_outputs", "check_module", "Finding", "VerifyReport"]
