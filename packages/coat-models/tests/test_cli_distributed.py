"""coat-train under torchrun on CPU: 2 ranks over gloo against one process.

One ``torchrun --nproc-per-node 2`` launch of this file (the ``__main__`` part at the end, as
in tests/test_distributed.py) calls ``coat_models.train.cli.main`` several times in one process
group: ``--ddp``, ``--fsdp --activation-checkpointing``, the same FSDP run interrupted and
resumed, a resume the policy refuses, and the llava-tiny preset under both. The
single-process references run here first.

Rank r of 2 takes micro-batch ``micro * 2 + r``, so 2 ranks with ``--grad-accum A`` train on
the tokens of one process with ``--grad-accum 2A``. Expected differences (CPU, one thread,
deterministic kernels):

* FSDP2 computes with bf16 parameters where one process uses autocast over fp32 ones, so
  the comparison uses ``--master-dtype bf16`` (both then compute on the same bf16 weights)
  and ``--grad-clip 0`` (the norm of bf16 gradients, summed per shard then across ranks,
  can differ from the one-process norm by one bf16 ulp, and the clip factor with it). With
  A = 1 the rank's gradients are reduced in fp32 and rounded once to bf16, exactly as one
  process accumulates two bf16 halves. Only the logged loss differs: one process averages
  the micro-batch losses in fp32, the ranks in float64: about 5e-8 relative;
  FSDP_RTOL = 1e-6. (With fp32 master weights the bf16 compute moves the losses by about
  2e-4 relative.)
* DDP with A = 2 sums the four micro-batch gradients in another fp32 order, (g0 + g2) +
  (g1 + g3) against ((g0 + g1) + g2) + g3: about 1e-7 relative per step, which FP8 may
  amplify: a weight one ulp apart can flip an FP8 code of an optimizer state or of an
  activation (per-tensor scales follow the maxima). Seen: up to 2.3e-6 over 4 steps on one
  host, 6.1e-5 on another (AMD EPYC, 2026-12-03: the train loss of step 4, while the eval
  loss after that step was within 5.7e-6, as a flip confined to that step's micro-batches
  would give); DDP_RTOL = 2e-4
  after the first step. The first step's loss comes before any update: only the averaging
  differs, DDP_FIRST_RTOL = 1e-6. Both FSDP_RTOL and DDP_FIRST_RTOL fail on a wrong data
  split: a micro-batch other than the one-process run's moves the first loss by about 2e-3.
* A resumed run reproduces the uninterrupted one bit for bit (same launch, same numbers).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from coat_models.train import cli

# One xdist worker takes the whole module (nox runs --dist loadgroup), so that the
# module-scoped `runs` is computed once, not once on every worker.
pytestmark = pytest.mark.xdist_group("cli_distributed")
WORLD = 2
FSDP_RTOL = 1e-6
DDP_FIRST_RTOL = 1e-6
DDP_RTOL = 2e-4
FAST = (
    "--preset tiny --mode coat --batch-size 4 --seq-len 64 --eval-batches 2 --corpus-mib 1 "
    "--steps 4 --eval-every 2 --threads 1 --no-progress"
).split()
DDP_ARGS = [*FAST, "--grad-accum", "2"]
FSDP_ARGS = [*FAST, "--master-dtype", "bf16", "--grad-clip", "0", "--save-every", "2"]
# The vision-language preset through the same Trainer: COAT on the tower, projector and LM.
VL = (
    "--preset llava-tiny --mode coat --batch-size 4 --eval-batches 1 --steps 4 --eval-every 2 "
    "--threads 1 --no-progress"
).split()
VL_FSDP = [*VL, "--master-dtype", "bf16", "--grad-clip", "0", "--save-every", "2"]


HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def losses(path: Path) -> list[tuple]:
    """(type, step, loss or val loss) of every metrics record."""
    return [(r["type"], r["step"], r.get("loss", r.get("val_loss"))) for r in read_jsonl(path)]


def assert_losses_close(got: Path, want: Path, rtol: float, first_rtol: float | None = None):
    """The same records, losses within ``rtol`` (the first within ``first_rtol``)."""
    a, b = losses(got), losses(want)
    assert [r[:2] for r in a] == [r[:2] for r in b]
    first = rtol if first_rtol is None else first_rtol
    assert a[0][2] == pytest.approx(b[0][2], rel=first, abs=0)
    assert [r[2] for r in a] == pytest.approx([r[2] for r in b], rel=rtol, abs=0)


# -------------------------------------------------------------------------- the launch
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Single-process references (one with a checkpoint), then one 2-process launch."""
    out = tmp_path_factory.mktemp("cli_distributed")
    threads = torch.get_num_threads()
    for name, argv in [
        ("ref_ddp", [*FAST, "--grad-accum", str(2 * WORLD)]),
        ("ref_fsdp", [*FSDP_ARGS, "--grad-accum", str(WORLD)]),
        ("ref_vl_ddp", [*VL, "--grad-accum", str(WORLD)]),
        ("ref_vl_fsdp", [*VL_FSDP, "--grad-accum", str(WORLD)]),
    ]:
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            assert cli.main([*argv, "--out", str(out / name)]) == 0
    torch.set_num_threads(threads)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={WORLD}", __file__, str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(
            f"the {WORLD}-process run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return out


