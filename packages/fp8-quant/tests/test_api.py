"""The public boundary: clear errors for bad input, and the backend switch."""

import sys

import fp8_quant
import numpy as np
import pytest
import torch
from fp8_quant import (
    E4M3,
    E5M2,
    Backend,
    FP8Format,
    group_amax,
    quantize_per_block,
    quantize_per_group,
    quantize_per_tensor,
    quantize_per_tensor_transpose,
    resolve_backend,
)

ALL_QUANTIZERS = [
    pytest.param(lambda x: group_amax(x), id="group_amax"),
    pytest.param(lambda x: quantize_per_tensor(x), id="per_tensor"),
    pytest.param(lambda x: quantize_per_tensor_transpose(x), id="per_tensor_transpose"),
    pytest.param(lambda x: quantize_per_group(x), id="per_group"),
    pytest.param(lambda x: quantize_per_block(x), id="per_block"),
]


@pytest.mark.parametrize("call", ALL_QUANTIZERS)
@pytest.mark.parametrize(
    ("x", "message"),
    [
        pytest.param(
            torch.ones(4, 16, dtype=torch.int32), "float32, bfloat16, float16", id="int32"
        ),
        pytest.param(torch.ones(4, 16, dtype=torch.bool), "float32, bfloat16, float16", id="bool"),
        pytest.param(
            torch.ones(4, 16).to(torch.float8_e4m3fn), "float32, bfloat16, float16", id="float8"
        ),
        pytest.param([[1.0] * 16] * 4, "must be a torch.Tensor", id="list"),
        # The other float8 types passed: the backends then disagreed (one quantized them,
        # the other raised NotImplementedError or KeyError).
        pytest.param(
            torch.ones(4, 16).to(torch.float8_e4m3fnuz), "float32, bfloat16", id="e4m3fnuz"
        ),
        pytest.param(torch.ones(4, 16).to(torch.float8_e8m0fnu), "float32, bfloat16", id="e8m0fnu"),
    ],
)
def test_non_float_input_is_a_type_error(call, x, message):
    with pytest.raises(TypeError, match=message):
        call(x)


@pytest.mark.parametrize("group_size", [0, -16, 3, 24, 16.0, True], ids=repr)
def test_bad_group_size_says_power_of_two(group_size):
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="positive power of two"):
        quantize_per_group(x, group_size)
    with pytest.raises(ValueError, match="positive power of two"):
        group_amax(x, group_size)
    with pytest.raises(ValueError, match="block must be .rows, cols., two powers of two"):
        quantize_per_block(x, (group_size, 16))


@pytest.mark.parametrize("fmt", ["e3m4", "fp8", "", None, 8], ids=repr)
def test_unknown_format_lists_the_accepted_ones(fmt):
    with pytest.raises(ValueError, match="e4m3.*e5m2"):
        quantize_per_group(torch.randn(4, 32), 16, fmt)


def test_format_names_and_enum_are_interchangeable():
    x = torch.randn(4, 32)
    for a, b in ((E4M3, "e4m3"), (E5M2, "E5M2"), (FP8Format.E5M2, "e5m2")):
        qa, sa = quantize_per_group(x, 16, a)
        qb, sb = quantize_per_group(x, 16, b)
        assert qa.dtype == FP8Format.parse(b).torch_dtype
        assert torch.equal(qa.view(torch.uint8), qb.view(torch.uint8)) and torch.equal(sa, sb)
    assert E4M3.max == 448.0 and E5M2.max == 57344.0


def test_shape_errors_are_value_errors():
    with pytest.raises(ValueError, match="2-D"):
        quantize_per_tensor_transpose(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="2-D"):
        quantize_per_block(torch.randn(8))
    with pytest.raises(ValueError, match="rows, cols"):
        quantize_per_block(torch.randn(8, 8), (8,))
    with pytest.raises(ValueError, match="at least one dimension"):
        quantize_per_group(torch.tensor(1.0))
    with pytest.raises(ValueError, match="at least one dimension"):
        group_amax(torch.tensor(1.0))
    with pytest.raises(ValueError, match="one value"):
        quantize_per_tensor(torch.randn(8), amax=torch.ones(2))
    with pytest.raises(ValueError, match="one value"):
        quantize_per_tensor_transpose(torch.randn(8, 8), amax=torch.ones(2))
    with pytest.raises(ValueError, match="empty"):
        quantize_per_tensor(torch.randn(0, 8))


