"""The harness of the ``bench_<op>.py`` files: quantizer throughput on an 8192x8192 bf16
tensor against the device's copy bandwidth; each file holds only its op's cases.

Run on a CUDA GPU:
    pytest -o python_files='bench_*.py' --benchmark-only packages/fp8-quant/benchmarks -s

Each op is timed two ways and reported as GB/s of its *minimal* bytes (read the input once,
write each output once) and as a fraction of the device-to-device copy bandwidth measured the
same way, the ceiling for a memory-bound op (``test_copy_bandwidth`` in
``bench_quantize_per_group.py``: a run without it prints ``-`` for the fractions):

* ``bench``: ``triton.testing.do_bench`` (CUDA events around each call, L2 flushed between
  calls, median). It includes whatever host time a call has beyond the flush: a 55-70 us
  kernel whose Python wrapper takes 70-90 us reads slower than it runs.
* ``stream``: CUDA events around 20 back-to-back calls, queued by the host while the GPU
  sleeps (no host gaps, no flush), median of 5: the kernels' own time. The targets are
  judged on this column; the bench column shows what one isolated call costs.

pytest-benchmark also records each op (host-timed, synchronized). One table of every op run
is printed at the end of the session and written as JSON to ``$BENCH_OUT`` when that is set.

Fixtures (fixtures, not an imported helper module: pytest imports these files in importlib
mode, with no benchmarks/ folder on ``sys.path``):

* ``x``: the bf16 input, ``M x N``, seed 0.
* ``amax``: the per-tensor amax a producing kernel would hand over (group scaling).
* ``layer_weights``: a Llama-2-7B decoder layer's seven fp32 weights (the multi-tensor ops).
* ``record(name, fn, nbytes, note="")``: time ``fn`` both ways, record it with
  pytest-benchmark, add the row ``name`` to the table and return it;
  ``record.ceiling(fn, nbytes, note)``: the same for the copy ceiling; ``record.time(fn)``:
  ``(bench_ms, stream_ms)`` alone; ``record.add(name, ms, stream_ms, nbytes, note, **extra)``:
  a row timed by the caller.
"""

import datetime
import json
import os

import fp8_quant
import pytest
import torch
from fp8_quant.timing import cuda_ms_per_call

M = N = 8192
CEILING = "copy (ceiling)"  # the row every fraction is against


@pytest.fixture(scope="session", autouse=True)
def _cuda():
    """Every benchmark here times CUDA kernels; the table and JSON need a device too."""
    if not torch.cuda.is_available():
        pytest.skip("benchmarks need CUDA")


# Module scope: each file makes its own 128 MiB input (same seed, same values) and frees it at
# its end, rather than holding it through the other packages' benchmarks of the same session.
@pytest.fixture(scope="module")
def x():
    torch.manual_seed(0)
    return torch.randn(M, N, device="cuda", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def amax(x):
    """The per-tensor amax a producing kernel would hand over (group scaling)."""
    return fp8_quant.group_amax(x, 16).amax()


# A Llama-2-7B decoder layer's weights (hidden 4096, MLP 11008): q, k, v, o; gate, up; down.
LAYER_SHAPES = [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)]


@pytest.fixture(scope="module")
def layer_weights():
    """The seven weights of a Llama-2-7B decoder layer as fp32 master weights (coat-train
    keeps them so), for the multi-tensor ops."""
    torch.manual_seed(0)
    return [torch.randn(s, device="cuda") * 0.02 for s in LAYER_SHAPES]


def _do_bench(fn) -> float:
    import triton.testing

    fn()  # compile and warm up outside the timing
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def _stream(fn, calls: int = 20, rounds: int = 5) -> float:
    """Median ms per call of ``calls`` calls run back to back (see the module docstring);
    a ~10 ms GPU sleep first, far longer than queueing the calls."""
    return cuda_ms_per_call(fn, calls, rounds=rounds, sleep_cycles=20_000_000)


class _Recorder:
    """The ``record`` fixture: rows of the table, keyed by op name."""

    def __init__(self, benchmark, rows: dict[str, dict]):
        self._benchmark = benchmark
        self._rows = rows

    def __call__(self, name: str, fn, nbytes: int, note: str = "") -> dict:
        row = self.add(name, *self.time(fn), nbytes, note)

        def synced():
            fn()
            torch.cuda.synchronize()

        self._benchmark.pedantic(synced, rounds=20, warmup_rounds=2)
        return row

    def ceiling(self, fn, nbytes: int, note: str = "") -> dict:
        """``self(...)`` for the row every fraction is against."""
        return self(CEILING, fn, nbytes, note)

    @staticmethod
    def time(fn) -> tuple[float, float]:
        return _do_bench(fn), _stream(fn)

    def add(
        self, name: str, ms: float, stream_ms: float, nbytes: int, note: str = "", **extra
    ) -> dict:
        self._rows[name] = {
            "ms": ms,
            "stream_ms": stream_ms,
            "bytes": nbytes,
            "GB/s": nbytes / ms / 1e6,
            "stream_GB/s": nbytes / stream_ms / 1e6,
            "note": note,
            **extra,
        }
        return self._rows[name]


@pytest.fixture(scope="session")
def _rows() -> dict[str, dict]:
    return {}


@pytest.fixture
def record(benchmark, _rows):
    return _Recorder(benchmark, _rows)


@pytest.fixture(scope="session", autouse=True)
def _table(_cuda, _rows):
    # Session scope: one table of every bench_<op>.py file that ran, printed once at the end.
    yield
    if not _rows:
        return
    # The ceiling first, as the line every other is read against; then the order they ran.
    rows = dict(sorted(_rows.items(), key=lambda item: item[0] != CEILING))
    copy = rows.get(CEILING)
    print(f"\nfp8-quant on {torch.cuda.get_device_name()}, bf16 {M}x{N}")
    print(f"{'':44s} {'--------- bench ---------':>26s} {'--------- stream --------':>26s}")
    print(f"{'op':44s}" + f" {'ms':>8s} {'GB/s':>8s} {'of copy':>8s}" * 2 + "  note")
    for name, row in rows.items():
        line = f"{name:44s}"
        for key, rate in (("fraction_of_copy", "GB/s"), ("stream_fraction_of_copy", "stream_GB/s")):
            row[key] = row[rate] / copy[rate] if copy else None
            frac = f"{100 * row[key]:7.1f}%" if copy else "       -"
            ms = row["ms" if rate == "GB/s" else "stream_ms"]
            line += f" {ms:8.4f} {row[rate]:8.0f} {frac}"
        print(f"{line}  {row['note']}")
    out = os.environ.get("BENCH_OUT")
    if out:
        import triton

        meta = {
            "device": torch.cuda.get_device_name(),
            "date": datetime.date.today().isoformat(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "shape": [M, N],
            "dtype": "bfloat16",
        }
        with open(out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