def output(out: Path, name: str, rank: int, stream: str = "out") -> str:
    return (out / f"{name}.rank{rank}.{stream}").read_text()


def codes(out: Path, rank: int) -> dict:
    return json.loads((out / f"codes.rank{rank}.json").read_text())


# --------------------------------------------------------------------------------- tests
@pytest.mark.slow
def test_fsdp_losses_match_one_process(runs):
    assert codes(runs, 0)["fsdp"] == codes(runs, 1)["fsdp"] == 0
    assert_losses_close(runs / "fsdp/coat/metrics.jsonl", runs / "ref_fsdp/coat/metrics.jsonl",
                        FSDP_RTOL)  # fmt: skip
    grad_norms = [r["grad_norm"] for r in read_jsonl(runs / "fsdp/coat/metrics.jsonl")
                  if r["type"] == "train"]  # fmt: skip
    want = [r["grad_norm"] for r in read_jsonl(runs / "ref_fsdp/coat/metrics.jsonl")
            if r["type"] == "train"]  # fmt: skip
    assert grad_norms == pytest.approx(want, rel=2**-7)  # bf16 norms: one ulp, see docstring


@pytest.mark.slow
def test_ddp_losses_match_one_process(runs):
    assert codes(runs, 0)["ddp"] == codes(runs, 1)["ddp"] == 0
    assert_losses_close(runs / "ddp/coat/metrics.jsonl", runs / "ref_ddp/coat/metrics.jsonl",
                        DDP_RTOL, DDP_FIRST_RTOL)  # fmt: skip
    # Byte counts stay integers as in one process (the max over ranks goes through float64).
    for path in (runs / "ddp/coat/metrics.jsonl", runs / "ref_ddp/coat/metrics.jsonl"):
        train = [r for r in read_jsonl(path) if r["type"] == "train"]
        assert all(type(r["mem_tracked_peak"]) is int for r in train), path


@pytest.mark.slow
def test_vl_preset_matches_one_process(runs):
    """llava-tiny (COAT: FP8 tower, projector and LM; CoatAdamW) under --ddp, and under
    --fsdp --activation-checkpointing with bf16 masters and no clipping (see the module
    docstring), against one process with --grad-accum 2. Measured: the losses differ by 4e-8
    relative at most (the loss averaging alone), caption accuracies and gradient norms not
    at all; a wrong data split (micro-batches 0 and 2 instead of 0 and 1) moves the first
    loss by 2e-4."""
    for name in ("vl_ddp", "vl_fsdp"):
        assert codes(runs, 0)[name] == codes(runs, 1)[name] == 0, output(runs, name, 0, "err")
        got, want = runs / name / "coat/metrics.jsonl", runs / f"ref_{name}/coat/metrics.jsonl"
        assert_losses_close(got, want, FSDP_RTOL)
        acc = [[r.get("val_caption_acc") for r in read_jsonl(p)] for p in (got, want)]
        norms = [[r.get("grad_norm") for r in read_jsonl(p)] for p in (got, want)]
        assert acc[0] == acc[1] and norms[0] == norms[1]
        run = json.loads((runs / name / "summary.json").read_text())["runs"][0]
        assert run["parallel"] == {"strategy": name[3:], "world_size": WORLD}
        assert run["preset"] == "llava-tiny" and run["vision_fp8"] is True
        assert output(runs, name, 1) == ""
    # checkpoints through DCP (both ranks' shards), the export gathered on rank 0
    newest = runs / "vl_fsdp/coat/checkpoints/step_0000004"
    assert {"__0_0.distcp", "__1_0.distcp", "manifest.json"} <= {p.name for p in newest.iterdir()}
    from transformers import LlavaForConditionalGeneration

    got = LlavaForConditionalGeneration.from_pretrained(runs / "vl_fsdp/coat/final").state_dict()
    ref = LlavaForConditionalGeneration.from_pretrained(runs / "ref_vl_fsdp/coat/final")
    ref = ref.state_dict()
    assert set(got) == set(ref)
    assert all(got[k].shape == ref[k].shape and got[k].dtype == ref[k].dtype for k in ref)