def test_shapes_and_dtypes_out():
    x = torch.randn(2, 3, 100, dtype=torch.bfloat16)
    q, s = quantize_per_group(x, 16, "e5m2")
    assert q.shape == x.shape and q.dtype == torch.float8_e5m2
    assert s.shape == (2, 3, 7) and s.dtype == torch.float32
    q, s = quantize_per_tensor(x)
    assert q.shape == x.shape and s.shape == () and s.dtype == torch.float32
    q, qt, s = quantize_per_tensor_transpose(x[0])
    assert q.shape == (3, 100) and qt.shape == (100, 3) and qt.is_contiguous()
    q, s = quantize_per_block(x[0], (2, 64))
    assert q.shape == (3, 100) and s.shape == (2, 2)
    assert group_amax(x, 32).shape == (2, 3, 4)


@pytest.mark.parametrize("bad", ["cuda", "Triton", "", None, ["triton"]], ids=repr)
def test_unknown_backend(bad):
    msg = r"backend must be one of \('auto', 'triton', 'reference'\), got "
    with pytest.raises(ValueError, match=msg):
        quantize_per_group(torch.randn(4, 16), backend=bad)
    with pytest.raises(ValueError, match=msg):
        Backend.parse(bad)


def test_backend_enum_and_its_strings_are_one_name():
    assert [m.value for m in Backend] == ["auto", "triton", "reference"]
    for m in Backend:
        # Hot paths compare to strings and key caches on either spelling.
        assert Backend.parse(m.value) is m and Backend.parse(m) is m
        assert m == m.value and hash(m) == hash(m.value) and str(m) == m.value
        assert {m.value: 1}[m] == 1 and {m: 1}[m.value] == 1 and m in (m.value,)
    x = torch.randn(4, 32)
    for backend in ("reference", Backend.REFERENCE):
        assert resolve_backend(x, backend) is Backend.REFERENCE
        q, s = quantize_per_group(x, backend=backend)
        q_ref, s_ref = fp8_quant.reference.quantize_per_group(x, 16, E4M3)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_auto_resolves_to_a_member(monkeypatch):
    monkeypatch.delenv("FP8_QUANT_BACKEND", raising=False)
    assert resolve_backend(torch.randn(2), "auto") is Backend.REFERENCE
    assert resolve_backend(torch.randn(2), Backend.AUTO) is Backend.REFERENCE
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launcher = sys.modules.get("fp8_quant.ops._launch")  # (kernels made for a GPU: they run
    if launcher is not None:  # on a CPU tensor only in the interpreter)
        monkeypatch.setattr(launcher, "_INTERPRETING", True)
    monkeypatch.setenv("FP8_QUANT_BACKEND", "triton")
    assert resolve_backend(torch.randn(2), Backend.AUTO) is Backend.TRITON
    # An explicit choice is not overridden by the environment.
    assert resolve_backend(torch.randn(2), Backend.REFERENCE) is Backend.REFERENCE


def test_env_var_picks_the_auto_backend(monkeypatch):
    calls = []
    monkeypatch.setattr(fp8_quant.reference, "group_amax", lambda *a: calls.append("ref"))
    monkeypatch.setenv("FP8_QUANT_BACKEND", "reference")
    group_amax(torch.randn(4, 16))
    assert calls == ["ref"]
    monkeypatch.setenv("FP8_QUANT_BACKEND", "tpu")
    with pytest.raises(ValueError, match="FP8_QUANT_BACKEND"):
        group_amax(torch.randn(4, 16))


def test_auto_backend_is_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("FP8_QUANT_BACKEND", raising=False)
    monkeypatch.setattr(fp8_quant.api, "_triton_ops", lambda: pytest.fail("triton used on CPU"))
    quantize_per_group(torch.randn(4, 16))


