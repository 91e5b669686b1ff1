"""coat-train's output directory: what a run may write where, the lock that keeps two runs
apart, and where each mode resumes from. ``check_out`` and ``check_resume`` run before
anything is written, ``check_resume_settings`` with the lock held before any mode trains,
``resume_point`` as each mode starts; a refusal names the remedy.

    out/.lock               held (flock) by the coat-train writing there, with its PID
    out/summary.json, loss.png
    out/<mode>/metrics.jsonl, summary.json, checkpoints/, final/, tensorboard/
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

from .. import checkpoint
from ..checkpoint import CheckpointError
from ..distributed import run_on_rank0
from .args import PROG, UsageError, env_rank
from .options import NEWEST
from .presets import fine_tunable
from .report import ReportError, metrics_until, train_steps
from .trainer import MODES, TrainConfig, check_launch, check_settings

LOCK_FILE = ".lock"
# What coat-train writes in --out and in each mode's directory: a fresh run replaces these,
# so an --out holding anything else is refused.
OUT_FILES = ("summary.json", "loss.png")
MODE_FILES = ("metrics.jsonl", "summary.json", "checkpoints", "final", "tensorboard")


def process_rank() -> int:
    """This process's rank (torchrun's RANK before the process group exists); 0 alone."""
    return dist.get_rank() if dist.is_initialized() else env_rank()


def say(*args, **kwargs) -> None:
    """``print`` on rank 0 only."""
    if process_rank() == 0:
        print(*args, **kwargs)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def check_out(out: Path, modes: list[str]) -> None:
    """Refuse an ``--out`` this process cannot create or write, or one holding files that
    coat-train did not write where it would replace them. Leaves nothing behind."""
    try:  # (first: asked about a longer name, the file system raises)
        longest = os.pathconf(out.anchor or ".", "PC_NAME_MAX")
    except (OSError, ValueError):
        longest = 255
    long = next((p for p in out.parts if len(os.fsencode(p)) > longest), None)
    if long is not None:
        raise UsageError(
            f"--out: its part {long[:40]}... is {len(os.fsencode(long))} bytes long, more than "
            f"a file name may be here ({longest}): pass a shorter --out"
        )
    if out.is_symlink() and not out.exists():
        raise UsageError(
            f"--out {out} is a link to {os.path.normpath(out.parent / os.readlink(out))}, "
            "which does not exist: create that "
            "directory, or pass another --out"
        )
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file: pass a directory")
    _check_not_inside_a_run(out)
    if out.is_dir():
        _check_foreign(out, modes)
    parent = out
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"--out {out}: {parent} is a file, not a directory: pass another --out")
    # os.access says yes to root everywhere but read-only mounts; a real mkdir does not lie.
    try:
        probe = tempfile.mkdtemp(prefix=".coat-train-probe-", dir=parent)
    except OSError as e:
        raise UsageError(
            f"--out {out}: cannot create a directory in {parent} ({e.strerror}): pass another --out"
        ) from None
    os.rmdir(probe)


def _lock_of(d: Path) -> bool | None:
    """Whether ``d`` holds coat-train's lock file (True: its content is a PID), another
    program's file of that name (False: anything else, or nothing, in it), or none (None)."""
    try:
        with open(d / LOCK_FILE, "rb") as f:
            content = f.read(32)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        return False
    except OSError:  # unreadable: taken for coat-train's, and output_lock says what is wrong
        return True
    # (its first line: a PID written over a longer one reads "28170\n3\n" until it is cut)
    return re.match(rb"\d+\n", content) is not None


def _check_not_inside_a_run(out: Path) -> None:
    """Refuse an ``--out`` inside a mode's directory of another run's ``--out`` (one with
    coat-train's lock file): that run deletes or rewrites it (its ``final`` export, its
    checkpoints), and this one would write into that run's results."""
    path = Path(os.path.abspath(out))
    for above in path.parents:
        if _lock_of(above):
            mode = path.relative_to(above).parts[0]
            if mode in MODES:
                raise UsageError(
                    f"--out {out} is inside {above / mode}, a mode's directory of the "
                    f"coat-train run in {above}: pass a directory outside it"
                )