@pytest.mark.slow
def test_export_gathers_the_whole_model_on_rank0(runs):
    """<out>/<mode>/final under torchrun: the full state dict, gathered to rank 0, loads as
    the plain model with the one-process run's names, shapes and dtypes and nearly its
    weights (the losses match within FSDP_RTOL / DDP_RTOL; 4 AdamW steps of lr 3e-3 move a
    weight by at most 1.2e-2)."""
    from transformers import AutoModelForCausalLM

    for name in ("fsdp", "ddp"):
        summary = json.loads((runs / name / "summary.json").read_text())
        assert summary["runs"][0]["export"] == str(runs / name / "coat" / "final")
        got = AutoModelForCausalLM.from_pretrained(runs / name / "coat" / "final").state_dict()
        ref = AutoModelForCausalLM.from_pretrained(runs / f"ref_{name}" / "coat" / "final")
        ref = ref.state_dict()
        assert set(got) == set(ref)
        for key, value in got.items():
            assert value.shape == ref[key].shape and value.dtype == ref[key].dtype, key
            torch.testing.assert_close(value, ref[key], rtol=0, atol=1.2e-2, msg=key)


@pytest.mark.slow
def test_rank0_alone_prints_and_writes(runs):
    for name in ("fsdp", "ddp"):
        table = output(runs, name, 0)
        assert "tokens/s per rank (step 3)" in table
        assert "peak memory per rank (tracked tensors)" in table
        assert f"2 ranks ({name}): tokens/s and memory per rank (the slowest" in table
        assert output(runs, name, 1) == ""
        assert "coat-train" not in output(runs, name, 1, "err")
        summary = json.loads((runs / name / "summary.json").read_text())
        run = summary["runs"][0]
        assert run["parallel"] == {"strategy": name, "world_size": WORLD}
        assert run["tokens_per_step"] == 4 * 64 * WORLD * (2 if name == "ddp" else 1)
        assert (runs / name / "loss.png").is_file() == HAS_MATPLOTLIB
    writes = [json.loads((runs / f"writes.rank{r}.json").read_text()) for r in range(WORLD)]
    assert writes[1] == [] and any(p.endswith("summary.json") for p in writes[0])
    # FSDP2 shards weights and optimizer state (per rank: about half of one process's)
    fsdp, ref = (json.loads((runs / d / "coat/summary.json").read_text())["memory"]
                 for d in ("fsdp", "ref_fsdp"))  # fmt: skip
    assert fsdp["weights"] < 0.6 * ref["weights"]
    assert fsdp["optimizer_state"] < 0.6 * ref["optimizer_state"]


