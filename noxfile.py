"""Developer sessions: `nox -s tests` (CPU, Triton via its interpreter), `nox -s bench` (GPU),
`nox -s lint`, `nox -s demo` (the main job: a small COAT vs BF16 training comparison).

On a machine without nox (e.g. the GPU box), the same commands run with the packages on
PYTHONPATH; see README.md.
"""

import os

import nox

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"

PACKAGES = ["fp8-quant", "fp8-optim", "fp8-activations", "coat-models"]
# torch 2.13.0 is the CPU wheel our CI machines keep on local disk; override to test others.
TORCH = os.environ.get("COAT_TORCH_SPEC", "torch==2.13.0")


def _install(session):
    session.install(TORCH)
    session.install("pytest", "pytest-benchmark", "numpy")
    session.install("--no-deps", *[f"-e./packages/{p}" for p in PACKAGES])
    session.install("triton>=3.6", "transformers>=5.17")
    # Hugging Face Trainer needs accelerate; only the Trainer integration test uses it.
    session.install("accelerate")


@nox.session
def tests(session):
    """All package tests plus tests/ on CPU; Triton kernels run in the interpreter."""
    _install(session)
    session.env["TRITON_INTERPRET"] = "1"
    # pytest exits 5 when nothing was collected: nox treats that as a failure, as it should.
    session.run(
        "pytest",
        "-m",
        "not gpu",
        *[f"packages/{p}/tests" for p in PACKAGES],
        "tests",
        *session.posargs,
    )


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
    session.install("ruff")
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