def test_triton_on_cpu_without_interpreter_says_how(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        quantize_per_group(torch.randn(4, 16), backend="triton")


@pytest.mark.gpu
def test_auto_backend_is_triton_on_cuda(cuda, monkeypatch):
    monkeypatch.delenv("FP8_QUANT_BACKEND", raising=False)
    calls = []
    ops = fp8_quant.api._triton_ops()
    monkeypatch.setattr(fp8_quant.api, "_triton_ops", lambda: calls.append(1) or ops)
    quantize_per_group(torch.randn(4, 16, device=cuda))
    assert calls == [1]


def test_dequantize_refuses_what_its_quantizer_did_not_return():
    """Scales of another group size or layout, raw bytes, a vector as the per-tensor scale:
    refused (they gave wrong values without a word); what the quantizer returned goes back
    to the input's values."""
    fq = fp8_quant
    x = torch.randn(4, 32)
    q, s = fq.quantize_per_group(x, 16)
    with pytest.raises(ValueError, match=r"scales has shape \(4, 2\), but q of shape \(4, 32\) "
                       r"needs \(4, 1\): pass the scales its quantizer returned"):  # fmt: skip
        fq.dequantize_per_group(q, s, 32)
    with pytest.raises(ValueError, match=r"needs \(4, 2\)"):
        fq.dequantize_per_group(q, s[:, :1], 16)
    with pytest.raises(TypeError, match="q must be FP8 codes"):
        fq.dequantize_per_group(q.view(torch.uint8), s, 16)
    qt, st = fq.quantize_per_tensor(x)
    with pytest.raises(ValueError, match=r"scale has shape \(32,\), but q of shape \(4, 32\)"):
        fq.dequantize_per_tensor(qt, torch.ones(32))
    with pytest.raises(TypeError, match="scale must be a float32 tensor, got float"):
        fq.dequantize_per_tensor(qt, 2.0)
    assert (fq.dequantize_per_group(q, s, 16) - x).abs().max() < 0.1 * x.abs().max()
    assert (fq.dequantize_per_tensor(qt, st) - x).abs().max() < 0.1 * x.abs().max()


def test_dequantize_per_block_refuses_what_its_quantizer_did_not_return():
    """Scales of another block, values that are not FP8 codes, a 1-D q, a block that is not
    two powers of two: one-line errors (the default block's dequantization of (64, 128)
    tiles ran without a word and was off by 99.9%; others failed deep in a broadcast)."""
    fq = fp8_quant
    x = torch.randn(128, 256)
    x[64:] *= 1000
    q, s = fq.quantize_per_block(x, (64, 128))
    with pytest.raises(ValueError, match=r"scales has shape \(2, 2\), but q of shape "
                       r"\(128, 256\) needs \(1, 2\)"):  # fmt: skip
        fq.dequantize_per_block(q, s)
    with pytest.raises(TypeError, match="q must be FP8 codes"):
        fq.dequantize_per_block(x, s, (64, 128))
    with pytest.raises(ValueError, match="q must be 2-D"):
        fq.dequantize_per_block(q[0], s, (64, 128))
    for call in (lambda b: fq.quantize_per_block(x, b), lambda b: fq.dequantize_per_block(q, s, b)):
        with pytest.raises(ValueError, match="block must be \\(rows, cols\\), two powers of two"):
            call(16)
    with pytest.raises(ValueError, match="at least one dimension"):
        fq.dequantize_per_group(q[0, 0], s, 16)
    with pytest.raises(TypeError, match="q must be FP8 codes"):
        fq.dequantize_per_group([1.0], s, 16)
    back = fq.dequantize_per_block(q, s, (64, 128))
    assert ((back - x).abs() <= 0.07 * x.abs() + 1e-3 * s.max()).all()


def test_triton_chosen_by_the_environment_says_so_on_cpu(monkeypatch):
    monkeypatch.setenv("FP8_QUANT_BACKEND", "triton")
    monkeypatch.setattr(fp8_quant.api, "triton_interpreting", lambda: False)
    with pytest.raises(ValueError, match=r"triton backend \(FP8_QUANT_BACKEND=triton chose it\)"):
        resolve_backend(torch.randn(2), "auto")
    with pytest.raises(ValueError, match="the triton backend needs a CUDA tensor"):
        resolve_backend(torch.randn(2), "triton")


@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 16), (0, 20)])
def test_empty_inputs_per_group_on_both_backends(shape, interpreter):
    """An empty tensor whose last dim is not: the shapes of the Triton backend on the
    reference one too (it raised: a reshape could not infer -1 from no elements)."""
    x = torch.empty(shape)
    for backend in ("reference", "triton"):
        q, s = fp8_quant.quantize_per_group(x, 16, backend=backend)
        assert q.shape == shape and s.shape == (*shape[:-1], -(-shape[-1] // 16))
        assert fp8_quant.dequantize_per_group(q, s, 16).shape == shape


def test_outputs_carry_no_autograd_graph_on_either_backend(interpreter):
    """Given inputs that require grad, both backends return detached codes, scales and
    maxima (the reference returned a graph, the triton backend none: code that
    backpropagated through them ran on CPU and failed on GPU)."""
    fq = fp8_quant
    x = torch.randn(32, 64, requires_grad=True)
    amax = x.detach().abs().amax().requires_grad_()
    for backend in ("reference", "triton"):
        outs = [
            *fq.quantize_per_tensor(x, amax=amax, backend=backend),
            *fq.quantize_per_tensor_transpose(x, amax=amax, backend=backend),
            *fq.quantize_per_group(x, 16, backend=backend),
            *fq.quantize_per_block(x, (16, 32), backend=backend),
            fq.group_amax(x, 16, backend=backend),
        ]
        assert not any(t.requires_grad for t in outs), backend


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.float8_e4m3fn, "bfloat16"])
def test_dequantize_to_a_non_float_dtype_is_a_type_error(dtype):
    """Integer and bool targets had truncated without a word, a string raised about a
    "device"."""
    x = torch.tensor([[0.3, -2.7, 5.0, 1.0]])
    q, s = quantize_per_tensor(x)
    qg, sg = quantize_per_group(x, 4)
    qb, sb = quantize_per_block(x, (1, 4))
    for call in (
        lambda: fp8_quant.dequantize_per_tensor(q, s, dtype),
        lambda: fp8_quant.dequantize_per_group(qg, sg, 4, dtype),
        lambda: fp8_quant.dequantize_per_block(qb, sb, (1, 4), dtype),
    ):
        with pytest.raises(TypeError, match="dtype must be torch.float32, torch.bfloat16"):
            call()


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("amax", [-1.0, -float("inf"), -1e-30, -1e-44], ids=repr)
def test_a_negative_amax_gives_a_nan_scale(backend, amax, request):
    """An amax is a max of |x|: a negative one had become scale 1, saturating the tensor at
    +-448 without a word. It is NaN now, as a NaN amax gives, also where its
    quotient by the format's max rounds to -0.0 (-1e-44); -0.0 is zero."""
    if backend == "triton":
        request.getfixturevalue("interpreter")
    x = torch.tensor([[100.0, 1000.0, -3.0, 0.5]])
    for call in (quantize_per_tensor, quantize_per_tensor_transpose):
        out = call(x, amax=torch.tensor(amax), backend=backend)
        assert out[-1].isnan().all()
        assert fp8_quant.dequantize_per_tensor(out[0], out[-1]).isnan().all()
    _, s = quantize_per_tensor(x, amax=torch.tensor(-0.0), backend=backend)
    assert s.item() == 1.0