@pytest.mark.slow
def test_full_disk_at_export_ends_every_rank_in_one_line(runs):
    """Rank 0 alone writes the export; when that fails (a full disk) every rank learns it
    and ends with exit 1 and one line naming the remedies, instead of the other ranks
    waiting at the export's barrier (or going on to the next mode without rank 0)."""
    for rank in range(WORLD):
        assert codes(runs, rank)["full_disk"] == 1
        err = output(runs, "full_disk", rank, "err")
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err, err
        assert "mode bf16 trained" in lines[0] and "--no-export" in lines[0]
    assert "No space left on device" in output(runs, "full_disk", 0, "err")
    assert not (runs / "full_disk" / "coat").exists()  # the next mode did not start
    assert (runs / "full_disk" / "bf16" / "summary.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, code, says",
    [("one_rank_fails", 2, {1: "rank 1: --out "}),
     ("other_options", 2, {0: "rank 1 was started with other settings than rank 0 (--seed)"}),
     ("every_rank_fails", 2, {0: "--weight-decay 0.1 with --lr 1e+06"}),
     ("not_finite", 1, {0: "mode coat: the loss became nan at step 2: lower --lr (now 1e+30)"})],
)  # fmt: skip
def test_an_error_is_said_once_by_a_rank_that_found_it(runs, name, code, says):
    """Every rank ends with the same status; one line in all, by rank 0 where it found the
    error (or every rank did), else by the rank that did, naming itself; nothing written."""
    for rank in range(WORLD):
        assert codes(runs, rank)[name] == code
        err = output(runs, name, rank, "err")
        if rank in says:
            assert err.startswith("coat-train: error: ") and says[rank] in err, err
            assert err.count("\n") == 1, err
        else:
            assert err == "", err
    if code == 2:
        assert not (runs / name).exists()


@pytest.mark.slow
def test_resume_under_torchrun_reproduces_losses_bit_for_bit(runs):
    assert codes(runs, 0)["killed"] == 130
    assert "interrupted" in output(runs, "killed", 0, "err")
    assert codes(runs, 0)["resumed"] == codes(runs, 1)["resumed"] == 0
    assert "; layers stay gathered until backward" in output(runs, "resumed", 0)
    for rank in range(WORLD):  # out of memory with it: one line that names it, exit 1
        assert codes(runs, rank)["oom_gathered"] == 1
    err = output(runs, "oom_gathered", 0, "err")
    assert "out of memory in mode coat" in err and "Traceback" not in err, err
    assert "or drop --no-reshard-after-forward" in err, err
    for rank in range(WORLD):  # what FSDP2 was given: the flag, and its default
        resharding = json.loads((runs / f"resharding.rank{rank}.json").read_text())
        assert resharding["resumed"] == [False] and resharding["fsdp"] == [True], resharding
    a = read_jsonl(runs / "fsdp/coat/metrics.jsonl")
    b = read_jsonl(runs / "killed/coat/metrics.jsonl")
    key = lambda r: (r["type"], r["step"], r.get("loss"), r.get("val_loss"), r.get("grad_norm"))
    assert [key(r) for r in a] == [key(r) for r in b]  # exact floats, no duplicated steps
    ckpts = sorted(p.name for p in (runs / "killed/coat/checkpoints").iterdir())
    assert ckpts == ["step_0000002", "step_0000004"]
    newest = runs / "killed/coat/checkpoints/step_0000004"
    assert sorted(p.name for p in newest.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]  # fmt: skip


