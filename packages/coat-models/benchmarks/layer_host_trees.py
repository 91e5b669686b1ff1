"""Host time of one Llama-2-7B-wide decoder layer (forward + backward), tree against tree.

Each tree is a checkout's ``packages/`` folder (e.g. an older commit unpacked with ``git archive
<commit> packages | tar -x -C /tmp/old``); every measurement runs in a fresh process whose
``PYTHONPATH`` holds that tree's four ``src`` folders, the trees alternating, so that all of
them share one host (a lent machine's host speed moves 2x between machines and within
minutes). The layer is built and converted through the public API only (``apply_coat(model)``
with its defaults), which every tree since the first has, so one script times them all.

Per tree, weights in fp32 under bf16 autocast (as coat-train trains) and in bf16, at batch 1
and 2 x seq 2048: the median over ``--rounds`` of the host time to enqueue one forward +
backward (no sync inside) and of its wall time (enqueue + synchronize). Every round first
updates each weight in place, as an optimizer step does, so the layer casts its weights again.
``--tree bf16=PATH`` times the model without ``apply_coat`` (BF16 eager) from that tree.

    git archive 87acba0 packages | tar -x -C /tmp/old
    python packages/coat-models/benchmarks/layer_host_trees.py \\
        --tree old=/tmp/old/packages --tree new=packages --tree bf16=packages --repeats 2

A diagnostic, not a training speed: coat-train's tokens/s are the numbers to report.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ("fp8-quant", "fp8-optim", "fp8-activations", "coat-models")
SEQ, HIDDEN, MLP, HEADS = 2048, 4096, 11008, 32


def _time(layer, x, grad, pos, autocast: bool, rounds: int) -> tuple[float, float]:
    """Median host and wall ms of ``layer``'s forward + backward on ``x``."""
    import torch

    params = list(layer.parameters())

    def step():
        x.grad = None
        for p in params:
            p.grad = None
        with torch.no_grad():
            for p in params:
                p.mul_(1)  # in place, as an optimizer step: the weights are cast again
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            out = layer(x, attention_mask=None, position_embeddings=pos)
        out.backward(grad)

    host, wall = host_wall(step, rounds, warmup=5)
    return statistics.median(host) * 1e3, statistics.median(wall) * 1e3


def host_wall(step, rounds: int, warmup: int) -> tuple[list[float], list[float]]:
    """Seconds per call of ``step()`` (after ``warmup`` calls), ``rounds`` times: the host's
    (until ``step`` returns, no sync inside) and the wall's (until the GPU is done too)."""
    import torch

    for _ in range(warmup):
        step()
    host, wall = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append(t1 - t0)
        wall.append(time.perf_counter() - t0)
    return host, wall


def measure(label: str, coat: bool, rounds: int) -> None:
    """Print one line per (weight dtype, batch): host and wall ms of a layer's fwd + bwd."""
    import torch
    from transformers import LlamaConfig, LlamaModel

    for dtype, name in ((torch.float32, "fp32 weights, autocast"), (torch.bfloat16, "bf16")):
        config = LlamaConfig(
            hidden_size=HIDDEN, intermediate_size=MLP, num_attention_heads=HEADS,
            num_key_value_heads=HEADS, num_hidden_layers=1, vocab_size=128,
            max_position_embeddings=SEQ, attn_implementation="sdpa",
        )  # fmt: skip
        torch.manual_seed(0)
        model = LlamaModel(config).to("cuda", dtype).train()
        if coat:
            from coat_models import apply_coat

            apply_coat(model)
        # RoPE's cos and sin in the weights' dtype (fp32 ones under autocast): bf16 q and k
        # times fp32 cos would be fp32 beside a bf16 v, which SDPA refuses.
        zeros = torch.zeros(1, SEQ, HIDDEN, device="cuda", dtype=dtype)
        pos = model.rotary_emb(zeros, torch.arange(SEQ, device="cuda")[None])
        for batch in (1, 2):
            x = torch.randn(batch, SEQ, HIDDEN, device="cuda", dtype=dtype, requires_grad=True)
            autocast = dtype == torch.float32
            host, wall = _time(model.layers[0], x, torch.randn_like(x), pos, autocast, rounds)
            print(f"{label}\t{name}\t{batch}\t{host:.3f}\t{wall:.3f}", flush=True)
        del model
        torch.cuda.empty_cache()


def _probe_ns() -> float:
    """Nanoseconds per empty Python call: how fast this host runs Python right now."""

    def f():
        pass

    t = time.perf_counter()
    for _ in range(1_000_000):
        f()
    return (time.perf_counter() - t) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--tree", action="append", default=[], metavar="LABEL=PACKAGES",
        help="a label and a packages/ folder; the label bf16 times BF16 eager",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--repeats", type=int, default=2, help="processes per tree, alternating")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        measure(args.child[0], args.child[1] == "coat", args.rounds)
        return 0
    if not args.tree:
        p.error("give at least one --tree LABEL=PATH")
    trees = []
    for item in args.tree:
        label, _, path = item.partition("=")
        root = Path(path)
        if not label or not all((root / pkg / "src").is_dir() for pkg in PACKAGES):
            p.error(f"--tree {item}: give LABEL=PATH with PATH a packages/ folder of this repo")
        trees.append((label, root))
    rows: dict[tuple, list] = {}
    print(f"host probe {_probe_ns():.0f} ns per Python call", flush=True)
    for _ in range(args.repeats):
        for label, root in trees:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                str((root / pkg / "src").resolve()) for pkg in PACKAGES))  # fmt: skip
            env.pop("TRITON_INTERPRET", None)
            mode = "bf16" if label == "bf16" else "coat"
            cmd = [sys.executable, __file__, "--child", label, mode, "--rounds", str(args.rounds)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode:
                print(out.stderr[-2000:], file=sys.stderr)
                return 1
            for line in out.stdout.splitlines():
                label_, name, batch, host, wall = line.split("\t")
                rows.setdefault((label_, name, batch), []).append((float(host), float(wall)))
    print(f"host probe {_probe_ns():.0f} ns per Python call")
    print(f"{'tree':8} {'weights':24} {'batch':>5}  host ms (each process)   wall ms (each)")
    for (label, name, batch), runs in rows.items():
        hosts = " ".join(f"{h:6.3f}" for h, _ in runs)
        walls = " ".join(f"{w:6.3f}" for _, w in runs)
        print(f"{label:8} {name:24} {batch:>5}  {hosts:22}   {walls}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
