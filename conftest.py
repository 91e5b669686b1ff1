"""Shared pytest setup for every package's tests.

GPU tests are marked ``gpu`` and skipped where CUDA is absent. Triton kernels run on CPU
through the interpreter: nox sets TRITON_INTERPRET=1 before anything imports triton.
"""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
