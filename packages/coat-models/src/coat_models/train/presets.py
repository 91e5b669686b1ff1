"""Model presets for coat-train: Llama shapes built in code (random init), a Hugging Face
config/checkpoint directory on disk, and LLaVA-style vision-language shapes (``VL_PRESETS``,
trained on the generated shapes-caption task of ``vl_data``)."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import pickle
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import MANIFEST
from ..vila import llava_tiny_config, vila7b_config
from .data import round_up
from .memory import is_oom
from .vl_data import min_seq_len, num_image_tokens


class ModelError(ValueError):
    """Unusable model choice; the message says what to change."""


@dataclass(frozen=True)
class Preset:
    """A Llama shape plus the training defaults that suit it."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int | None  # None: the data's vocabulary, rounded up to a multiple of 64
    # training defaults (each can be overridden on the command line)
    batch_size: int
    seq_len: int
    steps: int
    lr: float
    warmup: int
    eval_every: int
    eval_batches: int


PRESETS = {
    # 0.89 M params: byte-level Python loss 5.8 -> 3.0 in 100 CPU steps of 8 x 128 tokens.
    "tiny": Preset(128, 4, 4, 4, 352, None, 8, 128, 100, 3e-3, 10, 25, 4),
    "125m": Preset(768, 12, 12, 12, 2048, 32000, 16, 1024, 2000, 6e-4, 100, 200, 16),
    "350m": Preset(1024, 24, 16, 16, 2816, 32000, 16, 1024, 2000, 3e-4, 100, 200, 16),
    # the 1.2 B shape of the COAT paper's optimizer benchmark (16 layers, untied head)
    "1b": Preset(2048, 16, 16, 16, 8192, 32000, 8, 2048, 2000, 3e-4, 100, 200, 8),
    "llama2-7b": Preset(4096, 32, 32, 32, 11008, 32000, 1, 2048, 1000, 1e-4, 50, 200, 4),
    "llama2-13b": Preset(5120, 40, 40, 40, 13824, 32000, 1, 2048, 1000, 1e-4, 50, 200, 4),
}

# Training defaults for --model-dir (no preset).
MODEL_DIR_DEFAULTS = PRESETS["125m"]


def preset_config(name: str, data_vocab: int, vocab_size: int | None = None, max_seq: int = 2048):
    """LlamaConfig of preset ``name``; ``vocab_size`` overrides the preset's vocabulary."""
    from transformers import LlamaConfig

    if name not in PRESETS:
        raise ModelError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    if vocab_size is not None and vocab_size < 1:
        raise ModelError(f"--vocab-size must be >= 1, got {vocab_size}")
    p = PRESETS[name]
    vocab = vocab_size or p.vocab or round_up(data_vocab, 64)
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=p.hidden,
        intermediate_size=p.mlp,
        num_hidden_layers=p.layers,
        num_attention_heads=p.heads,
        num_key_value_heads=p.kv_heads,
        max_position_embeddings=max(max_seq, 4096),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")  # fmt: skip
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def model_dir_config(path: str):
    """(config, has_weights) of a Hugging Face model directory; nothing is downloaded."""
    from transformers import AutoConfig

    d = Path(path)
    if not (d / "config.json").is_file():
        raise ModelError(f"--model-dir {path}: {_not_a_model_dir(d)}")
    try:
        with quiet_transformers():  # (its advice on values: refused below, in one line)
            config = AutoConfig.from_pretrained(d, local_files_only=True)
    except Exception as e:
        # ValueError / OSError for bad JSON or an unknown model type, and huggingface_hub's
        # StrictDataclassError (an Exception, not a ValueError) for values the config's
        # validation refuses (hidden size not a multiple of the heads, a str for an int)
        if "trust_remote_code" in str(e):  # (its advice is an argument coat-train has not)
            raise ModelError(
                f"--model-dir {path}: its config.json names code of its own (auto_map), which "
                "coat-train does not run: pass a model directory of an architecture "
                "transformers implements"
            ) from None
        raise ModelError(f"--model-dir {path}: cannot read config.json ({one_line(e)})") from None
    if not isinstance(getattr(config, "vocab_size", None), int):
        # e.g. a LlavaConfig: its vocabulary is the text config's; not a causal LM config
        raise ModelError(
            f"--model-dir {path}: its config ({type(config).__name__}) is not a causal LM's (no "
            "vocab_size): pass a causal LM's directory; the LLaVA-style models train with "
            "--preset llava-tiny or vila-7b"
        )
    if config.vocab_size < 1:
        raise ModelError(f"--model-dir {path}: config.json has vocab_size {config.vocab_size}")
    pad = getattr(config, "pad_token_id", None)
    # (torch asserts, later; it takes a negative index from the end, as old conversions' -1)
    if isinstance(pad, int) and not -config.vocab_size <= pad < config.vocab_size:
        raise ModelError(
            f"--model-dir {path}: config.json's pad_token_id {pad} is not a token of its "
            f"vocabulary (vocab_size {config.vocab_size}): set it below {config.vocab_size}, "
            "or to null"
        )
    has_weights = any((d / f).is_file() for f in _WEIGHT_FILES)
    if has_weights:
        _check_safetensors(d)
        _check_bin(d)
    return config, has_weights


