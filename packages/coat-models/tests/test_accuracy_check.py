"""The golden loss-curve check of ``benchmarks/bench_e2e_accuracy.py`` (the comparison only:
the 2000-step runs themselves need a GPU): the committed golden curves pass against
themselves, a run off by more than the tolerance or missing a point fails, and the script
exits 1 / 2 for a failed check / unreadable curves."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "bench_e2e_accuracy.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_e2e_accuracy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _copy_run(bench, tmp_path: Path, scale_val=1.0, scale_train=1.0, drop_step=None) -> Path:
    """A run directory holding the golden curves, validation and training losses scaled."""
    for mode in bench.MODES:
        (tmp_path / mode).mkdir(parents=True)
        lines = []
        for line in (bench.GOLDEN / mode / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            if r.get("step") == drop_step:
                continue
            if r.get("type") == "eval":
                r["val_loss"] *= scale_val
            elif r.get("type") == "train":
                r["loss"] *= scale_train
            lines.append(json.dumps(r))
        (tmp_path / mode / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_golden_curves_pass_against_themselves(bench):
    ok, lines = bench.check(bench.GOLDEN)
    assert ok, lines
    for mode in bench.MODES:
        train, val = bench.read_curves(bench.GOLDEN, mode)
        assert len(train) == bench.STEPS and sorted(val) == [500, 1000, 1500, 2000]


def test_within_tolerance_passes(bench, tmp_path):
    ok, _ = bench.check(_copy_run(bench, tmp_path, scale_val=1.015, scale_train=0.985))
    assert ok


@pytest.mark.parametrize("kind", ["val", "train"])
def test_off_curve_fails(bench, tmp_path, kind):
    scale = {"scale_val": 1.03} if kind == "val" else {"scale_train": 1.03}
    ok, lines = bench.check(_copy_run(bench, tmp_path, **scale))
    assert not ok
    assert any(line.strip().startswith(f"OUT: {kind}") for line in lines), lines


def test_missing_point_fails(bench, tmp_path):
    ok, lines = bench.check(_copy_run(bench, tmp_path, drop_step=1000))
    assert not ok
    assert any("val @ 1000: run None" in line for line in lines), lines
    assert any("train 901-1000: run None" in line for line in lines), lines


def test_script_exit_codes(bench, tmp_path, capsys):
    good = _copy_run(bench, tmp_path / "good")
    assert bench.main(["--check-only", str(good)]) == 0
    bad = _copy_run(bench, tmp_path / "bad", scale_val=0.9)
    assert bench.main(["--check-only", str(bad)]) == 1
    shutil.rmtree(bad / "coat")
    assert bench.main(["--check-only", str(bad)]) == 2
    assert "cannot read the curves" in capsys.readouterr().err


def test_update_golden_records_where_the_curves_come_from(bench, tmp_path, monkeypatch):
    """--update-golden copies the run's curves and writes provenance.json beside them: the
    date, device, software, command and the run's final validation losses."""
    run = _copy_run(bench, tmp_path / "run", scale_val=0.99)
    golden = tmp_path / "golden"
    monkeypatch.setattr(bench, "GOLDEN", golden)
    assert bench.main(["--check-only", str(run), "--update-golden", "--why", "a test"]) == 0
    for mode in bench.MODES:
        assert (golden / mode / "metrics.jsonl").read_bytes() == (
            run / mode / "metrics.jsonl"
        ).read_bytes()
    prov = json.loads((golden / "provenance.json").read_text())
    want = ["bench_e2e_accuracy.py", "--check-only", str(run), "--update-golden", "--why", "a test"]
    assert prov["command"] == want and prov["why"] == "a test"
    for mode in bench.MODES:
        assert prov["final_val_loss"][mode] == bench.read_curves(run, mode)[1][2000]
    assert set(prov) >= {"date", "device", "software", "code", "gap"}


