"""Accuracy run (issue 6, benchmark 2): the 125m preset trained 2000 steps on the embedded
corpus with bf16 and with coat, same seed, data and schedule, through ``coat-train``.
Target: coat's final validation loss within 0.5% of bf16's (the paper's OLMo-1B gap: 0.43%).

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    BENCH_OUT=accuracy.json python packages/coat-models/benchmarks/bench_e2e_accuracy.py

Writes the loss curves (``<out>/<mode>/metrics.jsonl``), ``<out>/loss.png`` and
``<out>/summary.json`` (default out: packages/coat-models/benchmarks/results/accuracy-125m);
extra arguments go to coat-train (e.g. ``--batch-size 8`` to halve the time). Not a pytest
module: run it as a script.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from coat_models.train import cli

OUT = Path(__file__).parent / "results" / "accuracy-125m"
TARGET_GAP = 0.005


def main(argv: list[str] | None = None) -> int:
    extra = sys.argv[1:] if argv is None else argv
    out = OUT
    if "--out" in extra:
        out = Path(extra[extra.index("--out") + 1])
    else:
        extra = [*extra, "--out", str(out)]
    code = cli.main(["--preset", "125m", "--compare", "bf16,coat", "--steps", "2000", *extra])
    if code:
        return code
    runs = {r["mode"]: r for r in json.loads((out / "summary.json").read_text())["runs"]}
    gap = runs["coat"]["val_loss"] / runs["bf16"]["val_loss"] - 1
    ok = abs(gap) <= TARGET_GAP
    print(
        f"\nval loss bf16 {runs['bf16']['val_loss']:.4f}, coat {runs['coat']['val_loss']:.4f}: "
        f"gap {gap * 100:+.3f}% (target within {TARGET_GAP * 100:.1f}%: "
        f"{'met' if ok else 'NOT met'})"
    )
    if os.environ.get("BENCH_OUT"):
        result = {
            "val_loss_gap": gap,
            "target": TARGET_GAP,
            "met": ok,
            "out": str(out),
            "runs": runs,
        }
        Path(os.environ["BENCH_OUT"]).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