def fine_tunable(d: Path) -> bool:
    """Whether ``d`` (e.g. a run's export) holds a config that --model-dir trains on: a causal
    LM's, with a ``vocab_size`` (a LLaVA-style model's has none: it trains with its preset)."""
    try:
        return isinstance(json.loads((d / "config.json").read_text()).get("vocab_size"), int)
    except (OSError, ValueError, AttributeError):
        return False


def _not_a_model_dir(d: Path) -> str:
    """Why ``d`` (without config.json) is no model directory, naming the export meant where
    ``d`` is what coat-train wrote (its --out, a mode's directory, a checkpoint)."""
    if not d.is_dir():
        return "a file, not a directory" if d.exists() else "no such directory"
    is_checkpoint = (d / MANIFEST).is_file()
    above = d.parent.parent if is_checkpoint else d
    exports = [p.parent for p in (*above.glob("final/config.json"),
                                  *sorted(above.glob("*/final/config.json")))
               if fine_tunable(p.parent)]  # fmt: skip
    models = " or ".join(f"--model-dir {e}" for e in exports)
    if is_checkpoint:
        return (
            f"a coat-train checkpoint, not a model (no config.json): continue its run with "
            f"--resume {d}" + (f", or fine-tune its run's model with {models}" if models else "")
        )
    if models:
        return f"no config.json; coat-train exported its models below it: pass {models}"
    return "no config.json (need a Hugging Face model dir)"


def _safetensors_files(d: Path) -> list[str]:
    """The names of ``d``'s safetensors files: ``model.safetensors`` and those its index lists."""
    index = d / "model.safetensors.index.json"
    names = ["model.safetensors"] if (d / "model.safetensors").is_file() else []
    if index.is_file():
        try:
            names += sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelError(f"--model-dir {d}: {index.name} is not a weight index ({e})") from None
    return names


def _check_safetensors(d: Path) -> None:
    """Read the headers of the directory's safetensors files (cheap: no tensor data), so that
    a garbage or truncated file is refused before the run touches its output directory."""
    from safetensors import safe_open

    for name in _safetensors_files(d):
        try:
            with safe_open(d / name, framework="pt"):
                pass
        except Exception as e:  # safetensors raises its own SafetensorError, or OSError
            raise ModelError(
                f"--model-dir {d}: {name} is not a readable safetensors file ({e}): replace it "
                "or remove it to train from random weights"
            ) from None


