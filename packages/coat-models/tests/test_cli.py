"""coat-train end to end on CPU: compare table, metrics, plot, resume, bad input."""

import importlib.util
import io
import json
import os
import shutil

import coat_models
import numpy as np
import pytest
import torch
from coat_models.train import cli, jobs, outdir
from coat_models.train.presets import PRESETS, preset_config
from coat_models.train.trainer import Trainer

# Small enough for seconds per run on CPU; the tiny preset's shape.
FAST = "--preset tiny --batch-size 4 --seq-len 64 --eval-batches 2 --corpus-mib 1 --no-progress"
FAST = FAST.split()


def run(argv, capsys):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_run_dir(out, mode, steps, eval_every):
    recs = read_jsonl(out / mode / "metrics.jsonl")
    train = [r for r in recs if r["type"] == "train"]
    evals = [r for r in recs if r["type"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert [r["step"] for r in evals] == list(range(eval_every, steps + 1, eval_every))
    assert all(
        r["mode"] == mode and np.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in train
    )
    summary = json.loads((out / mode / "summary.json").read_text())
    assert summary["val_loss"] == evals[-1]["val_loss"]
    assert summary["train_loss"] == pytest.approx(np.mean([r["loss"] for r in train[-10:]]))
    return train, evals, summary


HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def check_plot(out, stdout, n_runs):
    """loss.png with one line colour per run (matplotlib's C0, C1, ...) where matplotlib is
    installed; else no picture and the one line that says how to get it."""
    png = out / "loss.png"
    summary = json.loads((out / "summary.json").read_text())
    if not HAS_MATPLOTLIB:
        assert not png.exists() and summary["plot"] is None
        assert "loss curves: not drawn, matplotlib is not installed: pip install" in stdout
        return
    from matplotlib import colors, image

    assert f"loss curves: {png}" in stdout and summary["plot"] == str(png)
    img = image.imread(io.BytesIO(png.read_bytes()))
    assert img.shape == (560, 900, 4)
    rgb = np.round(img[..., :3] * 255).astype(int).reshape(-1, 3)
    for i in range(n_runs):
        colour = np.round(np.array(colors.to_rgb(f"C{i}")) * 255).astype(int)
        assert (rgb == colour).all(axis=1).sum() > 50  # a line of this run's colour (0 if none)


@pytest.mark.parametrize("modes", ["bf16", "bf16,coat"])
def test_end_to_end(tmp_path, capsys, modes):
    out = tmp_path / "run"
    argv = ["--compare", modes, "--steps", "6", "--eval-every", "3", "--out", out, *FAST]
    code, stdout, stderr = run(argv, capsys)
    assert code == 0, stderr
    names = modes.split(",")
    for mode in names:
        check_run_dir(out, mode, steps=6, eval_every=3)
    check_plot(out, stdout, len(names))
    summary = json.loads((out / "summary.json").read_text())
    assert [r["mode"] for r in summary["runs"]] == names
    # what each run used, preset defaults filled in (args say None for those)
    tiny = PRESETS["tiny"]
    assert summary["args"]["lr"] is None and summary["args"]["warmup"] is None
    # the data options as given too (they were filled in, beside an internal flag)
    assert summary["args"]["corpus_mib"] == 1 and summary["args"]["data_dtype"] is None
    assert summary["args"]["val_fraction"] is None and "data_dtype_given" not in summary["args"]
    for r in summary["runs"]:
        assert r["config"]["lr"] == tiny.lr and r["config"]["warmup"] == tiny.warmup
        assert (r["config"]["batch_size"], r["config"]["seq_len"], r["config"]["steps"]) == (
            4,
            64,
            6,
        )
    # the table: one column per mode, the rows of the brief, the plot's path
    header = next(line for line in stdout.splitlines() if "(fp32 master)" in line)
    assert all(f"{m} (fp32 master)" in header for m in names)
    rows = ["train loss", "val loss", "tokens/s", "peak memory", "weights", "gradients"]
    for row in [*rows, "optimizer state", "activations (saved for backward)"]:
        assert row in stdout
    if len(names) == 2:
        assert "coat/bf16" in header
        mem = [r["memory"] for r in summary["runs"]]
        assert mem[1]["optimizer_state"] < mem[0]["optimizer_state"] / 3  # FP8 m and v
        assert mem[1]["activations"] < mem[0]["activations"]


@pytest.mark.slow
def test_compile_trains_the_modes_with_compiled_layers(tmp_path, capsys, monkeypatch):
    """--compile: every mode's decoder layers go through compile_layers (here with the
    aot_eager backend, the traced graph as it is: the same losses and final weights as eager
    on the CPU, fp32 master weights under autocast), the header says so, and summary.json
    records it per mode."""
    import coat_models.train.trainer as trainer
    from safetensors.torch import load_file

    compiled = []

    def compile_layers(model):
        compiled.append(model)
        return coat_models.compile_layers(model, backend="aot_eager")

    monkeypatch.setattr(trainer, "compile_layers", compile_layers)
    argv = ["--compare", "bf16,coat", "--steps", "4", "--eval-every", "4", *FAST]
    code, stdout, stderr = run([*argv, "--compile", "--out", tmp_path / "c"], capsys)
    assert code == 0, stderr
    assert len(compiled) == 2 and "torch.compile on (each decoder layer)" in stdout
    code, _, stderr = run([*argv, "--out", tmp_path / "e"], capsys)
    assert code == 0, stderr
    for mode in ("bf16", "coat"):
        c_train, _, c_sum = check_run_dir(tmp_path / "c", mode, steps=4, eval_every=4)
        e_train, _, e_sum = check_run_dir(tmp_path / "e", mode, steps=4, eval_every=4)
        assert [r["loss"] for r in c_train] == [r["loss"] for r in e_train]
        assert c_sum["compile"] is True and e_sum["compile"] is False
        # The weights after the last step: every step's gradients and update, bit for bit.
        c_w, e_w = (
            load_file(d / mode / "final/model.safetensors")
            for d in (tmp_path / "c", tmp_path / "e")
        )
        assert c_w.keys() == e_w.keys() and all(torch.equal(c_w[k], e_w[k]) for k in c_w)
    torch._dynamo.reset()


@pytest.mark.slow
def test_activation_checkpointing_prints_no_cache_notices(tmp_path):
    """transformers' notices that checkpointed layers drop use_cache and the cache are
    expected (the training forward passes a cache that keeps nothing): coat-train's stderr
    had two such lines with --activation-checkpointing. They go, other messages stay."""
    import logging
    import subprocess
    import sys

    from coat_models.train.trainer import _ExpectedCacheNotices

    argv = ["--mode", "coat", "--activation-checkpointing", "--steps", "2", *FAST]
    cmd = [sys.executable, "-m", "coat_models.train.cli", *argv, "--out", str(tmp_path / "o")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "incompatible with gradient checkpointing" not in done.stderr, done.stderr

    def kept(message):
        record = logging.LogRecord("transformers", logging.WARNING, "", 0, message, None, None)
        return _ExpectedCacheNotices().filter(record)

    assert not kept(
        "Caching is incompatible with gradient checkpointing in X. Setting `cache=None`."
    )
    assert kept("Some weights of the model checkpoint were not used")


@pytest.mark.slow
def test_compile_with_activation_checkpointing_keeps_eager_bits(tmp_path, capsys, monkeypatch):
    """--compile --activation-checkpointing (refused before): transformers' checkpointing
    runs each compiled layer forward again in backward; losses and final weights are those of
    the eager checkpointed run, bit for bit (aot_eager backend, CPU)."""
    import coat_models.train.trainer as trainer
    from safetensors.torch import load_file

    def compile_layers(model):
        return coat_models.compile_layers(model, backend="aot_eager")

    monkeypatch.setattr(trainer, "compile_layers", compile_layers)
    argv = ["--mode", "coat", "--activation-checkpointing", "--steps", "3", "--eval-every", "3"]
    counters = torch._dynamo.utils.counters
    torch._dynamo.reset()
    counters.clear()
    code, stdout, stderr = run([*argv, *FAST, "--compile", "--out", tmp_path / "c"], capsys)
    assert code == 0, stderr
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    code, _, stderr = run([*argv, *FAST, "--out", tmp_path / "e"], capsys)
    assert code == 0, stderr
    c_train, _, _ = check_run_dir(tmp_path / "c", "coat", steps=3, eval_every=3)
    e_train, _, _ = check_run_dir(tmp_path / "e", "coat", steps=3, eval_every=3)
    assert [r["loss"] for r in c_train] == [r["loss"] for r in e_train]
    c_w, e_w = (load_file(tmp_path / d / "coat/final/model.safetensors") for d in "ce")
    assert c_w.keys() == e_w.keys() and all(torch.equal(c_w[k], e_w[k]) for k in c_w)
    torch._dynamo.reset()


@pytest.mark.slow
def test_compile_with_gradient_accumulation_reads_the_weight_cache(tmp_path, capsys, monkeypatch):
    """--compile --grad-accum 2 keeps the FP8 weight cache, as eager does: each compiled
    layer gets its weights' cached copies as inputs, refreshed in one launch on the first
    micro-batch of a step only, and casts no weight itself; losses and final weights are
    eager's, bit for bit (aot_eager backend, CPU)."""
    import coat_models.train.trainer as trainer
    import fp8_quant.ops
    import fp8_quant.reference
    from safetensors.torch import load_file

    def compile_layers(model):
        return coat_models.compile_layers(model, backend="aot_eager")

    monkeypatch.setattr(trainer, "compile_layers", compile_layers)
    argv = ["--mode", "coat", "--grad-accum", "2", "--steps", "3", "--eval-every", "3", *FAST]
    code, _, stderr = run([*argv, "--out", tmp_path / "e"], capsys)
    assert code == 0, stderr
    casts = []  # (tensors, rows, columns) of each multi-tensor cast

    def spy(real):
        def call(xs, fmt, amaxes, row, col):
            casts.append((len(xs), row, col))
            return real(xs, fmt, amaxes, row, col)

        return call

    for module in (fp8_quant.ops, fp8_quant.reference):
        real = module.quantize_per_tensor_multi
        monkeypatch.setattr(module, "quantize_per_tensor_multi", spy(real))
    counters = torch._dynamo.utils.counters
    torch._dynamo.reset()
    counters.clear()
    code, stdout, stderr = run([*argv, "--compile", "--out", tmp_path / "c"], capsys)
    assert code == 0, stderr
    assert "FP8 weight cache on" in stdout
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]

    # Both layouts of a layer's seven weights, once a step per layer; no weight cast alone
    # (a layer's backward also quantizes q, k, v's or gate, up's gradients together, eagerly).
    weights = [c for c in casts if c not in ((2, True, True), (3, True, True))]
    assert weights == [(7, True, True)] * (3 * PRESETS["tiny"].layers)
    c_train, _, c_sum = check_run_dir(tmp_path / "c", "coat", steps=3, eval_every=3)
    e_train, _, _ = check_run_dir(tmp_path / "e", "coat", steps=3, eval_every=3)
    assert c_sum["fp8_weight_cache"] is True
    assert [r["loss"] for r in c_train] == [r["loss"] for r in e_train]
    c_w, e_w = (load_file(tmp_path / d / "coat/final/model.safetensors") for d in "ce")
    assert c_w.keys() == e_w.keys() and all(torch.equal(c_w[k], e_w[k]) for k in c_w)
    torch._dynamo.reset()


@pytest.mark.slow
def test_tiny_preset_learns_quickly(tmp_path, capsys):
    """The demo's preset and batch at half its sequence length (64 tokens, half the time): a
    clear drop of the loss in 30 CPU steps."""
    argv = "--preset tiny --steps 30 --eval-every 30 --corpus-mib 2 --seq-len 64".split()
    code, stdout, stderr = run([*argv, "--out", tmp_path], capsys)
    assert code == 0, stderr
    train, evals, _ = check_run_dir(tmp_path, "bf16", steps=30, eval_every=30)
    assert train[0]["loss"] > 5.5  # ln(320) = 5.77 at init
    assert evals[-1]["val_loss"] < 3.6
    # progress lines on stderr (not a terminal: every 10% of the steps)
    lines = [line for line in stderr.splitlines() if line.startswith("[bf16]")]
    assert len(lines) == 10 and "30/30" in lines[-1] and "tok/s" in lines[-1]


def interrupt_before(step):
    """A Trainer.queue_step that raises KeyboardInterrupt before optimizer step ``step``."""
    orig = Trainer.queue_step

    def queue_step(trainer, *args, **kwargs):
        if trainer.step + 1 == step:
            raise KeyboardInterrupt
        return orig(trainer, *args, **kwargs)

    return queue_step


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_sigterm_stops_like_ctrl_c(name, tmp_path, capsys, monkeypatch):
    """SIGTERM (a job scheduler, docker stop) and SIGHUP (the terminal closed) end the run as
    Ctrl-C does: the steps done are logged and the message names the checkpoints; exit 128 +
    the signal's number. They killed the process before, losing the queued steps."""
    import os
    import signal

    sig = getattr(signal, name)
    orig = Trainer.queue_step

    def queue_step(trainer, *args, **kwargs):
        if trainer.step + 1 == 4:
            os.kill(os.getpid(), sig)
        return orig(trainer, *args, **kwargs)

    before = signal.getsignal(sig)
    monkeypatch.setattr(Trainer, "queue_step", queue_step)
    code, _, err = run(["--steps", "6", "--log-every", "10", *FAST, "--out", tmp_path], capsys)
    assert code == 128 + sig and "Traceback" not in err
    # it said "completed checkpoints (if any) are under": there are none, and why
    assert err.endswith(
        f"terminated; no checkpoint was written to {tmp_path} (--save-every N writes them)\n"
    )
    assert [r["step"] for r in read_jsonl(tmp_path / "bf16" / "metrics.jsonl")] == [1, 2, 3]
    assert signal.getsignal(sig) is before  # restored


def test_token_ids_no_tokenizer_has_are_refused(tmp_path, capsys):
    """Ids up to 5M (a misread file) sized the model's vocabulary to 5M: the memory check,
    which counts weights, gradients and optimizer state, passed it, and the kernel's OOM
    killer ended the run without a word. Refused up front, naming --data-dtype; an explicit
    --vocab-size is taken at its word (the memory check then applies). Here ids up to 1.1M,
    which a machine of this test's size trains (before: it did, on a 1.1M-row embedding)."""
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(5000) * 220)
    argv = ["--data", ids, "--steps", 2, "--batch-size", 2, "--seq-len", 16, "--no-progress"]
    code, _, err = run([*argv, "--out", tmp_path / "o"], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "the data's largest token id is 1,099,780: no tokenizer has so many tokens" in err
    assert "--data-dtype" in err and "--vocab-size 1099840" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("mode", "master", "hint"),
    [
        (
            "bf16",
            "fp32",
            ": choose a smaller model, or --mode coat (or coat-optim) with --master-dtype bf16\n",
        ),
        (
            "coat-act",
            "fp32",
            ": choose a smaller model, or --mode coat (or coat-optim) with --master-dtype bf16\n",
        ),
        ("coat", "fp32", ": choose a smaller model, or --master-dtype bf16\n"),
        ("coat", "bf16", ": choose a smaller model\n"),
    ],
)
def test_a_model_too_large_is_told_only_what_is_not_in_effect(
    mode, master, hint, tmp_path, capsys, monkeypatch
):
    """The memory check told a COAT run with bf16 masters to use a COAT mode with
    --master-dtype bf16: what it had."""
    import os

    real = os.sysconf
    pages = {"SC_PHYS_PAGES": 2**30 // real("SC_PAGE_SIZE")}  # a machine of 1 GiB
    monkeypatch.setattr(os, "sysconf", lambda name: pages.get(name) or real(name))
    argv = ["--preset", "350m", "--mode", mode, "--master-dtype", master, "--steps", 1]
    code, _, err = run([*argv, "--corpus-mib", 1, "--out", tmp_path], capsys)
    assert code == 2 and "needs at least" in err and err.endswith(hint), err


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler during the test, whatever the test process inherited: a
    runner started as a background job or under nohup ignores SIGINT, which coat-train then
    keeps ignored (``test_a_signal_ignored_at_start_stays_ignored``), so a test that delivers
    Ctrl-C by calling the handler would find nothing to call."""
    import signal

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.usefixtures("python_sigint")
def test_a_signal_python_drops_still_stops_the_run(tmp_path, capsys, monkeypatch):
    """Ctrl-C whose KeyboardInterrupt lands in a ``__del__`` (the memory tracker's records),
    where Python prints and drops it: the run still stops as interrupted (exit 130) after
    the micro-batch it landed in (that step is not applied), the steps done logged, instead of
    training to the end and exiting 0."""
    import signal

    orig = Trainer.queue_step

    class DropsIt:
        def __del__(self):  # what Python does with a signal's exception raised here
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)

    def queue_step(trainer, *args, **kwargs):
        if trainer.step + 1 == 4:
            DropsIt()  # freed at once: the interrupt is raised and dropped
        return orig(trainer, *args, **kwargs)

    monkeypatch.setattr(Trainer, "queue_step", queue_step)
    argv = ["--steps", "8", "--log-every", "10", "--save-every", "2", *FAST, "--out", tmp_path]
    code, _, err = run(argv, capsys)
    assert code == 130 and err.endswith(
        f"interrupted; completed checkpoints are under {tmp_path}: run the same command with "
        "--resume to continue from the newest\n"
    ), err
    assert [r["step"] for r in read_jsonl(tmp_path / "bf16" / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.usefixtures("python_sigint")
def test_a_signal_python_drops_prints_no_traceback(monkeypatch):
    """The interrupt dropped in a ``__del__`` is recorded, so Python's "Exception ignored
    in ..." traceback is not printed for it (Ctrl-C during a save printed one); another
    exception raised in a ``__del__`` is still reported."""
    import signal
    import sys

    from coat_models.train import interrupt

    reported = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reported.append(type(u.exc_value)))

    class DropsIt:
        def __init__(self, raise_):
            self.raise_ = raise_

        def __del__(self):
            self.raise_()

    def interrupt_me():
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)

    def fail():
        raise ValueError("a bug")

    with interrupt.handled():
        DropsIt(interrupt_me)
        assert interrupt.pending() is KeyboardInterrupt
        DropsIt(fail)
    assert reported == [ValueError]
    DropsIt(interrupt_me)  # outside: Python's own handler raises, the hook reports it
    assert reported == [ValueError, KeyboardInterrupt]


_SIGNALLED = """
import os, resource, signal, sys, time, torch
from coat_models.train import interrupt
# As in a terminal's foreground: a suite started in the background (bash's '&') passes on
# an ignored SIGINT, which Python and coat-train then leave ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)
torch.set_num_threads(1)
a = torch.randn(6000, 6000, dtype=torch.float64)
if sys.argv[1] == "native-high-fds":  # the watchdog's pipe beyond select's 1024 fds
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 2048)), hard))
    held = [open(os.devnull) for _ in range(1100)]


