"""Import structure of coat_models: no module imports a module that imports it back
(directly or around a longer loop, at module level or inside a function), and each module
imports alone in a fresh interpreter."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import coat_models
import pytest

SRC = Path(coat_models.__file__).parent
PACKAGE = "coat_models"
# Dotted names below coat_models: "convert", "train.cli"; a package is named by its
# __init__ ("__init__", "train.__init__").
MODULES = sorted(
    ".".join(p.relative_to(SRC).with_suffix("").parts)
    for p in SRC.rglob("*.py")
    if "__pycache__" not in p.parts
)
TRAINER = "train"  # the training product; the integration must not import it


def _package_of(module: str) -> list[str]:
    """The package path holding ``module``: [] for coat_models itself, ["train"], ..."""
    return module.split(".")[:-1]


def _target(parts: list[str]) -> str:
    """The module node of ``coat_models.<parts>``: the submodule when it is a file, else the
    package's ``__init__`` (``from coat_models import apply_coat`` runs ``__init__``)."""
    name = ".".join(parts)
    if not parts:
        return "__init__"
    if (SRC / Path(*parts)).with_suffix(".py").is_file():
        return name
    return f"{name}.__init__"


def _is_module(parts: list[str]) -> bool:
    path = SRC / Path(*parts)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(module: str) -> set[str]:
    """The coat_models modules that ``module`` imports anywhere in its file."""
    tree = ast.parse((SRC / Path(*module.split("."))).with_suffix(".py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == PACKAGE:
                    found.add(_target(parts[1:]))
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] != PACKAGE:
                    continue
                base = parts[1:]
            else:
                package = _package_of(module)
                if node.level - 1 > len(package):
                    raise AssertionError(f"{module}: relative import above the package")
                base = package[: len(package) - (node.level - 1)]
                base += [p for p in (node.module or "").split(".") if p]
            # from . import a / from coat_models.train import cli: the submodules; names
            # that are not modules are attributes of ``base`` (its file or __init__).
            subs = [[*base, a.name] for a in node.names if _is_module([*base, a.name])]
            found |= {_target(sub) for sub in subs}
            if len(subs) < len(node.names):
                found.add(_target(base))
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
    assert {"checkpoint", "distributed", "train.data"} <= imports_of("train.trainer")


def test_no_import_cycles():
    graph = {m: imports_of(m) for m in MODULES}
    loop = find_cycle(graph)
    assert loop is None, "import loop: " + " -> ".join(loop)
    # The loops this package had: graphs <-> llama, llama <-> vila.
    assert "llama" not in graph["graphs"] and "vila" not in graph["llama"]


def test_integration_does_not_import_the_trainer():
    """The library (apply_coat, the optimizer, the multi-GPU helpers) must not know the trainer
    exists; the trainer builds on it."""
    integration = [m for m in MODULES if not m.startswith(f"{TRAINER}.")]
    assert {"convert", "distributed", "checkpoint"} <= set(integration)
    uses = {m: {t for t in imports_of(m) if t.startswith(f"{TRAINER}.")} for m in integration}
    uses = {m: t for m, t in uses.items() if t}
    assert uses == {}


# Run in one fresh interpreter: the libraries every module builds on are imported once, then a
# forked child per module imports that module alone (no other coat_models module loaded) and
# exits 0, or prints the error's last line and exits 1. A fresh interpreter per module would
# import torch ~35 times: two minutes of a 2-core CI machine for the same check.
_FORK_EACH = """
import json, os, sys, traceback
import torch, transformers, transformers.modeling_utils, triton
import fp8_quant, fp8_optim, fp8_activations
assert not any(m == "coat_models" or m.startswith("coat_models.") for m in sys.modules)
failed = {}
for name in json.loads(sys.argv[1]):
    sys.stdout.flush(); sys.stderr.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            __import__(name)
            os._exit(0)
        except BaseException:
            os.write(w, traceback.format_exc().strip().splitlines()[-1].encode())
            os._exit(1)
    os.close(w)
    with os.fdopen(r) as f:
        err = f.read()
    if os.waitpid(pid, 0)[1] != 0:
        failed[name] = err or "exited without a message"
print(json.dumps(failed))
"""


def _import_each(names: list[str], *paths: str) -> dict:
    """{module: last line of its error} for each of ``names`` that fails to import alone
    (``paths`` put in front of this process's ``sys.path``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, *sys.path])}
    run = subprocess.run(
        [sys.executable, "-c", _FORK_EACH, json.dumps(names)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


# The check itself can fail: a module whose import raises must be reported, with its error.
PLANTED = "import coat_models.convert\nraise ImportError('planted')\n"


@pytest.fixture(scope="module")
def import_each_failed(tmp_path_factory):
    """One ``_FORK_EACH`` run (one torch import, not one per test) over every coat_models
    module and a planted broken one (each imported in its own forked child, so the planted
    module cannot break the others' imports): what failed."""
    planted = tmp_path_factory.mktemp("planted")
    (planted / "broken_mod.py").write_text(PLANTED)
    names = [
        ".".join([PACKAGE, *m.split(".")[:-1]]) if m.endswith("__init__") else f"{PACKAGE}.{m}"
        for m in MODULES
    ]
    assert {"coat_models", "coat_models.train.cli", "coat_models.llama"} <= set(names)
    return names, _import_each([*names, "broken_mod"], str(planted))


@pytest.mark.slow
@pytest.mark.xdist_group("import_each")  # one worker: the module's fixture computed once
def test_each_module_imports_alone(import_each_failed):
    names, failed = import_each_failed
    assert not {n: e for n, e in failed.items() if n in names}, failed


@pytest.mark.slow
@pytest.mark.xdist_group("import_each")
def test_import_check_sees_a_broken_module(import_each_failed):
    # The planted module, which imports coat_models.convert (that one fine) and then raises,
    # is reported with its error, and nothing else is.
    _, failed = import_each_failed
    assert failed == {"broken_mod": "ImportError: planted"}


_INTERRUPTED_IMPORT = """
import sys

class Interrupts:  # a Ctrl-C while torch is being imported
    @staticmethod
    def find_spec(name, *args):
        if name == "torch":
            raise KeyboardInterrupt
        return None

import coat_models, coat_models.train
assert "torch" not in sys.modules and "transformers" not in sys.modules, "imported eagerly"
sys.meta_path.insert(0, Interrupts)
sys.exit(coat_models.train.main())
"""


# Each child first takes SIGINT as a terminal's foreground job does (Python's handler, not
# blocked): a child inherits an ignored or blocked SIGINT, and once the test worker's was
# either, the Ctrl-C never came (a full run, status 0).
_AS_FROM_A_TERMINAL = """
import signal
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
"""

_WRAPPED_INTERRUPT = """
import os, signal, sys

class Wraps:  # a Ctrl-C while torch is being imported, turned into its own error by a library
    @staticmethod
    def find_spec(name, *args):
        if name == "torch":
            try:
                os.kill(os.getpid(), signal.SIGINT)
            except KeyboardInterrupt as e:
                raise RuntimeError("Failed to import a module: KeyboardInterrupt") from e
        return None

import coat_models.train
sys.meta_path.insert(0, Wraps)
sys.exit(coat_models.train.main())
"""

_SIGNAL_AFTER_THE_RUN = """
import atexit, os, signal, sys, time
import coat_models.train
from coat_models.train import cli


def in_teardown():  # (atexit runs last-registered first: after main's own)
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)


atexit.register(in_teardown)
cli.main = lambda: 0  # a run that finished and was reported
code = coat_models.train.main()
assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # (not during the run)
sys.exit(code)
"""

_IGNORED_SIGINT = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job of a shell script


class Interrupts:  # a SIGINT while torch is being imported
    @staticmethod
    def find_spec(name, *args):
        if name == "torch":
            os.kill(os.getpid(), signal.SIGINT)
        return None


import coat_models.train

sys.meta_path.insert(0, Interrupts)
sys.argv = ["coat-train", "--mode", "coat", "--compare", "bf16"]  # refused after the imports
code = coat_models.train.main()
assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
sys.exit(code)
"""


@pytest.mark.slow
def test_console_script_status_is_the_runs_whatever_signal_comes_around_it():
    """A Ctrl-C during the imports that a library wrapped in its own error came
    out as that error's traceback; a signal after the run was reported (the second of
    interpreter teardown) made a finished run's status 130 or 143, with no word. A SIGINT
    ignored at the start (a background job) stays ignored."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    said = "\ncoat-train: interrupted while starting\n"
    refused = "coat-train: error: use --mode or --compare, not both\n"
    for code, status, err in ((_WRAPPED_INTERRUPT, 130, said), (_SIGNAL_AFTER_THE_RUN, 0, ""),
                              (_IGNORED_SIGINT, 2, refused)):  # fmt: skip
        run = subprocess.run([sys.executable, "-c", _AS_FROM_A_TERMINAL + code], env=env,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert (run.returncode, run.stderr) == (status, err), run.stderr[-2000:]


def test_console_script_answers_a_ctrl_c_during_its_imports():
    """``coat-train`` (``coat_models.train.main``) starts without importing torch or
    transformers, so a Ctrl-C while they load ends it with one line and status 130, not a
    traceback; ``coat_models``' public names still import on first use."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", _INTERRUPTED_IMPORT], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 130, run.stderr[-2000:]
    assert run.stderr == "\ncoat-train: interrupted while starting\n"
    assert set(coat_models.__all__) == set(coat_models._WHERE)
    assert all(callable(getattr(coat_models, name)) for name in coat_models.__all__)
    assert coat_models.llama.__name__ == "coat_models.llama"  # a submodule, imported on use
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        coat_models.nothing  # noqa: B018
    pyproject = (SRC.parents[1] / "pyproject.toml").read_text()
    assert 'coat-train = "coat_models.train:main"' in pyproject


_ANSWERS_LIGHT = """
import sys
import coat_models.train

sys.argv = ["coat-train", *sys.argv[1:]]
try:
    code = coat_models.train.main()
except SystemExit as e:
    code = e.code
heavy = sorted(m for m in ("torch", "transformers", "numpy") if m in sys.modules)
print("imported:", ",".join(heavy) or "nothing heavy")
sys.exit(code)
"""


@pytest.mark.parametrize(
    "argv, status, said",
    [
        (["--help"], 0, "usage: coat-train"),
        (["--version"], 0, "coat-models "),
        (["--steps", "0"], 2, "coat-train: error: argument --steps: must be an integer >= 1"),
        (["--preset", "7b"], 2, "coat-train: error: argument --preset: invalid choice"),
    ],
)
def test_help_version_and_a_bad_option_answer_without_importing_torch(argv, status, said):
    """``coat-train --help``, ``--version`` and a mistyped option took the ~5 s of importing
    torch and transformers before answering; the parser now runs first, on the standard
    library alone (``train.options``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", _ANSWERS_LIGHT, *argv], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == status, run.stderr[-2000:]
    assert said in run.stdout + run.stderr
    assert run.stdout.endswith("imported: nothing heavy\n"), run.stdout[-500:]


def test_the_parsers_names_are_the_trainers():
    """``train.options`` names the presets and master dtypes without importing the modules
    that hold them (they import torch): the names must stay theirs."""
    from coat_models.train import options, presets, trainer

    assert options.PRESET_NAMES == tuple(presets.PRESETS)
    assert options.VL_PRESET_NAMES == tuple(presets.VL_PRESETS)
    assert options.MASTER_DTYPE_NAMES == tuple(trainer.MASTER_DTYPES)
    assert options.MODES is trainer.MODES and options.RANGES is trainer.RANGES


@pytest.mark.parametrize("argv", [["--version"], ["--help"]])
def test_help_and_version_into_a_closed_pipe_end_quietly(argv):
    """``coat-train --version | head -1`` ended with a BrokenPipeError traceback."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    code = "import sys; from coat_models.train import main; sys.exit(main())"
    proc = subprocess.Popen([sys.executable, "-c", code, *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    proc.stdout.close()  # the reader is gone before anything is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0
    assert err == "", err
