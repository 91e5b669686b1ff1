"""Token data for coat-train: the embedded corpus, user files, and a deterministic batch sampler.

The default corpus needs no download: it is the Python standard library's own ``.py`` source
of the running interpreter (sorted paths, test suites and site-packages left out, capped
size), tokenized byte-level. One file in every 20 (by sorted path) is held out for
validation, so the split is fixed and spread over the whole library.

User data (``--data``): a text file (byte-level tokens, or the tokenizer of ``--model-dir``
if it ships one; NUL bytes say it is not text), or pre-tokenized ids in ``.npy`` (any integer
dtype) or raw ``.bin`` (``uint16`` by default, as nanoGPT writes them; or ``int32``). The
last ``val_fraction`` of the tokens is the validation split.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .options import STDLIB_MAX_BYTES

BYTE_EOS = 256  # document separator of the byte-level tokenizer
BYTE_VOCAB = 257  # 256 byte values + EOS
STDLIB_VAL_EVERY = 20  # every 20th file (sorted by path) is validation: 5%
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
BIN_DTYPES = {"uint16": np.uint16, "int32": np.int32}
MAX_TOKEN_ID = 2**31 - 1


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (vocabularies: a multiple of 64)."""
    return -(-n // multiple) * multiple


class DataError(ValueError):
    """Unusable data input; the message says what to change."""


@dataclass(frozen=True)
class TokenData:
    """1-D token id arrays for training and validation, and where they came from."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int  # every id is < vocab_size
    source: str  # one line for the run header
    fingerprint: str  # sha256 prefix over both splits: resume refuses other data
    builtin: bool = False  # the stdlib corpus (--corpus-mib), not a --data file
    vocab_from: str = "ids"  # what sets vocab_size: "ids" (a token file), "bytes", "tokenizer"

    def more(self, split: str) -> str:
        """What gives the ``"training"`` or ``"validation"`` split more tokens (the options
        that apply to this data: --val-fraction is refused without --data, --corpus-mib
        with it)."""
        if self.builtin:
            return "a larger --corpus-mib, or --data FILE"
        fraction = "smaller" if split == "training" else "larger"
        return f"a longer --data file, or a {fraction} --val-fraction"

    def check_fits(self, model_vocab: int, model_dir: bool = False) -> None:
        """Refuse ids the model's embedding cannot take, saying what sets them (the file's
        ids, byte-level text, --model-dir's tokenizer) and a remedy that applies (--vocab-size
        is a preset's)."""
        if self.vocab_size <= model_vocab:
            return
        need = self.vocab_size
        what = {
            "ids": f"the data has token id {need - 1}",
            "bytes": f"byte-level text takes ids up to {need - 1} (its bytes and end-of-text)",
            "tokenizer": f"--model-dir's tokenizer has {need} entries",
        }[self.vocab_from]
        if not model_dir:
            fix = f"pass --vocab-size {need} or more"
        elif self.vocab_from == "bytes":
            fix = f"pass a model with vocab_size >= {need}, or one with its tokenizer"
        elif self.vocab_from == "tokenizer":
            # (the directory's own tokenizer: "its own tokenizer" was no remedy)
            fix = (
                f"resize the model's embeddings to the tokenizer "
                f"(model.resize_token_embeddings({need}), then save_pretrained), or save a "
                "tokenizer that fits its vocabulary"
            )
        else:  # (ids made already: a tokenizer does not apply)
            fix = f"pass a model with vocab_size >= {need}"
        raise DataError(f"{what} but the model's vocabulary has {model_vocab} entries: {fix}")


def byte_encode(text: bytes) -> np.ndarray:
    """Byte-level tokenization: one token per byte, ids 0..255 (uint16)."""
    return np.frombuffer(text, dtype=np.uint8).astype(np.uint16)


def stdlib_sources(max_bytes: int = STDLIB_MAX_BYTES) -> list[tuple[str, bytes]]:
    """(relative path, contents) of the interpreter's own stdlib ``.py`` files, sorted by path,
    until ``max_bytes`` are collected. Deterministic for a given Python build."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for rel in _stdlib_files(root):
        if total >= max_bytes:
            break
        blob = Path(root, rel).read_bytes()[: max_bytes - total]
        out.append((rel, blob))
        total += len(blob)
    return out


@functools.cache
def _stdlib_files(root: Path) -> tuple[str, ...]:
    """The ``.py`` files under ``root`` as sorted relative paths; walked once per process
    (the walk, not the reading, is most of a small corpus's time)."""
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        paths += [
            Path(dirpath, f).relative_to(root).as_posix() for f in filenames if f.endswith(".py")
        ]
    return tuple(sorted(paths))


def _join_docs(docs: list[np.ndarray], eos: int | None) -> np.ndarray:
    """The documents one after another, each followed by ``eos`` (none without one)."""
    if not docs:
        return np.zeros(0, dtype=np.uint16)
    if eos is None:
        return np.concatenate(docs)
    sep = np.array([eos], dtype=docs[0].dtype)
    return np.concatenate([part for d in docs for part in (d, sep)])


def _fingerprint(train: np.ndarray, val: np.ndarray) -> str:
    h = hashlib.sha256()
    for arr in (train, val):
        h.update(str(arr.dtype).encode() + str(arr.shape).encode())
        h.update(np.ascontiguousarray(arr).view(np.uint8))
    return h.hexdigest()[:16]


def load_stdlib_corpus(max_bytes: int = STDLIB_MAX_BYTES, tokenizer=None) -> TokenData:
    """The embedded default corpus (see the module docstring)."""
    files = stdlib_sources(max_bytes)
    if not files and max_bytes < 1:
        raise DataError(
            "--corpus-mib caps the built-in corpus below one byte: raise it, or pass --data FILE"
        )
    if not files:
        raise DataError("found no standard-library .py files to train on: pass --data FILE")
    encode, eos, vocab = _encoder(tokenizer)
    train = _join_docs([encode(b) for i, (_, b) in enumerate(files) if i % STDLIB_VAL_EVERY], eos)
    val = _join_docs([encode(b) for i, (_, b) in enumerate(files) if not i % STDLIB_VAL_EVERY], eos)
    nbytes = sum(len(b) for _, b in files)
    py = f"python{sys.version_info.major}.{sys.version_info.minor}"
    source = f"{py} stdlib source ({len(files)} files, {nbytes / 2**20:.1f} MiB)"
    kind = "bytes" if tokenizer is None else "tokenizer"
    return TokenData(
        train, val, vocab, source, _fingerprint(train, val), builtin=True, vocab_from=kind
    )


def _encoder(tokenizer):
    """(encode: bytes -> ids, eos id or None, vocab size) for byte-level or a Hugging Face
    tokenizer."""
    if tokenizer is None:
        return byte_encode, BYTE_EOS, BYTE_VOCAB

    def encode(blob: bytes, errors: str = "replace") -> np.ndarray:
        # verbose=False: the whole text is one call, cut into --seq-len windows afterwards;
        # transformers' "longer than the specified maximum sequence length" is not true here.
        text = blob.decode("utf-8", errors=errors)
        ids = tokenizer(text, add_special_tokens=False, verbose=False)
        return np.asarray(ids["input_ids"], dtype=np.int32)

    # A tokenizer without an end-of-sequence token joins the files without a separator (id 0
    # had stood in, which such a tokenizer may use for anything: <unk>, a letter).
    return encode, tokenizer.eos_token_id, len(tokenizer)


def token_file_suffix(path: str | os.PathLike) -> str | None:
    """``".npy"`` or ``".bin"`` for a file of token ids (in any case: ``IDS.NPY``), else None
    (a text file)."""
    suffix = Path(path).suffix.lower()
    return suffix if suffix in (".npy", ".bin") else None


def load_token_file(
    path: str | os.PathLike, bin_dtype: str = "uint16", dtype_given: bool = False
) -> np.ndarray:
    """Pre-tokenized ids from ``.npy`` (memory-mapped, any integer dtype, flattened) or raw
    ``.bin`` (``bin_dtype``: uint16 or int32; ``dtype_given``: named by the user, so that
    uint16 ids that look like int32 ones are read as such)."""
    path, suffix = Path(path), token_file_suffix(path)
    if suffix == ".npy":
        try:
            ids = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, EOFError, OSError) as e:  # garbage, truncated or empty
            raise DataError(f"{path}: not a plain .npy array ({e})") from None
    else:
        if bin_dtype not in BIN_DTYPES:
            raise DataError(f"--data-dtype must be one of {sorted(BIN_DTYPES)}, got {bin_dtype!r}")
        dtype, size = np.dtype(BIN_DTYPES[bin_dtype]), path.stat().st_size
        if size == 0:  # np.memmap cannot map an empty file
            raise DataError(f"{path} is empty: pass a file of token ids")
        if size % dtype.itemsize:
            fits = [n for n, d in BIN_DTYPES.items() if size % np.dtype(d).itemsize == 0]
            raise DataError(
                f"{path}: size {size} bytes is not a multiple of {dtype.itemsize} ({bin_dtype}): "
                + (
                    f"pass --data-dtype {fits[0]} if its ids are {fits[0]}"
                    if fits
                    else "no --data-dtype fits; the file is truncated or not raw token ids"
                )
            )
        ids = np.memmap(path, dtype=dtype, mode="r")
        # int32 ids read as uint16 (the default) are each id followed by its high half: 0 below
        # 65,536, at most 7 for a vocabulary of 524,288 (Gemma 3's has 262,208). Trained on,
        # the model learns that every second token is 0. uint16 ids are seldom so (one-token
        # documents, each followed by an end-of-text id below 8): named, they are read.
        odd = ids[1::2].max() if ids.size >= 64 and not dtype_given else None
        if dtype.itemsize == 2 and odd is not None and odd < 8 <= ids[0::2].max():
            raise DataError(
                f"{path}: every second 16-bit value is below 8, as in int32 token ids read as "
                f"{bin_dtype}: pass --data-dtype int32 (or --data-dtype {bin_dtype} if they "
                "are)"
            )
    if ids.dtype.kind not in "iu":
        raise DataError(f"{path}: token ids must be integers, found dtype {ids.dtype}")
    ids = ids.reshape(-1)
    if ids.size and int(ids.min()) < 0:
        raise DataError(f"{path}: negative token id {int(ids.min())}")
    if ids.size and int(ids.max()) > MAX_TOKEN_ID:
        # Batches are int64 (a uint64 id above 2**63 would wrap to a negative one), and no
        # embedding has 2**31 rows: these are not token ids, or not of this dtype.
        raise DataError(
            f"{path}: token id {int(ids.max())} is beyond any vocabulary (ids must be < 2**31): "
            + ("pass the right --data-dtype" if suffix == ".bin" else "pass token ids")
        )
    return ids


def load_data(
    path: str | os.PathLike | None = None,
    *,
    bin_dtype: str = "uint16",
    dtype_given: bool = False,
    val_fraction: float = 0.05,
    max_bytes: int = STDLIB_MAX_BYTES,
    tokenizer=None,
) -> TokenData:
    """Training data: the embedded stdlib corpus when ``path`` is None, else a user file."""
    if path is None:
        return load_stdlib_corpus(max_bytes, tokenizer)
    path = Path(path)
    if path.is_dir():
        raise DataError(f"--data {path} is a directory: pass a file (.txt, .npy or .bin)")
    if not path.exists():
        raise DataError(f"--data {path}: no such file")
    if not path.is_file():  # /dev/null, a pipe, a socket: nothing to split and sample from
        raise DataError(f"--data {path} is not a regular file: pass a file (.txt, .npy or .bin)")
    if not 0 < val_fraction < 1:
        raise DataError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    if token_file_suffix(path):
        ids = load_token_file(path, bin_dtype, dtype_given)
        vocab = int(ids.max()) + 1 if ids.size else 0
        kind, vocab_from = f"{ids.size:,} token ids ({ids.dtype})", "ids"
    else:
        blob = path.read_bytes()
        if b"\0" in blob:  # text has none; .npz, .pt, zip, UTF-16 ... do
            raise DataError(
                f"--data {path} is not text (it holds NUL bytes): pass a UTF-8 text file, or "
                "token ids as .npy (one array, np.save) or raw .bin (--data-dtype)"
            )
        if path.suffix.lower() in (".json", ".jsonl"):  # trained as text, braces and keys too
            raise DataError(
                f"--data {path}: coat-train reads plain text, not JSON records: write the texts "
                f"to a .txt file (e.g. jq -r .text {path} > data.txt), or pass token ids (.npy, "
                ".bin)"
            )
        encode, _, vocab = _encoder(tokenizer)
        if tokenizer is None:
            ids = encode(blob)  # byte-level: any bytes
        else:
            try:
                ids = encode(blob, errors="strict")
            except UnicodeDecodeError as e:  # (it had trained on U+FFFD's tokens, silently)
                if e.end != len(blob) or "end of data" not in e.reason:
                    raise DataError(
                        f"--data {path} is not UTF-8 text (byte 0x{blob[e.start]:02x} at "
                        f"offset {e.start}), which --model-dir's tokenizer reads: convert it "
                        "from its encoding to UTF-8 (iconv -f ENCODING -t UTF-8), or pass token "
                        "ids (.npy, .bin)"
                    ) from None
                # A file cut inside its last character (head -c N): the rest is text.
                blob = blob[: e.start]
                ids = encode(blob, errors="strict")
            if len(ids) == 0 and blob.strip():
                raise DataError(
                    f"--model-dir's tokenizer ({type(tokenizer).__name__}, {len(tokenizer)} "
                    f"entries) made no tokens of --data {path}'s {len(blob):,} bytes: replace "
                    "or remove the tokenizer files (without them the data is byte-level)"
                )
        kind = f"text, {path.stat().st_size / 2**20:.2f} MiB"
        vocab_from = "bytes" if tokenizer is None else "tokenizer"
    if len(ids) == 0:
        raise DataError(f"--data {path} holds no tokens: pass a non-empty file")
    n_val = int(len(ids) * val_fraction)
    train, val = ids[: len(ids) - n_val], ids[len(ids) - n_val :]
    return TokenData(
        train, val, vocab, f"{path} ({kind})", _fingerprint(train, val), vocab_from=vocab_from
    )


class BatchSampler:
    """Random windows of ``seq_len`` tokens from the training split. The batch of (step,
    micro-step) depends only on (seed, step, micro-step): every mode of a comparison sees the
    same tokens, and a resumed run continues exactly from the step number alone."""

    def __init__(
        self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, more="more data"
    ):
        if len(tokens) <= seq_len:  # a window is seq_len + 1 tokens: inputs and next tokens
            raise DataError(
                f"the training split has {len(tokens)} tokens, fewer than --seq-len {seq_len} "
                f"+ 1: use {more}, or a shorter --seq-len"
            )
        self.tokens, self.batch_size, self.seq_len, self.seed = tokens, batch_size, seq_len, seed

    def batch(self, step: int, micro: int = 0) -> torch.Tensor:
        """int64 ids ``[batch_size, seq_len]`` of step ``step``, micro-batch ``micro``."""
        rng = np.random.default_rng([self.seed, step, micro])
        starts = rng.integers(0, len(self.tokens) - self.seq_len + 1, size=self.batch_size)
        rows = [np.asarray(self.tokens[s : s + self.seq_len], dtype=np.int64) for s in starts]
        return torch.from_numpy(np.stack(rows))


def val_batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int, more="more data"
):
    """The fixed validation set: the first ``max_batches`` batches of consecutive
    non-overlapping windows of the validation split (fewer if the split is short)."""
    n_windows = min(len(tokens) // seq_len, batch_size * max_batches)
    if n_windows == 0:
        raise DataError(
            f"the validation split has {len(tokens)} tokens, fewer than --seq-len {seq_len}: "
            f"use {more}, or a shorter --seq-len"
        )
    # A copy: int64 ids would otherwise stay a view of a read-only memory-mapped --data file,
    # which torch.from_numpy warns about (and the batches would change with the file).
    windows = np.array(tokens[: n_windows * seq_len], dtype=np.int64).reshape(n_windows, seq_len)
    return [torch.from_numpy(windows[i : i + batch_size]) for i in range(0, n_windows, batch_size)]
