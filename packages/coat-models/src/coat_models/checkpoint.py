"""Checkpoint directories that are complete or absent, and verified before anything is read.

A checkpoint is a directory of files plus ``manifest.json``, written last: the format, the
kind (``"torch"``: ``torch.save`` files of one process; ``"dcp"``:
``torch.distributed.checkpoint`` shards of every rank and its ``.metadata``), the number of
ranks, the step, a serial number (the order in which checkpoints were written into their
parent directory: "newest" means the highest serial, not the highest step, so that a run
resumed from an older checkpoint supersedes the later ones of the run it replaces: from its
start, by ``make_newest``, then by writing its own), and the
size and SHA-256 of every file. Readers parse the manifest (JSON: it runs no code), check
that the directory holds exactly the files it lists, and hash every file before they open
any of them.

How ``<parent>/step_0000004`` comes to be, so that once one checkpoint is complete a complete
one exists at every instant (a kill anywhere leaves a resumable directory):

1. the files go to ``.tmp-step_0000004-<pid>`` (one process) or ``step_0000004.partial``
   (DCP), each fsynced;
2. ``manifest.json`` is written (temporary name, fsync, rename): the directory is complete;
3. an existing ``step_0000004`` is renamed to ``.trash-*``, the new directory renamed into
   place, the trash deleted (``publish``);
4. pruning renames a checkpoint to ``.trash-*`` before deleting it, and never touches the
   newest (``prune``).

``recover`` finishes what a killed process left: a complete in-progress directory is
published, an incomplete one and any trash are deleted.

What a checkpoint may be trusted for: the hashes prove that the files are the ones listed
in the manifest, so truncation, flipped bytes, a half-written or half-deleted directory
and files added or replaced behind the manifest's back are refused. They do not prove who
wrote it: anyone who can write to the directory can write a matching manifest. Loading
never runs code from a checkpoint (``torch.load(weights_only=True)``, and DCP's pickled
``.metadata`` through an unpickler that builds only DCP's own metadata classes, see
``coat_models.distributed``), but the weights and settings in it are whatever its writer
put there.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "Manifest",
    "checkpoint_name",
    "has_checkpoints",
    "make_newest",
    "newest",
    "next_serial",
    "ordered",
    "prune",
    "publish",
    "read_manifest",
    "recover",
    "remove",
    "unpublished",
    "verify",
    "write_manifest",
    "write_torch_files",
]

MANIFEST = "manifest.json"
FORMAT = "coat-checkpoint"
VERSION = 1
KINDS = ("torch", "dcp")
# A DCP manifest lists one file per rank plus .metadata: a few hundred bytes per rank.
MAX_MANIFEST_BYTES = 16 * 2**20

_PUBLISHED = re.compile(r"step_\d+")
_IN_PROGRESS = (re.compile(r"\.tmp-(step_\d+)-\d+"), re.compile(r"(step_\d+)\.partial"))
_TRASH = ".trash-"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (missing manifest, corrupt or unexpected files); the
    message names the directory and what is wrong with it."""


def _reached(stage: str) -> None:
    """Fault-injection point, called after each step of a save, publish and prune. It does
    nothing; the kill-during-save tests replace it to SIGKILL the process at ``stage``."""


@dataclass(frozen=True)
class Manifest:
    """What ``manifest.json`` says: ``files`` maps each file name to (bytes, SHA-256 hex);
    ``info`` is JSON the writer adds (coat-train: how the run was launched)."""

    kind: str
    world_size: int
    step: int | None
    serial: int
    files: dict[str, tuple[int, str]]
    info: dict = field(default_factory=dict)

    def to_json(self) -> str:
        files = {name: {"bytes": n, "sha256": h} for name, (n, h) in sorted(self.files.items())}
        return json.dumps(
            {
                "format": FORMAT,
                "version": VERSION,
                "kind": self.kind,
                "world_size": self.world_size,
                "step": self.step,
                "serial": self.serial,
                "info": self.info,
                "files": files,
            },
            indent=1,
        )


