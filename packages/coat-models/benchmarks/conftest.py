"""What the pytest benchmarks here share (``bench_rope.py``, ``bench_cross_entropy.py``): the
``table`` fixture, one per file, which skips without a CUDA GPU, collects a row per case and
at the file's end prints them as a table and writes them to ``$BENCH_OUT`` as JSON (with the
device and torch version); ``peak_bytes(fn)``, the memory one call takes at its peak."""

from __future__ import annotations

import json
import os

import pytest
import torch


class Table:
    """Rows of named numbers; ``title`` and ``meta`` (shapes, ...) describe them."""

    def __init__(self):
        self.title, self.meta, self.rows = "", {}, {}

    def add(self, name: str, **numbers: float) -> None:
        self.rows[name] = numbers

    def finish(self) -> None:
        if not self.rows:
            return
        device = torch.cuda.get_device_name()
        cols = list(dict.fromkeys(k for r in self.rows.values() for k in r))
        width = max(len(n) for n in self.rows) + 2
        print(f"\n{self.title}, {device}")
        print(f"{'':{width}}" + "".join(f"{c:>12}" for c in cols))
        for name, r in self.rows.items():
            cells = "".join(f"{r[c]:12.3f}" if c in r else f"{'':12}" for c in cols)
            print(f"{name:{width}}{cells}")
        if os.environ.get("BENCH_OUT"):
            meta = {"device": device, "torch": torch.__version__, **self.meta}
            with open(os.environ["BENCH_OUT"], "w") as f:
                json.dump({"meta": meta, "results": self.rows}, f, indent=2)


@pytest.fixture(scope="module")
def table():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    t = Table()
    yield t
    t.finish()


@pytest.fixture
def peak_bytes():
    """``peak_bytes(fn)``: the most bytes one call of ``fn`` held allocated at once above
    what was allocated before it (``torch.cuda.max_memory_allocated``)."""

    def measure(fn) -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    return measure