def _check_bin(d: Path) -> None:
    """The ``pytorch_model.bin`` files that transformers would read (no safetensors beside
    them): the file, or the shards its ``pytorch_model.bin.index.json`` lists (a directory
    of shards alone trained from random weights: they were not seen), must exist and begin
    as torch.save files do (a zip archive, or an old-format pickle); what the pickles hold
    is checked when they are loaded (tensors only)."""
    safetensors = ("model.safetensors", "model.safetensors.index.json")  # read instead
    if any((d / f).is_file() for f in safetensors):
        return
    names = ["pytorch_model.bin"] if (d / "pytorch_model.bin").is_file() else []
    index = d / "pytorch_model.bin.index.json"
    if not names and index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if not all(isinstance(n, str) for n in names):
                raise ValueError("its weight_map names a shard by something else than a string")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelError(
                f"--model-dir {d}: cannot read {index.name} ({one_line(e)}): replace it, or "
                "remove the weights to train from random ones"
            ) from None
    for name in names:
        path = d / name
        if not path.is_file():
            raise ModelError(
                f"--model-dir {d}: {index.name} lists {name}, which is not there: copy it "
                "there, or remove the weights to train from random ones"
            )
        with open(path, "rb") as f:
            head = f.read(4)
        if not (head == b"PK\x03\x04" or head[:1] == b"\x80"):
            raise ModelError(
                f"--model-dir {d}: {name} is not a torch.save file: replace the weights "
                "(model.safetensors) or remove them to train from random weights"
            )


def check_weight_shapes(d: Path, model) -> None:
    """Refuse safetensors weights in ``d`` whose shapes differ from ``model``'s (built from
    ``d``'s config.json) under the same name. Headers only."""
    from safetensors import safe_open

    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for name in _safetensors_files(d):
        with safe_open(d / name, framework="pt") as f:
            for key in f.keys():
                got, want = tuple(f.get_slice(key).get_shape()), shapes.get(key)
                if want is not None and got != want:
                    raise ModelError(
                        f"--model-dir {d}: {name} holds {key} of shape {list(got)}, but its "
                        f"config.json makes it {list(want)}: pass the config.json saved with "
                        "these weights, or remove the weights to train from random ones"
                    )


_NOTED: set[str] = set()  # model dirs whose unused tensors were noted in this process