@pytest.mark.gpu
@pytest.mark.parametrize(
    "amax", [-1.0, -float("inf"), -1e-30, -1e-44, -0.0, 0.0, 1e-37, 3.0], ids=repr
)
def test_amax_edge_values_on_cuda_match_the_reference(cuda, amax):
    """The compiled kernels' scale for a given amax (negative ones NaN, -0.0 and 0 one, tiny
    ones one) is the reference's: NaN where it is NaN, the same bits elsewhere."""
    x = torch.tensor([[100.0, 1000.0, -3.0, 0.5]])
    for call in (quantize_per_tensor, quantize_per_tensor_transpose):
        want = call(x, amax=torch.tensor(amax), backend="reference")
        got = call(x.to(cuda), amax=torch.tensor(amax, device=cuda), backend="triton")
        if want[-1].isnan():
            assert got[-1].isnan()
        else:
            assert torch.equal(got[-1].cpu(), want[-1])
            assert torch.equal(got[0].cpu().view(torch.uint8), want[0].view(torch.uint8))


def test_a_group_or_block_longer_than_the_tensor_is_one_group(interpreter):
    """group_size 2**40 asked the reference for terabytes of padding: a group
    longer than the row is the row, on both backends, with the same bits as the smallest
    power of two that covers it."""
    torch.manual_seed(0)
    x = torch.randn(4, 10)
    for backend in ("reference", "triton"):
        q, s = quantize_per_group(x, 2**40, backend=backend)
        q16, s16 = quantize_per_group(x, 16, backend=backend)
        assert s.shape == (4, 1) and torch.equal(s, s16)
        assert torch.equal(q.view(torch.uint8), q16.view(torch.uint8))
        assert torch.equal(group_amax(x, 2**40, backend=backend), s16 * 448)
        back = fp8_quant.dequantize_per_group(q, s, 2**40)
        assert torch.equal(back, fp8_quant.dequantize_per_group(q16, s16, 16))
        qb, sb = quantize_per_block(x, (2**30, 2**30), backend=backend)
        qb16, sb16 = quantize_per_block(x, (4, 16), backend=backend)
        assert sb.shape == (1, 1) and torch.equal(sb, sb16)
        assert torch.equal(qb.view(torch.uint8), qb16.view(torch.uint8))
        back = fp8_quant.dequantize_per_block(qb, sb, (2**30, 2**30))
        assert torch.equal(back, fp8_quant.dequantize_per_block(qb16, sb16, (4, 16)))


