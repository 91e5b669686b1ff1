"""coat-train with the vision-language presets: the llava-tiny preset end to end on
CPU through the CLI (both modes, compare table, JSONL, PNG), and its bad-input messages."""

import json

import numpy as np
import pytest
import torch
from coat_models.train import cli

FAST = "--preset llava-tiny --batch-size 8 --eval-batches 1 --threads 1 --no-progress".split()


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


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
    # options of the token data: ignored without a word before
    (["--corpus-mib", "2"], 2, "--corpus-mib does not apply to --preset llava-tiny"),
    (["--val-fraction", "0.1"], 2, "--val-fraction does not apply to --preset llava-tiny"),
    (["--data-dtype", "int32"], 2, "--data-dtype does not apply to --preset llava-tiny"),
    # a micro-batch whose logits alone exceed the memory: killed by the OOM killer on CPU
    (["--batch-size", "10000000000"], 2, "lower --batch-size (raise --grad-accum to keep"),
    # too short for an image and its caption: the minimum
    (
        ["--seq-len", "20"],
        2,
        "--seq-len 20 is too short for --preset llava-tiny: its images "
        "and their captions need 55 tokens: pass --seq-len >= 55",
    ),
    # more micro-batches a step than the generated data keeps apart (they repeated the next
    # step's samples)
    (["--grad-accum", "65537"], 2, "--grad-accum 65537 x 1 rank(s) is past the 65536"),
    # past the language model's position table (trained, exported as 512)
    (
        ["--seq-len", "513"],
        2,
        "--seq-len 513 is longer than --preset llava-tiny's position "
        "table (512): pass --seq-len <= 512",
    ),
]


@pytest.mark.parametrize("argv,code,message", VL_BAD, ids=[m[:20] for *_, m in VL_BAD])
def test_vl_bad_input_gives_one_clear_line(tmp_path, capsys, argv, code, message):
    got, _, err = run([*FAST, "--steps", "2", *argv, "--out", tmp_path / "o"], capsys)
    assert got == code
    assert err.startswith("coat-train: error: ") and message in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "o").exists()  # refused before --out was touched


@pytest.mark.gpu
def test_gpu_llava_tiny_cuda_graphs_same_losses(monkeypatch, tmp_path, capsys):
    """CUDA graphs on a vision-language preset (coat-train's default on a GPU): the language
    model's COAT layers are recorded; every step's loss equals the eager run's
    (--no-cuda-graphs), bit for bit."""
    from coat_models import graphs

    recorded = []
    record = graphs._record
    monkeypatch.setattr(graphs, "_record", lambda *a: (recorded.append(1), record(*a))[1])
    losses = []
    for flags in (["--no-cuda-graphs"], []):
        out = tmp_path / f"graphs-{len(flags)}"
        argv = ["--mode", "coat", "--steps", "4", "--device", "cuda", "--out", out, *FAST]
        code, stdout, err = run([*argv, *flags], capsys)
        assert code == 0, err
        assert bool(recorded) is not bool(flags)  # recorded by the default run only
        assert ("CUDA graphs on" in stdout) is not bool(flags)
        losses.append([r["loss"] for r in read_jsonl(out / "coat/metrics.jsonl")
                       if r["type"] == "train"])  # fmt: skip
    assert losses[1] == losses[0]


# ------------------------------------------------------------------ checkpoints and resume
RESUME = [*FAST, "--mode", "coat", "--steps", "6", "--save-every", "2", "--eval-every", "2"]


def metrics(out) -> list[tuple]:
    """What must not change when a run is interrupted and resumed: every metrics record's
    type, step, losses, caption accuracy, learning rate and gradient norm (exact floats)."""
    keys = ("type", "step", "loss", "val_loss", "val_caption_acc", "lr", "grad_norm")
    return [tuple(r.get(k) for k in keys) for r in read_jsonl(out / "coat/metrics.jsonl")]