def check_inputs_outside(out: Path, modes: list[str], inputs: dict[str, str | None]) -> None:
    """Refuse an input (``{"--model-dir": path, ...}``) inside a mode directory of ``out``
    that this run replaces (deleted by a fresh run; its ``final`` rewritten by any)."""
    for option, given in inputs.items():
        if not given:
            continue
        # Resolved (a link to it from elsewhere) and as written (a link inside that is deleted).
        paths = (Path(given).resolve(), Path(os.path.abspath(given)))
        for mode in modes:
            mode_dirs = ((out / mode).resolve(), Path(os.path.abspath(out / mode)))
            if any(p == d or d in p.parents for p in paths for d in mode_dirs):
                raise UsageError(
                    f"{option} {given} is inside {out / mode}, which this run replaces: copy "
                    "it elsewhere first, or pass another --out"
                )


def _ours(name: str) -> bool:
    """A name coat-train writes in a mode's directory, or a killed run's temporary file."""
    return name in MODE_FILES or re.fullmatch(r"\..+\.tmp-\d+", name) is not None


def _check_foreign(out: Path, modes: list[str]) -> None:
    """A fresh run overwrites ``OUT_FILES`` and deletes each mode's directory: refuse where
    that would destroy files coat-train did not write."""
    lock = _lock_of(out)
    if lock is False:  # coat-train would take it over: truncate it and flock it
        raise UsageError(
            f"--out {out} holds a {LOCK_FILE} that coat-train did not write (no PID in it), "
            "which it would overwrite: pass a new or empty directory (or, if a coat-train was "
            f"killed as it started there, delete {out / LOCK_FILE})"
        )
    if lock is None:
        clash = [n for n in (*OUT_FILES, *modes) if (out / n).exists()]
        if clash:
            raise UsageError(
                f"--out {out} holds {', '.join(clash)}, which coat-train did not write (it "
                f"has no {LOCK_FILE}) and would replace: pass a new or empty directory"
            )
    for mode in modes:
        mode_dir = out / mode
        if mode_dir.exists() and not mode_dir.is_dir():
            raise UsageError(f"{mode_dir} is a file: move it, or pass another --out")
        names = [p.name for p in mode_dir.iterdir()] if mode_dir.is_dir() else []
        foreign = sorted(n for n in names if not _ours(n))
        if foreign:
            raise UsageError(
                f"{mode_dir} holds {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}, "
                f"which coat-train did not write; a fresh run deletes {mode_dir}: move them, "
                "or pass another --out"
            )


def _in_use(out: Path, fd: int) -> str:
    holder = os.pread(fd, 32, 0).decode(errors="replace").split("\n")[0].strip() or "unknown"
    return (
        f"--out {out} is in use by another coat-train (PID {holder}): wait for it to "
        "finish, or pass another --out"
    )


class OutInUse(UsageError):
    """``--out`` is locked by another coat-train: under torchrun this error wins over what
    the other ranks found there (the running run's files)."""