@pytest.mark.parametrize("block", [(3, 4), (16,), 16, (16, 0)], ids=repr)
def test_a_bad_block_names_the_block(block):
    """It had said "group_size must be a positive power of two"."""
    x = torch.randn(4, 4)
    with pytest.raises(ValueError, match=r"block must be \(rows, cols\), two powers of two"):
        quantize_per_block(x, block)
    q, s = quantize_per_block(x, (4, 4))
    with pytest.raises(ValueError, match=r"block must be \(rows, cols\), two powers of two"):
        fp8_quant.dequantize_per_block(q, s, block)


def test_triton_interpret_set_after_the_kernels_were_made_says_so(monkeypatch, interpreter):
    """TRITON_INTERPRET set after fp8_quant's kernels were defined (their import) does not
    reach them: the CPU launch crashed inside Triton; it is a ValueError now."""
    from fp8_quant.ops import _launch

    monkeypatch.setattr(_launch, "_INTERPRETING", False)  # the kernels made for a GPU
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1 was set after triton .or fp8_q"):
        quantize_per_group(torch.randn(4, 32), 16, backend="triton")


@pytest.mark.parametrize(
    "make",
    [lambda: torch.randn(12, 8).t(), lambda: torch.randn(1, 8).t(), lambda: torch.randn(1, 8),
     lambda: torch.randn(2, 3, 4).permute(2, 0, 1)],
    ids=["transposed", "one-column", "one-row", "permuted-3d"],
)  # fmt: skip
def test_per_tensor_outputs_are_row_major_buffers_of_their_own_on_both_backends(make, interpreter):
    """For a permuted x the reference kept x's layout in q (Triton's is row-major:
    q.view(-1) failed on one backend only), and its q_t was a view of q (q.t().contiguous()
    of a transposed x is a no-op): writing one changed the other."""
    x = make()
    got = {b: quantize_per_tensor(x, backend=b)[0] for b in ("triton", "reference")}
    for q in got.values():
        assert q.is_contiguous()
    assert torch.equal(got["triton"].view(torch.uint8), got["reference"].view(torch.uint8))
    if x.dim() != 2:
        return
    for backend in ("triton", "reference"):
        q, q_t, _ = quantize_per_tensor_transpose(x, backend=backend)
        assert q.is_contiguous() and q_t.is_contiguous() and q_t.shape == q.t().shape
        assert q.untyped_storage().data_ptr() != q_t.untyped_storage().data_ptr(), backend
        assert torch.equal(q_t.view(torch.uint8), q.t().view(torch.uint8))


def test_the_triton_backend_refuses_meta_tensors():
    """It crashed inside Triton (interpreter: "Cannot copy out of meta tensor") or named
    TRITON_INTERPRET as the remedy; the reference gives the shapes."""
    x = torch.randn(5, 33, device="meta")
    with pytest.raises(ValueError, match="cannot run meta tensors.*backend='reference'"):
        quantize_per_group(x, 16, backend="triton")
    q, s = quantize_per_group(x, 16, backend="reference")
    assert q.shape == (5, 33) and s.shape == (5, 3) and q.is_meta


def test_amax_and_scales_on_another_device_are_named():
    """A 0-dim CPU amax or scale goes with any x (both backends move it); other
    devices are named."""
    meta = torch.randn(5, 33, device="meta")
    assert quantize_per_tensor(meta, amax=torch.tensor(3.0), backend="reference")[0].is_meta
    q, s = quantize_per_tensor(meta, backend="reference")
    assert fp8_quant.dequantize_per_tensor(q, torch.ones(())).is_meta
    x = torch.randn(5, 33)
    with pytest.raises(ValueError, match="amax is on meta, x on cpu: pass amax on x's device"):
        quantize_per_tensor(x, amax=torch.tensor(3.0, device="meta"))
    q, s = quantize_per_group(x, 16)
    with pytest.raises(ValueError, match="scales is on meta, q on cpu: pass the scales on q's"):
        fp8_quant.dequantize_per_group(q, s.to("meta"), 16)


