"""Shared pytest setup for every package's tests.

GPU tests are marked ``gpu`` and skipped where CUDA is absent. Triton kernels run on CPU
through the interpreter: nox sets TRITON_INTERPRET=1 before anything imports triton.
"""

import os

import pytest
import torch


def pytest_configure(config):
    """Under pytest-xdist each worker gets its share of the cores, not all of them: two workers
    of two threads each on 2 cores made the suite 1.3x slower (OpenMP threads spin-waiting for
    a core another worker holds). OMP_NUM_THREADS passes the share on to the processes the
    tests start; one set by the caller is kept."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


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