def check_not_in_use(out: Path) -> None:
    """Refuse an ``--out`` whose lock another coat-train holds, before the checks of what is
    in it (they would call a running run's checkpoints "an earlier run's" and advise deleting
    them). Rank 0 only, as it takes the lock; a shared probe that creates nothing."""
    if process_rank() != 0:
        return
    try:
        fd = os.open(out / LOCK_FILE, os.O_RDONLY)
    except OSError:  # no lock file (or unreadable: output_lock says so later)
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutInUse(_in_use(out, fd)) from None
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _open_lock(out: Path, pid: bytes) -> int:
    """A descriptor of ``out/.lock``, made with ``pid`` in it when there is none: written
    to a file of its own and linked into place, so that another coat-train never finds it
    empty (its checks would call it another program's file)."""
    path = out / LOCK_FILE
    with contextlib.suppress(FileNotFoundError):
        return os.open(path, os.O_RDWR)
    # (a name of its own: PIDs repeat across containers sharing --out)
    fd, tmp = tempfile.mkstemp(dir=out, prefix=f"{LOCK_FILE}.tmp-")
    try:
        os.fchmod(fd, 0o644)
        os.write(fd, pid)
        os.link(tmp, path)
    except OSError:  # made meanwhile by another run, or no hard links on this file system
        os.close(fd)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return fd


@contextlib.contextmanager
def output_lock(out: Path):
    """Hold an exclusive ``flock`` on ``out/.lock`` for the run (rank 0): two coat-train
    processes on one ``--out`` would interleave their metrics and delete each other's
    checkpoints. The file stays (deleted, a third process could lock a new file while a
    second holds the old one), unless this call created ``out`` and nothing else was written."""
    error, fd = None, None
    created = process_rank() == 0 and not out.exists()
    if process_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        pid = f"{os.getpid()}\n".encode()
        fd = _open_lock(out, pid)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            error = _in_use(out, fd)
            os.close(fd)
            fd = None
        else:  # (written over, then cut: the file never reads empty to another run's checks)
            os.pwrite(fd, pid, 0)
            os.ftruncate(fd, len(pid))
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise UsageError(error)
    try:
        yield
    except BaseException:
        # A run refused before it wrote anything (e.g. --resume of another run's checkpoint
        # whose settings differ) leaves no directory of its own behind, lock file and all.
        if created and fd is not None and [p.name for p in out.iterdir()] == [LOCK_FILE]:
            with contextlib.suppress(OSError):
                (out / LOCK_FILE).unlink()
                out.rmdir()
        raise
    finally:
        if fd is not None:
            os.close(fd)


def _earlier_run(mode_dir: Path) -> UsageError:
    return UsageError(
        f"{mode_dir} holds checkpoints of an earlier run: pass --resume to continue it, or "
        f"another --out (or delete {mode_dir / 'checkpoints'})"
    )


def _check_kinds(out: Path, modes: list[str], resuming: bool) -> None:
    """A directory where coat-train writes a file (``summary.json``), or a file where it
    writes a directory (``final``), failed only when written, after training, with a remedy
    that did not fit: refuse it up front. (A fresh run deletes the mode directories.)"""
    kinds = dict.fromkeys((out / n for n in OUT_FILES), False)  # path -> a directory?
    for mode in modes if resuming else ():
        for name in MODE_FILES:
            kinds[out / mode / name] = name in ("checkpoints", "final", "tensorboard")
    for path, directory in kinds.items():
        if path.exists() and path.is_dir() != directory:
            there, wanted = ("directory", "file") if path.is_dir() else ("file", "directory")
            raise UsageError(
                f"{path} is a {there} where coat-train writes a {wanted}: move it, or pass "
                "another --out"
            )