def _some(names: list[str]) -> str:
    """The first three of ``names``, and how many more there are."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _check_loaded(weights_dir, model, info: dict) -> None:
    """Refuse weights that leave part of the model random (missing names) or that are not
    finite (the first loss would be NaN, blamed on the learning rate)."""
    # Parameters only: a persistent buffer that the model computes is not trained.
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    missing = sorted(k for k in info.get("missing_keys") or () if k in params)
    unused = sorted(info.get("unexpected_keys") or ())
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if unused and rank0 and str(weights_dir) not in _NOTED:  # once, not once per mode
        _NOTED.add(str(weights_dir))
        # (transformers' report of them is quieted with its others)
        print(
            f"coat-train: note: --model-dir {weights_dir}'s weights hold tensors the model does "
            f"not use: {_some(unused)}",
            file=sys.stderr,
        )
    if missing:
        raise ModelError(
            f"--model-dir {weights_dir}: its weights lack {_some(missing)}, which would start "
            "random: pass the causal LM's complete checkpoint, or remove the weights to train "
            "from random ones"
        )
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            raise ModelError(
                f"--model-dir {weights_dir}: its weights hold values that are not finite (in "
                f"{name}): replace them, or remove them to train from random ones"
            )


# Where configs keep the longest sequence their model takes: GPT-2's n_positions reads as
# max_position_embeddings too (transformers' attribute_map); Whisper's decoder keeps it in
# max_target_positions, MPT (ALiBi) in max_seq_len. Not seq_length: BLOOM checkpoints carry
# it from their training run, and BLOOM (ALiBi) runs past it (check_length finds real limits).
_LENGTH_KEYS = ("max_position_embeddings", "max_target_positions", "n_positions", "max_seq_len")


def longest_sequence(config) -> tuple[int, str] | None:
    """(n, why): the longest sequence the causal LM of ``config`` takes, and the config value
    that says so (``"max_position_embeddings 1024"``); None where the config names none.
    Learned positions fail past their table (an IndexError at the first step); RoPE runs on,
    at positions the model was not made for (RoPE scaled by a factor: ``_scaled_rope``);
    ALiBi (Falcon's ``alibi``) has no such length (its max_position_embeddings is its RoPE's,
    unused then). RoBERTa's family (XLM-R, CamemBERT, ...) numbers positions from
    pad_token_id + 1 (fairseq's way: its position table has a padding row), so it takes
    max_position_embeddings - pad_token_id - 1. Both are found on the model built on the
    meta device (no memory). Other limits are ``check_length``'s, once the model is built."""
    from transformers import AutoModelForCausalLM

    # (XLNet's max_position_embeddings -1: no table of positions)
    key = next((k for k in _LENGTH_KEYS if _positive(getattr(config, k, None))), None)
    if key is None:
        return None
    n, pad = getattr(config, key), getattr(config, "pad_token_id", None)
    plain, scaled = (n, f"{key} {n}"), None
    if key == "max_position_embeddings":
        if getattr(config, "alibi", None) is True:
            return None
        scaled = _scaled_rope(config, n)
    if scaled is None and not isinstance(pad, int):  # (no padding row without a padding token)
        return plain
    try:
        with torch.device("meta"), quiet_transformers():
            model = AutoModelForCausalLM.from_config(config)
        tokens = model.get_input_embeddings()
    except Exception:  # (no causal LM of this config: count_params says so)
        return plain
    rows = [m.padding_idx for name, m in model.named_modules()
            if isinstance(m, torch.nn.Embedding) and "position" in name
            and m.num_embeddings == n and m.padding_idx is not None]  # fmt: skip
    if rows and isinstance(pad, int):
        return n - rows[0] - 1, (
            f"{key} {n} allows ({type(model).__name__} numbers positions from pad_token_id "
            f"{rows[0]} + 1)"
        )
    # A scaling factor stretches RoPE's frequencies (its modules' inv_freq), not a table of
    # learned positions (OPT's, GPT-2's: a stray rope_scaling in their config.json).
    rope = any(name.endswith("inv_freq") for name, _ in model.named_buffers())
    # (exactly n rows, or named so: OPT's has 2 more; Gemma3n's per-layer token embeddings
    # have more rows than n and are no positions)
    table = any(isinstance(m, torch.nn.Embedding) and m is not tokens
                and (m.num_embeddings == n or "position" in name)
                for name, m in model.named_modules())  # fmt: skip
    return scaled if scaled is not None and rope and not table else plain


# The rope types whose "factor" makes a longer context (transformers 5.25's
# ROPE_INIT_FUNCTIONS: "default" ignores a factor).
_SCALED_ROPE = frozenset({"linear", "dynamic", "yarn", "longrope", "llama3", "proportional"})


def _scaled_rope(config, n: int) -> tuple[int, str] | None:
    """``longest_sequence``'s answer for RoPE scaled by a factor > 1 (``_SCALED_ROPE``:
    ``rope_parameters``, or ``rope_scaling`` in older configs, one table or one per layer
    type) to a length above max_position_embeddings ``n``, or None: the factor times
    ``original_max_position_embeddings`` (Qwen2.5's YaRN: 4 x 32768 beside 32768; Qwen3's:
    4 x 32768 beside 40960), but Llama 3's rope type has ``n`` as its scaled length where
    ``n`` is longer (Llama 3.1: factor 8 from 8192 beside 131072; 3.2: 32 from 8192). Without an
    original length, the factor times ``n``: configs that scaled their RoPE often kept
    max_position_embeddings at the base model's length (a Llama-2 fine-tune with linear
    factor 4 says 4096 and trains at 16384); others wrote the scaled length there (Gemma 3),
    where this reads more than the model was made for (RoPE runs on: nothing fails)."""
    best = None
    if not _finite(n):
        return None
    for params in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
        if not isinstance(params, dict):
            continue
        per_type = [v for v in params.values() if isinstance(v, dict)]
        for table in per_type or [params]:
            kind = table.get("rope_type", table.get("type"))
            factor, base = table.get("factor"), table.get("original_max_position_embeddings")
            if not isinstance(kind, str) or kind not in _SCALED_ROPE or not _finite(factor):
                continue
            if not factor > 1:
                continue
            base = int(base) if _finite(base) and base > 0 and base == int(base) else n
            if kind == "llama3" and base < n:
                continue  # (n is its scaled length)
            length = float(base) * factor
            if not math.isfinite(length):
                continue  # (an absurd factor: no length read)
            length = int(length)
            if length > n and (best is None or length > best[0]):
                best = length, f"RoPE scaled by {factor:g} from {base} positions ({length})"
    return best


def _finite(value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # (an int past float's range)
        return False


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def model_dir_tokenizer(path: str):
    """The tokenizer shipped in a model directory, or None (then data is byte-level)."""
    if not any((Path(path) / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # the tokenizers library raises plain Exception on a bad file
        raise ModelError(
            f"--model-dir {path}: cannot read its tokenizer ({first_line(e)}): replace or "
            "remove the tokenizer files (without them the data is byte-level)"
        ) from None


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def one_line(e: BaseException) -> str:
    """``e``'s message on one line (huggingface_hub's validation errors span two)."""
    return " ".join(str(e).split()) or type(e).__name__


@contextlib.contextmanager
def quiet_transformers():
    """transformers' log at error level only, within: its advice while a model is built or
    loaded (e.g. BERT's "add is_decoder=True", before ``check_causal`` refuses the model)
    spoke past coat-train's own one-line errors."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def attention_implementation(config) -> str:
    """``"sdpa"`` (torch's fused attention), or ``"eager"`` for an architecture whose
    transformers class has no SDPA path (Gemma2, Bloom, GPT-Neo, ...: transformers refuses
    ``attn_implementation="sdpa"`` for them)."""
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return "eager" if cls is not None and not getattr(cls, "_supports_sdpa", True) else "sdpa"


def build_model(
    config, *, device, master_dtype: torch.dtype, seed: int, weights_dir=None, model_dir=None,
    seq_len: int | None = None,
):  # fmt: skip
    """A causal LM from ``config`` on ``device``: random init seeded with ``seed`` (the same
    weights for every mode of a comparison), or the checkpoint in ``weights_dir``; parameters
    in ``master_dtype``. ``model_dir``: the ``--model-dir`` the config is from, whose model
    ``check_causal`` and, with ``seq_len`` (the run's), ``check_length`` probe (in fp32,
    before the cast)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if weights_dir is not None:
        try:
            with quiet_transformers():  # (its load report: missing weights are refused below)
                model, info = AutoModelForCausalLM.from_pretrained(
                    weights_dir,
                    dtype=torch.float32,
                    attn_implementation=attention_implementation(config),
                    local_files_only=True,
                    output_loading_info=True,
                )
        except (ValueError, OSError, pickle.UnpicklingError) as e:  # no causal LM, bad weights
            why = first_line(e)
            if "Weights only load failed" in why or isinstance(e, pickle.UnpicklingError):
                # Not torch's advice (weights_only=False: running the file's code).
                what = (
                    "its pytorch_model.bin holds"
                    if (Path(weights_dir) / "pytorch_model.bin").is_file()
                    else "one of its pytorch_model .bin shards holds"
                )
                why = (
                    f"{what} objects other than tensors and plain containers, or is no "
                    "torch.save file: replace the weights (model.safetensors) or remove them to "
                    "train from random weights"
                )
            raise ModelError(f"cannot load the model in {weights_dir}: {why}") from None
        _check_loaded(weights_dir, model, info)
        model = model.to(device)
    else:
        try:
            with torch.device(device), quiet_transformers():
                model = AutoModelForCausalLM.from_config(
                    config,
                    dtype=torch.float32,
                    attn_implementation=attention_implementation(config),
                )
        except ValueError as e:  # e.g. a config transformers has no causal LM for
            raise ModelError(
                f"cannot build a causal LM from this config: {first_line(e)}"
            ) from None
    if model_dir is not None:
        check_causal(model, model_dir)
        if seq_len is not None:
            check_length(model, model_dir, seq_len)
    # Init in fp32 then cast, so fp32- and bf16-master runs start from the same weights.
    return _parameters_to(model, master_dtype).train()


def check_causal(model, model_dir) -> None:
    """Refuse a ``--model-dir`` model that is not causal: transformers builds a "causal LM" of
    BERT-style configs too (``BertLMHeadModel`` without ``is_decoder``), whose attention sees
    later tokens; trained on next tokens it learns to copy them, without a word. Two forwards
    of four tokens that differ in the last one: a causal model's logits before it are equal
    (in fp32; a mixture of experts' routing changes its GEMMs' shapes: ~1e-7 apart)."""
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    ids = torch.arange(1, 5, device=device).remainder(vocab).unsqueeze(0)
    other = ids.clone()
    other[0, -1] = (ids[0, -1] + 1) % vocab
    training = model.training
    model.eval()  # (no dropout: the two forwards must differ only by the token)
    try:
        with torch.no_grad():
            a, b = (model(input_ids=x).logits[:, :-1].float() for x in (ids, other))
    except Exception:  # (a forward this probe cannot make: training says what it needs)
        return
    finally:
        model.train(training)
    if (a - b).abs().max() > 1e-4 * a.abs().max():
        raise ModelError(
            f"--model-dir {model_dir}: {type(model).__name__} is not a causal language model "
            "(a token changes the logits before it: its attention is bidirectional, as "
            "BERT's), which no mode of coat-train trains: pass a decoder-only model (Llama, "
            "Mistral, Qwen2, ...)"
        )


def check_causal_config(config, model_dir) -> None:
    """``check_causal`` before the model is built: on a one-layer copy of it on CPU (random
    init: being causal is the architecture's), its embeddings and one layer whatever its
    depth. A config that does not take one layer passes (the build checks it)."""
    from transformers import AutoModelForCausalLM

    shallow = copy.deepcopy(config)
    try:
        shallow.num_hidden_layers = 1
        with torch.device("cpu"), quiet_transformers():
            model = AutoModelForCausalLM.from_config(
                shallow, dtype=torch.float32, attn_implementation=attention_implementation(config)
            )
    except Exception:
        return
    check_causal(model, model_dir)


def check_length(model, model_dir, seq_len: int) -> None:
    """Refuse a --seq-len that ``model`` cannot run, whatever says so (a limit under a config
    key ``longest_sequence`` does not read, an offset of its own): one forward of ``seq_len``
    tokens, none of them the padding token (RoBERTa's positions skip those), as the first
    step would run; where it fails and two tokens run, halving finds the longest that runs;
    where two tokens fail too, through the whole model as well, the model is refused.
    (On CUDA an index past a table is a device-side assert, which the process does not come
    back from: the probe catches the failures raised on the host, e.g. a shape mismatch.)"""
    device = next(model.parameters()).device
    pad = getattr(model.config, "pad_token_id", None)
    token = (1 if pad == 0 else 0) % model.config.vocab_size
    # The model under its head: the positions are there, and (seq_len, vocab) fp32 logits
    # (4 GB for 4096 x 256k) could run out of memory where training's chunked loss does not.
    body = getattr(model, "base_model", model)

    def error(n: int) -> Exception | None:
        try:
            with torch.no_grad():
                body(input_ids=torch.full((1, n), token, device=device), use_cache=False)
        except Exception as e:
            if is_oom(e):  # (memory, not length: the run says what to lower)
                raise
            return e
        return None

    training = model.training
    model.eval()  # (no dropout)
    try:
        failure = error(seq_len)
        if failure is None:
            return
        if error(2) is not None:
            # It runs nothing: refused where the whole model fails too, as the first step
            # would (a config transformers let through, e.g. more key/value heads than
            # heads: a traceback at step 1).
            try:
                with torch.no_grad():
                    model(input_ids=torch.full((1, 2), token, device=device))
            except Exception as e:
                if is_oom(e):
                    raise
                raise ModelError(
                    f"--model-dir {model_dir}: {type(model).__name__} cannot run a forward "
                    f"({first_line(e)}): check its config.json"
                ) from None
            return  # (its body alone failed: training says what it needs)
        runs, fails = 2, seq_len
        while fails - runs > 1:
            mid = (runs + fails) // 2
            runs, fails = (runs, mid) if error(mid) else (mid, fails)
    finally:
        model.train(training)
    raise ModelError(
        f"--model-dir {model_dir}: {type(model).__name__} cannot run --seq-len {seq_len} "
        f"tokens ({first_line(failure)}): pass --seq-len <= {runs}"
    )


def _parameters_to(model, dtype: torch.dtype):
    """``model`` with its parameters cast to ``dtype``. Floating buffers (RoPE's inv_freq)
    stay fp32, as from_pretrained rebuilds them, so that the export computes what trained."""
    buffers = [(m, name, b) for m in model.modules() for name, b in m.named_buffers(recurse=False)
               if b is not None and b.is_floating_point()]  # fmt: skip
    model.to(dtype)
    for module, name, b in buffers:
        setattr(module, name, b)
    return model


@dataclass(frozen=True)
class VLPreset:
    """A LLaVA shape, how it is trained, and the training defaults that suit it (the field
    names of ``Preset`` that the CLI reads, so its option handling applies as is)."""

    config: object  # () -> LlavaConfig
    images_per_sample: int
    freeze_vision: bool  # VILA stage 3: the tower is frozen, projector + LM train
    vision_fp8: bool  # FP8 activations in the tower too (coat, coat-act)
    batch_size: int
    seq_len: int  # padded length; must fit images_per_sample images and captions
    steps: int
    lr: float
    warmup: int
    eval_every: int
    eval_batches: int


def _min_seq_len(config, images: int) -> int:
    return min_seq_len(num_image_tokens(config), images)


VL_PRESETS = {
    # 0.16 M params, 16 image tokens + caption = 55 tokens, trained end to end (tower too);
    # on CPU it gets below the template-only floor by step 300: it reads the images.
    "llava-tiny": VLPreset(llava_tiny_config, 1, False, True,
                           32, _min_seq_len(llava_tiny_config(), 1), 300, 3e-3, 20, 50, 4),
    # VILA1.5-7B shapes (7.17 B params), stage-3 SFT: tower frozen; 2 images of 729 tokens
    # and their captions in 2048 tokens.
    "vila-7b": VLPreset(vila7b_config, 2, True, False, 1, 2048, 200, 2e-5, 20, 50, 2),
}  # fmt: skip


def vl_min_seq_len(name: str) -> int:
    """The shortest sequence that holds VL preset ``name``'s images and their captions."""
    p = VL_PRESETS[name]
    return _min_seq_len(p.config(), p.images_per_sample)


def vl_param_count(name: str) -> int:
    """Parameters of VL preset ``name`` (counted on the meta device: nothing allocated)."""
    from transformers import LlavaForConditionalGeneration

    with torch.device("meta"):
        model = LlavaForConditionalGeneration(VL_PRESETS[name].config())
    return sum(p.numel() for p in model.parameters())


def build_vlm(config, *, device, master_dtype: torch.dtype = torch.float32, seed: int = 0):
    """``LlavaForConditionalGeneration(config)``, random init seeded with ``seed`` in fp32 on
    ``device`` (the same weights for every mode), then its parameters cast to
    ``master_dtype``."""
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlavaForConditionalGeneration(config)
    return _parameters_to(model, master_dtype).train()