def checkpoint_name(step: int) -> str:
    return f"step_{step:07d}"


# --------------------------------------------------------------------------- files
def _fsync_dir(path: Path) -> None:
    """Make renames and new entries in ``path`` durable (a rename is an update of the
    directory, not of the file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> tuple[int, str]:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return size, hashlib.file_digest(f, "sha256").hexdigest()


def write_torch_files(directory: Path, objects: dict[str, object]) -> None:
    """``torch.save`` each object to ``directory/<name>``, fsynced, in order."""
    for name, obj in objects.items():
        with open(directory / name, "wb") as f:
            try:
                torch.save(obj, f)
            except RuntimeError as e:  # torch's writer reports a full disk so ("unexpected pos")
                free = shutil.disk_usage(directory).free
                raise OSError(
                    f"cannot write {directory / name} ({free:,} bytes free there): "
                    f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
                ) from e
            f.flush()
            os.fsync(f.fileno())
        _reached(f"write:{name}")


def _write_manifest_file(directory: Path, manifest: Manifest, tmp_dir: Path | None = None) -> None:
    """``manifest.json`` of ``directory``, atomically: through a temporary in ``tmp_dir``
    (default: ``directory``; a published checkpoint's parent, so that a kill part-way leaves
    no file the manifest does not list inside it), removed if the write fails."""
    tmp = (tmp_dir or directory) / f".manifest-{directory.name}-{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / MANIFEST)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(directory)


def write_manifest(
    directory: Path,
    *,
    kind: str,
    world_size: int,
    step: int | None,
    serial: int,
    info: dict | None = None,
) -> Manifest:
    """Hash every file in ``directory`` and write its manifest, last: from here on the
    directory is a complete checkpoint. The files must be written and fsynced already."""
    directory = Path(directory)
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    files = {}
    for path in sorted(directory.iterdir()):
        if path.name == MANIFEST:
            continue
        if not path.is_file() or path.is_symlink():
            raise ValueError(f"{path}: a checkpoint holds plain files only")
        files[path.name] = _sha256(path)
    manifest = Manifest(kind, world_size, step, serial, files, dict(info or {}))
    _write_manifest_file(directory, manifest)
    _reached("manifest")
    return manifest


def missing(path) -> FileNotFoundError:
    """The error for a checkpoint ``path`` that is not there; it names what an interrupted
    save left (``<path>.partial``) and how to finish it."""
    partial = Path(path).with_name(Path(path).name + ".partial")
    hint = (
        " (an interrupted save left only <path>.partial: coat_models.checkpoint.settle(path) "
        "publishes it where complete, as the next save of the path does first)"
        if partial.exists()
        else ""
    )
    return FileNotFoundError(
        f"no checkpoint at {str(path)!r}{hint}: expected a directory written by save_checkpoint"
    )


def read_manifest(directory: Path) -> Manifest:
    """The manifest of ``directory``; ``FileNotFoundError`` if there is no such directory,
    ``CheckpointError`` if it has no valid manifest. Reads JSON only."""
    directory = Path(directory)
    if not directory.is_dir():
        raise missing(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{directory} has no {MANIFEST}: it is not a complete checkpoint of coat_models "
            "(an interrupted save, another tool, or a version before checkpoints carried "
            "manifests), and nothing in it is read"
        )
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{path} is larger than {MAX_MANIFEST_BYTES} bytes: not a manifest")
    try:
        raw = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # (nesting past the stack)
        why = "nested too deeply" if isinstance(e, RecursionError) else e
        raise CheckpointError(f"{path} is not valid JSON ({why}): the manifest is corrupt") from (
            None
        )
    return _parse(raw, path)


def _parse(raw, path: Path) -> Manifest:
    def bad(why: str):
        return CheckpointError(f"{path} is not a valid checkpoint manifest: {why}")

    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise bad(f"its format is not {FORMAT!r}")
    if raw.get("version") != VERSION:
        raise bad(f"version {raw.get('version')!r}, this coat_models reads version {VERSION}")
    kind, world, step, serial = (raw.get(k) for k in ("kind", "world_size", "step", "serial"))
    if kind not in KINDS:
        raise bad(f"kind {kind!r} is none of {KINDS}")
    if not _is_int(world) or world < 1:
        raise bad(f"world_size {world!r}")
    if step is not None and (not _is_int(step) or step < 0):
        raise bad(f"step {step!r}")
    if not _is_int(serial) or serial < 1:
        raise bad(f"serial {serial!r}")
    info, listed = raw.get("info", {}), raw.get("files")
    if not isinstance(info, dict):
        raise bad("info is not an object")
    if not isinstance(listed, dict) or not listed:
        raise bad("it lists no files")
    files = {}
    for name, entry in listed.items():
        # Plain names only: a manifest must not point outside its directory.
        if not _is_plain_name(name):
            raise bad(f"file name {name!r}")
        if not isinstance(entry, dict):
            raise bad(f"entry of {name!r}")
        size, digest = entry.get("bytes"), entry.get("sha256")
        if not _is_int(size) or size < 0:
            raise bad(f"size of {name!r}")
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise bad(f"SHA-256 of {name!r}")
        files[name] = (size, digest)
    return Manifest(kind, world, step, serial, files, info)


def check_archive_stored(source, name) -> None:
    """Refuse (``CheckpointError``) a ``torch.save`` archive (a path or a seekable file)
    with a compressed entry: torch.save stores every entry as is, and a deflated one is a
    way to make ``torch.load`` allocate about 1000 times the file's size (a 100 MB file asked
    for 100 GB) before any other check. A file that is not a zip archive is left to
    ``torch.load`` (which refuses it)."""
    import zipfile

    start = source.tell() if hasattr(source, "tell") else None
    try:
        with zipfile.ZipFile(source) as archive:
            packed = [i.filename for i in archive.infolist() if i.compress_type]
    except (zipfile.BadZipFile, OSError, ValueError):
        packed = []
    finally:
        if start is not None:
            source.seek(start)
    if packed:
        raise CheckpointError(
            f"{name} holds compressed entries ({packed[0]}, ...), which torch.save never "
            "writes: refused"
        )


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_plain_name(name) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..", MANIFEST)
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


def verify(directory: Path, manifest: Manifest, names=None) -> None:
    """Raise ``CheckpointError`` unless ``directory`` holds exactly the files ``manifest``
    lists, and those in ``names`` (default: all) have its sizes and SHA-256 hashes.
    ``names`` lets the ranks of a job share the hashing."""
    directory = Path(directory)
    on_disk = {p.name for p in directory.iterdir()} - {MANIFEST}
    unlisted = sorted(on_disk - set(manifest.files))
    if unlisted:
        raise CheckpointError(
            f"checkpoint {directory} holds files its manifest does not list "
            f"({', '.join(unlisted[:5])}): it was changed after it was written; nothing is read"
        )
    missing = sorted(set(manifest.files) - on_disk)
    if missing:
        raise CheckpointError(
            f"checkpoint {directory} lacks {', '.join(missing[:5])}, listed in its manifest "
            "(a file deleted after it was written)"
        )
    for name in sorted(manifest.files if names is None else names):
        size, digest = manifest.files[name]
        path = directory / name
        if not path.is_file() or path.is_symlink():
            raise CheckpointError(f"checkpoint {directory}: {name} is not a plain file")
        got_size, got = _sha256(path)
        if got_size != size:
            raise CheckpointError(
                f"checkpoint {directory} is corrupt: {name} has {got_size} bytes, its "
                f"manifest says {size} (truncated or replaced)"
            )
        if got != digest:
            raise CheckpointError(
                f"checkpoint {directory} is corrupt: the SHA-256 of {name} differs from its "
                "manifest (changed bytes)"
            )


# --------------------------------------------------------------------- directories
def _entries(parent: Path) -> list[Path]:
    """``parent``'s entries, sorted; none where it does not exist. A ``parent`` that exists
    as something else (a dangling link, say to a disk not mounted; a link loop; a file) is
    refused: read as empty, a resume would start from step 0 over the run's directory."""
    if not os.path.lexists(parent):
        return []
    if not parent.is_dir():
        raise CheckpointError(
            f"{parent} is not a readable directory (a dangling link, a link loop or a file): "
            "its checkpoints cannot be read; restore it (e.g. mount what the link points to), "
            "or remove it to start afresh"
        )
    return sorted(parent.iterdir())


