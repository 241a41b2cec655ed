"""The oldest torch and Triton kernelkit is tested on, checked at import.

kernelkit uses `triton.knobs`, tensor descriptors and `tl.range(..., warp_specialize=...)` (Triton 3.6);
an older stack fails later and less clearly, deep inside a kernel's compilation. Keep these floors
equal to the ones in pyproject.toml (a test checks it).
"""

from __future__ import annotations

import re

TORCH_MIN = "2.11"
TRITON_MIN = "3.6"


def _release(version: str) -> tuple[int, ...] | None:
    """The numeric release of a version string ('2.11.0+cu130' -> (2, 11, 0)); None if there is none.

    Only the release is compared: a dev or rc build of 2.11 ('2.11.0.dev20260101', '2.11.0a0+git1a2b')
    has 2.11's features, though PEP 440 orders it before 2.11.0.
    """
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:
        pass
    else:
        try:
            return Version(version).release
        except InvalidVersion:
            pass
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(version))
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def _older(found: str, floor: str) -> bool:
    have, want = _release(found), _release(floor)
    if have is None:  # an unparseable version cannot be proven old; let it through
        return False
    n = max(len(have), len(want))
    return have + (0,) * (n - len(have)) < want + (0,) * (n - len(want))


def check_versions() -> None:
    """Raise ImportError naming the required and found versions if torch or Triton is too old."""
    import torch
    import triton

    too_old = [f"{name}>={floor} (found {found})"
               for name, floor, found in (("torch", TORCH_MIN, str(torch.__version__)),
                                          ("triton", TRITON_MIN, str(triton.__version__)))
               if _older(found, floor)]
    if too_old:
        raise ImportError(f"kernelkit needs {' and '.join(too_old)}: upgrade with "
                          f"pip install -U 'torch>={TORCH_MIN}' 'triton>={TRITON_MIN}'")
