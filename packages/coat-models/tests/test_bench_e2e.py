"""``benchmarks/bench_e2e.py``'s own bookkeeping on CPU (its measurements need a GPU): a
trial's memory breakdown and the coat-train table it prints for BENCHMARKS.md."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

# One xdist worker takes the whole module (nox runs --dist loadgroup), so that the
# module-scoped `trials` is computed once, not once on every worker.
pytestmark = pytest.mark.xdist_group("bench_e2e")
SCRIPT = Path(__file__).parents[1] / "benchmarks" / "bench_e2e.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_e2e", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trials(bench):
    """bf16 at micro-batch 1 as ``bench_e2e.py --preset tiny --seq-len 32 --steps 2`` runs it,
    and the same trial as the coat-compile variant runs it with ``compile_layers`` and
    ``Module.compile`` no-ops (what is checked is the trial's bookkeeping, not compilation,
    which took 30-50 s of this fixture on a 2-core CPU)."""
    from coat_models.train.data import load_data
    from coat_models.train.presets import build_model, preset_config

    data = load_data(max_bytes=2**20)
    config = preset_config("tiny", data.vocab_size, max_seq=32)
    args = SimpleNamespace(seq_len=32, lr=1e-3, steps=2)
    cpu = torch.device("cpu")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.Module, "compile", lambda self, *a, **k: None)
        mp.setattr(bench, "compile_layers", lambda model, *a, **k: model)
        for name, compiled in (("bf16", False), ("coat-compile", True)):
            model = build_model(config, device=cpu, master_dtype=torch.float32, seed=0)
            out[name] = bench.trial(model, data, "bf16", "fp32", False, 1, args, cpu, compiled)
    return out


@pytest.mark.slow  # the trials fixture: two training trials, 3-5 s
def test_compiled_trial_reports_no_breakdown_it_did_not_count(trials):
    """The compiled trial counts no step's tensors (saved-tensor hooks would recompile): its
    tracked peak and parts are unknown (None, "n/a" in the tables), not the weights alone
    with zero activations and optimizer state."""
    counted, compiled = trials["bf16"]["memory"], trials["coat-compile"]["memory"]
    assert counted["optimizer_state"] > 0 and counted["tracked_peak"] > counted["weights"]
    parts = ("tracked_peak", "weights", "weight_copies", "gradients", "optimizer_state",
             "activations", "other")  # fmt: skip
    assert all(compiled[k] is None for k in parts), compiled
    assert compiled["device"] == "cpu" and compiled["measured_peak"] is None


@pytest.mark.slow  # the trials fixture: two training trials, 3-5 s
def test_coat_train_table_names_the_timed_steps(bench, trials):
    """Each trial times steps 3 to steps + 2 (a warm-up step and a memory-counting one come
    first): the table says so, with the trials' tokens/s and ratios."""
    fitting = {name: [r] for name, r in trials.items()}
    table = bench.coat_train_table(fitting, 1, steps=2)
    line = next(row for row in table.splitlines() if row.startswith("tokens/s"))
    assert line.startswith("tokens/s (steps 3-4) ")
    speeds = [trials[n]["tokens_per_s"] for n in ("bf16", "coat-compile")]
    assert line.split()[-3:] == [f"{speeds[0]:,.0f}", f"{speeds[1]:,.0f}",
                                 f"{speeds[1] / speeds[0]:.2f}x"]  # fmt: skip
    tracked = next(row for row in table.splitlines() if row.startswith("peak memory"))
    assert tracked.rstrip().endswith(" n/a")  # and no ratio against an unknown


BAD_ARGS = [
    (["--steps", "abc"], "bench_e2e.py: error: argument --steps: must be an integer >= 1, got"),
    (["--steps", "0"], "bench_e2e.py: error: argument --steps: must be an integer >= 1, got '0'"),
    (["--stepz", "2"], "bench_e2e.py: error: unrecognized arguments: --stepz 2 (see bench_e2e.py"),
    (["--variants", "bf16,fp4"], "bench_e2e.py: error: unknown variant fp4: choose from bf16,"),
    (["profile", "--variants", "torchao"], "bench_e2e.py profile: error: unknown variant torchao"),
    (["profile", "--rounds", "x"], "bench_e2e.py profile: error: argument --rounds: must be an"),
    (["--micro-batches", "1,x"], "bench_e2e.py: error: argument --micro-batches: must be comma"),
    (["--micro-batches", "0"], "bench_e2e.py: error: argument --micro-batches: must be comma"),
    # tracebacks (or an empty table)
    (["--preset", "nope"], "bench_e2e.py: error: argument --preset: invalid choice: 'nope'"),
    (["--device", "foo"], "bench_e2e.py: error: argument --device: invalid choice: 'foo'"),
    (["--seq-len", "0"], "bench_e2e.py: error: argument --seq-len: must be an integer >= 1"),
    (["--max-micro-batch", "0"], "bench_e2e.py: error: argument --max-micro-batch: must be"),
    (["profile", "--micro-batch", "0"], "bench_e2e.py profile: error: argument --micro-batch"),
    (["profile", "--rounds", "0"], "bench_e2e.py profile: error: argument --rounds: must be"),
    (["profile", "--out", "/no/such/dir/r.txt"], "bench_e2e.py profile: error: --out /no/such"),
]


@pytest.mark.parametrize("argv,line", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bad_arguments_are_one_line(bench, capsys, monkeypatch, argv, line):
    """argparse printed its usage block before the error; now one line, exit 2, before any
    model or data is made."""
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert err.startswith(line) and err.count("\n") == 1, err


def test_a_bad_bench_out_is_refused_before_the_run(bench, capsys, monkeypatch, tmp_path):
    """BENCH_OUT was opened after the whole run (minutes on a GPU), its results lost to a
    traceback: checked first now."""
    monkeypatch.setenv("BENCH_OUT", str(tmp_path / "no" / "such.json"))
    monkeypatch.setattr(bench, "load_data", lambda: pytest.fail("ran"))
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cpu", "--preset", "tiny"])
    assert e.value.code == 2
    assert "BENCH_OUT " in capsys.readouterr().err


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPT.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("modes", ["nope", "Coat", "coat,coat", "bf16,coat-act"])
def test_bench_fsdp_refuses_unknown_modes(capsys, monkeypatch, modes):
    """A mode other than bf16 and coat trained as bf16 under its own label."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as e:
        _script("bench_fsdp").parse_args(["--modes", modes])
    assert e.value.code == 2
    assert "argument --modes: " in capsys.readouterr().err
    assert _script("bench_fsdp").parse_args(["--modes", "coat"]).modes == ["coat"]


def test_bench_vila_refuses_unknown_variants_and_cases(monkeypatch):
    """A misspelt BENCH_VILA_VARIANTS name was dropped (bf16 alone ran)."""
    vila = _script("bench_vila")
    monkeypatch.setenv("BENCH_VILA_VARIANTS", "coat-graph")
    with pytest.raises(ValueError, match="unknown coat-graph"):
        vila._variants()
    monkeypatch.setenv("BENCH_VILA_VARIANTS", "coat-graphs")
    assert list(vila._variants()) == ["bf16", "coat-graphs"]
    for bad in ("nope", "0x1", "1x1,", "1x2x3"):
        monkeypatch.setenv("BENCH_VILA_CASES", bad)
        with pytest.raises(ValueError, match="BENCH_VILA_CASES"):
            vila._cases()
    monkeypatch.setenv("BENCH_VILA_CASES", "1x1,2x2")
    assert vila._cases() == [(1, 1), (2, 2)]
