"""coat_models.data: the embedded stdlib corpus, user text / .npy / .bin files, the sampler."""

import warnings

import numpy as np
import pytest
import torch
from coat_models.train.data import (
    BYTE_EOS,
    BYTE_VOCAB,
    STDLIB_VAL_EVERY,
    BatchSampler,
    DataError,
    load_data,
    stdlib_sources,
    val_batches,
)


def test_stdlib_corpus_is_real_deterministic_and_split_by_file():
    files = stdlib_sources(2**20)
    assert [p for p, _ in files] == sorted(p for p, _ in files)
    assert not any(part in p.split("/") for p, _ in files for part in ("test", "site-packages"))
    assert sum(len(b) for _, b in files) == 2**20  # capped exactly (the last file is cut)
    a, b = load_data(max_bytes=2**20), load_data(max_bytes=2**20)
    assert a.fingerprint == b.fingerprint and np.array_equal(a.train, b.train)
    assert a.vocab_size == BYTE_VOCAB and int(a.train.max()) < BYTE_VOCAB
    # one EOS per file; every 20th file (sorted) is validation
    n_val = len(range(0, len(files), STDLIB_VAL_EVERY))
    assert int((a.val == BYTE_EOS).sum()) == n_val
    assert int((a.train == BYTE_EOS).sum()) == len(files) - n_val
    first_val = files[0][1]
    assert bytes(a.val[: len(first_val)].astype(np.uint8)) == first_val
    assert b"def " in bytes(a.train[:200_000].astype(np.uint8))  # real Python source


def test_text_file_is_byte_tokenized_with_tail_validation(tmp_path):
    text = ("hello world. " * 200).encode() + "é\n".encode()
    path = tmp_path / "corpus.txt"
    path.write_bytes(text)
    d = load_data(path, val_fraction=0.1)
    ids = np.concatenate([d.train, d.val]).astype(np.uint8)
    assert bytes(ids) == text
    assert len(d.val) == int(len(text) * 0.1)
    assert d.vocab_size == BYTE_VOCAB


@pytest.mark.parametrize(
    "suffix,dtype",
    [(".npy", np.uint16), (".npy", np.int32), (".bin", np.uint16), (".bin", np.int32)],
    ids=["npy-u16", "npy-i32", "bin-u16", "bin-i32"],
)
def test_token_files(tmp_path, suffix, dtype):
    ids = (np.arange(5000) * 7919 % 1000).astype(dtype)
    path = tmp_path / f"ids{suffix}"
    if suffix == ".npy":
        np.save(path, ids)
    else:
        ids.tofile(path)
    d = load_data(path, bin_dtype=np.dtype(dtype).name, val_fraction=0.05)
    assert np.array_equal(np.concatenate([d.train, d.val]), ids)
    assert d.vocab_size == 1000 and len(d.val) == 250
    d.check_fits(1000)
    with pytest.raises(DataError, match="token id 999 but the model's vocabulary has 512"):
        d.check_fits(512)
    with pytest.raises(DataError, match="512 entries: pass a model with vocab_size >= 1000$"):
        d.check_fits(512, model_dir=True)  # (ids made already: no tokenizer to suggest)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda p: np.save(p / "x.npy", np.zeros(10, np.float32)), "must be integers"),
        (lambda p: np.save(p / "x.npy", np.array([1, -2, 3])), "negative token id"),
        (lambda p: (p / "x.bin").write_bytes(b"\0" * 7), "of 2 .uint16.: no --data-dtype fits"),
    ],
    ids=["float-npy", "negative-id", "odd-bin"],
)
def test_bad_token_files(tmp_path, make, match):
    make(tmp_path)
    (path,) = tmp_path.iterdir()
    with pytest.raises(DataError, match=match):
        load_data(path)


def test_a_bin_size_that_fits_another_dtype_names_it(tmp_path):
    path = tmp_path / "ids.bin"
    np.arange(3, dtype=np.uint16).tofile(path)  # 6 bytes: not int32's multiple, uint16's
    with pytest.raises(DataError, match=r"multiple of 4 \(int32\): pass --data-dtype uint16 if"):
        load_data(path, bin_dtype="int32")


@pytest.mark.parametrize("top", [999, 128_255], ids=["below-2**16", "llama3-vocab"])
def test_int32_ids_read_as_uint16_are_refused(tmp_path, top):
    """A .bin of int32 ids read with the default --data-dtype (uint16) was each id followed by
    its high half (0, or 1 for a 128k vocabulary): the model trained on every second token
    being 0, without a word."""
    ids = (np.arange(5000) * 7919 % (top + 1)).astype(np.int32)
    ids[-1] = top
    path = tmp_path / "ids.bin"
    ids.tofile(path)
    with pytest.raises(
        DataError, match=r"as uint16: pass --data-dtype int32 \(or --data-dtype uint"
    ):
        load_data(path)
    d = load_data(path, bin_dtype="int32")
    assert np.array_equal(np.concatenate([d.train, d.val]), ids) and d.vocab_size == top + 1
    # uint16 named (--data-dtype uint16) is read as such: one-token documents, each followed
    # by an end-of-text id 2, look the same
    d = load_data(path, bin_dtype="uint16", dtype_given=True)
    assert np.array_equal(np.concatenate([d.train, d.val]), ids.view(np.uint16))


@pytest.mark.parametrize(
    "name,save",
    [
        ("ids.npz", lambda p, ids: np.savez(p, ids=ids)),
        ("ids.pt", lambda p, ids: torch.save(torch.from_numpy(ids), p)),
        ("ids.txt", lambda p, ids: p.write_text("text\n", encoding="utf-16")),
    ],
    ids=["npz", "torch-save", "utf16-text"],
)
def test_binary_file_is_not_read_as_text(tmp_path, name, save):
    # Any suffix but .npy / .bin is text, tokenized byte-level: these were trained on as the
    # bytes of a zip or a pickle, the header saying "text".
    save(tmp_path / name, np.arange(3000, dtype=np.int64) % 300)
    with pytest.raises(DataError, match=r"is not text \(it holds NUL bytes\): pass a UTF-8"):
        load_data(tmp_path / name)