def check_resume(args, out: Path, modes: list[str]) -> None:
    """The resume options against what is on disk, before anything is written (reads the
    manifest of ``--resume DIR``: JSON, nothing else)."""
    _check_kinds(out, modes, args.resume is not None)
    if args.resume is None:
        for mode in modes:
            if checkpoint.has_checkpoints(out / mode / "checkpoints"):
                raise _earlier_run(out / mode)
        _note_narrower_report(out, modes, fresh=True)
    elif args.resume == NEWEST:
        _check_resumable(out, modes)
        _note_narrower_report(out, modes)
    else:
        if len(modes) != 1:
            raise UsageError(
                "--resume CHECKPOINT needs a single --mode; with --compare use "
                "plain --resume (each mode's newest checkpoint)"
            )
        path = Path(args.resume)
        if checkpoint.unpublished(path) or checkpoint.unpublished(path.resolve()):
            raise UsageError(
                f"--resume {path}: a checkpoint being written or deleted (or left so by a "
                f"killed run), not a published one: pass a step_N directory beside it, or "
                "plain --resume (it finishes a complete one left by a killed run and takes "
                "the newest)"
            )
        if not path.is_dir():
            what = "no such checkpoint directory"
            if path.exists():
                what = "a file, not a checkpoint directory"
            raise UsageError(
                f"--resume {path}: {what} (checkpoints are "
                f"<out>/<mode>/checkpoints/step_N; plain --resume takes the newest under --out)"
            )
        # A folder above the checkpoints (--out, a mode's, checkpoints/): name those in it,
        # and the --out under which plain --resume finds the newest.
        folders = {  # checkpoints folder -> the --out it is in
            path: path.parent.parent,
            path / "checkpoints": path.parent,
            path / modes[0] / "checkpoints": path,
        }
        found = [(p, above) for d, above in folders.items() for p in checkpoint.ordered(d)]
        if not (path / checkpoint.MANIFEST).exists() and found:
            newest, holder = found[-1]
            plain = "" if holder.resolve() == out.resolve() else f"--out {holder} and "
            raise UsageError(
                f"--resume {path} holds checkpoints, it is not one: pass one of them, e.g. "
                f"--resume {newest} (the newest), or {plain}--resume alone for the newest"
            )
        if not (path / checkpoint.MANIFEST).exists() and (path / "config.json").is_file():
            tune = (
                f"fine-tune it with --model-dir {path} (a new optimizer and LR schedule), or "
                if fine_tunable(path)
                else ""  # a LLaVA-style model's: --model-dir takes causal LMs only
            )
            raise UsageError(
                f"--resume {path} is a model (config.json), not a checkpoint: {tune}resume "
                "from a checkpoint of its run (written with --save-every)"
            )
        try:
            checkpoint.read_manifest(path)
        except CheckpointError as e:
            raise unusable_given(e, path, out, modes[0]) from None
        _check_elsewhere(path, out / modes[0])
        _note_narrower_report(out, modes)


def _check_elsewhere(ckpt: Path, mode_dir: Path) -> None:
    """A checkpoint continued into ``mode_dir`` must not mix two runs there: the named one
    must have the settings of the newest checkpoint there (any checkpoint of that run), or,
    where there are metrics but no checkpoints, none may be of steps up to its step."""
    ckpts, metrics = mode_dir / "checkpoints", mode_dir / "metrics.jsonl"
    given = checkpoint.read_manifest(ckpt)
    if checkpoint.has_checkpoints(ckpts):
        try:
            newest = checkpoint.newest(ckpts)
            theirs = None if newest is None else checkpoint.read_manifest(newest).info
        except CheckpointError:
            newest = theirs = None
        if theirs is not None and theirs.get("settings") == given.info.get("settings"):
            return
        which = f"those of its newest checkpoint, {newest}" if newest else "its checkpoints'"
        raise UsageError(
            f"--resume {ckpt}: {mode_dir} holds checkpoints of another run (the settings "
            f"differ from {which}): continued there, the two runs would mix; pass another "
            f"--out (or delete {mode_dir})"
        )
    step = given.step or 0
    try:
        earlier = bool(step and metrics_until(metrics, step))
    except (OSError, ReportError, ValueError):
        earlier = True
    if earlier:
        raise UsageError(
            f"--resume {ckpt}: {metrics} holds records of steps up to its step {step} and no "
            "checkpoint of their run: continued there, two runs' metrics could mix; pass "
            f"another --out (or move {metrics} away)"
        )