def _published(parent: Path) -> list[Path]:
    found = [p for p in _entries(parent) if _PUBLISHED.fullmatch(p.name)]
    for p in found:
        if not p.is_dir():  # (a link to a checkpoint directory is one)
            raise CheckpointError(
                f"{p} is not a checkpoint directory (a file, a dangling link or a link loop): "
                "delete it, or put the checkpoint directory it stands for back in its place"
            )
    return found


def _in_progress(parent: Path) -> list[tuple[Path, str]]:
    """(directory, name it will be published as) of every save not published yet."""
    found = []
    for p in _entries(parent):
        for pattern in _IN_PROGRESS:
            m = pattern.fullmatch(p.name)
            if m and p.is_dir():
                found.append((p, m.group(1)))
    return found


def _serial(directory: Path) -> int | None:
    try:
        return read_manifest(directory).serial
    except (CheckpointError, OSError):
        return None


def ordered(parent: Path) -> list[Path]:
    """Published checkpoints with a readable manifest, oldest (lowest serial) first."""
    found = [(s, p) for p in _published(parent) if (s := _serial(p)) is not None]
    return [p for _, p in sorted(found, key=lambda sp: (sp[0], sp[1].name))]


def next_serial(parent: Path) -> int:
    """The serial of the next checkpoint written into ``parent``."""
    dirs = _published(parent) + [p for p, _ in _in_progress(parent)]
    return 1 + max((s for p in dirs if (s := _serial(p)) is not None), default=0)


