"""coat-train with the vision-language presets (issue 7): the llava-tiny preset end to end on
CPU through the CLI (both modes, compare table, JSONL, PNG), and its bad-input messages."""

import json

import numpy as np
import pytest
import torch
from coat_models.train import cli

FAST = "--preset llava-tiny --batch-size 8 --eval-batches 1 --threads 1 --no-progress".split()


def run(argv, capsys):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_llava_tiny_compare_end_to_end(tmp_path, capsys):
    out = tmp_path / "vl"
    argv = ["--compare", "bf16,coat", "--steps", "6", "--eval-every", "3", "--out", out, *FAST]
    code, stdout, stderr = run(argv, capsys)
    assert code == 0, stderr
    for mode in ("bf16", "coat"):
        recs = [json.loads(x) for x in (out / mode / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in recs if r["type"] == "train"]
        evals = [r for r in recs if r["type"] == "eval"]
        assert [r["step"] for r in train] == list(range(1, 7))
        assert [r["step"] for r in evals] == [3, 6]
        assert all(np.isfinite(r["loss"]) for r in train)
        assert all(0 <= r["val_caption_acc"] <= 1 for r in evals)
        summary = json.loads((out / mode / "summary.json").read_text())
        assert summary["preset"] == "llava-tiny" and summary["val_loss"] == evals[-1]["val_loss"]
    # COAT tracks bf16 over these steps: the same data, seed and schedule
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert [r["mode"] for r in runs] == ["bf16", "coat"]
    assert abs(runs[1]["train_loss"] - runs[0]["train_loss"]) < 0.05 * runs[0]["train_loss"]
    assert runs[1]["memory"]["optimizer_state"] < runs[0]["memory"]["optimizer_state"] / 3
    assert runs[1]["memory"]["activations"] < runs[0]["memory"]["activations"]
    header = next(line for line in stdout.splitlines() if "(fp32 master)" in line)
    assert "coat/bf16" in header and "caption accuracy" in stdout
    assert ("loss curves: not drawn" in stdout) != (out / "loss.png").is_file()


VL_BAD = [
    (["--data", "x.txt"], 2, "--data does not apply to --preset llava-tiny"),
    (["--vocab-size", "512"], 2, "--vocab-size does not apply"),
    (["--save-every", "2"], 2, "checkpoints are not supported for --preset llava-tiny"),
    (["--seq-len", "20"], 1, "55"),  # too short for an image and its caption: the minimum
]


@pytest.mark.parametrize("argv,code,message", VL_BAD, ids=[m[:20] for *_, m in VL_BAD])
def test_vl_bad_input_gives_one_clear_line(tmp_path, capsys, argv, code, message):
    got, _, err = run([*FAST, "--steps", "2", *argv, "--out", tmp_path / "o"], capsys)
    assert got == code
    assert err.startswith("coat-train: error: ") and message in err, err
    assert "Traceback" not in err


@pytest.mark.gpu
def test_gpu_llava_tiny_cuda_graphs_same_losses(monkeypatch):
    """--cuda-graphs on a vision-language preset: the language model's COAT layers are
    recorded; every step's loss equals the eager run's, bit for bit."""
    from coat_models import graphs
    from coat_models.train.vl_train import train_vlm, vl_train_config

    recorded = []
    record = graphs._record
    monkeypatch.setattr(graphs, "_record", lambda *a: (recorded.append(1), record(*a))[1])
    losses = []
    for use_graphs in (False, True):
        cfg = vl_train_config("llava-tiny", "coat", steps=4, batch_size=8, eval_every=0,
                              eval_batches=1, cuda_graphs=use_graphs)  # fmt: skip
        losses.append(train_vlm("llava-tiny", cfg, device="cuda", progress=False)["losses"])
    assert recorded and losses[1] == losses[0]
