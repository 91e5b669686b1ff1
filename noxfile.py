"""Developer sessions: `nox -s tests` (CPU, Triton via its interpreter; every test, slow ones
included), `nox -s readme` (each package built and installed alone in a fresh venv, its README's
examples run there), `nox -s bench` (GPU), `nox -s lint`, `nox -s demo` (the main job: a small
COAT vs BF16 training comparison).

On a machine without nox (e.g. the GPU box), the same commands run with the packages on
PYTHONPATH; see README.md.
"""

import os
import re
import shutil
import tomllib
import zipfile
from pathlib import Path

import nox

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"

PACKAGES = ["fp8-quant", "fp8-optim", "fp8-activations", "coat-models"]
# torch 2.13.0 is the CPU wheel our CI machines keep on local disk; override to test others.
TORCH = os.environ.get("COAT_TORCH_SPEC", "torch==2.13.0")


def _install(session):
    # One pip run resolves everything at once (four runs took 18 s longer on CI's 2 cores).
    # --no-compile: pip byte-compiles every module of torch and transformers (the install took
    # 96 s with it, 82 s without, on CI's 2 cores); Python compiles the ones a run imports,
    # once, and writes them, also where the machine sets PYTHONDONTWRITEBYTECODE (ours does:
    # every test process would compile torch again). An empty value lets Python write them.
    session.env["PYTHONDONTWRITEBYTECODE"] = ""
    session.install(
        "--no-compile",
        TORCH,
        # pytest-xdist: the CPU suite on every core (CI has two), and the GPU suite's -n 4.
        "pytest",
        "pytest-benchmark",
        "pytest-xdist",
        "numpy",
        "triton>=3.6",
        "transformers>=5.17",
        # Hugging Face Trainer needs accelerate (the Trainer integration tests); matplotlib
        # and tensorboard are coat-models' optional extras (plot, --report-to tensorboard) and
        # peft the library whose adapters apply_coat refuses: installed so that those tests
        # run here.
        "accelerate",
        "matplotlib",
        "tensorboard",
        "peft",
    )
    session.install("--no-deps", *[f"-e./packages/{p}" for p in PACKAGES])


@nox.session
def tests(session):
    """All package tests plus tests/ on CPU; Triton kernels run in the interpreter."""
    _install(session)
    session.env["TRITON_INTERPRET"] = "1"
    # pytest exits 5 when nothing was collected: nox treats that as a failure, as it should.
    session.run(
        "pytest",
        "-n",
        "auto",
        "--maxprocesses",
        "4",
        # Tests marked xdist_group stay on one worker: a module's fixture computed once.
        "--dist",
        "loadgroup",
        "-m",
        "not gpu",
        *[f"packages/{p}/tests" for p in PACKAGES],
        "tests",
        *session.posargs,
    )


# What a README's examples need beyond the package itself. fp8-quant's Triton-kernel example
# runs on CPU through Triton's interpreter, which must be switched on before triton is imported
# and which imports numpy without declaring it. Nothing else sets TRITON_INTERPRET here: the
# other examples run on CPU through the plain-PyTorch reference.
README_NEEDS = {"fp8-quant": (["numpy"], {"TRITON_INTERPRET": "1"})}


def _declared_siblings(package: str) -> list[str]:
    """The packages of this repository that ``package`` depends on, directly or through one
    another, as their pyproject.toml files declare them."""
    found, todo = [], [package]
    while todo:
        project = tomllib.loads(Path(f"packages/{todo.pop()}/pyproject.toml").read_text())
        for requirement in project["project"]["dependencies"]:
            name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
            if name in PACKAGES and name not in found:
                found.append(name)
                todo.append(name)
    return found


def _check_wheel(session, wheel: Path) -> None:
    """What pip's install would not complain about but a user would miss."""
    names = zipfile.ZipFile(wheel).namelist()
    module = wheel.name.split("-")[0]
    for want in (f"{module}/py.typed", "licenses/LICENSE"):
        if not any(n == want or n.endswith(f".dist-info/{want}") for n in names):
            session.error(f"{wheel.name} lacks {want}")


@nox.session
@nox.parametrize("package", PACKAGES)
def readme(session, package):
    """One package alone: build its wheel and its declared siblings' (`pip wheel --no-deps`),
    install them into this fresh venv after torch, run its README's python blocks there."""
    session.install(TORCH)
    wheels = Path(session.create_tmp()) / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    for name in [package, *_declared_siblings(package)]:
        session.run(
            "python",
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "-w",
            str(wheels),
            f"./packages/{name}",
        )
    built = sorted(wheels.glob("*.whl"))
    for wheel in built:
        _check_wheel(session, wheel)
    # Only these wheels and what they declare: an undeclared import fails the examples below.
    session.install(*map(str, built))
    extras, env = README_NEEDS.get(package, ([], {}))
    if extras:
        session.install(*extras)
    session.run("python", "scripts/run_readme.py", f"packages/{package}/README.md", env=env)


@nox.session
def bench(session):
    """pytest-benchmark suites of every package; meant for a CUDA GPU."""
    _install(session)
    session.run(
        "pytest",
        "-o",
        "python_files=bench_*.py",
        "--benchmark-only",
        *[f"packages/{p}/benchmarks" for p in PACKAGES],
        *session.posargs,
    )


@nox.session
def lint(session):
    # Pinned to a minor release: a new ruff's rules or formatting would fail lint with no
    # change to the code (bump it on purpose, with the reformat).
    session.install("ruff ~= 0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def demo(session):
    """The main job: train a tiny Llama with BF16 and with COAT on CPU and compare."""
    _install(session)
    session.run(
        "coat-train",
        "--preset",
        "tiny",
        "--compare",
        "bf16,coat",
        "--out",
        "runs/demo",
        *session.posargs,
    )
