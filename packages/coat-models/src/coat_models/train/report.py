"""coat-train's reports: the progress line (tqdm), ``metrics.jsonl`` (and TensorBoard), the
compare table, the loss plot (matplotlib: the optional extra ``coat-models[plot]``; without
it a run still writes its metrics and summaries) and the run's ``summary.json``."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
import time
from pathlib import Path

from tqdm import tqdm


class ReportError(RuntimeError):
    """A report cannot be written or read; the message says what to do."""


class MetricsFileError(ReportError):
    """A run's metrics file holds a line that is not a record: bad input the user repairs
    (coat-train exits 2), not a failure of the run."""


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}" if abs(n) < 100 * size else f"{n / size:.0f} {unit}"
    return f"{n} B"


class Progress:
    """The run's progress on stderr (tqdm). The trainer calls ``update`` only where it reads
    the step values from the device. On a terminal the bar is redrawn at each update;
    elsewhere (a log file, CI) one line is printed at every 10% of the run and at the end."""

    def __init__(self, label: str, total: int, stream=None, enabled: bool = True):
        self.label, self.total, self.enabled = label, total, enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        # The same on every rank (not tied to the terminal): trainers read values here.
        self.every = max(1, total // 10)
        self.t0 = time.perf_counter()
        self._bar = None

    def update(self, step: int, fields: dict, first_step: int = 1):
        """Show ``step`` of ``total`` with ``fields`` (name -> formatted value); a run
        resumed at ``first_step`` counts its rate from there."""
        if not self.enabled:
            return
        postfix = ", ".join(f"{k} {v}" for k, v in fields.items())
        if self.tty:
            if self._bar is None:
                self._bar = tqdm(
                    total=self.total,
                    initial=first_step - 1,
                    desc=f"[{self.label}]",
                    unit="step",
                    file=self.stream,
                    dynamic_ncols=True,
                    mininterval=0,  # the calls are already sparse: draw each one
                )
            self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(step - self._bar.n)
            if step == self.total:
                self.close()
        elif step % self.every == 0 or step == self.total:
            line = tqdm.format_meter(
                step,
                self.total,
                time.perf_counter() - self.t0,
                prefix=f"[{self.label}]",
                ascii=True,  # a log file may not be read as UTF-8
                unit="step",
                postfix=postfix,
                initial=first_step - 1,
            )
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self):
        """End the terminal bar (its line stays); the trainers call it when they stop."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write to a temporary name, then rename: readers never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data if isinstance(data, bytes) else data.encode())
        os.replace(tmp, path)
    except OSError as e:  # e.g. a full disk: no half-written temporary left behind
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise _naming(e, path) from None


def _naming(e: OSError, path: Path) -> OSError:
    """``e`` naming ``path`` (the file being written), for the one-line error."""
    return OSError(e.errno, e.strerror or str(e), str(path)) if e.errno else e


TENSORBOARD_HINT = (
    "--report-to tensorboard needs the tensorboard package: pip install tensorboard "
    "(or pip install 'coat-models[tensorboard]'), or leave out --report-to"
)


