"""Fixtures shared by coat-models' tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """The tiny models' matrices are ~100 x 100: one thread is fastest, and spares the OpenMP
    spin-wait that made a 440x64 @ 64x176 matmul 87x slower with 2 threads (19.7 ms instead of
    0.23 ms) on a loaded 2-core machine. A module opts in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
