"""coat-train's checkpoints on CPU: killed at every step of a save and a prune, corrupted,
planted, resumed from older ones; the output lock; torn metrics; failed runs that must not
lose earlier results.

Every run here uses ``--threads 1``: the forked children and this process then compute the
same bits, and "resumes exactly" means equal floats, step by step.
"""

import contextlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from coat_models import checkpoint
from coat_models.train import cli, jobs
from coat_models.train.trainer import Trainer

# One xdist worker takes the whole module (nox runs --dist loadgroup), so that the
# module-scoped `runs` is computed once, not once on every worker.
pytestmark = pytest.mark.xdist_group("cli_checkpoints")
ARGS = (
    "--preset tiny --batch-size 4 --seq-len 64 --eval-batches 2 --corpus-mib 1 --no-progress "
    "--threads 1 --steps 6 --save-every 2 --eval-every 2"
).split()


def train(argv) -> tuple[int, str, str]:
    """``coat-train argv`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


@contextlib.contextmanager
def interrupted_before(step):
    """Trainer.queue_step raises KeyboardInterrupt (Ctrl-C) before optimizer step ``step``."""
    queue_step = Trainer.queue_step

    def interrupted(trainer, *args, **kwargs):
        if trainer.step + 1 == step:
            raise KeyboardInterrupt
        return queue_step(trainer, *args, **kwargs)

    Trainer.queue_step = interrupted
    try:
        yield
    finally:
        Trainer.queue_step = queue_step


def records(out) -> list[tuple]:
    """What must not change when a run is interrupted and resumed: every metrics record's
    type, step, losses, learning rate and gradient norm (exact floats), in order."""
    lines = (out / "bf16" / "metrics.jsonl").read_text().splitlines()
    keys = ("type", "step", "loss", "val_loss", "lr", "grad_norm")
    return [tuple(json.loads(line).get(k) for k in keys) for line in lines]


def names(path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``ref``: 6 uninterrupted steps (checkpoints at 2, 4, 6, the newest one kept).
    ``base``: the same run with two checkpoints kept, stopped by Ctrl-C before step 5."""
    threads = torch.get_num_threads()
    root = tmp_path_factory.mktemp("cli_checkpoints")
    assert train([*ARGS, "--keep-checkpoints", "1", "--out", root / "ref"])[0] == 0
    with interrupted_before(5):
        assert train([*ARGS, "--keep-checkpoints", "2", "--out", root / "base"])[0] == 130
    assert names(root / "base/bf16/checkpoints") == ["step_0000002", "step_0000004"]
    yield root
    torch.set_num_threads(threads)


