"""Every package README's ```python blocks run, in this process, with the packages of this
checkout: a broken example fails CI. ``nox -s readme`` runs the same blocks against each
package installed alone in a fresh virtual environment (scripts/run_readme.py does both)."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READMES = sorted(ROOT.glob("packages/*/README.md"))


def _load_runner():
    spec = importlib.util.spec_from_file_location("run_readme", ROOT / "scripts" / "run_readme.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


runner = _load_runner()


def test_every_package_has_a_readme_with_examples():
    assert [p.parent.name for p in READMES] == [
        "coat-models", "fp8-activations", "fp8-optim", "fp8-quant",
    ]  # fmt: skip
    for path in READMES:
        assert runner.python_blocks(path), path


@pytest.mark.parametrize("readme", READMES, ids=[p.parent.name for p in READMES])
def test_readme_examples_run(readme, one_thread):
    results = runner.run_readme(readme, torchrun=False, log=lambda _: None)
    ran = [b.where for b, status in results if status == "ran"]
    assert ran, "no example ran"
    # Only a GPU (or torchrun, tested below) may excuse a block here: the tests' environment
    # has every module a block names, so a misspelt marker cannot hide an example.
    for block, status in results:
        if status != "ran":
            assert block.torchrun or block.needs == ("cuda",), (block.where, status)


@pytest.mark.slow
def test_readme_torchrun_examples_run(tmp_path):
    """The multi-process examples, each under ``torchrun --nproc-per-node 2`` (gloo, CPU)."""
    blocks = [b for path in READMES for b in runner.python_blocks(path) if b.torchrun]
    assert blocks, "no README has a torchrun example any more: drop this test"
    for block in blocks:
        runner.run_torchrun(block, tmp_path)  # raises with the processes' output on failure


# ---------------------------------------------------------------- the runner's own behaviour
def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "README.md"
    path.write_text(textwrap.dedent(text))
    return path


def test_blocks_run_in_order_in_one_temporary_directory(tmp_path):
    path = _write(
        tmp_path,
        """\
        # demo
        ```python
        from pathlib import Path

        assert __name__ == "__main__"
        assert not Path("README.md").exists()  # not the README's directory
        Path("log.txt").write_text("first")
        ```
        text, then a bash block that is not run:
        ```bash
        exit 1
        ```
        ```python
        from pathlib import Path

        assert Path("log.txt").read_text() == "first"
        ```
        """,
    )
    results = runner.run_readme(path, log=lambda _: None)
    assert [(b.line, status) for b, status in results] == [(3, "ran"), (14, "ran")]
    assert not (tmp_path / "log.txt").exists()  # written in the runner's temporary directory


@pytest.mark.parametrize(
    "first, second, name",
    [
        pytest.param("x = [1]", "x.append(2)", "x", id="variable"),
        pytest.param("import torch", "torch.zeros(1)", "torch", id="import"),
        pytest.param("def f():\n    return 1", "f()", "f", id="function"),
    ],
)
def test_a_block_cannot_use_names_of_an_earlier_block(tmp_path, first, second, name):
    """Each block runs as a reader who pastes only that block runs it."""
    path = tmp_path / "README.md"
    path.write_text(f"```python\n{first}\n```\n\n```python\n{second}\n```\n")
    second_line = first.count("\n") + 6
    log = []
    with pytest.raises(NameError, match=f"name '{name}' is not defined") as info:
        runner.run_readme(path, log=log.append)
    where = str(path.resolve())
    assert log == [f"{where}:2: running", f"{where}:{second_line}: running"]  # the first ran
    frames = traceback.extract_tb(info.value.__traceback__)
    assert (where, second_line) in [(f.filename, f.lineno) for f in frames]


def test_a_failing_block_raises_with_the_readme_line(tmp_path):
    path = _write(
        tmp_path,
        """\
        ```python
        ok = 1
        ```

        ```python
        ok = 2
        y = ok + undefined_name
        ```
        """,
    )
    with pytest.raises(NameError, match="undefined_name") as info:
        runner.run_readme(path, log=lambda _: None)
    frames = traceback.extract_tb(info.value.__traceback__)
    assert (str(path.resolve()), 7) in [(f.filename, f.lineno) for f in frames]


def test_needs_marker_skips_what_is_missing(tmp_path):
    path = _write(
        tmp_path,
        """\
        <!-- readme: needs no_such_module_xyz -->
        ```python
        raise AssertionError("must not run")
        ```
        <!-- readme: needs pytest -->
        ```python
        import pytest
        ```
        """,
    )
    results = runner.run_readme(path, log=lambda _: None)
    assert [status for _, status in results] == ["skipped: needs module no_such_module_xyz", "ran"]


@pytest.mark.parametrize(
    "text, message",
    [
        pytest.param("# nothing to run\n```bash\nls\n```\n", "no ```python block", id="no-block"),
        pytest.param("```python\nx = 1\n", "never closed", id="unclosed"),
        pytest.param("<!-- readme: skip -->\n```python\nx = 1\n```\n", "needs WHAT", id="marker"),
    ],
)
def test_bad_readmes_are_refused(tmp_path, text, message):
    with pytest.raises(runner.ReadmeError, match=message):
        runner.python_blocks(_write(tmp_path, text))


def test_cli_exit_status(tmp_path, capsys):
    good = _write(tmp_path, "```python\nx = 1\n```\n")
    assert runner.main([str(good)]) == 0
    assert runner.main([str(tmp_path / "missing.md")]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.md"
    bad.write_text("```python\n1 / 0\n```\n")
    assert runner.main([str(bad)]) == 1


@pytest.fixture
def one_thread():
    """Tiny models: one thread is faster than two, and far faster on a busy CPU."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