def make_newest(directory: Path) -> None:
    """Give published checkpoint ``directory`` the next serial of its parent, so that it is
    the newest (a run resumed from an older checkpoint replaces the later ones of the run
    it continues; until it writes its own, a plain resume must come back to where it
    started, not to them). Only the manifest is rewritten (atomically); no-op where it is
    the newest already."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    done = ordered(directory.parent)
    if done and done[-1].name == directory.name:
        return
    new = replace(manifest, serial=next_serial(directory.parent))
    _write_manifest_file(directory, new, tmp_dir=directory.parent)


def unpublished(path: Path) -> bool:
    """Whether ``path`` is named as a checkpoint being written (or left so by a killed save)
    or being deleted, not a published one: ``recover`` renames or deletes those."""
    name = Path(path).name
    return name.startswith(_TRASH) or any(p.fullmatch(name) for p in _IN_PROGRESS)


def has_checkpoints(parent: Path) -> bool:
    """True if ``parent`` holds a published checkpoint (usable or not) or a complete one not
    published yet (``recover`` would publish it)."""
    return bool(_published(parent)) or any(
        (p / MANIFEST).is_file() for p, _ in _in_progress(parent)
    )


def newest(parent: Path) -> Path | None:
    """The published checkpoint with the highest serial, or ``None`` if there is none.
    A ``step_*`` directory without a valid manifest raises ``CheckpointError`` naming it: it
    might be the newest, and silently resuming from an older one would lose work."""
    dirs = _published(parent)
    unreadable = []
    for p in dirs:
        try:
            read_manifest(p)
        except CheckpointError as e:
            unreadable.append(str(e))
    if unreadable:
        more = f" (and {len(unreadable) - 1} more)" if len(unreadable) > 1 else ""
        raise CheckpointError(f"{unreadable[0]}{more}")
    done = ordered(parent)
    return done[-1] if done else None


def _to_trash(path: Path, stage: str) -> Path:
    """Rename ``path`` to a trash name (one atomic step: no reader ever sees a half-deleted
    checkpoint under its name); the trash path."""
    trash = path.with_name(f"{_TRASH}{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    _fsync_dir(path.parent)
    _reached(f"{stage}:trash")
    return trash


def _delete(path: Path, stage: str) -> None:
    """Delete a directory that is already out of the way (trash or incomplete), file by
    file; a kill part-way leaves a directory nobody reads."""
    if path.is_symlink():  # a checkpoint moved elsewhere and linked back: the link goes
        path.unlink()
        return
    for p in sorted(path.iterdir()):
        if p.is_dir() and not p.is_symlink():
            _delete(p, stage)
        else:
            p.unlink()
        _reached(stage)
    path.rmdir()


def remove(path: Path, stage: str = "remove") -> None:
    """Delete a checkpoint directory: renamed to trash first, then deleted."""
    _delete(_to_trash(path, stage), f"{stage}:delete")


def publish(tmp: Path, final: Path) -> None:
    """Rename the complete directory ``tmp`` (manifest written) to ``final``, replacing an
    older ``final``. Between the two renames ``tmp`` is complete, and ``recover`` publishes a
    complete ``tmp``: there is no moment without a complete copy."""
    trash = _to_trash(final, "replace") if final.exists() else None
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    _reached("publish")
    if trash is not None:
        _delete(trash, "replace:delete")


def prune(parent: Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` (>= 1) newest checkpoints (by serial) in ``parent``; the
    newest is never deleted, and directories without a readable manifest are left alone.
    Returns the deleted paths."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    doomed = ordered(parent)[:-keep]
    for path in doomed:
        remove(path, "prune")
    return doomed


def settle(final: Path) -> None:
    """Finish a publish of ``final`` (any name) killed between its two renames: where
    ``final`` is missing and ``<final>.partial`` complete, the latter is published; where
    ``final`` is there, the trash of its name (what it replaced) is deleted. The caller must
    be the only writer."""
    final = Path(final)
    partial = final.with_name(final.name + ".partial")
    if not os.path.lexists(final) and partial.is_dir() and _serial(partial) is not None:
        os.rename(partial, final)
        _fsync_dir(final.parent)
        _reached("settle")
    if os.path.lexists(final):
        prefix = f"{_TRASH}{final.name}-"
        for p in _entries(final.parent):
            if p.name.startswith(prefix) and len(p.name) == len(prefix) + 8 and p.is_dir():
                _delete(p, "settle:delete")


def recover(parent: Path) -> None:
    """Finish what a killed save, publish or prune left in ``parent`` (the caller must be the
    only writer, e.g. hold coat-train's output lock): a publish killed between its renames is
    finished (``settle``), then trash is deleted, a complete in-progress directory is
    published, an incomplete one deleted."""
    if not parent.is_dir():
        return
    for p in sorted(parent.iterdir()):
        if p.name.startswith(_TRASH) and p.is_dir():
            # (the trash name is <_TRASH><name>-<8 hex digits>: see _to_trash)
            settle(parent / p.name[len(_TRASH) : -9])
    for p in sorted(parent.iterdir()):
        if p.name.startswith(_TRASH) and p.is_dir():
            _delete(p, "recover:delete")
    for p, name in _in_progress(parent):
        final = parent / name
        mine, theirs = _serial(p), _serial(final) if final.is_dir() else None
        if mine is not None and (theirs is None or mine > theirs):
            publish(p, final)
        else:  # never finished, or older than what is published
            remove(p, "recover")
