import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    """Where kernel tests run: the GPU when present, else the CPU through the Triton interpreter."""
    if torch.cuda.is_available() and not INTERPRET:
        return "cuda"
    if not INTERPRET:
        pytest.skip("kernel tests need a GPU or TRITON_INTERPRET=1")
    return "cpu"