@pytest.mark.slow
def test_manifest_covers_every_rank_s_files(runs):
    """Rank 0 writes the manifest after the barrier: it lists both ranks' shards and DCP's
    .metadata with their SHA-256, and how the run was launched."""
    newest = runs / "killed/coat/checkpoints/step_0000004"
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["kind"] == "dcp" and manifest["world_size"] == WORLD
    assert manifest["step"] == 4 and manifest["info"]["parallel"] == {
        "strategy": "fsdp", "world_size": WORLD}  # fmt: skip
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for name, entry in manifest["files"].items():
        data = (newest / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.slow
def test_changed_shard_is_refused_on_every_rank(runs):
    """A byte of rank 0's shard changed. Rank 1 hashes that file (the ranks share the
    hashing); both ranks stop with exit 2 before reading anything, none hangs."""
    assert codes(runs, 0)["tampered"] == codes(runs, 1)["tampered"] == 2
    err = output(runs, "tampered", 0, "err")
    assert "step_0000004 is corrupt: the SHA-256 of __0_0.distcp differs" in err, err
    assert "--resume" in err and "step_0000002" in err


@pytest.mark.slow
def test_planted_metadata_runs_no_code_under_torchrun(runs):
    """A .metadata that would create a directory when unpickled, with a manifest forged to
    match and the right launch: every rank refuses it in the metadata unpickler."""
    assert codes(runs, 0)["planted"] == codes(runs, 1)["planted"] == 2
    err = output(runs, "planted", 0, "err")
    assert "posix.mkdir is not part of a checkpoint's metadata: refused" in err, err
    assert not (runs / "code-ran").exists()


@pytest.mark.slow
def test_resume_across_launches_is_refused(runs, capsys):
    """Policy: a checkpoint resumes only under the launch that wrote it (one process, or the
    same --fsdp/--ddp and number of ranks); every rank says so and exits, none hangs."""
    for rank in range(WORLD):  # bad input: exit 2 everywhere, the line printed by rank 0
        assert codes(runs, rank)["from_single"] == 2
    err = output(runs, "from_single", 0, "err")
    assert "coat-train: error: cannot resume from" in err, err
    assert "written by a run in one process; resume it in one process" in err
    ckpt = runs / "fsdp/coat/checkpoints/step_0000002"
    argv = [*FSDP_ARGS, "--grad-accum", "2", "--resume", ckpt, "--out", runs / "to_single"]
    code = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and "written by --fsdp on 2 ranks, this run is one process" in err


@pytest.mark.parametrize(
    "argv,env,message",
    [
        (["--fsdp", "--ddp"], {}, "use --fsdp or --ddp, not both"),
        (["--fsdp"], {}, "--fsdp trains one process per GPU under torchrun, but WORLD_SIZE"),
        (["--ddp"], {}, "launch `torchrun --nproc-per-node N --no-python coat-train"),
        ([], {"WORLD_SIZE": "2"}, "one of 2 torchrun processes, but neither --fsdp nor --ddp"),
        # a stray or partial torchrun environment: tracebacks from int() / init_distributed
        ([], {"WORLD_SIZE": "two"}, "WORLD_SIZE is 'two', not a number of processes"),
        (["--ddp"], {"WORLD_SIZE": "2"}, "--ddp: WORLD_SIZE is set but RANK, MASTER_ADDR, MASTER"),
    ],
    ids=[
        "fsdp-and-ddp",
        "fsdp-without-torchrun",
        "ddp-without-torchrun",
        "torchrun-no-flag",
        "world-size-not-a-number",
        "partial-torchrun-env",
    ],
)
def test_bad_combinations_give_one_clear_line(tmp_path, capsys, monkeypatch, argv, env, message):
    for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code = cli.main([*argv, "--out", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("coat-train: error: ") and message in err, err
    assert err.count("\n") == 1
    assert not torch.distributed.is_initialized()


def test_more_processes_than_gpus_is_one_clear_line(tmp_path, capsys, monkeypatch):
    """torchrun --nproc-per-node above the GPUs of the host: the rank without a GPU says so
    itself (rank 0 does not see it) in one line naming the count, exit 2, before any process
    group forms (CUDA's own error is a traceback)."""
    env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device called"))
    code = cli.main(["--ddp", "--out", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert (
        "coat-train: error: rank 1: local rank 1 has no GPU" in err and "--nproc-per-node 1" in err
    )
    assert not torch.distributed.is_initialized()


# ------------------------------------------------------------------- the 2-process side
class _Payload:
    """Unpickled by a plain unpickler, it creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _worker(out: Path) -> None:
    import torch.distributed as dist
    from coat_models import checkpoint
    from coat_models.distributed import init_distributed
    from coat_models.train import report
    from coat_models.train import trainer as train

    init_distributed()
    rank = dist.get_rank()
    writes: list[str] = []  # every file this rank wrote through write_atomic

    def recording(write_atomic):
        def record(path, data):
            writes.append(str(path))
            write_atomic(path, data)

        return record

    for module in (cli, report):
        module.write_atomic = recording(module.write_atomic)
    done: dict[str, int] = {}
    # per run: the reshard_after_forward each shard_model call got
    from coat_models import distributed as coat_distributed

    shard_model, resharding = coat_distributed.shard_model, {}

    def recording_shard(model, **kwargs):
        resharding.setdefault(current[0], []).append(kwargs.get("reshard_after_forward", True))
        return shard_model(model, **kwargs)

    coat_distributed.shard_model = recording_shard
    current = [""]

    def coat_train(name: str, argv: list, out_name: str | None = None) -> None:
        argv = [str(a) for a in [*argv, "--out", out / (out_name or name)]]
        current[0] = name
        with (
            open(out / f"{name}.rank{rank}.out", "w") as o,
            open(out / f"{name}.rank{rank}.err", "w") as e,
            contextlib.redirect_stdout(o),
            contextlib.redirect_stderr(e),
        ):
            done[name] = cli.main(argv)

    coat_train("ddp", [*DDP_ARGS, "--ddp"])
    coat_train("fsdp", [*FSDP_ARGS, "--fsdp", "--activation-checkpointing"])
    coat_train("vl_ddp", [*VL, "--ddp"])
    coat_train("vl_fsdp", [*VL_FSDP, "--fsdp", "--activation-checkpointing"])
    # the same run killed before step 4 (after the step-2 checkpoint), then resumed
    queue_step = train.Trainer.queue_step

    def interrupted(trainer, *args, **kwargs):
        if trainer.step + 1 == 4:
            raise KeyboardInterrupt
        return queue_step(trainer, *args, **kwargs)

    train.Trainer.queue_step = interrupted
    coat_train("killed", [*FSDP_ARGS, "--fsdp", "--activation-checkpointing"])
    train.Trainer.queue_step = queue_step
    # resumed without checkpointing and with the layers kept gathered: speed settings, same bits
    coat_train("resumed", [*FSDP_ARGS, "--fsdp", "--no-reshard-after-forward", "--resume"],
               out_name="killed")  # fmt: skip

    # out of memory with the layers kept gathered: the message names the flag
    def out_of_memory(trainer, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    train.Trainer.queue_step = out_of_memory
    coat_train("oom_gathered", [*FSDP_ARGS, "--fsdp", "--no-reshard-after-forward"])
    train.Trainer.queue_step = queue_step
    planted = out / "planted_ckpt"
    if rank == 0:
        shutil.copytree(out / "killed", out / "tampered")
        shard = out / "tampered/coat/checkpoints/step_0000004/__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
        planted.mkdir()
        payload = pickle.dumps(_Payload(out / "code-ran"), protocol=2)
        (planted / ".metadata").write_bytes(payload)
        launch = {"parallel": {"strategy": "fsdp", "world_size": WORLD}}
        checkpoint.write_manifest(planted, kind="dcp", world_size=WORLD, step=2, serial=1,
                                  info=launch)  # fmt: skip
    dist.barrier()
    coat_train("tampered", [*FSDP_ARGS, "--fsdp", "--resume"])
    coat_train("planted", [*FSDP_ARGS, "--fsdp", "--resume", planted])
    single = out / "ref_fsdp/coat/checkpoints/step_0000002"
    coat_train("from_single", [*FSDP_ARGS, "--fsdp", "--resume", single])
    # rank 0 cannot write the exported model (a full disk): every rank ends, in one line
    import errno

    from transformers import PreTrainedModel

    save_pretrained = PreTrainedModel.save_pretrained

    def full_disk(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    PreTrainedModel.save_pretrained = full_disk
    two_modes = [a for a in FAST if a not in ("--mode", "coat")] + ["--compare", "bf16,coat"]
    coat_train("full_disk", [*two_modes, "--steps", 2, "--eval-every", 2, "--ddp"])
    PreTrainedModel.save_pretrained = save_pretrained
    # A check failing on one rank only (a file missing on one node) was said by
    # nobody; ranks started with other options; an error every rank finds; a non-finite norm
    check_out = cli.check_out

    def unwritable_here(out_dir, modes):
        raise cli.UsageError(f"--out {out_dir}: not writable on this node")

    if rank == 1:
        cli.check_out = unwritable_here
    coat_train("one_rank_fails", [*FAST, "--ddp"])
    cli.check_out = check_out
    coat_train("other_options", [*FAST, "--ddp", *(["--seed", "7"] if rank == 1 else [])])
    coat_train("every_rank_fails", [*FAST, "--ddp", "--lr", "1e6"])
    # The first step moves every weight by about the LR (Adam): 1e30 overflows whatever the
    # data (1e6 made the gradient norm nan on one machine's stdlib corpus, 0 on another's).
    not_finite = ["--lr", "1e30", "--weight-decay", "0", "--warmup", "0", "--grad-clip", "0"]
    coat_train("not_finite", [*FAST, "--ddp", *not_finite, "--steps", "3", "--no-export"])
    (out / f"codes.rank{rank}.json").write_text(json.dumps(done))
    (out / f"writes.rank{rank}.json").write_text(json.dumps(writes))
    (out / f"resharding.rank{rank}.json").write_text(json.dumps(resharding))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