def answering(seconds):  # Python answers every signal for that long (any bytecode may raise)
    end = time.monotonic() + seconds
    while True:
        try:
            while time.monotonic() < end:
                time.sleep(0.01)
            return
        except KeyboardInterrupt:
            continue


with interrupt.handled("test: a second signal ({signal})"):
    if sys.argv[1] == "answered-then-native":  # one signal Python answers, then stuck
        try:
            signal.raise_signal(signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            pass
    if sys.argv[1] == "native-forked" and os.fork() == 0:
        try:  # a forked child that answers its Ctrl-C (as a data loader's worker would)
            time.sleep(30)
        except KeyboardInterrupt:
            pass
        os._exit(0)
    if sys.argv[1] == "own-handler":  # code inside sets a handler of its own
        signal.signal(signal.SIGINT, lambda signum, frame: print("own", flush=True))
    print("ready", flush=True)
    if sys.argv[1] in ("mashed", "own-handler"):
        answering(3)
    else:
        a @ a  # one native operation of seconds: no bytecode in between
        print("finished", flush=True)
if sys.argv[1] == "mashed":
    print("answered", len(interrupt._PENDING) == 0, flush=True)  # cleared on exit
    with interrupt.handled():  # a later stretch: no watchdog of the first one kills it
        time.sleep(2 * interrupt._Watchdog.GRACE_S)
print("orderly", flush=True)
"""


def _signalled(mode: str, sig, count=2, gap=0.3) -> tuple:
    """``_SIGNALLED``'s ``mode`` in a child process sent ``count`` signals ``gap`` s apart
    once ready: (status, out, err)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    child = subprocess.Popen(
        [sys.executable, "-c", _SIGNALLED, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert child.stdout.readline() == "ready\n"
        for _ in range(count):
            time.sleep(gap)
            os.killpg(child.pid, sig)  # its process group: a forked child's too
        out, err = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
            child.wait()
    return child.returncode, out, err


@pytest.mark.parametrize(
    "name,mode",
    [
        ("SIGINT", "native"),
        ("SIGTERM", "native"),
        ("SIGINT", "answered-then-native"),
        ("SIGINT", "native-high-fds"),
        ("SIGINT", "native-forked"),
    ],
)
@pytest.mark.slow
def test_a_second_signal_stops_a_run_stuck_in_one_native_operation(name, mode):
    """Python runs a signal's handler between bytecodes only: inside one long torch operation
    Ctrl-C waited for it to end (a helper's CLI probe: minutes). Two signals Python has not
    answered within a second end the process at once with the signal's exit status and a
    line saying so (fails before: the matmul ran on). Reviews found it disarmed after an
    earlier signal Python did answer, with its pipe at fd 1024 or above (select), and when a
    forked child answered into the shared pipe."""
    import signal

    sig = getattr(signal, name)
    code, out, err = _signalled(mode, sig)
    assert code == 128 + sig, (out, err)
    assert "finished" not in out
    assert err.strip().splitlines()[-1] == f"test: a second signal ({name})"


@pytest.mark.slow
def test_signals_that_python_answers_are_left_to_python():
    """Ctrl-C pressed many times while Python answers each (the usual case): every one is an
    ordinary KeyboardInterrupt, the watchdog ends nothing, and it is gone once its
    ``handled()`` ends (a review: a watchdog left behind killed a later stretch). Signals
    that a handler set over coat-train's takes are not the watchdog's."""
    import signal

    code, out, err = _signalled("mashed", signal.SIGINT, count=8, gap=0.02)
    assert (code, out.splitlines()[-2:]) == (0, ["answered True", "orderly"]), err
    assert "second signal" not in err
    # a handler set over coat-train's answers no signal to the watchdog: not counted (a
    # review: two signals it handled at once killed the process)
    code, out, err = _signalled("own-handler", signal.SIGINT, count=3, gap=0.2)
    assert (code, out.splitlines()) == (0, ["own", "own", "own", "orderly"]), (out, err)


def test_the_earlier_wakeup_fd_comes_back_or_none():
    """The wakeup fd set before ``handled()`` is set again after it; one closed meanwhile
    leaves none (it left the watchdog's closed pipe, where later signals' bytes could land
    in whatever file reused the number)."""
    import os
    import signal

    from coat_models.train import interrupt

    r, w = os.pipe()
    os.set_blocking(w, False)
    before = signal.set_wakeup_fd(w)
    try:
        with interrupt.handled():
            ours = signal.set_wakeup_fd(-1)
            signal.set_wakeup_fd(ours)
            assert ours not in (-1, w)  # the watchdog's pipe
        assert signal.set_wakeup_fd(w) == w
        with interrupt.handled():
            os.close(w)
        assert signal.set_wakeup_fd(-1) == -1
    finally:
        os.close(r)
        signal.set_wakeup_fd(before)


def test_a_signal_ignored_at_start_stays_ignored():
    """Started with SIGINT ignored (nohup, a shell's background job), the run does not take
    Ctrl-C meant for the terminal's foreground job: the handler is left as it was; SIGTERM
    is handled. Both handlers come back afterwards."""
    import signal

    from coat_models.train import interrupt

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupt.handled():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is interrupt._handler
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.usefixtures("python_sigint")
def test_a_dropped_signal_stops_the_run_after_the_micro_batch(tmp_path, capsys, monkeypatch):
    """Ctrl-C that lands where Python drops it (a ``__del__``: the memory tracker's records)
    is recorded and raised after the micro-batch it landed in, not only after the step: with
    a large --grad-accum a step is long, and the run looked deaf to Ctrl-C (exit 130, no
    further micro-batch)."""
    import signal

    from coat_models.train import trainer

    calls = []
    real_pinned = trainer.pinned

    class DropsIt:
        def __del__(self):
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)

    def pinned(t, device):
        calls.append(1)
        if len(calls) == 1:
            DropsIt()  # the interrupt is raised inside __del__ and dropped there
        return real_pinned(t, device)

    monkeypatch.setattr(trainer, "pinned", pinned)
    argv = ["--steps", "2", "--grad-accum", "50", *FAST, "--out", tmp_path]
    code, _, err = run(argv, capsys)
    assert code == 130 and "interrupted" in err
    assert 0 < len(calls) <= 4  # the first micro-batch's tensors (inputs, labels), no more


@pytest.mark.usefixtures("python_sigint")
def test_a_signal_inside_torch_save_is_an_interrupt_not_a_full_disk(tmp_path, capsys, monkeypatch):
    """Ctrl-C while a checkpoint is written: torch.save's writer turns the interrupt into a
    RuntimeError ("unexpected pos"), which read as a full disk (exit 1). It is reported as
    the interrupt (exit 130), and no checkpoint of that step is left."""
    import signal

    from coat_models import checkpoint

    real_save = torch.save

    def save(obj, f):
        try:
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
        except KeyboardInterrupt:  # as torch's C++ writer catches it
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . unexpected pos"
            ) from None
        return real_save(obj, f)

    monkeypatch.setattr(checkpoint.torch, "save", save)
    code, _, err = run(["--steps", "4", "--save-every", "2", *FAST, "--out", tmp_path], capsys)
    assert code == 130 and "interrupted" in err and "bytes free" not in err
    assert not list((tmp_path / "bf16").glob("checkpoints/step_*"))


def test_an_interrupted_rerun_leaves_no_earlier_report(tmp_path, capsys, monkeypatch):
    """Training again into an --out whose run finished drops that run's summary.json and
    loss.png first: a rerun stopped half-way left them describing the old run beside the
    new run's files."""
    args = ["--steps", "2", *FAST, "--out", tmp_path]
    code, *_ = run(args, capsys)
    assert code == 0 and (tmp_path / "summary.json").is_file()
    with monkeypatch.context() as m:
        m.setattr(Trainer, "queue_step", interrupt_before(2))
        code, *_ = run(args, capsys)
    assert code == 130
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "loss.png").exists()


@pytest.mark.parametrize(
    "mode,master,accum,device",
    [
        ("bf16", "fp32", 2, "cpu"),
        ("coat", "fp32", 1, "cpu"),
        ("coat", "bf16", 1, "cpu"),
        # On a GPU the checkpoint's RNG states are read back onto the CPU (a CUDA tensor
        # there failed every resume); with CUDA graphs (the default) and eagerly.
        pytest.param("coat", "fp32", 2, "cuda", marks=pytest.mark.gpu),
        pytest.param("coat", "fp32", 2, "cuda --no-cuda-graphs", marks=pytest.mark.gpu),
    ],
    ids=["bf16-accum2", "coat", "coat-bf16-master", "cuda-graphs", "cuda-eager"],
)
@pytest.mark.slow
def test_resume_reproduces_losses_bit_for_bit(
    tmp_path, capsys, monkeypatch, mode, master, accum, device
):
    flags = f"--mode {mode} --master-dtype {master} --steps 4 --grad-accum {accum}"
    flags += f" --device {device}"
    args = [*flags.split(), "--eval-every", "2", "--save-every", "2", *FAST]
    code, *_ = run([*args, "--out", tmp_path / "a"], capsys)
    assert code == 0
    # B: killed before step 4 (after the step-2 checkpoint and a logged step 3), resumed.
    with monkeypatch.context() as m:
        m.setattr(Trainer, "queue_step", interrupt_before(4))
        code, _, err = run([*args, "--out", tmp_path / "b"], capsys)
    assert code == 130 and "interrupted" in err
    ckpts = tmp_path / "b" / mode / "checkpoints"
    assert [p.name for p in ckpts.iterdir()] == ["step_0000002"]
    assert len(read_jsonl(tmp_path / "b" / mode / "metrics.jsonl")) == 4  # steps 1-3, eval 2
    code, _, err = run([*args, "--out", tmp_path / "b", "--resume"], capsys)
    assert code == 0, err
    a = read_jsonl(tmp_path / "a" / mode / "metrics.jsonl")
    b = read_jsonl(tmp_path / "b" / mode / "metrics.jsonl")
    key = lambda r: (
        r["type"],
        r["step"],
        r.get("loss"),
        r.get("val_loss"),
        r.get("lr"),
        r.get("grad_norm"),
    )
    assert [key(r) for r in a] == [key(r) for r in b]  # exact floats, no duplicated steps
    sa = torch.load(tmp_path / "a" / mode / "checkpoints" / "step_0000004" / "model.pt")
    sb = torch.load(ckpts / "step_0000004" / "model.pt")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_header_says_when_the_presets_warmup_spans_the_run(tmp_path, capsys):
    args = [*FAST, "--steps", 3, "--eval-batches", 1, "--no-export"]
    code, out, err = run([*args, "--out", tmp_path / "a"], capsys)  # tiny: warmup 10
    assert code == 0, err
    assert "the preset's LR warmup (10 steps) spans the run" in out.splitlines()[0]
    code, out, err = run([*args, "--warmup", 2, "--out", tmp_path / "b"], capsys)
    assert code == 0, err
    assert "LR warmup" not in out
    # --model-dir has no preset: its defaults are 125m's (warmup 100); it said "the preset's"
    preset_config("tiny", data_vocab=257).save_pretrained(tmp_path / "config")
    args = [a for a in args if a not in ("--preset", "tiny")]
    code, out, err = run(
        [*args, "--model-dir", tmp_path / "config", "--out", tmp_path / "c"], capsys
    )
    assert code == 0, err
    assert "; --model-dir's default LR warmup (100 steps) spans the run" in out.splitlines()[0]