@pytest.mark.parametrize("suffix", [".NPY", ".Bin"])
def test_token_file_suffix_in_any_case(tmp_path, suffix):
    ids = (np.arange(3000) % 300).astype(np.uint16)
    path = tmp_path / f"IDS{suffix}"
    if suffix == ".NPY":
        np.save(tmp_path / "ids.npy", ids)
        (tmp_path / "ids.npy").rename(path)
    else:
        ids.tofile(path)
    d = load_data(path, val_fraction=0.1)
    assert np.array_equal(np.concatenate([d.train, d.val]), ids) and d.vocab_size == 300


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_data(tmp_path / "nope.txt")


def test_sampler_is_a_pure_function_of_seed_and_step():
    tokens = np.arange(10_000, dtype=np.uint16)
    s = BatchSampler(tokens, batch_size=4, seq_len=16, seed=3)
    b = s.batch(5, 1)
    assert b.dtype == torch.int64 and b.shape == (4, 16)
    assert torch.equal(b, BatchSampler(tokens, 4, 16, seed=3).batch(5, 1))
    assert not torch.equal(b, s.batch(6, 1)) and not torch.equal(b, s.batch(5, 0))
    assert not torch.equal(b, BatchSampler(tokens, 4, 16, seed=4).batch(5, 1))
    # each row is a contiguous window of the data
    assert torch.equal(b[:, 1:] - b[:, :-1], torch.ones(4, 15, dtype=torch.int64))
    with pytest.raises(DataError, match="fewer than --seq-len"):
        BatchSampler(tokens[:16], 4, 16, seed=0)


def test_val_batches_are_fixed_windows():
    tokens = np.arange(1000, dtype=np.uint16)
    batches = val_batches(tokens, batch_size=4, seq_len=10, max_batches=3)
    assert [len(b) for b in batches] == [4, 4, 4]
    assert torch.equal(torch.cat(batches).flatten(), torch.arange(120))
    assert sum(len(b) for b in val_batches(tokens[:55], 4, 10, 3)) == 5  # short split: fewer
    with pytest.raises(DataError, match="validation split has 5 tokens"):
        val_batches(tokens[:5], 4, 10, 3)


def test_val_batches_of_a_memory_mapped_int64_file_are_copies(tmp_path):
    # np.save of Python ints writes int64: loaded memory-mapped (read-only), a view of it
    # made torch warn of a non-writable array, and the batches followed the file.
    np.save(tmp_path / "ids.npy", np.arange(2000, dtype=np.int64) % 300)
    d = load_data(tmp_path / "ids.npy", val_fraction=0.5)
    assert d.val.dtype == np.int64 and not d.val.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batches = val_batches(d.val, batch_size=4, seq_len=10, max_batches=2)
    assert not any(np.shares_memory(b.numpy(), d.val) for b in batches)
    assert torch.equal(torch.cat(batches).flatten(), torch.from_numpy(d.val[:80].copy()))


def test_data_beyond_the_model_vocabulary_names_the_size_needed():
    data = load_data(None, max_bytes=200_000)  # byte-level: ids up to 256 (the EOS)
    data.check_fits(data.vocab_size)
    with pytest.raises(DataError, match=f"pass --vocab-size {data.vocab_size} or more$"):
        data.check_fits(100)
    # A --model-dir: no --vocab-size there (it is refused with one); what sets the ids is
    # named (it said "the data has token id 256" of ASCII text).
    want = "byte-level text takes ids up to 256 .* has 100 entries: pass a model with "
    with pytest.raises(DataError, match=want + "vocab_size >= 257, or one with its tokenizer$"):
        data.check_fits(100, model_dir=True)


def test_a_tokenizer_larger_than_the_model_is_named(tmp_path):
    class Tokenizer:  # len() and a call, as transformers' tokenizers have
        eos_token_id = 1

        def __len__(self):
            return 332

        def __call__(self, text, **kw):
            return {"input_ids": [ord(c) % 300 for c in text]}

    path = tmp_path / "t.txt"
    path.write_text("abc " * 100)
    data = load_data(path, tokenizer=Tokenizer())
    want = "--model-dir's tokenizer has 332 entries but the model's vocabulary has 300 entries"
    # The tokenizer is the directory's own: the remedy resizes the model (it said "pass a
    # model with vocab_size >= 332 (or its own tokenizer)").
    fix = r": resize the model's embeddings to the tokenizer \(model.resize_token_embeddings\(332\)"
    with pytest.raises(DataError, match=want + fix):
        data.check_fits(300, model_dir=True)


def test_the_built_in_corpus_with_a_tokenizer_without_eos_has_no_separator():
    """Id 0 stood in for a missing end-of-sequence token between the files: <unk>, or
    whatever the tokenizer's id 0 is. Without one the files are joined as they
    are; with one, each file ends with it."""

    class Tokenizer:
        eos_token_id = None

        def __len__(self):
            return 300

        def __call__(self, text, **kw):
            return {"input_ids": [1 + ord(c) % 250 for c in text]}

    data = load_data(None, max_bytes=50_000, tokenizer=Tokenizer())
    assert 0 not in np.concatenate([data.train, data.val])
    Tokenizer.eos_token_id = 299
    data = load_data(None, max_bytes=50_000, tokenizer=Tokenizer())
    assert data.train[-1] == 299 and data.val[-1] == 299
