"""coat-train --report-to tensorboard, --version, and a disk that fills while it writes."""

import builtins
import errno
import importlib.metadata
import json
import pathlib
import sys

import pytest
from coat_models.train import cli, report

ARGV = (
    "--preset tiny --steps 4 --eval-every 2 --batch-size 2 --seq-len 32 --eval-batches 1 "
    "--log-every 2 --corpus-mib 1 --no-progress"
).split()


def test_tensorboard_events_hold_the_metrics(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    code = cli.main([*ARGV, "--report-to", "tensorboard", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"tensorboard: tensorboard --logdir {tmp_path} (event files in MODE/" in out
    records = [
        json.loads(r) for r in (tmp_path / "bf16" / "metrics.jsonl").read_text().splitlines()
    ]
    events = EventAccumulator(str(tmp_path / "bf16" / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s"} <= tags
    assert "eval/val_loss" in tags and "eval/eval_batches" not in tags  # a count, not a curve
    for kind, tag, key in (("train", "train/loss", "loss"), ("eval", "eval/val_loss", "val_loss")):
        expected = [(r["step"], r[key]) for r in records if r["type"] == kind]
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in expected]
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6)


def _board_matches_metrics(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    for kind, tag, key in (("train", "train/loss", "loss"), ("eval", "eval/val_loss", "val_loss")):
        expected = [(r["step"], r[key]) for r in records if r["type"] == kind]
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in expected]
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6)
    return records


def test_tensorboard_of_a_resumed_finished_run_shows_its_new_evaluation(tmp_path, capsys):
    """Resuming a finished run evaluates its last step again: TensorBoard then shows that one
    evaluation (not the old one beside it) and still the step's training point."""
    pytest.importorskip("tensorboard")
    argv = [*ARGV, "--report-to", "tensorboard", "--save-every", "4", "--out", str(tmp_path)]
    assert cli.main(argv) == 0, capsys.readouterr().err
    before = _board_matches_metrics(tmp_path / "bf16")
    assert cli.main([*argv, "--eval-batches", "2", "--resume"]) == 0, capsys.readouterr().err
    after = _board_matches_metrics(tmp_path / "bf16")
    old, new = ([r["val_loss"] for r in rs if r["type"] == "eval" and r["step"] == 4]
                for rs in (before, after))  # fmt: skip
    assert len(old) == len(new) == 1 and old != new  # 2 batches, not 1


def test_without_report_to_no_event_files(tmp_path, capsys):
    code = cli.main([*ARGV, "--steps", "2", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert not (tmp_path / "bf16" / "tensorboard").exists() and "tensorboard" not in out


def test_tensorboard_missing_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    # None in sys.modules makes `import` raise ImportError, as where it is not installed.
    for name in [
        n for n in sys.modules if n.startswith(("tensorboard", "torch.utils.tensorboard"))
    ]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    code = cli.main([*ARGV, "--report-to", "tensorboard", "--out", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    assert code == 2
    assert err == (
        "coat-train: error: --report-to tensorboard needs the tensorboard package: pip install "
        "tensorboard (or pip install 'coat-models[tensorboard]'), or leave out --report-to\n"
    )
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_report_to_unknown_is_refused(capsys):
    assert cli.main([*ARGV, "--report-to", "wandb"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("coat-train: error: argument --report-to: invalid choice: 'wandb'")
    assert err.count("\n") == 1


def test_version_names_every_package(capsys):
    assert cli.main(["--version"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = ["fp8-quant", "fp8-optim", "fp8-activations", "coat-models"]
    names += ["torch", "triton", "transformers"]
    assert lines == [f"{n} {importlib.metadata.version(n)}" for n in names]


def test_full_disk_on_the_metrics_names_the_file(tmp_path, capsys, monkeypatch):
    """A write of a metrics record that fails (here: into /dev/full, always ENOSPC) is one
    line naming metrics.jsonl and the remedy, exit 1 (it named no file)."""
    if not pathlib.Path("/dev/full").exists():
        pytest.skip("needs /dev/full (Linux)")

    def full(path, mode="r", *args, **kwargs):
        return builtins.open("/dev/full", mode, *args, **kwargs)

    monkeypatch.setattr(report, "open", full, raising=False)  # MetricsLog's appends
    code = cli.main([*ARGV, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    metrics = tmp_path / "bf16" / "metrics.jsonl"
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"coat-train: error: {metrics}: No space left on device; free space"), err


def test_full_disk_on_the_summary_names_it_and_leaves_no_temporary(tmp_path, capsys, monkeypatch):
    """summary.json's write fails half-way: the error names summary.json (not the temporary
    it was written to) and the half-written temporary is gone."""
    write_bytes = pathlib.Path.write_bytes

    def half_then_full(self, data):
        if "summary.json" not in self.name:
            return write_bytes(self, data)
        write_bytes(self, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(pathlib.Path, "write_bytes", half_then_full)
    code = cli.main([*ARGV, "--steps", "2", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    summary = tmp_path / "bf16" / "summary.json"
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"coat-train: error: {summary}: No space left on device; free space"), err
    assert not [p.name for p in summary.parent.iterdir() if "tmp" in p.name]
