"""Import structure of coat_models: no module imports a module that imports it back
(directly or around a longer loop, at module level or inside a function), and each module
imports alone in a fresh interpreter."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import coat_models

SRC = Path(coat_models.__file__).parent
PACKAGE = "coat_models"
MODULES = sorted(p.stem for p in SRC.glob("*.py"))


def _target(name: str) -> str:
    """The module node of ``coat_models.<name>``: the submodule when it is a file, else the
    package (``from coat_models import apply_coat`` runs ``__init__``)."""
    return name if (SRC / f"{name}.py").is_file() else "__init__"


def imports_of(module: str) -> set[str]:
    """The coat_models modules that ``module`` imports anywhere in its file."""
    tree = ast.parse((SRC / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == PACKAGE:
                    found.add(_target(parts[1]) if len(parts) > 1 else "__init__")
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and (node.module or "").split(".")[0] != PACKAGE:
                continue
            if node.level > 1:
                raise AssertionError(f"{module}: relative import above the package")
            path = (node.module or "").split(".")
            path = path[1:] if node.level == 0 else path
            path = [p for p in path if p]
            if path:
                found.add(_target(path[0]))
            else:  # from . import a, b / from coat_models import a, b
                found |= {_target(alias.name) for alias in node.names}
    found.discard(module)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop in ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state:
                loop = visit(nxt, path + [node])
                if loop is not None:
                    return loop
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            loop = visit(node, [])
            if loop is not None:
                return loop
    return None


def test_scanner_sees_loops():
    # The check itself can fail: a planted loop and the lazy import this refactor removed.
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert "vila" in imports_of("convert") and "llama" in imports_of("convert")
    assert "blocks" in imports_of("graphs")


def test_no_import_cycles():
    graph = {m: imports_of(m) for m in MODULES}
    loop = find_cycle(graph)
    assert loop is None, "import loop: " + " -> ".join(loop)
    # The loops this package had: graphs <-> llama, llama <-> vila.
    assert "llama" not in graph["graphs"] and "vila" not in graph["llama"]


def test_each_module_imports_alone():
    """A fresh interpreter per module (all started at once: import time is mostly torch)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = {
        m: subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import {PACKAGE}.{m}" if m != "__init__" else f"import {PACKAGE}",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for m in MODULES
    }
    failed = {}
    for m, proc in procs.items():
        _, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            failed[m] = err.strip().splitlines()[-1:]
    assert not failed, failed