class MetricsLog:
    """A run's ``metrics.jsonl`` (one JSON record per line, tagged with the mode) and, with
    ``tensorboard=True``, every number of a record but ``step`` and ``eval_batches`` as the
    TensorBoard scalar ``<type>/<name>`` in ``dir/tensorboard``. ``resume_step``: keep the
    records up to that step (a resumed run rewrites what came after); ``reevaluated``: also
    drop the evaluation record of that step (a run resumed at its last step evaluates again,
    with its own ``--eval-batches``).
    ``enabled=False`` (ranks other than 0) writes nothing."""

    def __init__(
        self,
        directory: Path,
        mode: str,
        *,
        resume_step: int | None = None,
        reevaluated: bool = False,
        tensorboard: bool = False,
        enabled: bool = True,
    ):
        self.mode, self._file, self._board = mode, None, None
        if not enabled:
            return
        path = self._path = Path(directory) / "metrics.jsonl"
        kept = [] if resume_step is None else metrics_until(path, resume_step)
        if reevaluated:
            kept = [line for line in kept if not _eval_at(line, resume_step)]
        write_atomic(path, "".join(kept))
        self._file = open(path, "a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ReportError(TENSORBOARD_HINT) from None
            # purge_step: TensorBoard hides what an earlier run logged at and after that step.
            # After the checkpoint's step, as the run rewrites that; at it when the run
            # evaluates that step again, and then the kept records of the step are logged anew.
            purge = None if resume_step is None else resume_step + (not reevaluated)
            self._board = SummaryWriter(str(Path(directory) / "tensorboard"), purge_step=purge)
            if reevaluated:
                for line in kept:
                    record = json.loads(line)
                    if record["step"] == resume_step:
                        self._scalars(record)

    def write(self, record: dict) -> None:
        if self._file is not None:
            try:
                self._file.write(
                    json.dumps({"mode": self.mode, **strict(record)}, allow_nan=False) + "\n"
                )
                self._file.flush()
            except OSError as e:  # e.g. a full disk
                raise _naming(e, self._path) from None
        if self._board is not None:
            self._scalars(record)

    def _scalars(self, record: dict) -> None:
        for name, value in record.items():
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if number and name not in ("step", "eval_batches"):
                self._board.add_scalar(f"{record['type']}/{name}", value, record["step"])

    def close(self) -> None:
        file, board, self._file, self._board = self._file, self._board, None, None
        try:
            if board is not None:
                board.close()
        finally:
            if file is not None:
                try:
                    file.close()
                except OSError as e:
                    raise _naming(e, self._path) from None

    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        if kind is None:
            self.close()
        else:  # the error on the way out is the one to report
            with contextlib.suppress(OSError):
                self.close()


def strict(record: dict) -> dict:
    """``record`` with each number that is not finite (a diverged run's last loss or
    gradient norm) as ``None``: strict JSON has no NaN or Infinity, and JSON readers other
    than Python's refuse the bare ``NaN`` that ``json.dumps`` writes by default."""
    return {k: _strict_value(v) for k, v in record.items()}


def _strict_value(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return strict(v)
    if isinstance(v, list | tuple):
        return [_strict_value(x) for x in v]
    return v


def _eval_at(line: str, step: int) -> bool:
    record = json.loads(line)
    return record.get("type") == "eval" and record["step"] == step


def train_steps(lines: list[str]) -> set[int]:
    """The steps of the training records among ``metrics_until``'s lines."""
    records = (json.loads(line) for line in lines)
    return {r["step"] for r in records if r.get("type") == "train"}


def metrics_until(path: Path, step: int) -> list[str]:
    """Lines of a metrics file up to ``step``. A torn last line (killed while writing it) is
    dropped: its step is after the checkpoint, written once the step's lines are out."""
    if not path.is_file():
        return []
    lines = path.read_text(errors="replace").splitlines(True)
    kept = []
    for number, line in enumerate(lines, 1):
        last = number == len(lines)
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not line.endswith("\n") or not isinstance(record.get("step"), int):
                raise ValueError("torn")
        except (ValueError, AttributeError):
            if last:
                break
            raise MetricsFileError(
                f"{path} line {number} is not a metrics record: repair or delete the file "
                "(the run's checkpoints do not depend on it)"
            ) from None
        if record["step"] <= step:
            kept.append(line)
    return kept


def curves(path: Path) -> dict:
    """``{"train": (steps, losses), "val": (steps, val losses)}`` of a ``metrics.jsonl``."""
    train, val = ([], []), ([], [])
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        dst, key = (train, "loss") if rec["type"] == "train" else (val, "val_loss")
        dst[0].append(rec["step"])
        dst[1].append(rec[key])
    return {"train": train, "val": val}


def write_run_report(out: Path, run: dict, summaries: list[dict], curves: dict) -> str:
    """Loss plot (with matplotlib), ``out/summary.json`` (``run`` plus the per-mode
    ``summaries`` and the plot's path) and the text to print: the compare table and where
    everything is."""
    png = out / "loss.png"
    try:
        write_atomic(png, loss_plot_png(curves))
        plot_line = f"loss curves: {png}"
    except PlotUnavailable as e:
        png.unlink(missing_ok=True)  # an earlier run's picture is not this run's
        png = None
        plot_line = f"loss curves: not drawn, {e}"
    result = {**run, "runs": summaries, "plot": None if png is None else str(png)}
    write_atomic(out / "summary.json", json.dumps(result, indent=1))
    metrics = ", ".join(str(out / s["mode"] / "metrics.jsonl") for s in summaries)
    exports = [s["export"] for s in summaries if s.get("export")]
    board_line = []
    if any((out / s["mode"] / "tensorboard").is_dir() for s in summaries):  # --report-to
        board_line = [f"tensorboard: tensorboard --logdir {out} (event files in MODE/tensorboard)"]
    return "\n".join([
        "", format_table(summaries), "", plot_line,
        f"metrics:     {metrics}",
        *board_line,
        f"models:      {', '.join(exports) or 'not exported (--no-export)'}",
        f"summary:     {out / 'summary.json'}",
    ])  # fmt: skip


def format_table(summaries: list[dict]) -> str:
    """Side-by-side table of runs; with two or more, ratios against the first run."""
    mem = [s["memory"] for s in summaries]
    measured = all(m["measured_peak"] is not None for m in mem)
    world = summaries[0].get("world_size", 1)
    per = "" if world == 1 else f" per {'GPU' if mem[0]['device'] == 'cuda' else 'rank'}"
    spans = [tuple(s.get("timed_steps") or (0, None, None)) for s in summaries]
    n, first, last = spans[0]
    if len(set(spans)) > 1:  # e.g. modes resumed from different steps: no one label fits
        timed = " (timed steps differ by run: see summary.json)"
    elif not n:
        timed = ""
    elif n == last - first + 1:
        timed = f" (steps {first}-{last})" if n > 1 else f" (step {first})"
    else:
        timed = f" ({n} steps of {first}-{last})"
    window = summaries[0]["train_loss_window"]
    rows = [
        (f"train loss (mean of last {window} steps)", [s["train_loss"] for s in summaries], "loss"),
        ("val loss (held-out split)", [s["val_loss"] for s in summaries], "loss"),
        (f"tokens/s{per}{timed}", [s["tokens_per_s"] for s in summaries], "rate"),
    ]
    parts = {
        "tracked_peak": "  tracked tensors at their peak",
        "weights": "    weights",
        "weight_copies": "    weight copies (casts, FP8 caches)",
        "gradients": "    gradients",
        "optimizer_state": "    optimizer state",
        "activations": "    activations (saved for backward)",
        "plan_buffers": "    launch-plan buffers (arenas, scratch)",
        "other": "  other (peak - tracked)",
    }
    if not any(m.get("plan_buffers") for m in mem):  # (no plans; older summaries: no key)
        del parts["plan_buffers"]
    if measured:
        parts = {"measured_peak": f"peak memory{per} ({mem[0]['measured_by']})", **parts}
    else:  # no peak to subtract from
        parts["tracked_peak"] = f"peak memory{per} (tracked tensors)"
        del parts["other"]
    rows += [(name, [m.get(key) for m in mem], "bytes") for key, name in parts.items()]
    fmt = {
        "loss": lambda v: "n/a" if v is None else f"{v:.4f}",
        "rate": lambda v: "n/a" if v is None else f"{v:,.0f}",
        "bytes": fmt_bytes,
    }
    base = summaries[0]["mode"]
    head = [""] + [f"{s['mode']} ({s['master_dtype']} master)" for s in summaries]
    head += [f"{s['mode']}/{base}" for s in summaries[1:]]
    body = []
    for name, vals, kind in rows:
        cells = [name] + [fmt[kind](v) for v in vals]
        for v in vals[1:]:
            if vals[0] in (None, 0) or v is None:
                cells.append("")
            elif kind == "loss":
                cells.append(f"{(v / vals[0] - 1) * 100:+.2f}%")
            else:
                cells.append(f"{v / vals[0]:.2f}x")
        body.append(cells)
    widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [head] + body
    ]
    notes = ["", MEMORY_NOTE[mem[0]["device"] == "cuda"]]
    graphed = [s["mode"] for s in summaries if s.get("cuda_graphs")]
    if graphed:
        notes[-1] += (
            f" With CUDA graphs ({', '.join(graphed)}; --no-cuda-graphs: eager), other includes "
            "the graphs' memory pool: the recorded layers' activations and gradient buffers."
        )
    for s in summaries:
        if not s.get("config", {}).get("launch_plans"):
            continue
        refused = s.get("launch_plan_refusals") or []
        replays = s.get("launch_plan_replays", 0)
        total = replays + s.get("launch_plan_eager_steps", 0)
        line = f"launch plans ({s['mode']}): {replays:,} of {total:,} layer steps replayed"
        retries = s.get("launch_plan_check_retries", 0)
        if retries:
            line += (
                f"; plan checks replayed a record {retries} more time{'s' * (retries != 1)} "
                "after a replay that differed from it (a nondeterministic kernel)"
            )
        if refused:
            n = len(refused)
            line += (
                f"; plans refused {n} time{'s' * (n != 1)} (a layer at a key, or at its cap of "
                f"keys), e.g. {refused[0]}"
            )
        notes.append(line)
    if world > 1:
        notes.append(
            f"{world} ranks ({summaries[0]['parallel']['strategy']}): tokens/s and memory{per}"
            " (the slowest rank's tokens/s, the memory of the rank with the highest peak); "
            "losses: mean over the micro-batches of all ranks."
        )
    return "\n".join(lines + notes)


MEMORY_NOTE = {
    True: "memory: peak = torch.cuda.max_memory_allocated over the run; the parts are tensor "
    "bytes at their joint peak (weights, copies of weights, gradients, optimizer state, tensors "
    "saved for backward); other = peak - parts: temporaries inside ops and caches.",
    False: "memory: CPU has no allocator statistics; peak = tensor bytes of weights, copies of "
    "weights, gradients, optimizer state and tensors saved for backward at their joint peak. "
    "Not counted: temporaries inside ops (tests: about 10% of a step's peak for bf16, 38% for "
    "COAT's plain-PyTorch CPU path).",
}


PLOT_HINT = "pip install 'coat-models[plot]' (matplotlib) to get loss.png"


class PlotUnavailable(ImportError):
    """matplotlib is not installed; the message says how to install it."""


def loss_figure(runs: dict[str, dict]):
    """A matplotlib ``Figure`` of loss curves. ``runs``: name -> ``{"train": (steps,
    losses), "val": (steps, losses)}``; per run a thin train line and a thick validation line
    in one colour (``C0``, ``C1``, ...). Raises ``PlotUnavailable`` without matplotlib."""
    try:
        # Figure alone, not pyplot: no global state, no GUI backend, safe in any process.
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailable(f"matplotlib is not installed: {PLOT_HINT}") from None
    fig = Figure(figsize=(9, 5.6), dpi=100, layout="constrained")
    ax = fig.subplots()
    for i, (name, run) in enumerate(runs.items()):
        colour = f"C{i}"
        ax.plot(*run["train"], color=colour, alpha=0.45, linewidth=1, label=f"{name} train")
        if len(run["val"][0]):
            ax.plot(*run["val"], color=colour, linewidth=2.5, marker="o", label=f"{name} val")
    ax.set(title="loss vs step", xlabel="optimizer step", ylabel="loss (nats)")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def loss_plot_png(runs: dict[str, dict]) -> bytes:
    """``loss_figure(runs)`` as PNG bytes (900 x 560 pixels)."""
    buf = io.BytesIO()
    loss_figure(runs).savefig(buf, format="png")
    return buf.getvalue()