@pytest.mark.parametrize(
    "size, kind",
    [(16.0, "builtins.float"), (torch.tensor(16), "torch.Tensor"), (np.int64(16), "numpy.int64")],
    ids=["float", "tensor", "numpy"],
)
def test_a_group_size_of_another_type_names_the_type(size, kind):
    """Np.int64(16) was told to be "a positive power of two"."""
    said = rf"a Python int, got .*\({kind}\): pass int\(group_size\)"
    with pytest.raises(ValueError, match=said):
        quantize_per_group(torch.randn(4, 32), size)


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_input_is_one_type_error(layout):
    x = torch.randn(4, 16)
    x = x.to_sparse() if layout == "coo" else x.to_sparse_csr()
    for call in (quantize_per_tensor, quantize_per_group, group_amax):
        with pytest.raises(TypeError, match=r"must be a dense tensor, got layout .*\.to_dense\(\)"):
            call(x)


def _triton_on_cpu(env_value: str | None, set_after_import: bool = False) -> str:
    """A fresh process's answer to a Triton quantize of a CPU tensor (stdout)."""
    import os
    import subprocess
    import textwrap

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if env_value is not None and not set_after_import:
        env["TRITON_INTERPRET"] = env_value
    code = textwrap.dedent(f"""
        import os, torch, triton
        if {set_after_import!r}:
            os.environ["TRITON_INTERPRET"] = {env_value!r}
        import fp8_quant
        try:
            q, s = fp8_quant.quantize_per_group(torch.randn(2, 16), 16, backend="triton")
            print("ran", tuple(s.shape))
        except ValueError as e:
            print("ValueError:", e)
    """)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.slow
def test_triton_interpret_is_read_as_triton_reads_it():
    """Fp8_quant read " 1" as on (Triton: off; the launch crashed in Triton) and
    "y" as off (Triton: on; on a GPU host that chose the interpreter's wrong FP8 cast), and a
    TRITON_INTERPRET set after `import triton` crashed inside Triton: it asks Triton."""
    assert _triton_on_cpu("y") == "ran (2, 1)\n"
    refused = "ValueError: the triton backend needs a CUDA tensor; for CPU tensors set"
    assert _triton_on_cpu(" 1").startswith(refused)
    late = "ValueError: TRITON_INTERPRET=1 was set after triton (or fp8_quant's Triton kernels)"
    assert _triton_on_cpu("1", set_after_import=True).startswith(late)


def test_small_mistakes_get_the_remedy(monkeypatch):
    """A non-tensor in ``resolve_backend`` said "'NoneType' object has no attribute
    'is_cuda'"; a format or dtype in ``group_size``'s place was told to "pass
    int(group_size)"; a float amax was not told how to pass it; ``export
    FP8_QUANT_BACKEND=`` (blank) was a backend named ""; the meta-tensor refusal did not say
    that the variable chose triton."""
    x = torch.randn(4, 16)
    for backend in ("auto", "triton"):
        with pytest.raises(TypeError, match="x must be a torch.Tensor, got NoneType"):
            resolve_backend(None, backend)
    with pytest.raises(ValueError, match=r"got 'e4m3': a format or dtype passed in group_size"):
        quantize_per_group(x, "e4m3")
    q, s = quantize_per_group(x)
    with pytest.raises(ValueError, match=r"pass it by name \(fmt=\.\.\., dtype=\.\.\.\)"):
        fp8_quant.dequantize_per_group(q, s, torch.bfloat16)
    with pytest.raises(TypeError, match=r"got float: pass torch.tensor\(amax, device=x.device\)"):
        quantize_per_tensor(x, amax=3.0)
    monkeypatch.setenv("FP8_QUANT_BACKEND", " ")
    assert resolve_backend(x, "auto") is Backend.REFERENCE
    monkeypatch.setenv("FP8_QUANT_BACKEND", "triton")
    with pytest.raises(ValueError, match=r"triton backend \(FP8_QUANT_BACKEND=triton chose it\) "
                       "cannot run meta tensors"):  # fmt: skip
        resolve_backend(torch.empty(2, device="meta"), "auto")


