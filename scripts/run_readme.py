"""Run the ```python blocks of README files the way a reader pastes them, so that a broken
example fails a check instead of a user.

    python scripts/run_readme.py packages/fp8-quant/README.md [MORE.md ...]

Each block runs in a fresh namespace (a new ``__main__``-like dict per block): a block that
uses a name only an earlier block defines fails with NameError, so every block must carry its
own imports and setup, as for a reader who pastes just that block. The blocks still share one
interpreter (imported modules, torch's global state) and, in order, one fresh temporary
working directory, so what they write lands nowhere and the checkout's ``packages/`` is not
importable by accident: the installed packages run. A traceback points at the README's own
line numbers.

A block states what it needs beyond its package with an HTML comment (invisible on GitHub)
on the line right above its fence:

    <!-- readme: needs cuda -->                      skipped without a CUDA GPU
    <!-- readme: needs transformers accelerate -->   skipped unless these modules import
    <!-- readme: needs torchrun -->                  a whole program: run on its own under
                                                     `torchrun --standalone --nproc-per-node 2`
                                                     (gloo on CPU, also on a host with fewer
                                                     GPUs than that), not in this process

Skipped blocks are listed with their reason. Exit status: 0 when every block that ran
passed, 1 when one failed, 2 for bad arguments (a missing file, a README without a python
block, an unknown marker).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^```python\s*$")
MARKER = re.compile(r"^<!--\s*readme:\s*(.*?)\s*-->\s*$")
TORCHRUN_PROCS = 2
TORCHRUN_TIMEOUT_S = 600


class ReadmeError(ValueError):
    """A README the runner cannot check (no python block, a malformed marker)."""


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the block's first code line
    code: str
    needs: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def torchrun(self) -> bool:
        return "torchrun" in self.needs


def python_blocks(path: Path) -> list[Block]:
    """Every fenced ```python block of ``path``, with the needs its marker line states."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if not FENCE.match(lines[i]):
            i += 1
            continue
        needs: tuple[str, ...] = ()
        marker = MARKER.match(lines[i - 1]) if i > 0 else None
        if marker:
            words = marker.group(1).split()
            if not words or words[0] != "needs" or len(words) < 2:
                raise ReadmeError(
                    f"{path}:{i}: a readme marker reads `<!-- readme: needs WHAT ... -->`, "
                    f"got {lines[i - 1]!r}"
                )
            needs = tuple(words[1:])
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        if end == len(lines):
            raise ReadmeError(f"{path}:{i + 1}: the ```python block is never closed")
        blocks.append(Block(Path(path), i + 2, "\n".join(lines[i + 1 : end]) + "\n", needs))
        i = end + 1
    if not blocks:
        raise ReadmeError(f"{path}: no ```python block to run")
    return blocks


def missing(block: Block) -> list[str]:
    """What ``block`` needs that this environment lacks (empty: it can run)."""
    out = []
    for need in block.needs:
        if need == "torchrun":
            continue  # torch itself: every package here depends on it
        if need == "cuda":
            import torch

            if not torch.cuda.is_available():
                out.append("a CUDA GPU")
        elif importlib.util.find_spec(need) is None:
            out.append(f"module {need}")
    return out


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_torchrun(block: Block, workdir: Path) -> None:
    """Run ``block`` as a program of its own under torchrun, in ``workdir``."""
    script = workdir / f"readme_line{block.line}.py"
    # Padding keeps the README's line numbers in tracebacks.
    script.write_text("\n" * (block.line - 1) + block.code, encoding="utf-8")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={TORCHRUN_PROCS}", str(script)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if _cuda_devices() < TORCHRUN_PROCS:  # one GPU per process, or all on CPU (gloo)
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{block.where}: the block failed under torchrun (exit {proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )


def run_readme(path: Path, *, torchrun: bool = True, log=print) -> list[tuple[Block, str]]:
    """Run the python blocks of ``path`` in order, each in a fresh namespace; returns
    ``(block, "ran" | "skipped: why")`` for each. Raises the first failing block's exception
    (its traceback names the README line). ``torchrun=False`` leaves out the blocks that need
    torchrun (they take a while)."""
    path = Path(path).resolve()
    blocks = python_blocks(path)
    results = []
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="readme-") as tmp:
        os.chdir(tmp)
        try:
            for block in blocks:
                lacking = missing(block)
                if lacking or (block.torchrun and not torchrun):
                    why = ", ".join(lacking) if lacking else "torchrun blocks not asked for"
                    results.append((block, f"skipped: needs {why}"))
                    log(f"{block.where}: skipped (needs {why})")
                    continue
                log(f"{block.where}: running")
                if block.torchrun:
                    run_torchrun(block, Path(tmp))
                else:
                    # A fresh namespace per block: what a reader pastes alone must run alone.
                    padded = "\n" * (block.line - 1) + block.code
                    exec(compile(padded, str(path), "exec"), {"__name__": "__main__"})  # noqa: S102
                results.append((block, "ran"))
        finally:
            os.chdir(cwd)
    return results


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    paths = [Path(a) for a in argv]
    for p in paths:
        if not p.is_file():
            print(f"run_readme: error: no such file: {p}", file=sys.stderr)
            return 2
    failed = 0
    for p in paths:
        try:
            results = run_readme(p)
        except ReadmeError as e:
            print(f"run_readme: error: {e}", file=sys.stderr)
            return 2
        except Exception:
            traceback.print_exc()
            print(f"run_readme: FAILED {p}", file=sys.stderr)
            failed += 1
            continue
        ran = sum(status == "ran" for _, status in results)
        print(f"run_readme: {p}: {ran} blocks ran, {len(results) - ran} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