def test_a_one_step_run_inside_the_presets_warmup_says_it_trains_nothing(tmp_path, capsys):
    """Warmup's first step has LR 0: with the preset's warmup, --steps 1 exited 0 with the
    untrained weights as its model, its note saying only that the LR stays below --lr."""
    args = [*FAST, "--steps", 1, "--eval-batches", 1, "--no-export", "--mode", "bf16"]
    code, out, err = run([*args, "--out", tmp_path / "a"], capsys)
    assert code == 0, err
    note = "the preset's LR warmup (10 steps) spans the run: its one step has LR 0 and leaves "
    assert note + "the weights as they were (set --warmup 0)" in out.splitlines()[0]
    assert [r["lr"] for r in read_jsonl(tmp_path / "a/bf16/metrics.jsonl") if "lr" in r] == [0.0]
    code, out, err = run([*args, "--warmup", 0, "--out", tmp_path / "b"], capsys)
    assert code == 0, err
    assert "LR warmup" not in out
    assert [r["lr"] for r in read_jsonl(tmp_path / "b/bf16/metrics.jsonl") if "lr" in r] == [3e-3]


def test_header_says_when_the_validation_split_is_shorter_than_eval_batches(tmp_path, capsys):
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 256, 20_000, dtype=np.int64))
    fast = [a for a in FAST if a not in ("--corpus-mib", "1")]
    args = [*fast, "--data", ids, "--steps", 1, "--no-export", "--mode", "bf16"]
    code, out, err = run([*args, "--out", tmp_path / "a"], capsys)
    assert code == 0, err
    assert "validation:" not in out
    # 5% of 20,000 tokens: 15 windows of 64, in batches of 4: 4 batches, the last of 3
    want = "; validation: 15 sequences in 4 batches, all the split holds (--eval-batches {} x"
    for asked in (1000, 4):  # (4: the short last batch went without a word)
        code, out, err = run([*args, "--eval-batches", asked, "--out", tmp_path / "b"], capsys)
        assert code == 0, err
        assert want.format(asked) + f" --batch-size 4 asks for {4 * asked})" in out.splitlines()[0]
    code, out, err = run([*args, "--eval-batches", 3, "--out", tmp_path / "c"], capsys)
    assert code == 0, err
    assert "validation:" not in out.splitlines()[0]


def test_validation_note_counts_in_the_singular():
    """One sequence in one batch is said so ("1 sequences in 1 batches" before)."""
    from types import SimpleNamespace

    from coat_models.train import cli
    from coat_models.train.trainer import TrainConfig

    job = SimpleNamespace(tasks=[SimpleNamespace(val=[torch.zeros(1, 8, dtype=torch.long)])])
    note = cli._val_note(job, TrainConfig(eval_batches=2, batch_size=4))
    assert note.startswith("; validation: 1 sequence in 1 batch, all the split holds ("), note


@pytest.mark.parametrize(
    ("every", "want"), [(2, ["step_0000002", "step_0000003"]), (9, ["step_0000003"])]
)
def test_last_step_is_checkpointed(tmp_path, capsys, every, want):
    # before: step 3 was not saved (every 2), nothing was (every 9)
    args = ["--steps", 3, "--save-every", every, "--eval-every", 3, "--out", tmp_path, *FAST]
    code, _, err = run(args, capsys)
    assert code == 0, err
    saved = sorted(p.name for p in (tmp_path / "bf16" / "checkpoints").iterdir())
    assert saved == want


def test_checkpoints_are_atomic(tmp_path, capsys, monkeypatch):
    args = ["--steps", 4, "--save-every", 2, "--eval-every", 4, "--out", tmp_path, *FAST]
    calls = []

    def failing_save(obj, f, *a, **k):
        calls.append(1)
        if len(calls) == 2:  # the second file of the first checkpoint
            raise OSError("disk full")
        return torch_save(obj, f, *a, **k)

    torch_save = torch.save
    monkeypatch.setattr(torch, "save", failing_save)
    code, _, err = run(args, capsys)  # one line, no traceback
    assert code == 1 and err.strip() == "coat-train: error: disk full", err
    ckpts = tmp_path / "bf16" / "checkpoints"
    # the half-written directory is removed at once (its files would keep the space)
    assert not list(ckpts.iterdir())
    monkeypatch.setattr(torch, "save", torch_save)
    # no checkpoint was written: no resume point
    code, _, err = run([*args, "--resume"], capsys)
    assert code == 0, err
    assert "no checkpoint" in err
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_0000002", "step_0000004"]
    files = sorted(p.name for p in (ckpts / "step_0000004").iterdir())
    assert files == ["manifest.json", "model.pt", "optimizer.pt", "trainer.pt"]