def test_a_group_size_given_as_digits_is_told_to_pass_an_int():
    with pytest.raises(ValueError, match=r"got '16' \(builtins.str\): pass int\(group_size\)"):
        quantize_per_group(torch.randn(4, 16), "16")


def test_formats_parse_their_torch_dtypes():
    assert FP8Format.parse(torch.float8_e4m3fn) is FP8Format.E4M3
    assert FP8Format.parse(torch.float8_e5m2) is FP8Format.E5M2
    for fmt in FP8Format:
        assert FP8Format.parse(fmt.torch_dtype) is fmt
    # other 8-bit floats are other formats (no NaN/inf encodings, another bias): refused
    for other in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float16):
        with pytest.raises(ValueError, match="unknown FP8 format.*torch.float8_e4m3fn"):
            FP8Format.parse(other)
    x = torch.randn(4, 32)
    q, s = quantize_per_tensor(x, torch.float8_e5m2, backend="reference")
    q2, s2 = quantize_per_tensor(x, "e5m2", backend="reference")
    assert q.dtype == torch.float8_e5m2 and torch.equal(q.view(torch.uint8), q2.view(torch.uint8))


def _lazy_negation(values: torch.Tensor) -> torch.Tensor:
    """``values`` as a real view with torch's negative bit (``z.conj().imag``): its memory
    holds ``-values``."""
    out = torch.complex(torch.zeros_like(values), -values).conj().imag
    assert out.is_neg() and torch.equal(out, values)
    return out


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_lazily_negated_views_quantize_to_their_values(backend, request):
    # The kernels read memory, so the triton backend gave such a view's codes the wrong sign
    # (and an amax passed so a NaN scale); now both backends see the values.
    if backend == "triton":
        request.getfixturevalue("interpreter")
    x = torch.randn(8, 64) * 3
    amax = torch.tensor(7.0)
    calls = {
        "group_amax": lambda x, amax: (group_amax(x, 16, backend=backend),),
        "per_group": lambda x, amax: quantize_per_group(x, 16, backend=backend),
        "per_block": lambda x, amax: quantize_per_block(x, (4, 32), backend=backend),
        "per_tensor": lambda x, amax: quantize_per_tensor(x, amax=amax, backend=backend),
        "per_tensor_transpose": lambda x, amax: quantize_per_tensor_transpose(
            x, amax=amax, backend=backend
        ),
    }
    for name, call in calls.items():
        # (a contiguous view too: quantize_per_tensor copied only non-contiguous inputs)
        for values in (x, x[:1].reshape(1, 64)):
            for a in (None, amax) if "tensor" in name else (None,):
                want = call(values, a)
                got = call(_lazy_negation(values), None if a is None else _lazy_negation(a))
                for g, w in zip(got, want, strict=True):
                    assert torch.equal(g.float(), w.float()), name


def test_reference_outputs_do_not_keep_the_padding():
    # A partial last group or block is padded with zeros; the cropped outputs used to be views
    # of the padded buffer: non-contiguous for dequantize (.view(-1) failed), and a quantized
    # row's storage kept the padding (twice the bytes in torch.save) when leading dims were 1.
    from fp8_quant import dequantize_per_block, dequantize_per_group

    def dense(t):
        assert t.is_contiguous() and t.stride() == torch.empty(t.shape).stride()
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()

    for shape, g in (((4, 17), 16), ((1, 4097), 8192), ((1, 1, 17), 16)):
        x = torch.randn(shape)
        q, s = quantize_per_group(x, g, backend="reference")
        dense(q)
        for dtype in (torch.float32, torch.bfloat16):
            y = dequantize_per_group(q, s, g, dtype=dtype)
            dense(y)
            assert y.dtype == dtype and torch.allclose(y.float(), x, rtol=0.07, atol=1e-3)
    x = torch.randn(1, 100)
    q, s = quantize_per_block(x, (128, 128), backend="reference")
    dense(q)
    for shape in ((1, 100), (5, 130)):
        q, s = quantize_per_block(torch.randn(shape), (4, 128), backend="reference")
        y = dequantize_per_block(q, s, (4, 128))
        dense(y)
        per_element = s.repeat_interleave(4, 0).repeat_interleave(128, 1)
        assert torch.equal(y, q.float() * per_element[: shape[0], : shape[1]])