def _finals(run: Path, bf16: float, coat: float) -> Path:
    """A run directory whose only points are the two modes' final validation losses."""
    for mode, loss in (("bf16", bf16), ("coat", coat)):
        (run / mode).mkdir(parents=True)
        record = {"type": "eval", "step": 2000, "val_loss": loss}
        (run / mode / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    return run


def test_parity_is_the_mean_gap_over_seeds(bench, tmp_path):
    """--seeds: seed s > 0 lives in <run>/seed-<s>; the target holds for the mean of the
    seeds' gaps (coat / bf16 - 1), each listed; coat below bf16 is not a miss."""
    run = _finals(tmp_path, 1.0, 1.012)
    met, lines = bench.parity(run)
    assert met is False and "gap +1.200%" in lines[-1], lines
    _finals(run / "seed-1", 1.0, 0.992)
    _finals(run / "seed-2", 2.0, 1.98)
    (run / "seed-x").mkdir()  # not a seed folder
    assert list(bench.seed_runs(run)) == [0, 1, 2]
    met, lines = bench.parity(run)
    assert met is True, lines
    assert lines[-1].startswith("mean gap of 3 seeds -0.")
    assert [line.split(":")[0] for line in lines[:3]] == ["seed 0", "seed 1", "seed 2"]
    assert "gap -0.800%" in lines[1] and "gap -1.000%" in lines[2]
    # the mean, not each seed: (1.2 - 0.8 - 1.0) / 3 = -0.2%
    assert "-0.200%" in lines[-1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seeds", "0"], "--seeds must be at least 1"),
        (["--seeds", "3", "--seed", "5"], "--seed is not passed on"),
        (["--seed=5"], "--seed is not passed on"),
    ],
)
def test_bad_seed_arguments_are_refused(bench, tmp_path, capsys, monkeypatch, argv, message):
    """Refused before anything trains (one line, exit 2): no seeds, and a --seed for
    coat-train, whose last --seed would make every seed's run the same one (nor is --seed
    read as an abbreviation of --seeds)."""
    from coat_models.train import cli

    def train(argv):
        raise AssertionError(f"trained with {argv}")

    monkeypatch.setattr(cli, "main", train)
    with pytest.raises(SystemExit) as e:
        bench.main([*argv, "--out", str(tmp_path / "run")])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "line, message",
    [
        ("[1, 2]", "line 1: not a JSON object"),
        ('{"type": "train", "step": 1, "loss": null}', "line 1: its train record needs"),
        ('{"type": "eval", "step": "2000", "val_loss": 0.7}', "line 1: its eval record needs"),
        ("{not json", "Expecting property name"),
    ],
)
def test_unreadable_curves_are_one_line_and_exit_2(bench, tmp_path, capsys, line, message):
    """A metrics file that is not what coat-train writes is unreadable input (exit 2, one
    line naming the file), not a failed accuracy check (exit 1) or a traceback."""
    run = _copy_run(bench, tmp_path / "run")
    (run / "coat" / "metrics.jsonl").write_text(line + "\n")
    assert bench.main(["--check-only", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read the curves" in err and message in err, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--check-only", ""], "--check-only needs the run's directory"),
        (["--check-only", "RUN", "--bogus"], "unrecognized arguments with --check-only"),
    ],
)
def test_check_only_never_trains(bench, tmp_path, capsys, monkeypatch, argv, message):
    """``--check-only ''`` is not "no --check-only" (which trains), and options it would
    ignore are refused: one line, exit 2, nothing trained."""
    from coat_models.train import cli

    def train(argv):
        raise AssertionError(f"trained with {argv}")

    monkeypatch.setattr(cli, "main", train)
    monkeypatch.chdir(tmp_path)
    argv = [str(_copy_run(bench, tmp_path / "run")) if a == "RUN" else a for a in argv]
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "accuracy-125m-run").exists()


def test_training_without_a_gpu_is_refused(bench, tmp_path, capsys, monkeypatch):
    """Without --check-only the script trains the 125m preset twice for 2000 steps: on a
    host without a GPU that started hours of CPU training. One line, exit 2;
    an explicit --device (coat-train's) still runs; BENCH_OUT is checked before training."""
    from coat_models.train import cli

    trained = []
    monkeypatch.setattr(cli, "main", lambda argv: trained.append(argv) or 1)
    monkeypatch.setattr(bench, "_has_gpu", lambda: False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        bench.main([])
    assert e.value.code == 2 and not trained
    assert "needs a CUDA GPU (or --check-only RUN_DIR" in capsys.readouterr().err
    assert bench.main(["--device", "cpu"]) == 1 and trained  # (the stand-in's exit code)
    assert bench.main(["--device=cpu"]) == 1 and len(trained) == 2
    trained.clear()
    monkeypatch.setenv("BENCH_OUT", "")  # (empty: no file, as the writing code reads it)
    assert bench.main(["--device=cpu"]) == 1 and len(trained) == 1
    monkeypatch.setattr(bench, "_has_gpu", lambda: True)
    monkeypatch.setenv("BENCH_OUT", str(tmp_path / "no" / "such.json"))
    with pytest.raises(SystemExit) as e:
        bench.main([])
    assert e.value.code == 2 and len(trained) == 1
    assert "BENCH_OUT" in capsys.readouterr().err
