"""coat_models.checkpoint and the DCP helpers' checks: manifests, hashes, publish / prune /
recover, and DCP metadata that can run no code."""

import io
import json
import os
import pickle

import pytest
import torch
from coat_models import checkpoint, distributed
from coat_models.checkpoint import CheckpointError


class Payload:
    """A pickle that creates ``marker`` when unpickled by a plain unpickler."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def make_checkpoint(directory, step=1, serial=None, files=None):
    directory.mkdir(parents=True)
    for name, data in (files or {"a.pt": b"alpha" * 100, "b.pt": b"beta" * 50}).items():
        (directory / name).write_bytes(data)
    if serial is None:
        serial = checkpoint.next_serial(directory.parent)
    return checkpoint.write_manifest(
        directory, kind="torch", world_size=1, step=step, serial=serial, info={"k": [1]}
    )


def complete(parent) -> list[str]:
    """Names of the directories in ``parent`` that verify and that ``recover`` keeps (trash
    is on its way out, whatever it holds)."""
    names = []
    for d in sorted(parent.iterdir()) if parent.is_dir() else []:
        if d.name.startswith(".trash-"):
            continue
        try:
            checkpoint.verify(d, checkpoint.read_manifest(d))
        except (CheckpointError, OSError):
            continue
        names.append(d.name)
    return names


def test_manifest_round_trip(tmp_path):
    d = tmp_path / "step_0000001"
    written = make_checkpoint(d, step=1)
    read = checkpoint.read_manifest(d)
    assert read == written
    assert read.files["a.pt"][0] == 500 and read.info == {"k": [1]} and read.serial == 1
    raw = json.loads((d / "manifest.json").read_text())
    assert raw["format"] == "coat-checkpoint" and raw["kind"] == "torch"
    checkpoint.verify(d, read)


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


CORRUPTIONS = [
    ("flip", lambda d: _flip(d / "b.pt"), "the SHA-256 of b.pt differs from its manifest"),
    ("truncate", lambda d: (d / "a.pt").write_bytes(b"alpha"), "a.pt has 5 bytes, its manifest"),
    ("added", lambda d: (d / ".metadata").write_bytes(b"x"), "does not list (.metadata)"),
    ("deleted", lambda d: (d / "a.pt").unlink(), "lacks a.pt"),
]


@pytest.mark.parametrize("name,corrupt,message", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_verify_names_what_changed(tmp_path, name, corrupt, message):
    d = tmp_path / "step_0000001"
    manifest = make_checkpoint(d)
    corrupt(d)
    with pytest.raises(CheckpointError, match="corrupt|not list|lacks") as e:
        checkpoint.verify(d, manifest)
    assert message in str(e.value) and str(d) in str(e.value)


BAD_MANIFESTS = [
    ("torn", lambda m: m[: len(m) // 2], "is not valid JSON"),
    ("other-format", lambda m: m.replace("coat-checkpoint", "x"), "format is not"),
    ("outside-dir", lambda m: m.replace('"a.pt"', '"../a.pt"'), "file name '../a.pt'"),
    ("bad-hash", lambda m: m.replace('"sha256": "', '"sha256": "zz'), "SHA-256 of"),
    ("bad-kind", lambda m: m.replace('"torch"', '"pickle"'), "kind 'pickle'"),
]


@pytest.mark.parametrize("name,edit,message", BAD_MANIFESTS, ids=[b[0] for b in BAD_MANIFESTS])
def test_bad_manifest_is_refused(tmp_path, name, edit, message):
    d = tmp_path / "step_0000001"
    make_checkpoint(d)
    path = d / "manifest.json"
    path.write_text(edit(path.read_text()))
    with pytest.raises(CheckpointError, match="manifest") as e:
        checkpoint.read_manifest(d)
    assert message in str(e.value)


def test_no_manifest_and_no_directory(tmp_path):
    (tmp_path / "step_0000001").mkdir()
    with pytest.raises(CheckpointError, match="has no manifest.json: it is not a complete"):
        checkpoint.read_manifest(tmp_path / "step_0000001")
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        checkpoint.read_manifest(tmp_path / "nowhere")


def test_newest_is_by_serial_and_prune_keeps_it(tmp_path):
    """A run resumed from step 2 writes step 4 after an earlier run's step 6: its step 4 is
    the newest, and pruning keeps it rather than the higher step."""
    for step in (2, 4, 6):
        make_checkpoint(tmp_path / checkpoint.checkpoint_name(step), step=step)
    assert checkpoint.newest(tmp_path).name == "step_0000006"
    fresh = tmp_path / ".tmp-step_0000004-1"
    make_checkpoint(fresh, step=4)
    checkpoint.publish(fresh, tmp_path / "step_0000004")
    assert checkpoint.newest(tmp_path).name == "step_0000004"
    assert checkpoint.read_manifest(tmp_path / "step_0000004").serial == 4
    deleted = checkpoint.prune(tmp_path, keep=1)
    assert sorted(p.name for p in deleted) == ["step_0000002", "step_0000006"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000004"]


def test_make_newest_rewrites_the_serial_only(tmp_path):
    for step in (2, 4, 6):
        make_checkpoint(tmp_path / f"step_000000{step}", step=step)
    old = tmp_path / "step_0000002"
    before = checkpoint.read_manifest(old)
    checkpoint.make_newest(old)
    after = checkpoint.read_manifest(old)
    assert checkpoint.newest(tmp_path) == old and after.serial == 4
    assert after == checkpoint.Manifest(**{**vars(before), "serial": 4})
    checkpoint.verify(old, after)  # its files are the ones it lists
    checkpoint.make_newest(old)  # the newest already: unchanged
    assert checkpoint.read_manifest(old).serial == 4
    assert [p.name for p in checkpoint.ordered(tmp_path)] == [
        "step_0000004", "step_0000006", "step_0000002"]  # fmt: skip
    assert checkpoint.unpublished(tmp_path / ".tmp-step_0000008-12")
    assert checkpoint.unpublished(tmp_path / "step_0000008.partial")
    assert not checkpoint.unpublished(old)


def test_newest_refuses_a_checkpoint_it_cannot_read(tmp_path):
    make_checkpoint(tmp_path / "step_0000002", step=2)
    (tmp_path / "step_0000009").mkdir()  # no manifest: it might be the newest
    with pytest.raises(CheckpointError, match="step_0000009 has no manifest.json"):
        checkpoint.newest(tmp_path)
    assert checkpoint.prune(tmp_path, keep=1) == []  # left alone: not ours to judge
    assert checkpoint.has_checkpoints(tmp_path)


def test_publish_and_prune_keep_a_complete_checkpoint_at_every_stage(tmp_path, monkeypatch):
    """At every fault-injection point of a re-save (step 4 exists) and a prune to 1, a
    complete checkpoint that ``recover`` keeps is on disk."""
    parent = tmp_path / "checkpoints"
    make_checkpoint(parent / "step_0000002", step=2)
    make_checkpoint(parent / "step_0000004", step=4)
    seen = []

    def check(stage):
        seen.append((stage, complete(parent)))

    monkeypatch.setattr(checkpoint, "_reached", check)
    tmp = parent / ".tmp-step_0000004-7"
    make_checkpoint(tmp, step=4, files={"a.pt": b"new" * 10})
    checkpoint.publish(tmp, parent / "step_0000004")
    checkpoint.prune(parent, keep=1)
    stages = [s for s, _ in seen]
    for stage in ("manifest", "replace:trash", "publish", "replace:delete", "prune:trash"):
        assert stage in stages
    assert all(done for _, done in seen), seen
    # while the old step 4 is in the trash, the new one is complete under its temporary name
    assert dict(seen)["replace:trash"] == [".tmp-step_0000004-7", "step_0000002"]
    assert sorted(p.name for p in parent.iterdir()) == ["step_0000004"]
    assert (parent / "step_0000004" / "a.pt").read_bytes() == b"new" * 10


def test_recover_publishes_complete_and_deletes_incomplete(tmp_path):
    parent = tmp_path
    make_checkpoint(parent / "step_0000002", step=2)
    make_checkpoint(parent / ".tmp-step_0000004-3", step=4)  # killed after its manifest
    (parent / ".tmp-step_0000006-3").mkdir()  # killed while writing
    (parent / ".tmp-step_0000006-3" / "model.pt").write_bytes(b"half")
    (parent / "step_0000008.partial").mkdir()  # a DCP save killed before its manifest
    (parent / ".trash-step_0000000-ab").mkdir()  # a delete killed half-way
    assert checkpoint.has_checkpoints(parent)
    checkpoint.recover(parent)
    assert sorted(p.name for p in parent.iterdir()) == ["step_0000002", "step_0000004"]
    assert checkpoint.newest(parent).name == "step_0000004"


def test_recover_drops_an_in_progress_copy_older_than_the_published_one(tmp_path):
    make_checkpoint(tmp_path / ".tmp-step_0000004-3", step=4, serial=1)
    make_checkpoint(tmp_path / "step_0000004", step=4, serial=2, files={"a.pt": b"newer"})
    checkpoint.recover(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000004"]
    assert (tmp_path / "step_0000004" / "a.pt").read_bytes() == b"newer"


# ------------------------------------------------------------------ DCP in one process
@pytest.fixture
def dcp_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    path = tmp_path / "ckpt" / "step_0000001"
    distributed.save_checkpoint(path, model, opt, extra={"step": 1}, step=1, info={"x": 1})
    return path, model, opt


def test_dcp_checkpoint_has_a_manifest_and_loads(dcp_checkpoint):
    path, model, opt = dcp_checkpoint
    manifest = distributed.verify_checkpoint(path)
    assert manifest.kind == "dcp" and manifest.world_size == 1 and manifest.step == 1
    assert sorted(manifest.files) == [".metadata", "__0_0.distcp"]
    assert distributed.read_checkpoint_extra(path) == {"step": 1}
    want = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert distributed.load_checkpoint(path, model, opt) == {"step": 1}
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), want, strict=True))


@pytest.mark.parametrize("fused", [True, False])
def test_dcp_load_keeps_the_optimizers_implementation(dcp_checkpoint, fused):
    """A DCP checkpoint, like a torch one (test_train), leaves the loading optimizer's
    implementation switches as they are (it wrote fused=None; the loaded optimizer says
    fused=True, or foreach=False): the state loads, the optimizer steps on."""
    path, model, opt = dcp_checkpoint
    switches = {"fused": True} if fused else {"foreach": False}
    other = torch.optim.AdamW(model.parameters(), lr=1e-3, **switches)
    model.zero_grad(set_to_none=True)  # as a resuming run's model: DCP then sets up the state
    distributed.load_checkpoint(path, model, other)
    group = other.param_groups[0]
    assert (group["fused"], group["foreach"]) == ((True, None) if fused else (None, False))
    p = next(model.parameters())
    assert torch.equal(other.state[p]["exp_avg"], opt.state[p]["exp_avg"])
    assert float(other.state[p]["step"]) == 1.0
    model(torch.randn(2, 8)).sum().backward()
    other.step()
    assert float(other.state[p]["step"]) == 2.0


def test_dcp_changed_shard_is_refused_before_reading(dcp_checkpoint):
    path, model, opt = dcp_checkpoint
    _flip(path / "__0_0.distcp")
    with pytest.raises(CheckpointError, match="SHA-256 of __0_0.distcp differs"):
        distributed.load_checkpoint(path, model, opt)


@pytest.mark.parametrize("forged_manifest", [False, True], ids=["no-manifest", "forged-manifest"])
def test_dcp_planted_metadata_runs_no_code(dcp_checkpoint, tmp_path, forged_manifest):
    """A ``.metadata`` that would call ``os.mkdir`` when unpickled: without a manifest
    nothing is read; with a manifest forged to match, the metadata unpickler refuses it."""
    path, model, opt = dcp_checkpoint
    marker = tmp_path / "code-ran"
    (path / "manifest.json").unlink()
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    if forged_manifest:
        checkpoint.write_manifest(path, kind="dcp", world_size=1, step=1, serial=1)
        message = "posix.mkdir is not part of a checkpoint's metadata: refused"
    else:
        message = "has no manifest.json"
    with pytest.raises(CheckpointError, match=message):
        distributed.read_checkpoint_extra(path)
    with pytest.raises(CheckpointError, match=message):
        distributed.load_checkpoint(path, model, opt)
    # A caller that skips the hash check still gets no code run from the metadata.
    with pytest.raises(CheckpointError, match="posix.mkdir is not part of a checkpoint's"):
        distributed.read_checkpoint_extra(path, verify=False)
    assert not marker.exists()


@pytest.mark.parametrize("where", ["extra", "param_groups"])
def test_dcp_data_whose_manifest_matches_runs_no_code(tmp_path, where):
    """DCP's own planner unpickled a checkpoint's non-tensor items (``extra``, the
    optimizer's hyperparameters) with ``weights_only=False``: a data file written with a
    matching manifest ran its code on load. Now they load as data or are refused."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    marker = tmp_path / "code-ran"
    state = distributed._dcp_state(model, opt)
    if where == "extra":
        state["extra"] = Payload(marker)
    else:
        key = next(k for k in state["optim"] if k.startswith("param_groups.") and k.endswith(".lr"))
        state["optim"][key] = Payload(marker)
    path = tmp_path / "evil"
    dcp.save(state, checkpoint_id=path, no_dist=True)
    checkpoint.write_manifest(path, kind="dcp", world_size=1, step=1, serial=1)
    with pytest.raises(CheckpointError, match="holds more than data .*: refused"):
        distributed.load_checkpoint(path, model, opt)
    if where == "extra":
        with pytest.raises(CheckpointError, match="holds more than data"):
            distributed.read_checkpoint_extra(path)
    assert not marker.exists()


def test_dcp_extra_holding_objects_is_one_checkpoint_error(tmp_path):
    """``save_checkpoint(extra={"e": <object>})``: refused on load with torch's own text,
    which suggests ``weights_only=False`` (running the file's code)."""
    model = torch.nn.Linear(8, 4)
    marker = tmp_path / "code-ran"
    distributed.save_checkpoint(tmp_path / "c", model, extra={"e": Payload(marker)})
    for load in (lambda: distributed.load_checkpoint(tmp_path / "c", model),
                 lambda: distributed.read_checkpoint_extra(tmp_path / "c")):  # fmt: skip
        with pytest.raises(CheckpointError, match="extra of the checkpoint holds more than data"):
            load()
    assert not marker.exists()


def test_dcp_metadata_asking_for_a_transform_is_refused(dcp_checkpoint):
    """A ``.metadata`` (manifest to match) naming DCP's zstd stream transform for an item:
    torch reads it back without a bound on what it expands to; save_checkpoint never
    writes one."""
    import dataclasses

    path, model, opt = dcp_checkpoint
    metadata = distributed._read_metadata(str(path))
    index = next(iter(metadata.storage_data))
    info = metadata.storage_data[index]
    if not hasattr(info, "transform_descriptors"):
        pytest.skip("this torch's DCP has no transforms")
    metadata.storage_data[index] = dataclasses.replace(
        info, transform_descriptors=["stream.zstd/1"]
    )
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    checkpoint.write_manifest(path, kind="dcp", world_size=1, step=1, serial=1)
    with pytest.raises(CheckpointError, match="asks for transforms .*stream.zstd"):
        distributed.load_checkpoint(path, model, opt)


def test_dcp_metadata_whose_chunks_cover_part_of_a_tensor_is_refused(dcp_checkpoint):
    """A ``.metadata`` (manifest to match) whose chunk for a weight covers half its rows:
    the load went through, the other half keeping the model's values."""
    import dataclasses

    path, model, opt = dcp_checkpoint
    metadata = distributed._read_metadata(str(path))
    meta = metadata.state_dict_metadata["model.0.weight"]
    (chunk,) = meta.chunks
    half = dataclasses.replace(chunk, sizes=torch.Size([chunk.sizes[0] // 2, chunk.sizes[1]]))
    meta.chunks[0] = half
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    checkpoint.write_manifest(path, kind="dcp", world_size=1, step=1, serial=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    want = r"model.0.weight: its chunks do not cover its \(8, 8\) exactly"
    with pytest.raises(CheckpointError, match=want):
        distributed.load_checkpoint(path, model, opt)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # two chunks that overlap, adding up to the whole, are refused too
    meta.chunks[:] = [half, half]
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    checkpoint.write_manifest(path, kind="dcp", world_size=1, step=1, serial=1)
    with pytest.raises(CheckpointError, match="chunks do not cover"):
        distributed.load_checkpoint(path, model, opt)


def test_a_compressed_torch_archive_is_refused_before_loading(tmp_path):
    """torch.load accepted a torch.save archive rewritten with deflated entries: a 262 KB
    file made it allocate 256 MB (about 1000:1) before any other check."""
    import zipfile

    plain = tmp_path / "plain.pt"
    torch.save({"x": torch.zeros(4096, dtype=torch.uint8)}, plain)
    checkpoint.check_archive_stored(plain, "plain.pt")  # what torch.save writes passes
    packed = tmp_path / "packed.pt"
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(packed, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    assert packed.stat().st_size < plain.stat().st_size
    with pytest.raises(CheckpointError, match="packed.pt holds compressed entries"):
        checkpoint.check_archive_stored(packed, "packed.pt")
    buffer = io.BytesIO(packed.read_bytes())
    buffer.seek(3)
    with pytest.raises(CheckpointError, match="compressed"):
        checkpoint.check_archive_stored(buffer, "it")
    assert buffer.tell() == 3  # (left where it was)


def test_dcp_metadata_pointing_outside_the_checkpoint_is_refused(dcp_checkpoint, tmp_path):
    """A ``.metadata`` (with a manifest to match) placing an item in
    ``../outside.bin`` read a file the manifest never hashed."""
    import dataclasses

    path, model, opt = dcp_checkpoint
    metadata = distributed._read_metadata(str(path))
    index = next(iter(metadata.storage_data))
    info = metadata.storage_data[index]
    metadata.storage_data[index] = dataclasses.replace(info, relative_path="../outside.bin")
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    checkpoint.write_manifest(path, kind="dcp", world_size=1, step=1, serial=1)
    with pytest.raises(CheckpointError, match="places data in '../outside.bin', not a file"):
        distributed.load_checkpoint(path, model, opt)
    with pytest.raises(CheckpointError, match="not a file of the checkpoint"):
        distributed.read_checkpoint_extra(path)


def test_dcp_extra_written_on_a_gpu_comes_back_on_the_cpu(tmp_path, monkeypatch):
    """DCP keeps one rank's copy of ``extra``: a GPU tensor in it (e.g. an LR scheduler's
    state with a tensor lr) must not come back on that rank's GPU on every rank, nor fail
    where that GPU does not exist. Mimicked on the CPU: the tensors are saved tagged as on
    ``cuda:1``, as rank 1 of a GPU run writes them."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    path = tmp_path / "step_0000001"
    extra = {"step": 1, "base_lrs": [torch.tensor(0.25)]}
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:1")
        distributed.save_checkpoint(path, model, opt, extra=extra, step=1)
    for got in (
        distributed.read_checkpoint_extra(path),
        distributed.load_checkpoint(path, model, opt),
    ):
        assert got["step"] == 1
        (lr,) = got["base_lrs"]
        assert lr.device == torch.device("cpu") and lr.item() == 0.25


def test_make_newest_interrupted_leaves_the_checkpoint_whole(tmp_path, monkeypatch):
    """Its temporary manifest was written inside the published checkpoint, and a
    Ctrl-C before the rename left a file the manifest does not list: the checkpoint was
    refused from then on. It goes to the parent and is removed if the write fails."""
    for step in (2, 4):
        make_checkpoint(tmp_path / f"step_000000{step}", step=step)
    old = tmp_path / "step_0000002"

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.make_newest(old)
    monkeypatch.undo()
    checkpoint.verify(old, checkpoint.read_manifest(old))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000002", "step_0000004"]
    assert checkpoint.read_manifest(old).serial == 1  # unchanged


def test_dcp_checkpoint_with_fp8_codes_under_the_moment_names_loads(tmp_path):
    """CoatAdamW once kept FP8 codes under ``exp_avg`` / ``exp_avg_sq`` (torch AdamW's names,
    under which AdamW read them as moments); now ``exp_avg_fp8`` / ``exp_avg_sq_fp8``. A DCP
    checkpoint with the older names still loads, bit for bit."""
    from fp8_optim import CoatAdamW

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 4))
    opt = CoatAdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
    old_names = {"exp_avg_fp8": "exp_avg", "exp_avg_sq_fp8": "exp_avg_sq"}
    opt.register_state_dict_post_hook(
        lambda o, sd: {
            **sd,
            "state": {
                i: {old_names.get(k, k): v for k, v in s.items()} for i, s in sd["state"].items()
            },
        }
    )
    path = tmp_path / "ckpt" / "step_0000002"
    distributed.save_checkpoint(path, model, opt, step=2)
    saved = distributed._saved_metadata(str(path))
    assert "optim.state.0.weight.exp_avg" in saved
    assert "optim.state.0.weight.exp_avg_fp8" not in saved
    want = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()}
    model2 = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 4))
    opt2 = CoatAdamW(model2.parameters(), lr=1e-3)
    distributed.load_checkpoint(path, model2, opt2)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)
        assert opt2.state[q].keys() == want[p].keys()
        for k, v in want[p].items():
            got = opt2.state[q][k]
            if v.element_size() == 1:  # (FP8 codes: compared as bytes)
                got, v = got.view(torch.uint8), v.view(torch.uint8)
            assert torch.equal(got, v), k


class _Killed(BaseException):
    """A save stopped at a fault-injection point, as a kill would stop it."""


@pytest.mark.parametrize("then", ["recover", "settle", "save-again"])
def test_a_save_killed_while_replacing_a_checkpoint_of_any_name_loses_neither(
    tmp_path, monkeypatch, then
):
    """A save over an existing ``ckpt/latest`` killed between its two renames left the old
    checkpoint in the trash and the new one complete in ``latest.partial``; ``recover``
    published only ``step_<n>`` names and deleted the trash (neither checkpoint left), and the
    next save deleted the complete ``.partial`` as stale. Now the new one is published."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = tmp_path / "ckpt" / "latest"
    distributed.save_checkpoint(path, model, opt, extra={"step": 1}, step=1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()

    def kill_at(stage):
        if stage == "replace:trash":
            raise _Killed

    monkeypatch.setattr(checkpoint, "_reached", kill_at)
    with pytest.raises(_Killed):
        distributed.save_checkpoint(path, model, opt, extra={"step": 2}, step=2)
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match=r"<path>\.partial: .*settle\(path\)"):
        distributed.load_checkpoint(path, model, opt)
    if then == "recover":
        checkpoint.recover(path.parent)
    elif then == "settle":
        checkpoint.settle(path)
    else:
        distributed.save_checkpoint(path, model, opt, extra={"step": 3}, step=3)
    assert sorted(p.name for p in path.parent.iterdir()) == ["latest"]
    want = {"step": 3} if then == "save-again" else {"step": 2}
    assert distributed.load_checkpoint(path, model, opt) == want