def weights(out) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "coat/final/model.safetensors")


@pytest.mark.slow
def test_llava_tiny_resumes_bit_for_bit(tmp_path, capsys):
    """COAT (FP8 activations, CoatAdamW's FP8 states) on llava-tiny, stopped by Ctrl-C
    before step 5 and resumed from its step-4 checkpoint: the same records and the same
    final weights, bit for bit, as the uninterrupted run."""
    from coat_models.train.trainer import Trainer

    ref, out = tmp_path / "ref", tmp_path / "killed"
    code, _, err = run([*RESUME, "--out", ref], capsys)
    assert code == 0, err
    queue_step = Trainer.queue_step

    def interrupted(trainer, *args, **kwargs):
        if trainer.step + 1 == 5:
            raise KeyboardInterrupt
        return queue_step(trainer, *args, **kwargs)

    Trainer.queue_step = interrupted
    try:
        code, _, err = run([*RESUME, "--out", out], capsys)
    finally:
        Trainer.queue_step = queue_step
    assert code == 130 and "interrupted" in err, err
    assert sorted(p.name for p in (out / "coat/checkpoints").iterdir()) == [
        "step_0000002", "step_0000004"]  # fmt: skip
    # Without --resume the earlier run's checkpoints are not overwritten.
    code, _, err = run([*RESUME, "--out", out], capsys)
    assert code == 2 and "holds checkpoints of an earlier run: pass --resume" in err, err
    code, stdout, err = run([*RESUME, "--out", out, "--resume"], capsys)
    assert code == 0, err
    assert "resuming from" in stdout and "step_0000004" in stdout
    assert metrics(out) == metrics(ref)
    want, got = weights(ref), weights(out)
    assert want.keys() == got.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    summary = json.loads((out / "coat/summary.json").read_text())
    assert summary["steps"] == 6 and summary["preset"] == "llava-tiny"
    # No message offers --model-dir for this run's model (a LLaVA export, which
    # --model-dir refuses: it takes causal LMs)
    final, ckpt = out / "coat" / "final", out / "coat" / "checkpoints" / "step_0000004"
    longer = [a if a != "6" else "8" for a in RESUME]
    plain = [a for a in FAST if a not in ("--preset", "llava-tiny")]
    cases = [
        ([*longer, "--out", out, "--resume"], f"cannot resume from {out / 'coat'}"),
        ([*plain, "--model-dir", out, "--out", tmp_path / "o"], f"--model-dir {out}: no config"),
        ([*plain, "--model-dir", ckpt, "--out", tmp_path / "o"], f"--model-dir {ckpt}: a coat-"),
        ([*RESUME, "--resume", final, "--out", tmp_path / "o"], f"--resume {final} is a model"),
        # resumed as a text preset: the model differs, and its data with it (the message
        # blamed --data, --corpus-mib or the tokenizer)
        (
            [
                *[a if a != "llava-tiny" else "tiny" for a in RESUME],
                "--resume",
                ckpt,
                "--out",
                tmp_path / "t",
            ],
            "settings differ (model: checkpoint {'model': 'preset llava-tiny'",
        ),
        # another seed: the shapes task's data differ (the message blamed --data, which VL
        # presets refuse, and named the checkpoint's 'tokens' against a bare fingerprint)
        ([*RESUME, "--seed", "7", "--out", out, "--resume"], "data: checkpoint 'task "),
    ]
    for argv, message in cases:
        code, _, err = run(argv, capsys)
        assert code == 2 and message in err and err.count("\n") == 1, err
        if "tiny" in argv:  # its data differ as another model's task, not as a --data change
            assert "(another model's task)" in err and "--data file" not in err, err
        if "--seed" in argv:
            assert "now 'task " in err and "(the --seed or --seq-len of the shapes" in err, err
            assert "--data file" not in err, err
        assert "--model-dir " + str(final) not in err and "fine-tune" not in err, err