def _inputs(tmp_path) -> dict:
    """The files the bad-input cases name, by placeholder."""
    from transformers import (
        BertConfig,
        CamembertConfig,
        GPT2Config,
        RobertaConfig,
        T5Config,
        WhisperConfig,
        XLMRobertaConfig,
    )

    paths = {name: tmp_path / name for name in ("ids.npy", "empty.bin", "empty.txt", "a_file")}
    np.save(paths["ids.npy"], np.arange(5000, dtype=np.int32))
    paths["empty.bin"].write_bytes(b"")
    paths["empty.txt"].write_bytes(b"")
    paths["a_file"].write_text("not a directory")
    config = preset_config("tiny", data_vocab=257)
    for name in ("bad_weights", "bad_tokenizer", "gpt2", "no_manifest", "bad_manifest"):
        paths[name] = tmp_path / name
    config.save_pretrained(paths["bad_weights"])
    (paths["bad_weights"] / "model.safetensors").write_bytes(b"\x08" + b"garbage" * 9)
    paths["bad_bin"] = tmp_path / "bad_bin"
    config.save_pretrained(paths["bad_bin"])
    (paths["bad_bin"] / "pytorch_model.bin").write_bytes(b"garbage" * 9)
    config.save_pretrained(paths["bad_tokenizer"])
    (paths["bad_tokenizer"] / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=320).save_pretrained(paths["gpt2"])
    # config.json values that crashed with tracebacks or gave advice coat-train cannot take
    paths["pad"] = tmp_path / "pad"
    pad = preset_config("tiny", data_vocab=257)
    pad.pad_token_id = 400
    pad.save_pretrained(paths["pad"])
    paths["t5"] = tmp_path / "t5"
    T5Config(vocab_size=320, d_model=32, num_layers=1, num_heads=2).save_pretrained(paths["t5"])
    paths["remote"] = tmp_path / "remote"
    paths["remote"].mkdir()
    remote = {**preset_config("tiny", data_vocab=257).to_dict(), "model_type": "mine",
              "auto_map": {"AutoConfig": "configuration_mine.MineConfig"}}  # fmt: skip
    (paths["remote"] / "config.json").write_text(json.dumps(remote))
    # transformers makes a "causal LM" of a BERT config (BertLMHeadModel), bidirectional
    paths["bert"] = tmp_path / "bert"
    BertConfig(vocab_size=320, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=64).save_pretrained(paths["bert"])  # fmt: skip
    paths["gpt2_short"] = tmp_path / "gpt2_short"
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=320, n_positions=16).save_pretrained(
        paths["gpt2_short"]
    )
    # RoBERTa's family as decoders (causal): positions from pad_token_id 1 + 1, so 32 of 34
    decoder = dict(vocab_size=320, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                   intermediate_size=64, max_position_embeddings=34, is_decoder=True)  # fmt: skip
    for name, roberta in [("roberta", RobertaConfig), ("xlmr", XLMRobertaConfig),
                          ("camembert", CamembertConfig)]:  # fmt: skip
        paths[name] = tmp_path / name
        roberta(**decoder).save_pretrained(paths[name])
    # Whisper's decoder: its length is max_target_positions (no max_position_embeddings)
    paths["whisper"] = tmp_path / "whisper"
    whisper = WhisperConfig(vocab_size=320, d_model=32, encoder_layers=1, decoder_layers=1,
                            encoder_attention_heads=2, decoder_attention_heads=2,
                            encoder_ffn_dim=64, decoder_ffn_dim=64, max_target_positions=16,
                            pad_token_id=1, bos_token_id=0, eos_token_id=2,
                            decoder_start_token_id=0)  # fmt: skip
    whisper.save_pretrained(paths["whisper"])
    paths["no_manifest"].mkdir()
    (paths["no_manifest"] / "model.pt").write_bytes(b"PK")
    paths["bad_manifest"].mkdir()
    (paths["bad_manifest"] / "manifest.json").write_text('{"format": "coat-check')
    # ids beyond int64 (they would wrap to negative ids in the int64 batches)
    paths["u64.npy"] = tmp_path / "u64.npy"
    np.save(paths["u64.npy"], np.full(5000, 2**64 - 1, dtype=np.uint64))
    paths["six.BIN"] = tmp_path / "six.BIN"  # a .bin in capitals: 3 uint16 ids, not int32s
    paths["six.BIN"].write_bytes(b"\1\0\2\0\3\0")
    # config.json values transformers' validation refuses (not a ValueError: a traceback)
    paths["bad_heads"] = tmp_path / "bad_heads"
    paths["bad_heads"].mkdir()
    llama = {"model_type": "llama", "hidden_size": 100, "num_attention_heads": 3,
             "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 320}  # fmt: skip
    (paths["bad_heads"] / "config.json").write_text(json.dumps(llama))
    # a size torch refuses (a negative dimension: a RuntimeError traceback)
    paths["negative"] = tmp_path / "negative"
    paths["negative"].mkdir()
    (paths["negative"] / "config.json").write_text(
        json.dumps({**llama, "hidden_size": -128, "num_attention_heads": 4})
    )
    # weights saved with another config (transformers printed its table, then a traceback)
    paths["other_weights"] = tmp_path / "other_weights"
    from safetensors.torch import save_file

    small = preset_config("tiny", data_vocab=257)
    small.save_pretrained(paths["other_weights"])
    wide = torch.zeros(small.intermediate_size * 2, small.hidden_size)
    save_file({"model.layers.0.mlp.up_proj.weight": wide},
              paths["other_weights"] / "model.safetensors")  # fmt: skip
    paths["llava"] = tmp_path / "llava"
    from coat_models.vila import llava_tiny_config

    llava_tiny_config().save_pretrained(paths["llava"])
    paths["dangling"] = tmp_path / "dangling"
    os.symlink(tmp_path / "nowhere" / "x", paths["dangling"])
    (tmp_path / "sub").mkdir()
    paths["relative"] = tmp_path / "sub" / "relative"
    os.symlink("../gone", paths["relative"])  # relative to the link's folder
    return {name.replace(".", "_"): path for name, path in paths.items()} | {"tmp": tmp_path}


def _ram_bytes():
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


SMALL = ["--corpus-mib", "1"]
BAD_INPUTS = [
    (["--preset", "huge"], "argument --preset: invalid choice: 'huge' (choose from "),
    (["--compare", "bf16,fp4"], "unknown mode fp4"),
    (["--mode", "bf16", "--compare", "bf16,coat"], "use --mode or --compare, not both"),
    (["--mode", "bf16", "--master-dtype", "bf16"], "needs CoatAdamW's stochastic rounding"),
    (["--data", "{tmp}/missing.txt"], "no such file"),
    (["--data", "{empty_bin}"], "empty.bin is empty: pass a file of token ids"),
    (["--data", "{empty_txt}"], "empty.txt holds no tokens"),
    (["--model-dir", "{tmp}"], "no config.json"),
    (["--preset", "tiny", "--model-dir", "{tmp}"], "use --preset or --model-dir, not both"),
    (["--data", "{ids_npy}", "--vocab-size", "1024"], "token id 4999 but the model's vocabulary"),
    (
        ["--vocab-size", "0"],
        "argument --vocab-size: must be an integer in [1, 1099511627776] (token ids, 2^40",
    ),
    (
        ["--vocab-size", "-5"],
        "argument --vocab-size: must be an integer in [1, 1099511627776] (token ids, 2^40 at "
        "most), got '-5'",
    ),
    (["--batch-size", "0"], "argument --batch-size: must be an integer >= 1, got '0'"),
    (["--warmup", "-1"], "argument --warmup: must be an integer >= 0, got '-1'"),
    (["--steps", "5", "--warmup", "5"], "--warmup 5 covers all 5 steps: the learning rate would"),
    (["--threads", "0"], "argument --threads: must be an integer in [1, "),
    # crashed torch's thread pool
    (["--threads", "100000"], "argument --threads: must be an integer in [1, "),
    (["--seed", "-1"], f"argument --seed: must be an integer in [0, {2**63 - 1}] (numpy's"),
    (["--seed", str(2**63)], f"int64 seeds), got '{2**63}'"),
    (["--corpus-mib", "nan"], "argument --corpus-mib: must be a finite number > 0, got 'nan'"),
    (["--corpus-mib", "0"], "argument --corpus-mib: must be a finite number > 0, got '0'"),
    (["--lr", "inf"], "argument --lr: must be a finite number > 0, got 'inf'"),
    (["--lr", "0"], "argument --lr: must be a finite number > 0, got '0'"),
    (["--min-lr-ratio", "1.5"], "--min-lr-ratio: must be a finite number in [0, 1], got '1.5'"),
    (["--grad-clip", "-1"], "argument --grad-clip: must be a finite number >= 0, got '-1'"),
    (["--weight-decay", "nan"], "argument --weight-decay: must be a finite number >= 0, got 'nan'"),
    (["--weight-decay", "-0.1"], "argument --weight-decay: must be a finite number >= 0, got"),
    (["--val-fraction", "1"], "--val-fraction: must be a finite number in (0, 1), got '1'"),
    (["--keep-checkpoints", "0", "--save-every", "2"], "--keep-checkpoints must be >= 1 with"),
    # no checkpoint is written without --save-every: the option was ignored without a word
    (["--keep-checkpoints", "3"], "--keep-checkpoints applies with --save-every N (without it"),
    (
        ["--seq-len", "100000", "--corpus-mib", "0.05"],
        "fewer than --seq-len 100000 + 1: use a larger --corpus-mib, or --data FILE, or a "
        "shorter --seq-len",
    ),
    # the remedies of the data given: --corpus-mib is refused with --data (it was advised)
    (
        ["--data", "{ids_npy}", "--seq-len", "4800"],
        "the training split has 4750 tokens, fewer than --seq-len 4800 + 1: use a longer "
        "--data file, or a smaller --val-fraction, or a shorter --seq-len",
    ),
    (
        ["--data", "{ids_npy}", "--seq-len", "300"],
        "the validation split has 250 tokens, fewer than --seq-len 300: use a longer --data "
        "file, or a larger --val-fraction, or a shorter --seq-len",
    ),
    (["--resume", "{tmp}/nope"], "no such checkpoint directory (checkpoints are <out>/<mode>/"),
    (["--resume", "{ids_npy}"], "ids.npy: a file, not a checkpoint directory (checkpoints are"),
    (["--data", "{tmp}"], "is a directory: pass a file"),  # said "no such file"
    (["--resume", "{no_manifest}"], "no_manifest has no manifest.json: it is not a complete"),
    # a checkpoint named that is none or corrupt: no way on was named
    (["--resume", "{no_manifest}"], "and nothing in it is read; pass no --resume to start from"),
    (["--resume", "{bad_manifest}"], "manifest.json is not valid JSON"),
    (["--model-dir", "{bad_weights}", *SMALL], "model.safetensors is not a readable safetensors"),
    (["--model-dir", "{bad_tokenizer}", *SMALL], "cannot read its tokenizer"),
    # torch's text after the header: "re-running torch.load with weights_only set to False"
    (["--model-dir", "{bad_bin}", *SMALL], "pytorch_model.bin is not a torch.save file: replace"),
    # the reason first, not after apply_coat's ~350-character text of what it supports
    (["--model-dir", "{gpt2}", "--mode", "coat", *SMALL], "mode coat: apply_coat: GPT2LMHeadModel"),
    (["--model-dir", "{pad}", *SMALL], "pad_token_id 400 is not a token of its vocabulary (vo"),
    # (transformers' list of every causal LM config class, one line of ~4 KB, came after)
    (["--model-dir", "{t5}", *SMALL], "AutoModelForCausalLM.; coat-train trains decoder-only"),
    (["--model-dir", "{remote}", *SMALL], "names code of its own (auto_map), which coat-train doe"),
    # it trained, learning to copy the next token its attention saw
    (["--model-dir", "{bert}", "--seq-len", "64", *SMALL], "BertLMHeadModel is not a causal langu"),
    (["--out", "{a_file}"], "a_file is a file: pass a directory"),
    (["--out", "{a_file}/run"], "a_file is a file, not a directory: pass another --out"),
    (["--out", "/proc/coat-train-test/run"], "cannot create a directory in /proc"),
    # "File exists" and "File name too long" after the header, exit 1
    (["--out", "{dangling}"], "dangling is a link to {tmp}/nowhere/x, which does not exist"),
    (["--out", "{relative}"], "relative is a link to {tmp}/gone, which does not exist"),
    (["--out", "{tmp}/" + "a" * 300], "is 300 bytes long, more than a file name may be here"),
    (["--mode", "bf16", "--cuda-graphs"], "add a mode with FP8 activations"),
    (["--mode", "coat", "--cuda-graphs", "--fp8-weight-cache"], "drop --fp8-weight-cache"),
    # accepted and ignored: no mode of the run has FP8 activations
    (["--compare", "bf16,coat-optim", "--fp8-weight-cache"], "applies to modes with FP8 act"),
    # Path("") is the current directory: the run's files landed there
    (["--out", ""], "--out is empty: pass a directory"),
    (["--out", "/"], "--out / is the file system's root: pass a directory of its own"),
    (["--out", "/tmp/.."], "--out /tmp/.. is the file system's root"),
    (
        ["--mode", "coat", "--cuda-graphs", "--activation-checkpointing"],
        "runs neither with --fsdp nor with --activation-checkpointing",
    ),
    (["--mode", "coat", "--cuda-graphs", "--device", "cpu"], "needs a CUDA device"),
    (["--mode", "coat", "--no-reshard-after-forward"], "is FSDP2's (sharded weights gathered"),
    (["--mode", "coat", "--compile", "--cuda-graphs"], "both take over the decoder layers"),
    # bf16 alone: it said to add a mode with FP8 activations, then refused the pair
    (["--compile", "--cuda-graphs"], "--compile and --cuda-graphs both take over the decoder"),
    (["--mode", "bf16", "--launch-plans"], "--launch-plans records COAT's FP8 decoder layers: a"),
    (["--mode", "coat", "--launch-plans", "--cuda-graphs"], "--launch-plans takes over the deco"),
    (["--mode", "coat", "--launch-plans", "--compile"], "--launch-plans takes over the decoder"),
    (["--mode", "coat", "--launch-plans", "--activation-checkpointing"], "does not run with --act"),
    (["--mode", "coat", "--launch-plans", "--fp8-weight-cache"], "drop --fp8-weight-cache"),
    # it said "no such file"
    (["--data", "/dev/null"], "--data /dev/null is not a regular file: pass a file"),
    # a window of one token predicts nothing: was a NaN loss blamed on --lr (exit 1)
    (["--seq-len", "1", *SMALL], "argument --seq-len: must be an integer >= 2 (a causal LM"),
    # an empty --compare ran bf16 alone; "," named a blank mode
    (["--compare", ""], "argument --compare: names no mode: list some of bf16, coat"),
    (["--compare", ","], "argument --compare: names no mode"),
    (["--compare", "coat, coat"], "argument --compare: lists a mode twice: coat, coat"),
    # an empty item was dropped without a word
    (["--compare", "bf16,,coat"], "argument --compare: has an empty item: 'bf16,,coat'"),
    (["--compare", "coat,"], "argument --compare: has an empty item"),
    # bf16 masters requested, and every mode of the comparison silently kept fp32
    (["--compare", "bf16,coat-act", "--master-dtype", "bf16"], "has none: add one, or drop"),
    # data options that do not apply were ignored without a word
    (["--val-fraction", "0.2"], "--val-fraction applies to a --data file only: leave it out"),
    # it said no standard-library files were found
    (["--corpus-mib", "1e-9"], "--corpus-mib caps the built-in corpus below one byte: raise"),
    (["--data", "{ids_npy}", "--corpus-mib", "1"], "--corpus-mib applies to the built-in"),
    (["--data", "{ids_npy}", "--data-dtype", "int32"], "--data-dtype applies to a .bin --data"),
    (["--data", "{u64_npy}"], "token id 18446744073709551615 is beyond any vocabulary"),
    # .BIN was text: --data-dtype "applies to a .bin --data file only", and without it the
    # file's bytes were trained on
    (["--data", "{six_BIN}", "--data-dtype", "int32"], "six.BIN: size 6 bytes is not a multip"),
    # ids misread (or a huge --vocab-size): "a smaller model or bf16 masters" did not help
    (["--vocab-size", "99999999999"], "a vocabulary of 99,999,999,999 tokens: if it is the"),
    # a micro-batch whose logits alone exceed RAM: the OOM killer ended the run silently
    (["--batch-size", "100000000", *SMALL], "for its logits (vocab 320), but"),
    # learned positions: an IndexError traceback after --out was written
    (
        ["--model-dir", "{gpt2_short}", "--seq-len", "32", *SMALL],
        "--seq-len 32 is longer than --model-dir {gpt2_short}'s max_position_embeddings 16",
    ),
    # positions from pad_token_id + 1 and limits under other keys: a traceback at step 1
    (
        ["--model-dir", "{roberta}", "--seq-len", "33", *SMALL],
        "{roberta}'s max_position_embeddings 34 allows (RobertaForCausalLM numbers positions "
        "from pad_token_id 1 + 1): pass --seq-len <= 32",
    ),
    (["--model-dir", "{xlmr}", "--seq-len", "34", *SMALL], "XLMRobertaForCausalLM numbers posi"),
    # past the table too: it said "pass --seq-len <= 34"
    (["--model-dir", "{camembert}", "--seq-len", "64", *SMALL], "pad_token_id 1 + 1): pass --se"),
    (
        ["--model-dir", "{whisper}", "--seq-len", "32", *SMALL],
        "--seq-len 32 is longer than --model-dir {whisper}'s max_target_positions 16: pass "
        "--seq-len <= 16",
    ),
    (["--model-dir", "{bad_heads}"], "hidden size (100) is not a multiple of the number of"),
    (["--model-dir", "{llava}"], "(LlavaConfig) is not a causal LM's (no vocab_size): pass"),
    (["--model-dir", "{negative}"], "(Trying to create tensor with negative dimension -128"),
    (
        ["--model-dir", "{other_weights}", *SMALL],
        "model.safetensors holds model.layers.0.mlp.up_proj.weight of shape [704, 128], but its "
        "config.json makes it [352, 128]: pass the config.json saved with these weights",
    ),
    # values beyond what the run can hold: tracebacks (an overflow), one after --out was made
    (["--vocab-size", "99999999999999999999"], "--vocab-size: must be an integer in [1, 109951162"),
    (["--grad-accum", "99999999999999999999"], "--grad-accum: must be an integer in [1, 2147483"),
    # a NaN loss blamed on --lr
    (["--weight-decay", "1e30"], "lr x weight_decay >= 1 per step (zeroing or flipping it)"),
]


@pytest.mark.parametrize("argv,message", BAD_INPUTS, ids=[m[:24] for _, m in BAD_INPUTS])
def test_bad_input_gives_one_clear_line(tmp_path, capsys, argv, message):
    """One line, exit 2, no traceback, and nothing written: no --out directory appears."""
    paths = _inputs(tmp_path)
    argv = [a.format(**paths) for a in argv]
    if "--out" not in argv:
        argv += ["--out", tmp_path / "out"]
    before = sorted(tmp_path.rglob("*"))
    code, _, err = run([*argv, "--no-progress"], capsys)
    assert code == 2, err
    message = message.format(**paths)
    assert err.startswith("coat-train: error: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize(
    "name,seq_len,longest,why",
    [
        ("roberta", 33, 32, "index 34 is out of bounds for dimension 1 with size 34"),
        ("whisper", 32, 16, "index 16 is out of bounds for dimension 0 with size 16"),
    ],
    ids=["roberta", "whisper"],
)
def test_a_seq_len_the_model_cannot_run_is_found_by_a_forward(
    tmp_path, capsys, monkeypatch, name, seq_len, longest, why
):
    """A length limit that no config key coat-train reads names (here: none is read), or an
    offset of the architecture's own: one forward of --seq-len tokens as the model is built
    finds it, and the longest that runs (it was an IndexError traceback at step 1)."""
    monkeypatch.setattr(jobs, "longest_sequence", lambda config: None)
    paths = _inputs(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    argv = ["--model-dir", paths[name], "--mode", "bf16", "--steps", "2", "--batch-size", "2",
            "--out", tmp_path / "out", "--no-progress", *SMALL]  # fmt: skip
    code, _, err = run([*argv, "--seq-len", seq_len], capsys)
    assert code == 2 and err.startswith("coat-train: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"cannot run --seq-len {seq_len} tokens ({why}" in err
    assert err.endswith(f": pass --seq-len <= {longest}\n"), err
    assert sorted(tmp_path.rglob("*")) == before
    code, _, err = run([*argv, "--seq-len", longest], capsys)  # the longest that runs trains
    assert code == 0, err


def test_a_model_dir_whose_model_runs_no_forward_is_one_line(tmp_path, capsys):
    """A config transformers builds but whose model runs nothing (more key/value heads than
    heads): one line naming the model's error, nothing written (it was a traceback at step 1,
    exit 1)."""
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=4,
                max_position_embeddings=64).save_pretrained(tmp_path / "qwen2")  # fmt: skip
    before = sorted(tmp_path.rglob("*"))
    argv = ["--model-dir", tmp_path / "qwen2", "--mode", "bf16", "--steps", "1", "--seq-len", 32,
            "--out", tmp_path / "out", "--no-progress", *SMALL]  # fmt: skip
    code, _, err = run(argv, capsys)
    assert code == 2 and err.startswith("coat-train: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "Qwen2ForCausalLM cannot run a forward (" in err and "check its config.json" in err
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("kind", ["xlstm", "minimax", "no-attention", "recurrent_gemma"])
def test_model_dirs_with_caches_of_their_own_train(tmp_path, capsys, kind):
    """Models whose forward keeps a cache class of its own, or a hybrid without attention
    layers, get none (use_cache=False), not coat-train's NoKVCache: xLSTM read its recurrent
    states off it (an AttributeError traceback at step 1), MiniMax refused it, and the
    hybrid's mask code asked it for attention sizes (ValueError tracebacks); RecurrentGemma
    makes its own (given one, it kept step 1's states: a traceback at step 2)."""
    import transformers

    if kind == "recurrent_gemma":
        config = transformers.RecurrentGemmaConfig(
            vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=1, lru_width=64,
            attention_window_size=16, conv1d_width=4,
        )  # fmt: skip
    elif kind == "no-attention":  # (its forward takes use_cache through **kwargs)
        config = transformers.GraniteMoeHybridConfig(
            vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, shared_intermediate_size=128, mamba_n_heads=4,
            mamba_d_head=32, mamba_d_state=8, mamba_chunk_size=16,
            layer_types=["mamba", "mamba"],
        )  # fmt: skip
    elif kind == "xlstm":
        config = transformers.xLSTMConfig(vocab_size=320, hidden_size=64, embedding_dim=64,
                                          num_heads=4, num_blocks=2, num_hidden_layers=2,
                                          chunk_size=16)  # fmt: skip
    else:
        layers = ["linear_attention", "full_attention"]
        config = transformers.MiniMaxConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=16,
                                            num_local_experts=4, num_experts_per_tok=2,
                                            block_size=16, max_position_embeddings=64,
                                            layer_types=layers)  # fmt: skip
    config.save_pretrained(tmp_path / kind)
    argv = ["--model-dir", tmp_path / kind, "--mode", "bf16", "--steps", "3", "--seq-len", 32,
            "--batch-size", "1", "--eval-batches", "1", "--out", tmp_path / "out",
            "--no-progress", "--no-export", *SMALL]  # fmt: skip
    code, _, err = run(argv, capsys)
    assert code == 0, err


def test_a_model_dir_config_its_model_code_cannot_take_is_one_line(tmp_path, capsys):
    """A config whose values the model's code cannot take (Nemotron's num_key_value_heads
    None, which it divides by): one line, nothing written (a TypeError traceback)."""
    from transformers import NemotronConfig

    NemotronConfig(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=None,
                   intermediate_size=128).save_pretrained(tmp_path / "nemotron")  # fmt: skip
    before = sorted(tmp_path.rglob("*"))
    argv = ["--model-dir", tmp_path / "nemotron", "--mode", "bf16", "--steps", "1",
            "--out", tmp_path / "out", "--no-progress", *SMALL]  # fmt: skip
    code, _, err = run(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "cannot build a causal LM from this config (TypeError: " in err
    assert err.endswith("check its config.json\n"), err
    assert sorted(tmp_path.rglob("*")) == before


def _llama_config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, max_position_embeddings=32, **kw)  # fmt: skip


PLAIN = (32, "max_position_embeddings 32")
LLAMA3 = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.mark.parametrize(
    "scaling,want",
    [
        (None, PLAIN),
        ({"rope_type": "linear", "factor": 2.0}, (64, "RoPE scaled by 2 from 32 positions (64)")),
        (
            {"rope_type": "dynamic", "factor": 4.0},
            (128, "RoPE scaled by 4 from 32 positions (128)"),
        ),
        (  # Qwen2.5's YaRN: the original length is max_position_embeddings
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
            (128, "RoPE scaled by 4 from 32 positions (128)"),
        ),
        (  # Qwen3's YaRN: 4 x 32768 beside max_position_embeddings 40960
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 24},
            (96, "RoPE scaled by 4 from 24 positions (96)"),
        ),
        # Llama 3's max_position_embeddings past the original length is the scaled one
        # already (Llama 3.2's 131072 read as 262144)
        ({**LLAMA3, "factor": 32.0, "original_max_position_embeddings": 2}, PLAIN),
        (
            {**LLAMA3, "factor": 2.0, "original_max_position_embeddings": 32},
            (64, "RoPE scaled by 2 from 32 positions (64)"),
        ),
        ({"rope_type": "linear", "factor": 1.0}, PLAIN),
        ({"rope_type": "default", "factor": 4.0}, PLAIN),  # (transformers ignores the factor)
        ({"rope_type": "linear", "factor": float("inf")}, PLAIN),  # (an OverflowError traceback)
        ({"rope_type": "linear", "factor": 1e308}, PLAIN),
        ({"rope_type": "linear", "factor": 10**400}, PLAIN),  # (an OverflowError traceback)
        (
            {"rope_type": "proportional", "factor": 2.0},
            (64, "RoPE scaled by 2 from 32 positions (64)"),
        ),
    ],
    ids=["plain", "linear", "dynamic", "yarn", "yarn-qwen3", "llama3.2", "llama3-original",
         "factor-1", "default", "inf", "huge", "huge-int", "proportional"],
)  # fmt: skip
def test_longest_sequence_of_scaled_rope_is_the_scaled_length(scaling, want):
    """A config whose RoPE is scaled by a factor, with max_position_embeddings left at the
    base length, was refused past that length, the one it was scaled away from."""
    from coat_models.train.presets import longest_sequence

    config = _llama_config(**({} if scaling is None else {"rope_scaling": scaling}))
    assert longest_sequence(config) == want


def test_longest_sequence_reads_rope_scaling_per_layer_type_and_not_on_a_table():
    """One RoPE table per layer type (Gemma 3's): the scaled one is read; a rope_scaling in
    the config of a model with learned positions (OPT) does not stretch its table (on CUDA
    the index past it is a device-side assert)."""
    from coat_models.train.presets import longest_sequence
    from transformers import Gemma3TextConfig, OPTConfig

    gemma = Gemma3TextConfig(vocab_size=320, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=16, max_position_embeddings=32,
                             rope_scaling={"rope_type": "linear", "factor": 8.0})  # fmt: skip
    assert longest_sequence(gemma) == (256, "RoPE scaled by 8 from 32 positions (256)")
    # Gemma 3n's per-layer token embeddings (more rows than positions) are not a table of
    # positions (it read 32)
    from transformers import Gemma3nTextConfig

    gemma3n = Gemma3nTextConfig(vocab_size=512, vocab_size_per_layer_input=512, hidden_size=64,
                                hidden_size_per_layer_input=8, num_hidden_layers=2,
                                num_kv_shared_layers=0, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                max_position_embeddings=32, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"],
                                altup_num_inputs=2, laurel_rank=8,
                                activation_sparsity_pattern=[0.0] * 2)  # fmt: skip
    full = gemma3n.rope_parameters["full_attention"]
    gemma3n.rope_parameters["full_attention"] = {**full, "rope_type": "linear", "factor": 2.0}
    assert longest_sequence(gemma3n) == (64, "RoPE scaled by 2 from 32 positions (64)")
    opt = OPTConfig(vocab_size=320, hidden_size=32, ffn_dim=64, num_hidden_layers=1,
                    num_attention_heads=2, max_position_embeddings=32,
                    word_embed_proj_dim=32)  # fmt: skip
    opt.rope_scaling = {"type": "linear", "factor": 2.0}
    assert longest_sequence(opt) == PLAIN


def test_model_dirs_past_their_max_positions_that_run_there_train(tmp_path, capsys):
    """Falcon with ALiBi (its max_position_embeddings is its unused RoPE's) and a Llama whose
    RoPE is scaled by 2 from its max_position_embeddings train at --seq-len past that
    length (both were refused: "pass --seq-len <= 32"); past the scaled length the Llama
    is refused, naming it."""
    from transformers import FalconConfig

    falcon = FalconConfig(vocab_size=320, hidden_size=32, num_hidden_layers=1,
                          num_attention_heads=2, alibi=True,
                          max_position_embeddings=32)  # fmt: skip
    falcon.save_pretrained(tmp_path / "falcon")
    scaled = _llama_config(rope_scaling={"rope_type": "linear", "factor": 2.0})
    scaled.save_pretrained(tmp_path / "scaled")
    common = ["--mode", "bf16", "--steps", "1", "--batch-size", "1", "--eval-batches", "1",
              "--no-progress", "--no-export", *SMALL]  # fmt: skip
    for name, seq_len in [("falcon", 48), ("scaled", 64)]:
        argv = ["--model-dir", tmp_path / name, "--seq-len", seq_len, "--out", tmp_path / name]
        code, _, err = run([*argv, *common], capsys)
        assert code == 0, err
    argv = ["--model-dir", tmp_path / "scaled", "--seq-len", 65, "--out", tmp_path / "o"]
    code, _, err = run([*argv, *common], capsys)
    assert code == 2 and "--seq-len 65 is longer than --model-dir" in err, err
    assert err.endswith("'s RoPE scaled by 2 from 32 positions (64): pass --seq-len <= 64\n"), err


@pytest.mark.parametrize("mode", ["bf16", "coat"])
@pytest.mark.slow
def test_a_refused_model_dir_prints_only_coat_train_s_line(tmp_path, mode):
    """transformers' advice while it builds a model (BERT's "add is_decoder=True") was
    printed above coat-train's one-line refusal; its logger writes to the process's stderr
    (not what capsys sees), so the command runs in a process of its own here."""
    import subprocess
    import sys

    paths = _inputs(tmp_path)
    argv = ["--model-dir", str(paths["bert"]), "--mode", mode, "--seq-len", "32", "--steps",
            "2", "--out", str(tmp_path / "out"), "--no-progress", *SMALL]  # fmt: skip
    cmd = [sys.executable, "-m", "coat_models.train.cli", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("coat-train: error: ") and done.stderr.count("\n") == 1, (
        done.stderr
    )
    assert "is not a causal language model" in done.stderr


def test_a_training_length_in_the_config_is_not_a_limit(tmp_path, capsys):
    """BLOOM checkpoints' config.json carry the seq_length they were trained at; BLOOM (ALiBi)
    runs past it, and a --seq-len beyond it was refused as too long."""
    from transformers import BloomConfig

    model_dir = tmp_path / "bloom"
    BloomConfig(hidden_size=32, n_layer=1, n_head=2, vocab_size=320, seq_length=64).save_pretrained(
        model_dir
    )
    argv = ["--model-dir", model_dir, "--mode", "bf16", "--seq-len", "128", "--steps", "2",
            "--batch-size", "2", "--out", tmp_path / "out", "--no-progress", *SMALL]  # fmt: skip
    code, _, err = run(argv, capsys)
    assert code == 0, err


def test_a_batch_the_model_refuses_at_the_first_step_is_one_line(tmp_path, capsys):
    """Reformer trains only on sequences as long as the product of its axial_pos_shape; its
    ValueError at the first forward was a traceback. Now one line naming the model, its
    words and the options to change (exit 2); the same model trains at a length it takes."""
    from transformers import ReformerConfig

    model_dir = tmp_path / "reformer"
    ReformerConfig(
        hidden_size=32, num_attention_heads=2, attention_head_size=16, feed_forward_size=64,
        vocab_size=320, axial_pos_embds_dim=[16, 16], axial_pos_shape=[8, 8],
        max_position_embeddings=64, is_decoder=True, num_hashes=1, local_attn_chunk_length=16,
        attn_layers=["local", "local"],
    ).save_pretrained(model_dir)  # fmt: skip
    argv = ["--model-dir", model_dir, "--mode", "bf16", "--steps", "1", "--batch-size", "2",
            "--eval-batches", "1", "--no-export", "--no-progress", *SMALL]  # fmt: skip
    code, _, err = run([*argv, "--seq-len", "32", "--out", tmp_path / "a"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(
        "coat-train: error: mode bf16: the model (ReformerModelWithLMHead) refused a batch of "
        "2 x 32 tokens: If training, make sure that config.axial_pos_shape"
    ), err
    assert err.endswith("; change --seq-len or --batch-size, or the model's config.json\n"), err
    code, _, err = run([*argv, "--seq-len", "64", "--out", tmp_path / "b"], capsys)
    assert code == 0, err


def test_a_model_no_mode_trains_is_refused_without_naming_another_mode(tmp_path, capsys):
    """A COAT mode refused BERT with "train it in bf16 or coat-optim", which refused it in turn
    (not causal): a model that no mode trains is said to be one. A causal model apply_coat does
    not take (a RoBERTa decoder) keeps that advice, which holds: bf16 trains it."""
    paths = _inputs(tmp_path)
    argv = ["--seq-len", "32", "--steps", "2", "--batch-size", "2", "--out", tmp_path / "out",
            "--no-progress", *SMALL]  # fmt: skip
    for modes in (["--mode", "coat"], ["--mode", "coat-act"], ["--compare", "bf16,coat"]):
        code, _, err = run(["--model-dir", paths["bert"], *modes, *argv], capsys)
        assert code == 2 and err.count("\n") == 1, err
        assert "BertLMHeadModel is not a causal language model" in err
        assert "which no mode of coat-train trains" in err and "bf16" not in err, err
    code, _, err = run(["--model-dir", paths["roberta"], "--mode", "coat", *argv], capsys)
    assert code == 2 and "RobertaForCausalLM has no base model attribute 'layers'" in err, err
    assert "train it in bf16 or coat-optim" in err
    code, _, err = run(["--model-dir", paths["roberta"], "--mode", "bf16", *argv], capsys)
    assert code == 0, err


@pytest.mark.parametrize(
    "value,interpret,message",
    [
        ("bogus", "1", "FP8_QUANT_BACKEND must be one of ('auto', 'triton', 'reference'), got"),
        ("TRITON", "1", "got 'TRITON': set one of them, or unset it"),
        ("triton", "0", "FP8_QUANT_BACKEND=triton needs a CUDA device, or TRITON_INTERPRET=1"),
    ],
    ids=["unknown", "capitals", "triton-on-cpu"],
)
@pytest.mark.skipif(torch.cuda.is_available(), reason="triton runs on CUDA")
def test_a_bad_fp8_quant_backend_is_one_line_before_anything_is_written(
    tmp_path, capsys, monkeypatch, value, interpret, message
):
    """FP8_QUANT_BACKEND was read first by a COAT layer or CoatAdamW's first step: a
    traceback, after coat-optim's earlier results (and the run's report) were deleted."""
    out = tmp_path / "run"
    code, _, err = run(
        ["--steps", "2", "--compare", "bf16,coat-optim", "--out", out, *FAST], capsys
    )
    assert code == 0, err
    before = sorted(out.rglob("*"))
    monkeypatch.setenv("FP8_QUANT_BACKEND", value)
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    for mode in ("coat-optim", "coat"):
        code, _, err = run(["--steps", "2", "--mode", mode, "--out", out, *FAST], capsys)
        assert code == 2 and err.startswith("coat-train: error: ") and message in err, err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert sorted(out.rglob("*")) == before
    # bf16 runs no FP8 kernel: the variable does not concern it
    code, _, err = run(["--steps", "2", "--mode", "bf16", "--out", out, *FAST], capsys)
    assert code == 0, err


# argparse's own errors printed its 20-line usage block before the line that mattered.
PARSER_ERRORS = [
    (["--steps", "abc"], "argument --steps: must be an integer >= 1, got 'abc'"),
    (["--stepz", "3"], "unrecognized arguments: --stepz 3 (see coat-train --help)"),
    # an abbreviation is not taken for the option it begins (--step 3 trained 3 steps)
    (["--step", "3"], "unrecognized arguments: --step 3 (see coat-train --help)"),
    (["--out"], "argument --out: expected one argument (see coat-train --help)"),
    # the list of choices is quoted by some Python versions, not by others
    (["--mode", "fp8"], "argument --mode: invalid choice: 'fp8' (choose from "),
    (["--device", "gpu"], "argument --device: invalid choice: 'gpu' (choose from "),
]


@pytest.mark.parametrize("argv,line", PARSER_ERRORS, ids=["bad-int", "unknown-flag",
                         "abbreviated", "no-value", "bad-mode", "bad-device"])  # fmt: skip
def test_parser_errors_are_one_line(tmp_path, capsys, monkeypatch, argv, line):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.chdir(tmp_path)  # --out's default is relative: nothing may appear here
    code, out, err = run(argv, capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"coat-train: error: {line}") and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []
    if "(choose from " in line:  # the remedy: every valid value
        choices = {"--mode": cli.MODES, "--device": ["auto", "cpu", "cuda"]}[argv[0]]
        assert all(c in err for c in choices), err


def test_parser_error_is_printed_once_under_torchrun(capsys, monkeypatch):
    """Like every other error: rank 0 prints it, the others exit 2 without a word."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert run(["--steps", "abc"], capsys) == (2, "", "")
    monkeypatch.setenv("RANK", "0")
    assert run(["--steps", "abc"], capsys)[2].count("coat-train: error: ") == 1
    monkeypatch.setenv("RANK", "x")  # not torchrun's: never silent
    assert run(["--steps", "abc"], capsys)[2].count("coat-train: error: ") == 1


@pytest.mark.parametrize("world", [None, "1"], ids=["no-world-size", "world-size-1"])
def test_a_rank_without_torchrun_is_not_silent(tmp_path, capsys, monkeypatch, world):
    """A RANK left in the environment without torchrun's WORLD_SIZE, or with a WORLD_SIZE of
    1: a lone run, which prints its errors, its progress and writes its report as rank 0 (it
    said nothing and wrote no report: only rank 0 does)."""
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("RANK", "1")
    assert run(["--steps", "abc"], capsys)[2].count("coat-train: error: ") == 1
    code, out, err = run(["--steps", 2, "--no-export", "--out", tmp_path, *FAST], capsys)
    assert code == 0 and "coat-train: preset tiny" in out, err
    assert (tmp_path / "summary.json").is_file()


def test_help_is_the_full_usage(capsys):
    code, out, err = run(["--help"], capsys)
    assert code == 0 and err == ""
    assert out.startswith("usage: coat-train ")
    for option in ("--preset", "--compare", "--steps", "--threads", "--report-to", "--version"):
        assert option in out


def test_out_is_checked_before_data_and_model(tmp_path, capsys, monkeypatch):
    def not_reached(*a, **k):
        raise AssertionError("loaded data before checking --out")

    monkeypatch.setattr(jobs, "load_data", not_reached)
    monkeypatch.setattr(jobs, "build_model", not_reached)
    (tmp_path / "f").write_text("")
    code, _, err = run(["--out", tmp_path / "f" / "run", *FAST], capsys)
    assert code == 2 and "is a file, not a directory" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_cuda_option_without_cuda(tmp_path, capsys):
    code, _, err = run(["--device", "cuda", "--out", tmp_path], capsys)
    assert code == 2 and "--device cuda: no CUDA device is available" in err


@pytest.mark.skipif(_ram_bytes() > 200e9, reason="this machine could hold it")
def test_model_too_large_for_memory(tmp_path, capsys):
    code, _, err = run(["--preset", "llama2-13b", "--device", "cpu", "--out", tmp_path], capsys)
    assert code == 2
    assert "llama2-13b has 13.02 B parameters: mode bf16 (fp32 master) needs at least" in err


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"),
    ],
    ids=["cuda", "cpu"],
)
def test_out_of_memory_is_one_clear_line(tmp_path, capsys, monkeypatch, error):
    def boom(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(Trainer, "queue_step", boom)
    code, _, err = run(["--steps", 2, "--out", tmp_path, *FAST], capsys)
    assert code == 1 and "Traceback" not in err
    assert "out of memory in mode bf16 with micro-batch 4 x 64 tokens on cpu: lower" in err


def test_checkpoints_of_an_earlier_run_are_not_overwritten(tmp_path, capsys):
    args = ["--steps", 2, "--save-every", 2, "--eval-every", 2, "--out", tmp_path, *FAST]
    assert run(args, capsys)[0] == 0
    code, _, err = run(args, capsys)
    assert code == 2 and "holds checkpoints of an earlier run: pass --resume" in err
    report = {n: (tmp_path / n).read_bytes() for n in outdir.OUT_FILES if (tmp_path / n).exists()}
    assert "summary.json" in report
    code, _, err = run([*args, "--lr", "1e-2", "--resume"], capsys)
    assert code == 2 and "settings differ (lr: checkpoint 0.003, now 0.01)" in err
    code, _, err = run([*args, "--corpus-mib", "0.5", "--resume"], capsys)
    assert code == 2 and "settings differ (data: checkpoint 'tokens " in err, err
    assert "(the --data file, --data-dtype, --val-fraction, --corpus-mib, the tokenizer or " \
        "coat-train's tokenization changed)" in err  # fmt: skip
    # Refused before anything of the run is written: the earlier run's report stays whole.
    assert {n: (tmp_path / n).read_bytes() for n in report} == report


def test_compare_resume_refused_at_a_later_mode_changes_nothing(tmp_path, capsys):
    """Under --compare every mode's checkpoint is checked before any mode trains: a setting
    that differs for the second mode only (--master-dtype: bf16 mode keeps fp32 masters)
    is refused before the first mode goes on, and nothing under --out changes."""
    args = ["--compare", "bf16,coat", "--steps", 4, "--save-every", 2, "--eval-every", 2]
    args += ["--no-export", "--out", tmp_path, *FAST]
    assert run(args, capsys)[0] == 0
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    code, _, err = run([*args, "--steps", 6, "--resume"], capsys)
    assert code == 2 and "settings differ (steps: checkpoint 4, now 6)" in err
    code, _, err = run([*args, "--resume", "--master-dtype", "bf16"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "coat/checkpoints/step_0000004: settings differ (master_dtype: checkpoint 'fp32'" in err
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    lock = tmp_path / outdir.LOCK_FILE
    assert after.keys() - {lock} == before.keys() - {lock}
    assert all(after[p] == data for p, data in before.items() if p.name != outdir.LOCK_FILE)


def test_a_refused_resume_into_a_new_out_leaves_no_directory(tmp_path, capsys):
    """--resume of another run's checkpoint whose settings differ, into an --out that did not
    exist: refused (exit 2) and no directory left behind (it held the lock file alone). Other
    --steps: the message names the run's export as the way to train its model further."""
    args = ["--save-every", 2, "--no-export", *FAST]
    assert run([*args[:2], *FAST, "--steps", 2, "--out", tmp_path / "a"], capsys)[0] == 0
    ckpt = tmp_path / "a" / "bf16" / "checkpoints" / "step_0000002"
    code, _, err = run([*args, "--steps", 4, "--out", tmp_path / "b", "--resume", ckpt], capsys)
    assert code == 2 and "settings differ (steps: checkpoint 2, now 4)" in err, err
    assert f"--model-dir {tmp_path / 'a' / 'bf16' / 'final'}, its export" in err, err
    assert not (tmp_path / "b").exists()
    # An --out that existed stays, lock file included.
    (tmp_path / "c").mkdir()
    code, _, err = run([*args, "--steps", 4, "--out", tmp_path / "c", "--resume", ckpt], capsys)
    assert code == 2 and [p.name for p in (tmp_path / "c").iterdir()] == [outdir.LOCK_FILE]


@pytest.mark.parametrize("damage", ["truncated", "no-manifest", "empty-step", "metrics"])
@pytest.mark.slow
def test_compare_resume_with_a_broken_later_checkpoint_changes_nothing(tmp_path, capsys, damage):
    """A later mode's newest checkpoint that cannot be resumed (a truncated file, a lost
    manifest, an empty step directory, a broken metrics line) is refused before the first
    mode goes on: exit 2, one line, nothing under --out changed: the
    first mode is not resumed and finished again, its results rewritten and the report
    deleted, only for the second one to fail."""
    args = ["--compare", "bf16,coat", "--steps", 4, "--save-every", 2, "--eval-every", 2]
    args += ["--no-export", "--keep-checkpoints", 5, "--out", tmp_path, *FAST]
    assert run(args, capsys)[0] == 0
    ckpts = tmp_path / "coat" / "checkpoints"
    newest = ckpts / "step_0000004"
    if damage == "truncated":
        with open(newest / "model.pt", "r+b") as f:
            f.truncate(1000)
    elif damage == "no-manifest":
        (newest / "manifest.json").unlink()
    elif damage == "empty-step":
        (ckpts / "step_0000006").mkdir()
    else:
        metrics = tmp_path / "coat" / "metrics.jsonl"
        lines = metrics.read_text().splitlines(True)
        metrics.write_text("".join([lines[0], "{not json\n", *lines[1:]]))
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    code, _, err = run([*args, "--resume"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "coat" in err and "Traceback" not in err
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    lock = tmp_path / outdir.LOCK_FILE
    assert after.keys() - {lock} == before.keys() - {lock}
    assert all(after[p] == data for p, data in before.items() if p.name != outdir.LOCK_FILE)


@pytest.mark.parametrize("weights", [False, True], ids=["config-only", "checkpoint"])
def test_model_dir_and_text_data(tmp_path, capsys, weights):
    from transformers import LlamaForCausalLM

    config = preset_config("tiny", data_vocab=257)
    model_dir = tmp_path / "model"
    if weights:
        torch.manual_seed(1)
        LlamaForCausalLM(config).save_pretrained(model_dir)
    else:
        config.save_pretrained(model_dir)
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    flags = "--steps 2 --eval-every 2 --batch-size 2 --seq-len 32 --eval-batches 1 --no-progress"
    argv = ["--model-dir", model_dir, "--data", text, *flags.split()]
    code, stdout, err = run([*argv, "--out", tmp_path / "out"], capsys)
    assert code == 0, err
    assert f"model dir {model_dir} (0.89 M params, vocab 320)" in stdout
    assert f"data: {text} (text, 0.02 MiB)" in stdout
    check_run_dir(tmp_path / "out", "bf16", steps=2, eval_every=2)


def test_a_negative_pad_token_id_counts_from_the_end(tmp_path):
    """torch takes padding_idx -1 (the last row), as old Llama conversions' configs give it;
    only ids outside [-vocab, vocab) are refused."""
    from coat_models.train.presets import ModelError, model_dir_config

    config = preset_config("tiny", data_vocab=257)
    for pad, ok in ((-1, True), (-320, True), (-321, False), (319, True), (320, False)):
        config.pad_token_id = pad
        config.save_pretrained(tmp_path / str(pad))
        if ok:
            assert model_dir_config(str(tmp_path / str(pad)))[0].pad_token_id == pad
        else:
            with pytest.raises(ModelError, match=f"pad_token_id {pad} is not a token of its"):
                model_dir_config(str(tmp_path / str(pad)))


def test_a_hybrid_model_dir_trains(tmp_path, capsys):
    """LFM2 (conv layers beside attention) stopped at the first step with an IndexError
    traceback: its cache had no conv layers (test_train's hybrid test has the why)."""
    from transformers import Lfm2Config

    config = Lfm2Config(vocab_size=300, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                        layer_types=["conv", "full_attention"])  # fmt: skip
    config.save_pretrained(tmp_path / "lfm2")
    flags = "--steps 2 --eval-every 2 --batch-size 2 --seq-len 32 --eval-batches 1 --no-progress"
    argv = ["--model-dir", tmp_path / "lfm2", *flags.split(), "--corpus-mib", "1"]
    code, _, err = run([*argv, "--out", tmp_path / "out"], capsys)
    assert code == 0, err
    check_run_dir(tmp_path / "out", "bf16", steps=2, eval_every=2)


def test_a_model_dir_without_sdpa_attention_trains_with_eager(tmp_path, capsys):
    """Gemma2 (as Bloom, GPT-Neo, MPT) has no SDPA path in transformers: coat-train asked for
    it, and relayed transformers' advice to pass attn_implementation="eager", which it has no
    option for. Such a model trains with its eager attention."""
    from transformers import Gemma2Config

    Gemma2Config(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128,
                 head_dim=16).save_pretrained(tmp_path / "gemma2")  # fmt: skip
    flags = "--steps 2 --eval-every 2 --batch-size 2 --seq-len 32 --eval-batches 1 --no-progress"
    argv = ["--model-dir", tmp_path / "gemma2", *flags.split(), "--corpus-mib", "1"]
    code, _, err = run([*argv, "--out", tmp_path / "out"], capsys)
    assert code == 0, err
    check_run_dir(tmp_path / "out", "bf16", steps=2, eval_every=2)
    config = json.loads((tmp_path / "out" / "bf16" / "final" / "config.json").read_text())
    assert config["model_type"] == "gemma2"


def test_model_dir_of_sharded_bin_weights_trains_from_them(tmp_path, capsys):
    """A directory whose weights are pytorch_model.bin shards and their index (no single
    file) trained from random weights without a word: the index was not looked for. A
    shard the index lists but the directory lacks is one line."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    model = LlamaForCausalLM(preset_config("tiny", data_vocab=257))
    model.save_pretrained(tmp_path / "safetensors")
    model.config.save_pretrained(tmp_path / "shards")  # + shards as older transformers wrote
    names = list(model.state_dict())
    shards = [tmp_path / "shards" / f"pytorch_model-0000{i}-of-00002.bin" for i in (1, 2)]
    weight_map = {}
    halves = (names[: len(names) // 2], names[len(names) // 2 :])
    for shard, keys in zip(shards, halves, strict=True):
        torch.save({k: model.state_dict()[k].clone() for k in keys}, shard)
        weight_map |= dict.fromkeys(keys, shard.name)
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp_path / "shards" / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    flags = "--steps 1 --batch-size 2 --seq-len 32 --eval-batches 1 --corpus-mib 1 --no-export"
    losses = []
    for name in ("safetensors", "shards"):
        argv = ["--model-dir", tmp_path / name, *flags.split(), "--no-progress"]
        code, _, err = run([*argv, "--out", tmp_path / f"out-{name}"], capsys)
        assert code == 0, err
        losses.append(read_jsonl(tmp_path / f"out-{name}" / "bf16" / "metrics.jsonl")[0]["loss"])
    assert losses[0] == losses[1]
    shards[-1].unlink()
    argv = ["--model-dir", tmp_path / "shards", *flags.split(), "--no-progress"]
    code, _, err = run([*argv, "--out", tmp_path / "out-missing"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"pytorch_model.bin.index.json lists {shards[-1].name}, which is not there" in err
    (tmp_path / "shards" / "pytorch_model.bin.index.json").write_text('{"weight_map": {"a": 5}}')
    code, _, err = run([*argv, "--out", tmp_path / "out-bad-index"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "cannot read pytorch_model.bin.index.json (its weight_map names a shard by" in err


def _user_dir(root):
    """A directory of a user's own files where coat-train would write."""
    root.mkdir()
    (root / "summary.json").write_text('{"mine": true}')
    (root / "loss.png").write_bytes(b"my plot")
    (root / "bf16").mkdir()
    (root / "bf16" / "notes.txt").write_text("precious")
    return root


def _tree(root):
    return {p.relative_to(root): p.read_bytes() if p.is_file() else None for p in root.rglob("*")}


def test_model_dir_and_resume_name_the_directory_meant(tmp_path, capsys):
    """--model-dir given a run's --out, mode directory or checkpoint, and --resume given
    the exported model, said only "no config.json" / "no manifest.json"."""
    run_dir = tmp_path / "run"
    args = ["--steps", 2, "--save-every", 2, "--eval-every", 2, *FAST]
    assert run([*args, "--out", run_dir], capsys)[0] == 0
    final, ckpt = run_dir / "bf16" / "final", run_dir / "bf16" / "checkpoints" / "step_0000002"
    train = [a for a in args if a not in ("--preset", "tiny")]
    cases = [
        (["--model-dir", run_dir], f"no config.json; coat-train exported its models below it: "
         f"pass --model-dir {final}"),
        (["--model-dir", run_dir / "bf16"], f"pass --model-dir {final}"),
        (["--model-dir", ckpt], f"a coat-train checkpoint, not a model (no config.json): "
         f"continue its run with --resume {ckpt}, or fine-tune its run's model with "
         f"--model-dir {final}"),
        (["--model-dir", tmp_path / "nope"], "nope: no such directory"),
        (["--model-dir", final / "config.json"], "config.json: a file, not a directory"),
        (["--resume", final, "--preset", "tiny"], f"--resume {final} is a model (config.json), "
         f"not a checkpoint: fine-tune it with --model-dir {final}"),
    ]  # fmt: skip
    before = sorted(tmp_path.rglob("*"))
    for argv, message in cases:
        code, _, err = run([*train, *argv, "--out", tmp_path / "out"], capsys)
        assert code == 2 and err.startswith("coat-train: error: ") and message in err, err
        assert err.count("\n") == 1
    assert sorted(tmp_path.rglob("*")) == before
    # the directory named is the one meant
    code, _, err = run([*train, "--model-dir", final, "--out", tmp_path / "out"], capsys)
    assert code == 0, err


def test_out_holding_a_user_s_files_is_refused(tmp_path, capsys):
    """A fresh run deletes its mode's directory and overwrites summary.json and loss.png:
    before, a user's bf16/notes.txt and summary.json were destroyed without a word."""
    out = _user_dir(tmp_path / "mine")
    before = _tree(out)
    code, _, err = run(["--steps", 2, "--out", out, *FAST], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"--out {out} holds summary.json, loss.png, bf16, which coat-train did not" in err
    assert _tree(out) == before
    # a coat-train output directory (it has the lock file) with a user's file in a mode's
    # directory: a fresh run would delete it
    out = tmp_path / "run"
    args = ["--steps", 2, "--eval-every", 2, "--no-export", "--out", out, *FAST]
    assert run(args, capsys)[0] == 0
    (out / "bf16" / "notes.txt").write_text("precious")
    before = _tree(out)
    code, _, err = run(args, capsys)
    assert code == 2 and f"{out / 'bf16'} holds notes.txt, which coat-train did not" in err
    assert _tree(out) == before


@pytest.mark.parametrize("content", [b"", b"held by a build tool\n"], ids=["empty", "text"])
def test_out_with_another_program_s_lock_file_is_refused(tmp_path, capsys, content):
    """A directory holding a .lock that coat-train did not write (no PID in it) passed for a
    coat-train output: its summary.json was overwritten, and the file truncated and flocked."""
    out = _user_dir(tmp_path / "mine")
    (out / ".lock").write_bytes(content)
    before = _tree(out)
    code, _, err = run(["--steps", 2, "--out", out, *FAST], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"--out {out} holds a .lock that coat-train did not write (no PID in it)" in err
    assert _tree(out) == before and (out / ".lock").read_bytes() == content
    # nor is a folder under it taken for a mode's directory of a run there
    (out / "bf16").mkdir(exist_ok=True)
    args = ["--steps", 2, "--eval-every", 2, "--no-export", "--out", out / "bf16" / "x"]
    code, _, err = run([*args, *FAST], capsys)
    assert code == 0, err


def test_out_inside_another_runs_mode_directory_is_refused(tmp_path, capsys):
    """--out RUN/bf16/final (the other run's export) or RUN/bf16 (its results, while it ran)
    was accepted and wrote a run into them; a folder beside the modes stays usable."""
    run_dir = tmp_path / "run"
    args = ["--steps", 2, "--eval-every", 2, *FAST]
    assert run([*args, "--out", run_dir], capsys)[0] == 0
    before = _tree(run_dir)
    for inside in (run_dir / "bf16" / "final", run_dir / "bf16", run_dir / "coat" / "x"):
        code, _, err = run([*args, "--out", inside], capsys)
        mode = inside.relative_to(run_dir).parts[0]
        assert code == 2 and err == (
            f"coat-train: error: --out {inside} is inside {run_dir / mode}, a mode's directory "
            f"of the coat-train run in {run_dir}: pass a directory outside it\n"
        ), err
        assert _tree(run_dir) == before
    code, _, err = run([*args, "--no-export", "--out", run_dir / "more"], capsys)
    assert code == 0, err


def test_out_with_unrelated_names_only_is_used(tmp_path, capsys):
    """Files coat-train does not touch do not stop a run, and stay."""
    out = tmp_path / "project"
    out.mkdir()
    (out / "README.txt").write_text("mine")
    args = ["--steps", 2, "--eval-every", 2, "--no-export", "--out", out, *FAST]
    code, _, err = run(args, capsys)
    assert code == 0, err
    assert (out / "README.txt").read_text() == "mine" and (out / "bf16" / "summary.json").is_file()


def test_help_states_the_defaults_the_code_uses():
    """Every option with a default in the parser, and each data option (defaults applied
    after parsing), names that default in its help; the presets' vocabulary is the one
    --vocab-size's help states."""
    import argparse

    parser = cli.build_parser()
    helps = {}
    for action in parser._actions:
        text = " ".join((action.help or "").split())
        helps[action.dest] = text.replace("%(default)s", str(action.default)).replace(
            "%(default)g", f"{action.default:g}" if isinstance(action.default, float) else ""
        )
    defaults = {
        a.dest: a.default
        for a in parser._actions
        # identity: 0 == False would drop --seed's and --save-every's defaults
        if not any(a.default is v for v in (None, False, argparse.SUPPRESS))
    }
    defaults |= cli.DATA_DEFAULTS | {"keep_checkpoints": cli.KEEP_CHECKPOINTS}
    assert set(defaults) >= {"grad_accum", "min_lr_ratio", "weight_decay", "grad_clip", "seed",
                             "log_every", "out", "save_every", "keep_checkpoints", "device",
                             "report_to", "master_dtype", "corpus_mib", "val_fraction",
                             "data_dtype"}  # fmt: skip
    for dest, value in defaults.items():
        said = {f"default {value}", f"default: {value}"}
        if isinstance(value, float):
            said |= {f"default {value:g}", f"default: {value:g}"}
        assert any(s in helps[dest] for s in said), (dest, value, helps[dest])
    from coat_models.train import data

    assert cli.DATA_DEFAULTS["corpus_mib"] * 2**20 == data.STDLIB_MAX_BYTES
    vocabs = {p.vocab for p in PRESETS.values()}
    assert vocabs == {None, 32000} and "default: 32000, tiny: the data's" in helps["vocab_size"]
    assert PRESETS["tiny"].vocab is None and "(default: tiny)" in helps["preset"]


@pytest.mark.parametrize("mode", ["coat-optim", "coat"])
def test_refused_resume_names_the_remedy_and_writes_no_mode_dir(mode, tmp_path, capsys):
    """A checkpoint of other settings is refused before the mode's directory is made, and the
    message says what to do (it named the difference alone). Only the differences: a COAT
    mode (whose numerics leave compile out) had also listed "compile: checkpoint False, now
    None"."""
    args = ["--steps", 2, "--save-every", 2, "--eval-every", 2, "--no-export", *FAST]
    assert run([*args, "--out", tmp_path / "a"], capsys)[0] == 0
    ckpt = tmp_path / "a" / "bf16" / "checkpoints" / "step_0000002"
    out = tmp_path / "b"
    code, _, err = run([*args, "--mode", mode, "--resume", ckpt, "--out", out], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"settings differ (mode: checkpoint 'bf16', now '{mode}'): pass the settings" in err
    assert "or start afresh with another --out" in err
    assert not out.exists()  # nor the --out it made (test_a_refused_resume_into_a_new_out...)


@pytest.mark.slow
def test_resume_from_another_out_into_an_earlier_run_is_refused(tmp_path, capsys):
    """``--resume DIR`` of another run (other settings: another seed) into an --out whose
    mode holds an earlier run's checkpoints is refused before anything is written, wherever
    DIR is (it appended the new run's steps to the earlier run's metrics and replaced its
    checkpoints, exit 0), as is one whose metrics of the steps up to DIR's no checkpoint
    vouches for; a checkpoint of the run itself continues wherever it was copied, as does
    any into an --out where nothing stands in the way."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    args = ["--mode", "coat", "--steps", 4, "--save-every", 2, "--eval-every", 2, "--no-export"]
    assert run([*args, "--seed", 1, "--out", a, *FAST], capsys)[0] == 0
    assert run([*args, "--out", b, *FAST], capsys)[0] == 0
    before = {p: p.read_bytes() for p in a.rglob("*") if p.is_file()}
    older = b / "coat" / "checkpoints" / "step_0000002"
    nested = a / "kept" / "step_0000002"  # another run's, inside --out: the same refusal
    shutil.copytree(older, nested)
    for ckpt in (older, nested):
        code, _, err = run([*args, "--out", a, "--resume", ckpt, *FAST], capsys)
        assert code == 2 and "Traceback" not in err
        assert (
            f"--resume {ckpt}: {a / 'coat'} holds checkpoints of another run (the settings "
            f"differ from those of its newest checkpoint, {a / 'coat' / 'checkpoints'}" in err
        )
        assert "continued there, the two runs would mix; pass another --out" in err
    shutil.rmtree(a / "kept")
    assert {p: p.read_bytes() for p in a.rglob("*") if p.is_file()} == before
    backup = tmp_path / "backup" / "step_0000002"  # the run's own, copied elsewhere
    shutil.copytree(a / "coat" / "checkpoints" / "step_0000002", backup)
    assert run([*args, "--seed", 1, "--out", a, "--resume", backup, *FAST], capsys)[0] == 0
    (a / "coat" / "checkpoints").rename(tmp_path / "moved")  # the metrics alone
    code, _, err = run([*args, "--out", a, "--resume", older, *FAST], capsys)
    assert code == 2 and f"{a / 'coat' / 'metrics.jsonl'} holds records of steps up to " \
        "its step 2 and no checkpoint of their run" in err  # fmt: skip
    assert run([*args, "--out", c, "--resume", older, *FAST], capsys)[0] == 0
    assert run([*args, "--out", b, "--resume", older, *FAST], capsys)[0] == 0


def test_a_pickle_of_other_objects_in_model_dir_is_refused_without_torch_s_advice(tmp_path, capsys):
    """A pytorch_model.bin whose pickle holds other objects is not run, and the one line
    names the remedy (torch's text suggested loading it with weights_only=False: running the
    file's code)."""
    import datetime
    import pickle

    from coat_models.train.presets import preset_config

    d = tmp_path / "model"
    preset_config("tiny", data_vocab=257).save_pretrained(d)
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(datetime.date(2020, 1, 1), protocol=2))
    args = ["--batch-size", 2, "--seq-len", 32, "--corpus-mib", 1, "--no-progress"]
    code, _, err = run(["--model-dir", d, "--steps", 2, "--out", tmp_path / "o", *args], capsys)
    assert code == 2 and "Traceback" not in err and "weights_only" not in err, err
    said = "pytorch_model.bin holds objects other than tensors and plain containers, or is no "
    assert said + "torch.save file: replace the weights (model.safetensors) or remove them" in err


def test_resume_takes_the_model_dir_however_it_is_written(tmp_path, capsys, monkeypatch):
    """A run of --model-dir D resumes with D written as D/ or as a path relative to the
    working directory (the settings compared the strings as typed: refused)."""
    from coat_models.train.presets import preset_config

    d = tmp_path / "model"
    preset_config("tiny", data_vocab=257).save_pretrained(d)
    args = ["--steps", 4, "--save-every", 2, "--no-export", "--out", tmp_path / "o"]
    args += ["--batch-size", 2, "--seq-len", 32, "--corpus-mib", 1, "--no-progress"]
    assert run(["--model-dir", d, *args], capsys)[0] == 0
    shutil.rmtree(tmp_path / "o" / "bf16" / "checkpoints" / "step_0000004")
    code, _, err = run(["--model-dir", f"{d}/", *args, "--resume"], capsys)
    assert code == 0, err
    monkeypatch.chdir(tmp_path)
    shutil.rmtree(tmp_path / "o" / "bf16" / "checkpoints" / "step_0000004")
    code, _, err = run(["--model-dir", "model", *args, "--resume"], capsys)
    assert code == 0, err


@pytest.mark.slow
def test_resuming_one_mode_of_a_comparison_says_its_report_is_replaced(tmp_path, capsys):
    """Plain --resume of one mode where --out's report compared two: the run says that the
    comparison report is replaced and how to rebuild it (it was replaced without a word)."""
    args = ["--steps", 4, "--save-every", 2, "--no-export", "--out", tmp_path, *FAST]
    assert run(["--compare", "bf16,coat", *args], capsys)[0] == 0
    code, _, err = run(["--compare", "bf16,coat", *args, "--resume"], capsys)
    assert code == 0 and "note:" not in err, err
    code, _, err = run(["--mode", "coat", *args, "--resume"], capsys)
    assert code == 0, err
    assert f"note: {tmp_path / 'summary.json'} compares bf16, coat; resuming coat alone " \
        "replaces it and loss.png with a report of coat: --compare bf16,coat --resume " \
        "rebuilds the comparison" in err  # fmt: skip


@pytest.mark.slow
def test_a_fresh_run_of_fewer_modes_says_its_report_replaces_the_comparison(tmp_path, capsys):
    """A fresh run of one mode into an --out whose report compared two (the other mode's
    run finished, no checkpoints): it says that summary.json and loss.png will cover this
    mode alone and that the other mode's files stay (it was replaced without a word). A
    fresh run of the same modes says nothing."""
    args = ["--steps", 2, "--no-export", "--out", tmp_path, *FAST]
    assert run(["--compare", "bf16,coat", *args], capsys)[0] == 0
    code, _, err = run(["--compare", "bf16,coat", *args], capsys)
    assert code == 0 and "note:" not in err, err
    code, _, err = run(["--mode", "coat", *args], capsys)
    assert code == 0, err
    assert (
        f"note: {tmp_path / 'summary.json'} compares bf16, coat; this run replaces it "
        f"and loss.png with a report of coat (the files of bf16 in {tmp_path} stay)" in err
    )
    assert (tmp_path / "bf16" / "summary.json").is_file()


@pytest.mark.parametrize("fresh", [True, False])
@pytest.mark.parametrize(
    "report", ['{"runs": [{"mode": ["x"]}]}', '{"runs": {"mode": "x"}}', '{"runs": [1]}', "[]"]
)
def test_a_report_coat_train_did_not_write_gets_no_note(tmp_path, capsys, report, fresh):
    """A summary.json in --out that is not coat-train's report (edited by hand: its modes
    not names) is passed over without a note (it raised TypeError: unhashable type)."""
    from coat_models.train.outdir import _note_narrower_report

    (tmp_path / "summary.json").write_text(report)
    _note_narrower_report(tmp_path, ["coat"], fresh=fresh)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "entry, kind, resume",
    [("summary.json", "dir", False), ("loss.png", "dir", True),
     ("coat/final", "file", True), ("coat/summary.json", "dir", True)],
)  # fmt: skip
def test_an_entry_of_the_wrong_kind_where_coat_train_writes_is_refused_up_front(
    tmp_path, capsys, entry, kind, resume
):
    """A directory where coat-train writes a file, or a file where it writes a directory,
    is refused before training, exit 2, naming it (a file named final failed at the export,
    after every step, saying to free space); a fresh run deletes the mode directories, so
    there only the report's files count."""
    args = ["--mode", "coat", "--steps", 2, "--save-every", 1, "--no-export", "--out", tmp_path]
    assert run([*args, *FAST], capsys)[0] == 0
    path = tmp_path / entry
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    path.mkdir() if kind == "dir" else path.write_text("")
    code, _, err = run([*args, *FAST, *(["--resume"] if resume else [])], capsys)
    there, wanted = ("directory", "file") if kind == "dir" else ("file", "directory")
    assert code == 2 and err.count("\n") == 1, err
    assert f"{path} is a {there} where coat-train writes a {wanted}: move it" in err


# ---------------------------------------------------------------- probe of the CLI
@pytest.mark.parametrize("modes", [["--compare", "bf16,coat"], ["--mode", "bf16"]])
def test_a_model_dir_inside_a_mode_directory_it_replaces_is_refused(tmp_path, capsys, modes):
    """--model-dir set to an earlier run's export inside --out/<mode> (to train on from it)
    is refused up front, exit 2, with nothing deleted: the fresh run deleted it before
    training that mode, so a second --compare mode silently started from the first one's
    trained weights, and the model was lost. (Files of the user's own in a mode directory
    are refused as foreign.)"""
    out = tmp_path / "run"
    code, *_ = run(["--steps", "2", *FAST, "--out", out, "--mode", "bf16"], capsys)
    assert code == 0
    model = out / "bf16" / "final"
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    code, _, err = run(
        ["--steps", "2", *FAST[2:], "--out", out, *modes, "--model-dir", model], capsys
    )
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"--model-dir {model} is inside {out / 'bf16'}, which this run replaces" in err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_the_interrupt_message_counts_this_runs_modes_only(tmp_path, capsys, monkeypatch):
    """Interrupted with no checkpoint of its own modes, the run says so, even when the --out
    holds another mode's checkpoints (it advised --resume, which then refused)."""
    out = tmp_path / "run"
    code, *_ = run(["--steps", "2", "--save-every", "2", *FAST, "--out", out, "--mode", "coat"],
                   capsys)  # fmt: skip
    assert code == 0
    monkeypatch.setattr(Trainer, "queue_step", interrupt_before(2))
    code, _, err = run(["--steps", "4", *FAST, "--out", out, "--mode", "bf16"], capsys)
    assert code == 130
    assert err.endswith(f"interrupted; no checkpoint was written to {out} (--save-every N "
                        "writes them)\n")  # fmt: skip


def test_a_signal_after_the_run_was_reported_changes_nothing(tmp_path, capsys, monkeypatch):
    """A Ctrl-C landing after the report, in the clean-up, leaves the finished run's exit 0
    (it escaped as a KeyboardInterrupt traceback, a completed run recorded as killed)."""
    from transformers.utils import logging as hf_logging

    def interrupted():
        raise KeyboardInterrupt

    # (all put back; transformers' real switch is never touched, so later tests see it as
    # they would have: an earlier version left the bars off for the rest of the worker)
    monkeypatch.setattr(hf_logging, "is_progress_bar_enabled", lambda: True)
    monkeypatch.setattr(hf_logging, "disable_progress_bar", lambda: None)
    monkeypatch.setattr(hf_logging, "enable_progress_bar", interrupted)
    code, out, err = run(["--steps", "2", *FAST, "--out", tmp_path], capsys)
    assert code == 0 and "Traceback" not in err and "summary" in out


def test_a_model_dir_linked_from_inside_a_mode_directory_is_refused(tmp_path, capsys):
    """A --model-dir given as a link inside --out/<mode> (to a model elsewhere) is refused:
    the fresh run deletes the link before a later --compare mode reads it."""
    out = tmp_path / "run"
    code, *_ = run(["--steps", "2", *FAST, "--out", out, "--mode", "bf16"], capsys)
    assert code == 0
    elsewhere = tmp_path / "elsewhere"
    shutil.move(out / "bf16" / "final", elsewhere)
    (out / "bf16" / "final").symlink_to(elsewhere)
    link = out / "bf16" / "final"
    code, _, err = run(
        ["--steps", "2", *FAST[2:], "--out", out, "--compare", "bf16,coat", "--model-dir", link],
        capsys,
    )
    assert code == 2 and f"--model-dir {link} is inside {out / 'bf16'}" in err
    assert link.is_symlink()


def test_fp8_weight_cache_under_fsdp_is_refused(tmp_path, capsys, monkeypatch):
    """--fsdp --fp8-weight-cache is one line, exit 2, as other options that do not apply
    (the cache was silently left off)."""
    monkeypatch.setattr(cli, "_strategy", lambda args: "fsdp")  # (as under torchrun)
    monkeypatch.setattr(cli, "_rank_device", lambda: torch.device("cpu"))
    _two_ranks(monkeypatch)
    code, _, err = run(
        ["--steps", "2", *FAST, "--out", tmp_path, "--mode", "coat", "--fp8-weight-cache"], capsys
    )
    assert code == 2 and "--fp8-weight-cache does not apply under --fsdp" in err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "differ, named",
    [({"mode": "bf16"}, "--mode"), ({"seed": 1, "steps": 6}, "--seed, --steps"),
     ({}, "the data read")],
)  # fmt: skip
def test_ranks_started_with_other_settings_are_refused(monkeypatch, differ, named):
    """Under torchrun every rank must run rank 0's options on rank 0's data: a rank started
    otherwise (nodes launched apart) trained other numbers silently, hung or aborted. Each
    rank's options are compared as given, before its checks fill in defaults."""
    import argparse
    import types

    args = argparse.Namespace(mode="coat", seed=0, steps=4, data="a.txt", keep=None)
    job = types.SimpleNamespace(tasks=[types.SimpleNamespace(fingerprint="f00")])

    def plan():
        args.keep = 3  # a default filled in
        return cli.Plan(None, None, job, None, None, None)

    def gather(out, mine):
        other = {**mine, "args": {**mine["args"], **differ}}
        if not differ:
            other["data"] = ["f01"]
        out[:] = [mine, other]

    monkeypatch.setattr(cli.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(cli.dist, "all_gather_object", gather)
    with pytest.raises(cli.UsageError, match=rf"rank 1 was started with other .*\({named}\)"):
        cli._agreed(args, plan)
    monkeypatch.setattr(cli.dist, "all_gather_object", lambda out, mine: out.__setitem__(
        slice(None), [mine, mine]))  # fmt: skip
    assert cli._agreed(args, plan).job is job  # the same everywhere: nothing to say


def _two_ranks(monkeypatch, other_error: str | None = None):
    """One rank of two under a stand-in process group: the other rank's checks end with
    ``other_error`` ("": they pass; None: as this rank's)."""

    def gather(out, mine):
        if other_error is None:
            out[:] = [mine, mine]
        else:
            other = {**mine, "data": None if other_error else mine["data"], "error": other_error}
            out[:] = [mine, other]

    monkeypatch.setattr(cli.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(cli.dist, "all_gather_object", gather)


def test_an_error_some_ranks_find_is_said_by_them(monkeypatch):
    """A check failing on one rank only (a file missing on one node) was said by
    nobody: rank 0 alone printed errors, and it had passed. The failing rank now says it,
    naming its rank; a rank whose checks passed stops without a word; an error every rank
    found is raised as it is (rank 0 says it once)."""
    import argparse
    import types

    args = argparse.Namespace(data="a.txt")
    job = types.SimpleNamespace(tasks=[types.SimpleNamespace(fingerprint="f00")])

    def passes():
        return cli.Plan(None, None, job, None, None, None)

    def fails():
        raise cli.DataError("--data a.txt: no such file")

    _two_ranks(monkeypatch, other_error="DataError: --data a.txt: no such file")
    with pytest.raises(cli.OtherRankFailed):
        cli._agreed(args, passes)
    with pytest.raises(cli.DataError) as raised:
        cli._agreed(args, fails)
    assert not isinstance(raised.value, cli.RankUsageError)
    _two_ranks(monkeypatch, other_error="")
    with pytest.raises(cli.RankUsageError, match="^--data a.txt: no such file$"):
        cli._agreed(args, fails)
    _two_ranks(monkeypatch, other_error="another message")
    with pytest.raises(cli.RankUsageError, match="^--data a.txt: no such file$"):
        cli._agreed(args, fails)


def test_out_in_use_wins_over_what_other_ranks_find_there(monkeypatch):
    """Under torchrun a second run on a busy --out got rank 0's "in use" line and
    rank 1's finding of the running run's checkpoints ("an earlier run's: delete them");
    every rank raises rank 0's line (said once, by rank 0)."""
    import argparse

    from coat_models.train.outdir import OutInUse

    args = argparse.Namespace(data="a.txt")
    theirs = "UsageError: /o/coat holds checkpoints of an earlier run: delete them"
    _two_ranks(monkeypatch, other_error=theirs)

    def busy():
        raise OutInUse("--out /o is in use by another coat-train (PID 7)")

    with pytest.raises(cli.UsageError, match="^--out /o is in use") as raised:
        cli._agreed(args, busy)
    assert not isinstance(raised.value, cli.RankUsageError)

    def other(out, mine):  # this rank found the files; rank 0 (the other) the lock
        out[:] = [{**mine, "error": "OutInUse: --out /o is in use by another coat-train"},
                  mine]  # fmt: skip

    monkeypatch.setattr(cli.dist, "all_gather_object", other)

    def finds():
        raise cli.UsageError("/o/coat holds checkpoints of an earlier run: delete them")

    with pytest.raises(cli.UsageError, match="^--out /o is in use by another coat-train$"):
        cli._agreed(args, finds)


def test_an_error_of_one_rank_is_reported_with_its_rank(monkeypatch, capsys, tmp_path):
    """Through main(): the rank that failed alone prints one line naming its rank (exit 2);
    the rank whose checks passed prints nothing (exit 2)."""
    monkeypatch.setattr(cli, "_strategy", lambda args: "ddp")  # (as under torchrun)
    monkeypatch.setattr(cli, "_rank_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(cli, "process_rank", lambda: 1)
    _two_ranks(monkeypatch, other_error="")
    argv = ["--steps", "2", *FAST, "--out", str(tmp_path / "o"), "--mode", "bf16"]
    own_data = [a for a in argv if a not in ("--corpus-mib", "1")]
    code = cli.main([*own_data, "--data", str(tmp_path / "missing.txt")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("coat-train: error: rank 1: --data ") and err.count(
        "\n") == 1, err  # fmt: skip
    _two_ranks(monkeypatch, other_error="--data x: no such file")
    code = cli.main(argv)  # (the built-in corpus: this rank's checks pass)
    assert code == 2 and capsys.readouterr() == ("", "")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("other", ["same", "passes"])
def test_an_os_error_in_the_checks_is_exchanged_too(monkeypatch, capsys, tmp_path, rank, other):
    """An error outside the input errors (an unreadable --data: OSError) skipped the
    exchange: that rank left alone (the others' collective broke into a traceback) and an
    error every rank found was printed by each. Now: once by rank 0 when every rank found
    it, else by each rank that did, naming itself; exit 1 either way."""

    def unreadable(*args):
        raise PermissionError(13, "Permission denied", "data.txt")

    monkeypatch.setattr(cli, "_strategy", lambda args: "ddp")  # (as under torchrun)
    monkeypatch.setattr(cli, "_rank_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(cli, "process_rank", lambda: rank)
    monkeypatch.setattr("coat_models.train.outdir.process_rank", lambda: rank)  # (say)
    monkeypatch.setattr(cli, "lm_job", unreadable)
    _two_ranks(monkeypatch, None if other == "same" else "")
    code = cli.main(["--steps", "2", *FAST, "--out", str(tmp_path / "o"), "--mode", "bf16"])
    err = capsys.readouterr().err
    assert code == 1
    if other == "same":
        want = "coat-train: error: data.txt: Permission denied\n" if rank == 0 else ""
    else:
        want = f"coat-train: error: rank {rank}: data.txt: Permission denied\n"
    assert err == want


# ---------------------------------------------------------------- probe of the CLI
def test_resume_compares_the_model_dir_s_config_not_its_path(tmp_path, capsys):
    """A resume took a config.json edited in place (another model trained on from the
    checkpoint, exit 0) and refused a byte-identical copy of the model dir elsewhere."""
    d = tmp_path / "model"
    preset_config("tiny", data_vocab=257).save_pretrained(d)
    args = ["--steps", 4, "--save-every", 2, "--no-export", "--out", tmp_path / "o"]
    args += ["--batch-size", 2, "--seq-len", 32, "--corpus-mib", 1, "--no-progress"]
    assert run(["--model-dir", d, *args], capsys)[0] == 0
    last = tmp_path / "o" / "bf16" / "checkpoints" / "step_0000004"
    shutil.rmtree(last)
    moved = tmp_path / "moved"
    shutil.copytree(d, moved)
    code, _, err = run(["--model-dir", moved, *args, "--resume"], capsys)
    assert code == 0, err
    shutil.rmtree(last)
    config = json.loads((moved / "config.json").read_text())
    config["rms_norm_eps"] = 0.1
    (moved / "config.json").write_text(json.dumps(config))
    code, _, err = run(["--model-dir", moved, *args, "--resume"], capsys)
    assert code == 2 and "--model-dir's config.json: checkpoint 'fingerprint " in err, err
    assert "(it changed)" in err and err.count("\n") == 1
    assert not last.exists()


def _saved_llama(path):
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    model = LlamaForCausalLM(preset_config("tiny", data_vocab=257))
    model.save_pretrained(path)
    return model


def test_model_dir_weights_missing_or_not_finite_are_refused(tmp_path, capsys):
    """Weights without some of the model's tensors (a base model's or a classifier's
    checkpoint) trained with those random, exit 0; weights with NaNs stopped at step 1
    blaming --lr. Both are one line, exit 2, naming the tensors."""
    from safetensors.torch import load_file, save_file

    argv = ["--steps", 2, "--batch-size", 2, "--seq-len", 32, "--corpus-mib", 1, "--no-progress"]
    missing, nan = tmp_path / "missing", tmp_path / "nan"
    for d in (missing, nan):
        _saved_llama(d)
    weights = load_file(missing / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight" and "layers.1.mlp"
               not in k}, missing / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    weights["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(weights, nan / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()  # (save_pretrained's bar)
    code, _, err = run(["--model-dir", missing, *argv, "--out", tmp_path / "o1"], capsys)
    assert code == 2 and "its weights lack lm_head.weight, model.layers.1.mlp." in err, err
    assert "and 1 more, which would start random" in err and err.count("\n") == 1
    code, _, err = run(["--model-dir", nan, *argv, "--out", tmp_path / "o2"], capsys)
    assert code == 2 and "values that are not finite (in model.layers.1.mlp.down_proj" in err
    assert err.count("\n") == 1 and "LOAD REPORT" not in err
    # Tensors the model does not use train on, with a one-line note (transformers' report of
    # them is quieted with the rest).
    weights["model.layers.1.mlp.down_proj.weight"][0, 0] = 0.0
    weights["model.extra.weight"] = torch.ones(3)
    save_file(weights, nan / "model.safetensors", metadata={"format": "pt"})
    code, _, err = run(["--model-dir", nan, *argv, "--out", tmp_path / "o3"], capsys)
    assert code == 0, err
    assert "weights hold tensors the model does not use: model.extra.weight\n" in err


def _tokenizer_dir(path, **special):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", *"abcdefghijklmnopqrstuvwxyz"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **special)
    fast.save_pretrained(path)
    LlamaForCausalLM(preset_config("tiny", data_vocab=257)).save_pretrained(path)


def test_text_data_a_tokenizer_cannot_read_is_refused(tmp_path, capsys):
    """With --model-dir's tokenizer: Latin-1 text trained as U+FFFD tokens, JSON records
    trained as text with their braces and keys, and the "longer than the specified maximum
    sequence length" warning was printed for the whole file; each is a one-line refusal
    now (exit 2), or silent."""
    d = tmp_path / "model"
    _tokenizer_dir(d, eos_token="</s>", model_max_length=16)
    capsys.readouterr()  # (save_pretrained's bar)
    argv = ["--model-dir", d, "--steps", 2, "--batch-size", 2, "--seq-len", 32, "--no-progress"]
    latin = tmp_path / "latin1.txt"
    latin.write_bytes(("caf\u00e9 na\u00efve " * 400).encode("latin-1"))
    code, _, err = run([*argv, "--data", latin, "--out", tmp_path / "o1"], capsys)
    assert code == 2 and f"--data {latin} is not UTF-8 text (byte 0xe9 at offset 3)" in err
    cut = tmp_path / "cut.txt"  # cut inside its last character (head -c N): text all the same
    cut.write_bytes(("the caf\u00e9 " * 400).encode()[:-2])
    code, _, err = run([*argv, "--data", cut, "--out", tmp_path / "o0"], capsys)
    assert code == 0, err
    records = tmp_path / "data.jsonl"
    records.write_text('{"text": "abc"}\n' * 400)
    code, _, err = run([*argv, "--data", records, "--out", tmp_path / "o2"], capsys)
    assert code == 2 and "coat-train reads plain text, not JSON records" in err
    text = tmp_path / "ok.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    code, _, err = run([*argv, "--data", text, "--out", tmp_path / "o3"], capsys)
    assert code == 0 and "longer than the specified maximum sequence length" not in err, err


def test_a_default_seq_len_too_long_for_the_model_says_it_is_the_default(tmp_path, capsys):
    """The error named --seq-len 1024, which the user never passed."""
    d = tmp_path / "model"
    config = preset_config("tiny", data_vocab=257)
    config.max_position_embeddings = 128
    config.save_pretrained(d)
    code, _, err = run(["--model-dir", d, "--out", tmp_path / "o", *SMALL], capsys)
    assert code == 2 and "--seq-len 1024 (the default) is longer than" in err, err


def test_compare_refuses_a_layer_that_only_the_probe_tells_apart_before_any_mode(tmp_path, capsys):
    """Granite's layers have Llama's modules but scale the residual: --compare bf16,coat
    trained and exported bf16 before coat's conversion probed a layer and refused it."""
    import transformers

    one = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, vocab_size=320)  # fmt: skip
    d = tmp_path / "granite"
    transformers.GraniteConfig(**one, residual_multiplier=0.5).save_pretrained(d)
    out = tmp_path / "o"
    code, _, err = run(["--model-dir", d, "--compare", "bf16,coat", "--out", out, *FAST[2:]],
                       capsys)  # fmt: skip
    assert code == 2, err
    layer = "layer 0 of GraniteForCausalLM (GraniteDecoderLayer)"
    assert f"mode coat: apply_coat: {layer} is not supported: " in err
    assert "computes something else" in err and err.count("\n") == 1
    assert "apply_coat supports" not in err and len(err) < 400, err
    assert err.endswith("; train it in bf16 or coat-optim, or pass a Llama-shaped model\n")
    assert not out.exists()


def test_a_refused_later_layer_names_no_option_the_command_line_lacks(tmp_path, capsys):
    """SmolLM3's fourth layer (no RoPE) is refused after three passed: apply_coat's hint
    "module_filter_fn can leave such layers out" named an option coat-train has not."""
    import transformers

    config = transformers.SmolLM3Config(hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, vocab_size=320,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    d = tmp_path / "smollm3"
    config.save_pretrained(d)
    out = tmp_path / "o"
    code, _, err = run(["--model-dir", d, "--mode", "coat", "--out", out, *FAST[2:]], capsys)
    assert code == 2 and "layer 3 of SmolLM3ForCausalLM" in err, err
    assert "module_filter_fn" not in err and err.count("\n") == 1
    assert not out.exists()