def copy_base(runs, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(runs / "base", out)
    return out, out / "bf16" / "checkpoints"


def complete(ckpts) -> list[str]:
    """Directories ``recover`` keeps (no trash) that verify against their manifest."""
    found = []
    for d in sorted(ckpts.iterdir()):
        if d.name.startswith(".trash-"):
            continue
        try:
            checkpoint.verify(d, checkpoint.read_manifest(d))
        except (checkpoint.CheckpointError, OSError):
            continue
        found.append(d.name)
    return found


# ------------------------------------------------------------ killed during a save
# Forks one child per stage from a process that has imported torch, transformers and
# coat_models but run nothing (safe to fork; the children skip those imports). Each child
# runs coat-train in a copy of a prepared --out and SIGKILLs itself when a save reaches the
# given stage (checkpoint._reached).
_FORK_SERVER = textwrap.dedent(
    """
    import json, os, shutil, signal, sys
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401
    from coat_models import checkpoint
    from coat_models.train import cli

    killed = {}
    for job in json.loads(sys.argv[1]):  # {"base", "out", "stage", "argv"}
        out = job["out"]
        shutil.copytree(job["base"], out)
        pid = os.fork()
        if pid == 0:
            log = os.open(out + ".log", os.O_WRONLY | os.O_CREAT, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)

            def kill_at(reached, stage=job["stage"]):
                if reached == stage:
                    os.kill(os.getpid(), signal.SIGKILL)

            checkpoint._reached = kill_at
            code = cli.main([a.replace("{out}", out) for a in job["argv"]] + ["--out", out])
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(100 + code)  # the stage was never reached
        _, status = os.waitpid(pid, 0)
        killed[out] = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    print(json.dumps(killed))
    """
)
# Both start from the base run (step 2 and step 4 saved) and resume from step 2 with
# --keep-checkpoints 1, so their first save replaces the step-4 checkpoint already there.
KILLED = {
    # step 2 moved out of the checkpoints directory first: the step 4 being replaced is the
    # only checkpoint there (the --keep-checkpoints 1 case)
    "replace-the-only-one": (
        "{out}/saved/step_0000002",
        [
            "write:model.pt",
            "write:optimizer.pt",
            "write:trainer.pt",
            "manifest",  # the new step 4 complete under its temporary name
            "replace:trash",  # the old step 4 renamed away
            "publish",  # the new step 4 in place
            "replace:delete",  # the old step 4 part-deleted
        ],
    ),
    # step 2 stays: after the save, pruning to one deletes it
    "prune": (
        "{out}/bf16/checkpoints/step_0000002",
        ["prune:trash", "prune:delete"],  # step 2 renamed away; part-deleted
    ),
}


@pytest.mark.slow
def test_killed_at_each_stage_of_save_and_prune_resumes_bit_identically(runs, tmp_path):
    """SIGKILL at every step of a re-save and a prune with --keep-checkpoints 1: at each a
    complete checkpoint is on disk, and --resume continues from step 4 (the old or the new
    copy) to the uninterrupted run's records, float for float."""
    jobs = []
    for scenario, (resume_from, stages) in KILLED.items():
        base = tmp_path / scenario / "base"
        shutil.copytree(runs / "base", base)
        if scenario == "replace-the-only-one":
            (base / "saved").mkdir()
            shutil.move(base / "bf16/checkpoints/step_0000002", base / "saved")
        argv = [*ARGS, "--keep-checkpoints", "1", "--resume", resume_from]
        for stage in stages:
            out = tmp_path / scenario / stage.replace(":", "-")
            jobs.append({"base": str(base), "out": str(out), "stage": stage, "argv": argv})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _FORK_SERVER, json.dumps(jobs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    killed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert killed == {job["out"]: True for job in jobs}, killed
    want = records(runs / "ref")
    for job in jobs:
        out, stage = Path(job["out"]), job["stage"]
        ckpts = out / "bf16" / "checkpoints"
        log = Path(job["out"] + ".log").read_text()
        assert "resuming from" in log and "Traceback" not in log, log
        assert complete(ckpts), f"{out}: no complete checkpoint left: {names(ckpts)}"
        code, said, err = train([*ARGS, "--keep-checkpoints", "1", "--resume", "--out", out])
        assert code == 0, f"{out}: {err}"
        assert f"resuming from {ckpts / 'step_0000004'}" in said, f"{out}: {said}"
        assert records(out) == want, out
        assert names(ckpts) == ["step_0000006"], out


@pytest.mark.slow
def test_resume_from_an_older_checkpoint_supersedes_later_ones(runs, tmp_path):
    """After resuming from step 2, the step 4 this run writes is the newest checkpoint, not
    the earlier run's step 6: pruning keeps it, and --resume continues from it."""
    out = tmp_path / "run"
    ckpts = out / "bf16" / "checkpoints"
    assert train([*ARGS, "--keep-checkpoints", "3", "--out", out])[0] == 0
    assert names(ckpts) == ["step_0000002", "step_0000004", "step_0000006"]
    resume_2 = ["--resume", ckpts / "step_0000002"]
    with interrupted_before(5):
        code, *_ = train([*ARGS, "--keep-checkpoints", "1", *resume_2, "--out", out])
    assert code == 130
    assert names(ckpts) == ["step_0000004"]
    code, said, err = train([*ARGS, "--keep-checkpoints", "1", "--resume", "--out", out])
    assert code == 0, err
    assert f"resuming from {ckpts / 'step_0000004'}" in said
    assert records(out) == records(runs / "ref")


@pytest.mark.slow
def test_plain_resume_after_an_interrupted_resume_of_an_older_checkpoint_returns_to_it(
    runs, tmp_path
):
    """Resumed from step 2, interrupted before writing a checkpoint of its own: plain
    --resume continues from step 2 again, not from the replaced run's step 6, whose
    records the first resume cut from the metrics (they were lost)."""
    out = tmp_path / "run"
    ckpts = out / "bf16" / "checkpoints"
    assert train([*ARGS, "--keep-checkpoints", "3", "--out", out])[0] == 0
    with interrupted_before(3):
        code, *_ = train([*ARGS, "--resume", ckpts / "step_0000002", "--out", out])
    assert code == 130
    code, said, err = train([*ARGS, "--keep-checkpoints", "1", "--resume", "--out", out])
    assert code == 0, err
    assert f"resuming from {ckpts / 'step_0000002'}" in said, said
    assert records(out) == records(runs / "ref")
    assert names(ckpts) == ["step_0000006"]


def test_a_resume_from_an_older_checkpoint_drops_the_replaced_runs_summary_and_model(tmp_path):
    """After such a resume was interrupted, the mode's summary.json and final/
    still described the replaced run's end (its metrics were cut back already)."""
    out = tmp_path / "run"
    mode = out / "bf16"
    assert train([*ARGS, "--keep-checkpoints", "3", "--out", out])[0] == 0
    assert (mode / "summary.json").is_file() and (mode / "final").is_dir()
    with interrupted_before(3):
        code, *_ = train([*ARGS, "--resume", mode / "checkpoints" / "step_0000002", "--out", out])
    assert code == 130
    assert not (mode / "summary.json").exists() and not (mode / "final").exists()


@pytest.mark.parametrize("how", ["link", "copy"])
@pytest.mark.slow
def test_a_resume_of_an_older_checkpoint_by_link_or_copy_supersedes_too(runs, tmp_path, how):
    """Through a link to it, the replaced run's summary and model went but the
    checkpoint was not made the newest (a plain --resume after an interrupt took step 6,
    its records gone); from a copy kept elsewhere, the summary and model stayed."""
    out = tmp_path / "run"
    mode = out / "bf16"
    assert train([*ARGS, "--keep-checkpoints", "3", "--out", out])[0] == 0
    (tmp_path / "aside").mkdir()
    given = tmp_path / "aside" / "step_0000002"
    if how == "link":
        given.symlink_to(mode / "checkpoints" / "step_0000002")
    else:
        shutil.copytree(mode / "checkpoints" / "step_0000002", given)
    with interrupted_before(3):
        assert train([*ARGS, "--resume", given, "--out", out])[0] == 130
    assert not (mode / "summary.json").exists() and not (mode / "final").exists()
    if how == "link":
        code, said, err = train([*ARGS, "--keep-checkpoints", "1", "--resume", "--out", out])
        assert code == 0, err
        assert f"resuming from {mode / 'checkpoints' / 'step_0000002'}" in said, said
        assert records(out) == records(runs / "ref")


def test_resume_through_a_link_to_an_unpublished_checkpoint_is_refused(runs, tmp_path):
    """The name check read the link's name; recovery then deleted the trash it
    pointed to and the run failed (exit 1)."""
    out, ckpts = copy_base(runs, tmp_path)
    shutil.copytree(ckpts / "step_0000004", ckpts / ".trash-step_0000004-1a2b3c4d")
    link = tmp_path / "link"
    link.symlink_to(ckpts / ".trash-step_0000004-1a2b3c4d")
    code, _, err = train([*ARGS, "--resume", link, "--out", out])
    assert code == 2 and "not a published one" in err, err
    assert (ckpts / ".trash-step_0000004-1a2b3c4d").is_dir()


def test_a_later_modes_launch_is_checked_before_any_mode_trains(tmp_path):
    """--compare bf16,coat-optim --resume refused coat-optim's checkpoint of
    another launch (torchrun) only at that mode's start, after bf16 had gone on and the
    report was gone. Here its manifest says --ddp on 2 ranks. And --resume DIR of one mode
    of a comparison says it replaces the report (plain --resume said so, DIR did not)."""
    out = tmp_path / "run"
    argv = [*ARGS, "--steps", "2", "--compare", "bf16,coat-optim", "--out", out]
    assert train(argv)[0] == 0
    ckpt = out / "coat-optim" / "checkpoints" / "step_0000002"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest.update(kind="dcp", world_size=2)
    manifest["info"]["parallel"] = {"strategy": "ddp", "world_size": 2}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    code, _, err = train([*argv, "--resume"])
    assert code == 2 and err.count("\n") == 1, err
    assert "it was written by --ddp on 2 ranks, this run is one process" in err, err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    manifest["info"]["parallel"] = "ddp"  # corrupt: said with the way on
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = train([*argv, "--resume"])
    assert code == 2 and "its manifest's launch is 'ddp'" in err, err
    assert "there is no older checkpoint: delete" in err, err
    bf16 = out / "bf16" / "checkpoints" / "step_0000002"
    code, _, err = train([*ARGS, "--steps", "2", "--resume", bf16, "--out", out])
    assert code == 0, err
    assert "compares bf16, coat-optim; resuming bf16 alone replaces it" in err, err


@pytest.mark.parametrize("name", [".tmp-step_0000004-123", "step_0000004.partial",
                                  ".trash-step_0000004-1a2b3c4d"])  # fmt: skip
def test_resume_of_an_unpublished_checkpoint_is_refused(runs, tmp_path, name):
    """--resume of a directory a save is writing (or a killed one left, or one being
    deleted): refused on one line naming the way on; it was accepted, then the checks
    before training published it under its step_N name and the run failed to find it."""
    out, ckpts = copy_base(runs, tmp_path)
    shutil.copytree(ckpts / "step_0000004", ckpts / name)
    before = names(ckpts)
    code, _, err = train([*ARGS, "--resume", ckpts / name, "--out", out])
    assert code == 2 and err.count("\n") == 1, err
    assert "not a published one: pass a step_N directory beside it, or plain --resume" in err
    assert names(ckpts) == before


# ------------------------------------------------------------------- corrupt or planted
def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


CORRUPT_NEWEST = [
    ("flipped", lambda d: _flip_byte(d / "model.pt"), "the SHA-256 of model.pt differs"),
    ("truncated", lambda d: os.truncate(d / "optimizer.pt", 100), "optimizer.pt has 100 bytes"),
    ("no-manifest", lambda d: (d / "manifest.json").unlink(), "has no manifest.json"),
]


@pytest.mark.parametrize("name,corrupt,message", CORRUPT_NEWEST, ids=[c[0] for c in CORRUPT_NEWEST])
def test_corrupt_newest_checkpoint_is_named_not_skipped(runs, tmp_path, name, corrupt, message):
    """The newest checkpoint fails its checks: one line naming it and the way on, exit 2,
    nothing changed; the run neither falls back to step 2 silently nor starts afresh."""
    out, ckpts = copy_base(runs, tmp_path)
    corrupt(ckpts / "step_0000004")
    metrics = (out / "bf16" / "metrics.jsonl").read_bytes()
    code, _, err = train([*ARGS, "--keep-checkpoints", "2", "--resume", "--out", out])
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "step_0000004" in err and message in err, err
    # it names the previous checkpoint to continue from (without a manifest too: its advice
    # was to delete the manifest, then to delete it again)
    assert f"--resume {ckpts / 'step_0000002'}" in err, err
    assert (out / "bf16" / "metrics.jsonl").read_bytes() == metrics
    assert names(ckpts) == ["step_0000002", "step_0000004"]
    # named with --resume DIR: the same refusal, and the ways on (it named none)
    code, _, err = train([*ARGS, "--resume", ckpts / "step_0000004", "--out", out])
    assert code == 2 and err.count("\n") == 1 and message in err, err
    # (plain --resume would take the same one, no --resume meets the earlier run's checkpoints)
    assert err.endswith(
        f"; pass --resume {ckpts / 'step_0000002'} (the newest readable one beside it), or "
        "another --out without --resume to start from step 0\n"
    ), err
    # into another --out: no plain --resume to offer there (it named one), a fresh start works
    code, _, err = train([*ARGS, "--resume", ckpts / "step_0000004", "--out", tmp_path / "new"])
    assert code == 2 and err.endswith(
        f"; pass --resume {ckpts / 'step_0000002'} (the newest readable one beside it), or no "
        "--resume to start from step 0\n"
    ), err
    assert (out / "bf16" / "metrics.jsonl").read_bytes() == metrics
    if name == "flipped":  # the way it names works, and ends where the uninterrupted run does
        resume_2 = ["--resume", ckpts / "step_0000002"]
        code, _, err = train([*ARGS, "--keep-checkpoints", "1", *resume_2, "--out", out])
        assert code == 0, err
        assert records(out) == records(runs / "ref")


def _rehashed(edit):
    """``edit(directory)`` then a manifest of the edited files (a writer who re-hashes)."""

    def corrupt(d):
        old = checkpoint.read_manifest(d)
        (d / "manifest.json").unlink()
        edit(d)
        checkpoint.write_manifest(
            d, kind=old.kind, world_size=old.world_size, step=old.step, serial=old.serial,
            info=old.info,
        )  # fmt: skip

    return corrupt


def _edit_torch_file(name, change):
    def edit(d):
        state = torch.load(d / name, weights_only=True)
        change(state)
        torch.save(state, d / name)

    return _rehashed(edit)


def _deflate(name):
    """Rewrite ``name``'s zip archive with deflated entries (torch.load reads them: about
    1000:1 of memory per byte of file)."""

    def edit(d):
        import zipfile

        data = (d / name).read_bytes()
        with (
            zipfile.ZipFile(io.BytesIO(data)) as src,
            zipfile.ZipFile(d / name, "w", zipfile.ZIP_DEFLATED) as dst,
        ):
            for info in src.infolist():
                dst.writestr(info.filename, src.read(info.filename))

    return edit


def _edit_manifest_info(d):
    raw = json.loads((d / "manifest.json").read_text())
    raw["info"]["settings"]["config"] = "x"  # the info is no file the manifest hashes
    (d / "manifest.json").write_text(json.dumps(raw))


def _first_moment(state):
    st = state["state"][0]
    st["exp_avg"] = st["exp_avg"][:1]


ODD_NEWEST = [  # (the newest checkpoint's step_0000004)
    ("step-link", lambda d: (shutil.rmtree(d), d.symlink_to("step_0000004")),
     "step_0000004 is not a checkpoint directory (a file, a dangling link or a link loop)"),
    ("step-file", lambda d: (shutil.rmtree(d), d.write_text("x")),
     "step_0000004 is not a checkpoint directory (a file, a dangling link or a link loop)"),
    ("nested-manifest", lambda d: (d / "manifest.json").write_text("[" * 100000 + "]" * 100000),
     "is not valid JSON (nested too deeply)"),
    ("manifest-info", _edit_manifest_info, "its manifest's recorded settings are corrupt"),
    ("trainer-totals", _edit_torch_file("trainer.pt", lambda s: s["totals"].update(timed=5)),
     "has no valid 'totals'"),
    ("trainer-losses", _edit_torch_file("trainer.pt", lambda s: s.update(train_losses=["a"])),
     "has no valid 'train_losses'"),
    ("trainer-schedule", _edit_torch_file("trainer.pt", lambda s: s["scheduler"].update(
        last_epoch=0)), "its LR schedule is at step 0, its training state at step 4: not a "
     "checkpoint coat-train wrote"),
    ("trainer-step", _edit_torch_file("trainer.pt", lambda s: s["config"].update(steps=3)),
     "its training state is at step 4 of a 3-step run: not a checkpoint coat-train wrote"),
    ("trainer-no-format", _edit_torch_file("trainer.pt", lambda s: s.pop("format")),
     "is not a coat-train checkpoint (its training state has no valid 'format')"),
    ("trainer-format", _edit_torch_file("trainer.pt", lambda s: s.update(format=2)),
     "its training state is of format 2, this coat-train reads format 1: resume it with the "
     "coat-train that wrote it"),
    ("trainer-deflated", _rehashed(_deflate("trainer.pt")),
     "trainer.pt holds compressed entries (archive/"),
    ("moment-shape", _edit_torch_file("optimizer.pt", _first_moment),
     "optimizer state 'exp_avg' of parameter 0 has shape"),
    ("groups", _edit_torch_file("optimizer.pt", lambda s: s.update(param_groups=[1])),
     "does not fit this model and optimizer"),
]  # fmt: skip


@pytest.mark.parametrize("name,corrupt,message", ODD_NEWEST, ids=[c[0] for c in ODD_NEWEST])
def test_odd_checkpoint_entries_are_refused_not_skipped(runs, tmp_path, name, corrupt, message):
    """What a probe of resume found: a ``step_*`` entry that is a file or a link
    to no directory was skipped (the run fell back to step 2, then failed to save over it),
    a manifest nested past the stack or whose settings are no dict, a training state of wrong
    types or optimizer groups of wrong types (tracebacks, exit 1), an AdamW moment of another
    shape (loaded, exit 0): one line, exit 2, nothing written."""
    out, ckpts = copy_base(runs, tmp_path)
    corrupt(ckpts / "step_0000004")
    metrics = (out / "bf16" / "metrics.jsonl").read_bytes()
    code, _, err = train([*ARGS, "--keep-checkpoints", "2", "--resume", "--out", out])
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err, err
    assert (out / "bf16" / "metrics.jsonl").read_bytes() == metrics
    assert names(ckpts) == ["step_0000002", "step_0000004"]


def test_a_checkpoint_moved_and_linked_back_resumes(runs, tmp_path):
    """``step_0000004`` moved to another disk with a link left in its place is a checkpoint
    (the check for links that stand for none refused it too); pruned, its link
    goes and what it points to stays."""
    out, ckpts = copy_base(runs, tmp_path)
    shutil.move(ckpts / "step_0000004", tmp_path / "elsewhere")
    (ckpts / "step_0000004").symlink_to(tmp_path / "elsewhere")
    code, _, err = train([*ARGS, "--keep-checkpoints", "1", "--resume", "--out", out])
    assert code == 0, err
    assert records(out) == records(runs / "ref")
    assert names(ckpts) == ["step_0000006"] and (tmp_path / "elsewhere" / "model.pt").is_file()


def test_checkpoints_behind_a_dangling_link_are_not_a_fresh_start(runs, tmp_path):
    """``checkpoints`` a link to a disk that is not mounted (or a loop, or a file): it was read
    as no checkpoint, and --resume trained from step 0 after deleting the mode's directory
    (metrics and link). Now one line, exit 2, nothing touched."""
    out, ckpts = copy_base(runs, tmp_path)
    shutil.move(ckpts, tmp_path / "disk")
    ckpts.symlink_to(tmp_path / "offline")
    metrics = (out / "bf16" / "metrics.jsonl").read_bytes()
    code, _, err = train([*ARGS, "--keep-checkpoints", "2", "--resume", "--out", out])
    assert code == 2 and err.count("\n") == 1, err
    assert "checkpoints is not a readable directory (a dangling link" in err, err
    assert ckpts.is_symlink() and (out / "bf16" / "metrics.jsonl").read_bytes() == metrics
    ckpts.unlink()
    ckpts.symlink_to(tmp_path / "disk")  # mounted again: it resumes
    code, _, err = train([*ARGS, "--keep-checkpoints", "2", "--resume", "--out", out])
    assert code == 0, err


class Payload:
    """A pickle that creates ``marker`` when a plain unpickler reads it."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.mark.parametrize("forged_manifest", [False, True], ids=["no-manifest", "forged-manifest"])
def test_planted_dcp_metadata_is_never_unpickled(runs, tmp_path, forged_manifest):
    """``checkpoints/step_9999999/.metadata`` planted (a pickle that would run code): not
    read, found by --resume or named by --resume DIR. Without a manifest it is no
    checkpoint; with one forged to match, a one-process run refuses DCP before reading."""
    out, ckpts = copy_base(runs, tmp_path)
    marker = tmp_path / "code-ran"
    planted = ckpts / "step_9999999"
    planted.mkdir()
    (planted / ".metadata").write_bytes(pickle.dumps(Payload(marker), protocol=2))
    if forged_manifest:
        info = {"parallel": {"strategy": "fsdp", "world_size": 2}}
        checkpoint.write_manifest(
            planted, kind="dcp", world_size=2, step=9999999, serial=99, info=info
        )
    for resume in (["--resume"], ["--resume", planted]):
        code, _, err = train([*ARGS, *resume, "--out", out])
        if forged_manifest:
            assert code == 2 and "written by --fsdp on 2 ranks, this run is one process" in err
        else:
            assert code == 2 and "step_9999999 has no manifest.json" in err, err
        assert not marker.exists()


@pytest.mark.parametrize("protocol", [2, pickle.DEFAULT_PROTOCOL])
def test_forged_manifest_cannot_make_a_torch_file_run_code(runs, tmp_path, protocol):
    """trainer.pt replaced by a code-running pickle and the manifest rewritten to match:
    torch.load(weights_only=True) refuses it; one line, exit 2, also for a pickle protocol
    torch.save does not write (torch's warning about it is not shown)."""
    out, ckpts = copy_base(runs, tmp_path)
    marker = tmp_path / "code-ran"
    newest = ckpts / "step_0000004"
    (newest / "trainer.pt").write_bytes(pickle.dumps(Payload(marker), protocol=protocol))
    manifest = checkpoint.read_manifest(newest)
    (newest / "manifest.json").unlink()
    checkpoint.write_manifest(
        newest, kind="torch", world_size=1, step=4, serial=manifest.serial, info=manifest.info
    )
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        code, _, err = train([*ARGS, "--resume", "--out", out])
    assert not [w for w in shown if "pickle protocol" in str(w.message)]
    assert code == 2 and err.count("\n") == 1, err
    assert "trainer.pt is not a checkpoint file this code can read" in err
    assert "weights_only" not in err  # torch's advice to load it anyway is not passed on
    assert not marker.exists()


def test_model_file_that_does_not_fit_names_what_differs(runs, tmp_path):
    """model.pt without one of the model's tensors (the manifest rewritten to match): one
    line that names the missing key, exit 2 (it said only "Error(s) in loading state_dict
    for LlamaForCausalLM:", the details on lines it dropped)."""
    out, ckpts = copy_base(runs, tmp_path)
    newest = ckpts / "step_0000004"
    state = torch.load(newest / "model.pt", weights_only=True)
    key = sorted(state)[-1]
    del state[key]
    torch.save(state, newest / "model.pt")
    manifest = checkpoint.read_manifest(newest)
    (newest / "manifest.json").unlink()
    checkpoint.write_manifest(
        newest, kind="torch", world_size=1, step=4, serial=manifest.serial, info=manifest.info
    )
    code, _, err = train([*ARGS, "--resume", "--out", out])
    assert code == 2 and err.count("\n") == 1, err
    assert "does not fit this model and optimizer" in err and "Missing key(s)" in err, err
    assert key in err


@pytest.mark.parametrize("where", ["checkpoint", "metrics"])
def test_full_disk_while_training_is_one_line(tmp_path, monkeypatch, where):
    """A full disk while writing a checkpoint (torch's writer says "unexpected pos", a
    RuntimeError) or metrics.jsonl: one line naming the file and the remedy, exit 1, no
    traceback (it was a traceback either way)."""
    import errno

    from coat_models.train.report import MetricsLog

    if where == "checkpoint":

        def full(obj, f):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 614208")

        monkeypatch.setattr(checkpoint.torch, "save", full)
    else:

        def full(self, record):
            raise OSError(errno.ENOSPC, "No space left on device", "metrics.jsonl")

        monkeypatch.setattr(MetricsLog, "write", full)
    code, _, err = train([*ARGS, "--save-every", "1", "--out", tmp_path / "run"])
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "free space there or pass another --out" in err, err
    if where == "checkpoint":
        assert "cannot write" in err and ".pt (" in err and "bytes free there" in err, err
        # The partial checkpoint is gone: its files would keep the space the run lacked.
        assert not [p.name for p in (tmp_path / "run" / "bf16" / "checkpoints").iterdir()]
    else:
        assert "metrics.jsonl: No space left on device" in err, err


@pytest.mark.parametrize("above", ["out", "mode", "checkpoints"])
def test_resume_of_a_folder_above_the_checkpoints_names_them(runs, tmp_path, above):
    """--resume DIR given --out, the mode's folder or checkpoints/: one line naming the
    newest checkpoint inside, exit 2 (it said the folder has no manifest.json)."""
    out, ckpts = copy_base(runs, tmp_path)
    folder = {"out": out, "mode": out / "bf16", "checkpoints": ckpts}[above]
    code, _, err = train([*ARGS, "--resume", folder, "--out", out])
    assert code == 2 and err.count("\n") == 1, err
    newest = ckpts / "step_0000004"
    assert f"holds checkpoints, it is not one: pass one of them, e.g. --resume {newest}" in err
    assert err.endswith(" (the newest), or --resume alone for the newest\n"), err


@pytest.mark.parametrize("above", ["out", "mode", "checkpoints"])
def test_resume_of_a_folder_of_another_out_names_that_out(runs, tmp_path, above):
    """--resume DIR given a folder above the checkpoints of another --out than this run's:
    plain --resume would look under this run's --out, so the advice names the other one."""
    out, ckpts = copy_base(runs, tmp_path)
    folder = {"out": out, "mode": out / "bf16", "checkpoints": ckpts}[above]
    code, _, err = train([*ARGS, "--resume", folder, "--out", tmp_path / "new"])
    assert code == 2 and err.count("\n") == 1, err
    assert err.endswith(f", or --out {out} and --resume alone for the newest\n"), err
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
def test_resume_with_modes_the_out_has_no_checkpoint_of_names_those_it_has(runs, tmp_path):
    """Plain --resume of another mode than the run in --out trained: refused, naming the
    modes to continue (it trained coat from step 0 and replaced the report in --out with
    coat's alone); nothing changed. A --compare that stopped before any checkpoint still
    starts from step 0 (no mode has one)."""
    out, ckpts = copy_base(runs, tmp_path)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    code, _, err = train([*ARGS, "--mode", "coat", "--resume", "--out", out])
    assert code == 2 and err.count("\n") == 1, err
    assert err.endswith(
        f"--resume: {out} holds checkpoints of bf16 and none of coat: continue that run with "
        "--mode bf16 --resume (or --compare bf16,coat --resume if it compared them: coat then "
        "starts from step 0), or train coat into another --out\n"
    ), err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    code, _, err = train([*ARGS, "--compare", "bf16,coat", "--resume", "--out", tmp_path / "new"])
    assert code == 0 and "no checkpoint in" in err, err


# --------------------------------------------------------------------------- metrics
def test_torn_last_metrics_line_is_trimmed(runs, tmp_path):
    """A kill while a metrics line was being written leaves half a line: --resume drops it."""
    out, _ = copy_base(runs, tmp_path)
    with open(out / "bf16" / "metrics.jsonl", "a") as f:
        f.write('{"mode": "bf16", "type": "train", "step": 5, "lo')
    code, _, err = train([*ARGS, "--keep-checkpoints", "1", "--resume", "--out", out])
    assert code == 0, err
    assert records(out) == records(runs / "ref")


def test_garbage_inside_metrics_is_an_error(runs, tmp_path):
    """A metrics file with a line that is not a record is bad input: one line naming the
    remedy, exit 2 (as a corrupt checkpoint), not a run-time failure."""
    out, _ = copy_base(runs, tmp_path)
    path = out / "bf16" / "metrics.jsonl"
    lines = path.read_text().splitlines(True)
    path.write_text(lines[0] + "garbage\n" + "".join(lines[1:]))
    code, _, err = train([*ARGS, "--resume", "--out", out])
    assert code == 2 and "metrics.jsonl line 2 is not a metrics record" in err, err


def test_resumed_finished_run_evaluates_again_and_logs_it(runs, tmp_path):
    """Resuming the finished run with another --eval-batches evaluates again: the summary's
    val loss is the metrics file's last record (one eval record at the last step, not two).
    Each eval record says how many batches it averaged, and the resumed run says that the
    earlier evaluations averaged another number (it mixed the two in silence)."""
    out = tmp_path / "run"
    shutil.copytree(runs / "ref", out)
    before = records(out)
    # (ARGS say --eval-batches 2; the last one given counts)
    code, _, err = train([*ARGS, "--eval-batches", "3", "--keep-checkpoints", "1", "--resume",
                          "--out", out])  # fmt: skip
    assert code == 0, err
    after = records(out)
    evals = [r for r in after if r[0] == "eval" and r[1] == 6]
    assert len(evals) == 1 and evals[0][3] != before[-1][3]  # 3 batches, not 2
    assert after[:-1] == [r for r in before if not (r[0] == "eval" and r[1] == 6)]
    summary = json.loads((out / "bf16" / "summary.json").read_text())
    assert summary["val_loss"] == evals[0][3]
    lines = (out / "bf16" / "metrics.jsonl").read_text().splitlines()
    batches = {r["step"]: r["eval_batches"] for r in map(json.loads, lines) if r["type"] == "eval"}
    assert batches == {2: 2, 4: 2, 6: 3}
    metrics = out / "bf16" / "metrics.jsonl"
    assert (
        f"note: validation now averages 3 batches (--eval-batches); {metrics}'s evaluations "
        "at steps 2, 4 averaged 2 batches: their val losses are not comparable with this run's"
    ) in err, err
    # resumed again with the same --eval-batches as the evaluations kept: no note
    code, _, err = train([*ARGS, "--keep-checkpoints", "1", "--resume", "--out", out])
    assert code == 0 and "note:" not in err, err


def test_resumed_midway_with_other_eval_batches_names_the_evaluations_kept(runs, tmp_path):
    """Resumed from step 4 with another --eval-batches: the kept evaluations of steps 2 and 4
    (step 4's is not run again) are named, and the later ones average the new number."""
    out, _ = copy_base(runs, tmp_path)
    step_4 = out / "bf16" / "checkpoints" / "step_0000004"
    code, _, err = train([*ARGS, "--eval-batches", "1", "--keep-checkpoints", "1", "--resume",
                          step_4, "--out", out])  # fmt: skip
    assert code == 0, err
    assert "evaluations at steps 2, 4 averaged 2 batches" in err, err
    assert "validation now averages 1 batch (--eval-batches)" in err, err
    lines = (out / "bf16" / "metrics.jsonl").read_text().splitlines()
    batches = {r["step"]: r["eval_batches"] for r in map(json.loads, lines) if r["type"] == "eval"}
    assert batches == {2: 2, 4: 2, 6: 1}


def test_resume_says_when_the_metrics_lack_earlier_steps(runs, tmp_path):
    """A metrics file that lost the records before the checkpoint (deleted): the resumed
    run says so, and still trains to the same end; with the records there it says nothing."""
    out, _ = copy_base(runs, tmp_path)
    code, _, err = train([*ARGS, "--keep-checkpoints", "1", "--resume", "--out", out])
    assert code == 0 and "note:" not in err, err
    out, _ = copy_base(runs, tmp_path / "lost")
    (out / "bf16" / "metrics.jsonl").unlink()
    code, _, err = train([*ARGS, "--keep-checkpoints", "1", "--resume", "--out", out])
    assert code == 0, err
    assert "has no training records of 4 of the checkpoint's 4 steps (first missing: 1)" in err
    assert records(out) == [r for r in records(runs / "ref") if r[1] > 4]


# ------------------------------------------------------------------ the output directory
_LOCK_HOLDER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from coat_models.train.outdir import output_lock

    with output_lock(Path(sys.argv[1])):
        print("locked", flush=True)
        sys.stdin.read()
    """
)


@pytest.mark.slow
def test_second_process_on_one_out_is_refused(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen(
        [sys.executable, "-c", _LOCK_HOLDER, str(out)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, _, err = train([*ARGS, "--steps", "2", "--out", out])
        assert code == 2 and err.count("\n") == 1, err
        assert f"is in use by another coat-train (PID {holder.pid}): wait for it" in err
        assert names(out) == [".lock"]  # nothing else written
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert holder.returncode == 0
    code, _, err = train([*ARGS, "--steps", "2", "--out", out])  # the lock went with the holder
    assert code == 0, err


@pytest.mark.parametrize(
    "earlier", [None, b"4242\n", b"4194303999\n"], ids=["new", "earlier-run", "longer-pid"]
)
def test_the_lock_file_never_reads_empty_while_it_is_taken(tmp_path, monkeypatch, earlier):
    """Another coat-train's checks read the lock file without locking it: one found empty
    (made, then locked, then written; or an earlier run's cut to nothing, then written) is
    another program's file, and that run was refused in the wrong words. Every step of
    taking the lock is watched: the file holds a PID at each."""
    from coat_models.train import outdir

    out = tmp_path / "run"
    if earlier is not None:
        out.mkdir()
        (out / outdir.LOCK_FILE).write_bytes(earlier)
    seen = []

    def watched(name):
        real = getattr(os, name)

        def call(*args):
            result = real(*args)
            if (out / outdir.LOCK_FILE).exists():
                seen.append((name, (out / outdir.LOCK_FILE).read_bytes(), outdir._lock_of(out)))
            return result

        monkeypatch.setattr(os, name, call)

    for name in ("open", "ftruncate", "pwrite"):
        watched(name)
    real_flock = outdir.fcntl.flock

    def flock(fd, op):
        seen.append(("flock", (out / outdir.LOCK_FILE).read_bytes(), outdir._lock_of(out)))
        return real_flock(fd, op)

    monkeypatch.setattr(outdir.fcntl, "flock", flock)
    with outdir.output_lock(out):
        pass
    monkeypatch.undo()
    assert seen and all(ours for *_, ours in seen), seen  # coat-train's, at every step
    assert (out / outdir.LOCK_FILE).read_bytes() == f"{os.getpid()}\n".encode()
    assert sorted(p.name for p in out.iterdir()) == [outdir.LOCK_FILE]


def test_a_running_run_s_checkpoints_are_not_called_an_earlier_run_s(tmp_path):
    """A second coat-train on the --out of one still running was told that its checkpoints
    were an earlier run's, to delete them or pass --resume: the lock is probed
    first, as the run holding it would answer."""
    import fcntl

    out = tmp_path / "run"
    argv = [*ARGS, "--steps", "2", "--save-every", "2", "--out", out]
    assert train(argv)[0] == 0
    fd = os.open(out / ".lock", os.O_RDWR)  # a running coat-train's lock, PID 4242
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        os.pwrite(fd, b"4242\n", 0)
        before = _snapshot(out)
        code, _, err = train(argv)
        assert code == 2 and err.count("\n") == 1, err
        assert "is in use by another coat-train (PID 4242): wait for it" in err
        assert _snapshot(out) == before
    finally:
        os.close(fd)


def test_a_second_signal_while_the_interrupt_is_reported_is_one_line(tmp_path, monkeypatch):
    """A second Ctrl-C / SIGTERM while the interrupt's line was being made (a walk of --out)
    ended in a traceback, exit 1: still the one line, exit 130."""
    from coat_models.train import cli
    from coat_models.train.trainer import Trainer

    def interrupted(trainer, *args, **kwargs):
        raise KeyboardInterrupt

    def second_signal(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "queue_step", interrupted)
    monkeypatch.setattr(cli, "_way_on", second_signal)
    code, _, err = train([*ARGS, "--steps", "2", "--out", tmp_path / "run"])
    assert code == 130 and "Traceback" not in err
    assert err.strip().splitlines() == [
        f"coat-train: interrupted; completed checkpoints (if any) are under {tmp_path / 'run'}"
    ]


def _snapshot(root) -> dict:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_failed_new_run_keeps_the_previous_results(runs, tmp_path, monkeypatch):
    """A new run in the same --out that fails, at the checks or when its model is built,
    leaves the earlier run's results as they were."""
    out = tmp_path / "run"
    argv = [*ARGS, "--steps", "2", "--save-every", "0", "--out", out]
    assert train(argv)[0] == 0
    before = _snapshot(out)
    code, _, err = train([*argv, "--seq-len", "100000", "--corpus-mib", "0.05"])
    assert code == 2 and "fewer than --seq-len 100000 + 1" in err
    assert _snapshot(out) == before

    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate")

    monkeypatch.setattr(jobs, "build_model", no_memory)
    code, _, err = train(argv)
    assert code == 1 and "out of memory in mode bf16" in err
    assert _snapshot(out) == before


def test_a_checkpoint_directory_named_latest_is_resumed(runs, tmp_path, monkeypatch):
    """``--resume latest`` was read as plain ``--resume`` (argparse's value for the bare
    flag), so a checkpoint copied to ./latest started a new --out from step 0 without a
    word; now it is that directory. An empty ``--resume=`` had meant the current one."""
    _, ckpts = copy_base(runs, tmp_path)
    shutil.copytree(ckpts / "step_0000004", tmp_path / "latest")
    monkeypatch.chdir(tmp_path)
    argv = [*ARGS, "--keep-checkpoints", "1", "--resume", "latest", "--out", "new"]
    code, said, err = train(argv)
    assert code == 0, err
    assert "resuming from ./latest" in said, said
    assert records(tmp_path / "new")[0][:2] == ("train", 5)
    assert records(tmp_path / "new") == [r for r in records(runs / "ref") if r[1] > 4]
    code, _, err = train([*ARGS, "--resume=", "--out", "other"])
    assert code == 2 and err.endswith(
        "argument --resume: is empty: pass a checkpoint directory, or --resume alone for the "
        "newest under --out\n"
    ), err


def test_an_interrupted_resume_into_a_new_out_names_its_checkpoint(runs, tmp_path):
    """Stopped before its first checkpoint, a run started with --resume DIR in another --out
    said only that no checkpoint was written there: plain --resume then starts from step 0.
    The line names the --resume DIR to pass again."""
    _, ckpts = copy_base(runs, tmp_path)
    given = ckpts / "step_0000002"
    with interrupted_before(4):
        code, _, err = train([*ARGS, "--resume", given, "--out", tmp_path / "new"])
    assert code == 130
    assert err.endswith(
        f"interrupted; no checkpoint was written to {tmp_path / 'new'}: run the same command, "
        f"with --resume {given}, to start again from that checkpoint\n"
    ), err
    # plain --resume there started from step 0 and dropped the records of steps 3 and on
    metrics = (tmp_path / "new" / "bf16" / "metrics.jsonl").read_bytes()
    code, _, err = train([*ARGS, "--resume", "--out", tmp_path / "new"])
    assert code == 2 and err.endswith(
        f"--resume: {tmp_path / 'new' / 'bf16'} has no checkpoint and its metrics start at step "
        "3: its run went on from a checkpoint elsewhere; pass that --resume DIR again, or "
        "train into another --out to start from step 0\n"
    ), err
    assert (tmp_path / "new" / "bf16" / "metrics.jsonl").read_bytes() == metrics
