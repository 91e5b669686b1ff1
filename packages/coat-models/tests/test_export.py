"""The end-of-run export: a standard Hugging Face directory (save_pretrained, safetensors,
config) that AutoModelForCausalLM loads back with the trained weights."""

import json

import pytest
import torch
from coat_models.train import cli
from coat_models.train.data import load_data
from coat_models.train.presets import build_model, preset_config
from coat_models.train.trainer import TrainConfig, Trainer


@pytest.fixture(scope="module")
def data():
    return load_data(max_bytes=2**20)


@pytest.mark.parametrize(
    "mode,master",
    [
        ("bf16", "fp32"),
        ("coat", "fp32"),
        ("coat", "bf16"),
    ],
    ids=["bf16", "coat", "coat-bf16-master"],
)
def test_export_loads_back_with_the_trained_weights(tmp_path, data, mode, master):
    from transformers import AutoModelForCausalLM

    cpu = torch.device("cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[master]
    cfg = TrainConfig(mode=mode, master_dtype=master, steps=3, batch_size=2, seq_len=32,
                      warmup=1, eval_every=0, eval_batches=1)  # fmt: skip
    model = build_model(preset_config("tiny", data.vocab_size, max_seq=32), device=cpu,
                        master_dtype=dtype, seed=0)  # fmt: skip
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(model, data, cfg, device=cpu, out_dir=tmp_path / mode, progress=False)
    trainer.fit()
    path = trainer.export(tmp_path / mode / "final")
    trainer.close()
    assert path == tmp_path / mode / "final"
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert not list(tmp_path.glob(f"{mode}/.final.tmp-*"))

    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    trained = trainer.model.state_dict()
    assert set(loaded.state_dict()) == set(trained)
    for name, value in loaded.state_dict().items():
        assert value.dtype == dtype, name
        assert torch.equal(value, trained[name]), name
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)  # it did train
    # Buffers too (not in the state dict): RoPE's inv_freq stays fp32 under bf16 master
    # weights, as from_pretrained rebuilds it (it was cast to bf16: other rotations).
    buffers = dict(loaded.named_buffers())
    for name, b in trainer.model.named_buffers():
        assert b.dtype == buffers[name].dtype and torch.equal(b, buffers[name]), name

    ids = torch.from_numpy(data.val[:64].astype("int64")).view(2, 32)
    trainer.model.eval()
    loaded.eval()
    with torch.no_grad():
        ours, theirs = trainer.model(input_ids=ids).logits, loaded(input_ids=ids).logits
    if master == "fp32":  # model.eval() runs the plain model's ops: the same logits
        assert torch.equal(ours, theirs)
    else:
        # bf16 weights: COAT's bf16 ops round in other places than transformers' (the
        # weights are equal bit for bit, above): within two bf16 roundings of a logit of 1.
        torch.testing.assert_close(ours, theirs, rtol=2**-7, atol=2**-7)


def test_cli_names_the_export_in_its_output_and_summary(tmp_path, capsys):
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()  # transformers' default, whatever ran before in this worker
    argv = "--preset tiny --steps 2 --eval-every 2 --batch-size 2 --seq-len 32 --eval-batches 1"
    code = cli.main([*argv.split(), "--corpus-mib", "1", "--no-progress", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    final = tmp_path / "bf16" / "final"
    assert f"models:      {final}" in out.splitlines()
    assert json.loads((tmp_path / "bf16" / "summary.json").read_text())["export"] == str(final)
    run = json.loads((tmp_path / "summary.json").read_text())["runs"][0]
    assert run["export"] == str(final)
    assert (final / "model.safetensors").is_file()
    # The built-in byte-level corpus separates its files with BYTE_EOS: generate() of the
    # export stops there (its config named no end-of-sequence id).
    assert json.loads((final / "config.json").read_text())["eos_token_id"] == 256
    assert "Writing model shards" not in err  # --no-progress quiets transformers' bar too
    assert hf_logging.is_progress_bar_enabled()  # and leaves it as it found it


ARGV = "--preset tiny --steps 2 --eval-every 2 --batch-size 2 --seq-len 32 --eval-batches 1"


def test_no_export(tmp_path, capsys):
    argv = [*ARGV.split(), "--corpus-mib", "1", "--no-progress", "--no-export"]
    code = cli.main([*argv, "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert not (tmp_path / "bf16" / "final").exists()
    assert "models:      not exported (--no-export)" in out.splitlines()
    assert json.loads((tmp_path / "bf16" / "summary.json").read_text())["export"] is None


def test_safetensors_write_error_is_an_os_error(tmp_path, monkeypatch):
    """safetensors reports a full disk as its own SafetensorError, not an OSError: the
    export turns it into one (which coat-train reports in one line), leaving no partial
    copy."""
    from coat_models.train.trainer import export_pretrained
    from safetensors import SafetensorError
    from transformers import PreTrainedModel

    def full_disk(self, path, **kw):
        path.mkdir(parents=True)
        raise SafetensorError("Error while serializing: I/O error: No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full_disk)
    model = build_model(preset_config("tiny", 320, max_seq=32), device=torch.device("cpu"),
                        master_dtype=torch.float32, seed=0)  # fmt: skip
    with pytest.raises(OSError, match="No space left on device"):
        export_pretrained(model, tmp_path / "final")
    assert list(tmp_path.iterdir()) == []


def test_export_removes_copies_that_killed_exports_left(tmp_path):
    """A process killed while exporting left ``.final.tmp-<pid>`` (a 7B model's copy is 27
    GB), and the next export (a --resume) kept it for good: every such copy is removed (one
    writer: coat-train holds --out's lock); other entries stay."""
    from coat_models.train.trainer import export_pretrained

    for name in (".final.tmp-12345", ".final.tmp-999999"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"partial")
    (tmp_path / ".other.tmp-1").mkdir()
    model = build_model(preset_config("tiny", 320, max_seq=32), device=torch.device("cpu"),
                        master_dtype=torch.float32, seed=0)  # fmt: skip
    export_pretrained(model, tmp_path / "final")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp-1", "final"]


def test_full_disk_at_export_keeps_the_results_and_says_what_to_do(tmp_path, capsys, monkeypatch):
    """save_pretrained failing (here: a simulated full disk after a partial write) leaves no
    partial copy, keeps the mode's metrics and summary, and ends in one line naming the
    remedies (exit 1, no traceback)."""
    import errno

    from transformers import PreTrainedModel

    def full_disk(self, path, **kw):
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full_disk)
    code = cli.main([*ARGV.split(), "--corpus-mib", "1", "--no-progress", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "No space left on device" in lines[0] and "--no-export" in lines[0]
    mode_dir = tmp_path / "bf16"
    assert json.loads((mode_dir / "summary.json").read_text())["export"] is None
    assert (mode_dir / "metrics.jsonl").stat().st_size > 0
    assert not list(mode_dir.glob(".final.tmp-*")) and not (mode_dir / "final").exists()