def _note_narrower_report(out: Path, modes: list[str], fresh: bool = False) -> None:
    """Say so when plain ``--resume`` of fewer modes than ``--out``'s report compared will
    replace that report with theirs (the other modes' files stay), and how to rebuild it;
    ``fresh``: a new run whose modes leave out some of the report's."""
    try:
        runs = json.loads((out / "summary.json").read_text())["runs"]
        there = [r["mode"] for r in runs]
    except (OSError, ValueError, KeyError, TypeError):
        return
    if not all(isinstance(m, str) for m in there):  # not a report coat-train wrote: no note
        return
    if fresh:
        others = [m for m in there if m not in modes]
        if others:
            say(
                f"{PROG}: note: {out / 'summary.json'} compares {', '.join(there)}; this run "
                f"replaces it and loss.png with a report of {', '.join(modes)} (the files of "
                f"{', '.join(others)} in {out} stay)",
                file=sys.stderr,
            )
        return
    if set(there) <= set(modes) or not set(modes) <= set(there):
        return
    both = ",".join(m for m in MODES if m in there)
    say(
        f"{PROG}: note: {out / 'summary.json'} compares {', '.join(there)}; resuming "
        f"{', '.join(modes)} alone replaces it and loss.png with a report of "
        f"{', '.join(modes)}: --compare {both} --resume rebuilds the comparison (each mode "
        "goes on from its newest checkpoint, one at its last step is evaluated again)",
        file=sys.stderr,
    )


def _first_step(metrics: Path) -> int | None:
    """The step of the first record of a mode's ``metrics.jsonl`` (None if unreadable)."""
    try:
        with metrics.open() as f:
            return int(json.loads(f.readline())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _check_resumable(out: Path, modes: list[str]) -> None:
    """Plain ``--resume`` where no mode of this run has a checkpoint but other modes in
    ``--out`` do: name the ways to continue that run instead of starting these from 0.
    Also where a mode has none but its metrics start past step 1: a run that went on from a
    checkpoint elsewhere (``--resume DIR``) and stopped before its first save here; from
    step 0 its records would go."""
    if not out.is_dir():
        return
    for m in modes:
        first = _first_step(out / m / "metrics.jsonl")
        if first and first > 1 and not checkpoint.has_checkpoints(out / m / "checkpoints"):
            raise UsageError(
                f"--resume: {out / m} has no checkpoint and its metrics start at step {first}: "
                "its run went on from a checkpoint elsewhere; pass that --resume DIR again, or "
                "train into another --out to start from step 0"
            )
    if any(checkpoint.has_checkpoints(out / m / "checkpoints") for m in modes):
        return
    others = [m for m in MODES if checkpoint.has_checkpoints(out / m / "checkpoints")]
    if not others:
        return

    def flag(names):
        return f"--mode {names[0]}" if len(names) == 1 else f"--compare {','.join(names)}"

    asked = ",".join(modes)
    both = flag([m for m in MODES if m in others or m in modes])
    raise UsageError(
        f"--resume: {out} holds checkpoints of {', '.join(others)} and none of {asked}: "
        f"continue that run with {flag(others)} --resume (or {both} --resume if it compared "
        f"them: {asked} then starts from step 0), or train {asked} into another --out"
    )


def unusable_given(e: CheckpointError, named: Path, out: Path, mode: str) -> CheckpointError:
    """A checkpoint named by ``--resume DIR`` that failed its checks, with the ways on that
    work (another checkpoint beside it, plain ``--resume``, a fresh start)."""
    named = named.resolve()
    ways = []
    beside = [p for p in checkpoint.ordered(named.parent) if p.resolve() != named]
    if beside:
        ways.append(f"--resume {beside[-1]} (the newest readable one beside it)")
    own = out / mode / "checkpoints"
    try:  # what plain --resume would take (it refuses an unreadable newest one)
        own_newest = checkpoint.newest(own)
    except CheckpointError:
        own_newest = None
    if own_newest is not None and own_newest.resolve() != named:
        ways.append(f"plain --resume (the newest under {own})")
    if checkpoint.has_checkpoints(own):
        ways.append("another --out without --resume to start from step 0")
    else:
        ways.append("no --resume to start from step 0")
    return CheckpointError(f"{e}; pass {', or '.join(ways)}")


def resume_point(args, mode_dir: Path) -> Path | None:
    """Where this mode continues from (``None``: step 0), with the output lock held, once
    what a killed run left is finished (``checkpoint.recover``)."""
    ckpts = mode_dir / "checkpoints"
    barrier()  # every rank is past the previous mode
    run_on_rank0(lambda: checkpoint.recover(ckpts))  # the others wait for it
    if args.resume is None:
        if checkpoint.has_checkpoints(ckpts):
            raise _earlier_run(mode_dir)
        return None
    if args.resume != NEWEST:
        say(f"{PROG}: resuming from {args.resume}", flush=True)
        return Path(args.resume)
    found = _newest(ckpts)
    if found is None:  # a run killed before its first checkpoint
        say(f"{PROG}: no checkpoint in {ckpts}: mode starts from step 0", file=sys.stderr)
    else:
        say(f"{PROG}: resuming from {found}", flush=True)
    return found


def note_lost_records(mode_dir: Path, ckpt: Path, eval_batches: int, steps: int) -> None:
    """Say so when the mode's metrics file lacks training records of steps its own
    checkpoint ``ckpt`` has done (the file deleted or replaced): the loss curve would start
    late with no word; and when its evaluations averaged another number of batches than
    ``eval_batches`` (a resume may change --eval-batches): their val losses and the coming
    ones measure different things (a finished run, ``steps`` done, evaluates its last step
    again: that record is replaced). Call once the checkpoint is accepted; silent for a
    checkpoint from elsewhere (that run starts its own metrics)."""
    if process_rank() != 0 or own_checkpoint(mode_dir / "checkpoints", ckpt) is None:
        return
    with contextlib.suppress(CheckpointError, OSError, ReportError, ValueError):
        step = checkpoint.read_manifest(ckpt).step
        if not step:
            return
        path = mode_dir / "metrics.jsonl"
        kept = metrics_until(path, step)
        missing = set(range(1, step + 1)) - train_steps(kept)
        if missing:
            print(
                f"{PROG}: note: {path} has no training records of {len(missing)} of the "
                f"checkpoint's {step} steps (first missing: {min(missing)}): the metrics and "
                "loss curve lack them; the summary's numbers come from the checkpoint",
                file=sys.stderr,
            )
        _note_other_eval_batches(path, kept, eval_batches, step if step >= steps else None)


def _note_other_eval_batches(
    path: Path, lines: list[str], eval_batches: int, replaced: int | None
) -> None:
    other = {}  # step -> batches, of the evaluations kept that averaged another number
    for line in lines:
        record = json.loads(line)
        n = record.get("eval_batches") if record.get("type") == "eval" else None
        if isinstance(n, int) and n != eval_batches and record["step"] != replaced:
            other[record["step"]] = n
    if other:
        steps = ", ".join(map(str, list(other)[:5])) + (", ..." if len(other) > 5 else "")
        was = "/".join(map(str, sorted(set(other.values()))))
        print(
            f"{PROG}: note: validation now averages {eval_batches} batch"
            f"{'es' * (eval_batches != 1)} (--eval-batches); {path}'s evaluations at "
            f"step{'s' * (len(other) != 1)} {steps} averaged {was} batches: their val losses "
            "are not comparable with this run's (each eval record says its eval_batches)",
            file=sys.stderr,
        )


def supersede(mode_dir: Path, ckpt: Path) -> None:
    """A run resumed from an older checkpoint ``ckpt`` of its own ``mode_dir`` rewrites what
    came after it: ``ckpt`` becomes the newest (a plain --resume after an interrupt comes
    back to it, not to a later checkpoint of the replaced run), and the replaced run's
    summary and exported model go (also for an older checkpoint resumed from elsewhere)."""
    ckpts = mode_dir / "checkpoints"
    own = own_checkpoint(ckpts, ckpt)
    done = checkpoint.ordered(ckpts)
    if own is not None:
        if done and done[-1].name == own.name:  # the newest: nothing replaced
            return
        checkpoint.make_newest(own)
    elif not done:  # from elsewhere, into a mode directory without checkpoints
        return
    (mode_dir / "summary.json").unlink(missing_ok=True)
    shutil.rmtree(mode_dir / "final", ignore_errors=True)


def own_checkpoint(ckpts: Path, ckpt: Path) -> Path | None:
    """``ckpt``'s entry in ``ckpts`` (a link to it, or one inside linked from elsewhere,
    included), or None for a checkpoint from elsewhere."""
    if ckpt.parent.resolve() == ckpts.resolve():
        return ckpts / ckpt.name
    if ckpt.resolve().parent == ckpts.resolve():
        return ckpts / ckpt.resolve().name
    return None


def _newest(ckpts: Path) -> Path | None:
    """``checkpoint.newest``, its refusal saying what to do."""
    try:
        return checkpoint.newest(ckpts)
    except CheckpointError as e:
        usable = checkpoint.ordered(ckpts)  # those with a readable manifest
        todo = (
            f"delete that checkpoint directory, or pass --resume {usable[-1]} (the newest "
            "readable one)"
            if usable
            else "delete that checkpoint directory (no other is readable: the mode starts "
            "from step 0), or pass another --out"
        )
        raise CheckpointError(f"{e}: {todo}") from None


def check_resume_settings(args, cfgs: list[TrainConfig], job, out: Path, parallel=None) -> None:
    """With plain --resume, every mode's newest checkpoint before any mode trains (under
    --compare a refusal at a later mode would otherwise come after the earlier ones went on,
    their results rewritten): a readable manifest, this run's launch and the settings it
    records (if it does); for the later modes also the files' hashes and the metrics (the
    first mode's are checked as it loads). Runs with the lock held."""
    if args.resume != NEWEST:
        return
    for i, (cfg, task) in enumerate(zip(cfgs, job.tasks, strict=True)):
        mode_dir = out / cfg.mode
        barrier()
        run_on_rank0(lambda d=mode_dir: checkpoint.recover(d / "checkpoints"))
        found = _newest(mode_dir / "checkpoints")
        if found is None:
            continue
        manifest = checkpoint.read_manifest(found)
        try:
            check_launch(found, manifest, parallel)
            settings = manifest.info.get("settings")
            if isinstance(settings, dict) and {"config", "data", "describe"} <= settings.keys():
                # (the manifest's info is no file it hashes: edited, its values can be anything)
                if not (
                    isinstance(settings["config"], dict)
                    and isinstance(settings["data"], str)
                    and isinstance(settings["describe"], dict)
                ):
                    raise CheckpointError(f"{found}: its manifest's recorded settings are corrupt")
                check_settings(found, settings, cfg, task.fingerprint, job.describe)
            if i and manifest.kind == "torch":  # one process: DCP's own check is collective
                checkpoint.verify(found, manifest)
        except CheckpointError as e:
            raise unusable_newest(e, found) from None
        if i and manifest.kind == "torch" and manifest.step is not None:
            metrics_until(mode_dir / "metrics.jsonl", manifest.step)


def unusable_newest(e: CheckpointError, newest: Path) -> CheckpointError:
    """A newest checkpoint that failed its checks, with what to do: never a silent fall back
    to an older one."""
    older = [p for p in checkpoint.ordered(newest.parent) if p != newest]
    if older:
        todo = (
            f"delete {newest} to resume from the previous checkpoint, or pass --resume {older[-1]}"
        )
    else:
        todo = f"there is no older checkpoint: delete {newest.parent} to start afresh"
    return CheckpointError(f"{e}; {todo}")
