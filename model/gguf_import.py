"""Import a Llama GGUF file (llama.cpp's format) into a Hugging Face-style folder.

Reads the file with the ``gguf`` package (https://github.com/ggml-org/llama.cpp/tree/master/gguf-py),
dequantizes every tensor to float32 with ``gguf.quants.dequantize`` (F32, F16, BF16, Q8_0, Q4_0,
Q4_1, Q5_*, K-quants, ...), undoes llama.cpp's q/k row permutation, and writes ``config.json``,
``model.safetensors`` (float32), ``tokenizer.json`` (built with ``tokenizers``),
``tokenizer_config.json`` (with the chat template) and ``generation_config.json``.

The tokenizer follows llama.cpp's BPE pre-tokenizers (``tokenizer.ggml.pre``, see
``llama-vocab.cpp``): only those whose Hugging Face ``tokenizers`` equivalent is exact are supported.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path

import numpy as np

from .gguf_header import read_tensor_infos, tensor_bytes

# GGUF tensor name (per layer after "blk.{i}.") -> Hugging Face name (after "model.layers.{i}.")
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
MARKER = "folio_import.json"
"""The file an import folder records its source in (and, for ``weights=False``, ``"weights": "gguf"``)."""
# tensors that carry nothing the Hugging Face layout needs (checked separately)
_IGNORED_TENSORS = {"rope_freqs.weight"}

# GPT-2's pre-tokenizer regex (the one `tokenizers.pre_tokenizers.ByteLevel(use_regex=True)` applies)
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# Llama 3's pre-tokenizer regex (tokenizer.json of meta-llama/Meta-Llama-3-8B; llama.cpp LLAMA3)
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre values -> how llama.cpp splits text before BPE (llama-vocab.cpp):
#   digits: every \p{N} its own piece first, then the GPT-2 regex
#   gpt2: the GPT-2 regex alone
#   llama3: the Llama 3 regex, BPE with ignore_merges (a whole piece in the vocab is one token)
PRE_TOKENIZERS = {
    "smollm": "digits", "starcoder": "digits", "refact": "digits", "codeshell": "digits",
    "gpt2": "gpt2", "mpt": "gpt2", "olmo": "gpt2",
    "llama-bpe": "llama3", "llama3": "llama3", "smaug-bpe": "llama3", "dbrx": "llama3",
}

# llama.cpp token types (gguf.TokenType)
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4


def open_gguf(path):
    """A ``gguf.GGUFReader`` of ``path`` (memory-mapped, read-only).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a GGUF file, a truncated or corrupt one, or a tensor of a GGML type id that
            ``gguf`` does not know (each named).
    """
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such GGUF file: {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic at its start)")
    _, infos = read_tensor_infos(path)
    need = max((t.offset + tensor_bytes(t) for t in infos.values()), default=0)
    size = path.stat().st_size
    if need > size:
        raise ValueError(f"{path} is truncated: {size:,} bytes, its tensors need {need:,}")
    try:
        return gguf.GGUFReader(str(path), "r")
    except ValueError as e:
        if "GGMLQuantizationType" in str(e):
            raise ValueError(f"{path}: a tensor has a GGML type unknown to the gguf package ({e}); re-quantize "
                             f"it with llama.cpp's llama-quantize to Q4_K_M or Q8_0") from None
        raise ValueError(f"{path} is truncated or corrupt: {e}") from None
    except (IndexError, OSError, struct.error) as e:
        raise ValueError(f"{path} is truncated or corrupt ({type(e).__name__}: {e})") from None


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: adjacent-pair rotary rows -> HF rotate_half rows.

    Per head of width d: ``hf_row[i] = gguf_row[2i]``, ``hf_row[i + d/2] = gguf_row[2i + 1]``.
    """
    out_features, in_features = w.shape
    d = out_features // n_heads
    return np.ascontiguousarray(
        w.reshape(n_heads, d // 2, 2, in_features).swapaxes(1, 2).reshape(out_features, in_features))


def _rope_scaling_from_freqs(rope_freqs: np.ndarray, head_dim: int, rope_theta: float) -> dict:
    """Recover Llama 3.1-style ``rope_scaling`` from llama.cpp's ``rope_freqs`` tensor.

    llama.cpp stores per-frequency divisors instead of the scaling parameters; the candidate
    parameter sets of the released Llama 3.x models are tried and the one that reproduces the tensor
    is returned.

    Raises:
        ValueError: no known parameter set reproduces the tensor.
    """
    from ..kernels.reference import rope_inv_freq

    base = rope_inv_freq(head_dim, rope_theta, None)
    factor = float(np.max(rope_freqs))
    for low, high, orig in ((1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 4.0, 2048)):
        cand = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                "high_freq_factor": high, "original_max_position_embeddings": orig}
        scaled = rope_inv_freq(head_dim, rope_theta, cand)
        if np.allclose(base / scaled, rope_freqs, rtol=1e-4, atol=1e-4):
            return cand
    raise ValueError("GGUF rope_freqs tensor does not match any known llama3 rope_scaling; "
                     "convert from the original Hugging Face checkpoint instead")


def _config_from_gguf(reader, tensor_names: set[str]) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (folio imports llama only)")

    def kv(key, default=None):
        return _field(reader, f"llama.{key}", default)

    hidden = int(kv("embedding_length"))
    heads = int(kv("attention.head_count"))
    kv_heads = int(kv("attention.head_count_kv", heads))
    head_dim = int(kv("attention.key_length", kv("rope.dimension_count", hidden // heads)))
    if int(kv("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError("GGUF rope.dimension_count != head_dim (partial rotary) is not supported")
    scaling_type = kv("rope.scaling.type")
    if scaling_type not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling type {scaling_type!r}")
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    vocab = int(kv("vocab_size", len(tokens)))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(kv("feed_forward_length")),
        "num_hidden_layers": int(kv("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rope_theta": float(kv("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "rms_norm_eps": float(kv("attention.layer_norm_rms_epsilon", 1e-5)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "max_position_embeddings": int(kv("context_length", 2048)),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if cfg[key] is not None:
            cfg[key] = int(cfg[key])
    return cfg


def build_tokenizer(reader):
    """A ``tokenizers.Tokenizer`` equivalent to llama.cpp's tokenizer of the GGUF file.

    Byte-level BPE from ``tokenizer.ggml.tokens`` / ``merges``; the pre-tokenizer chosen by
    ``tokenizer.ggml.pre`` (see ``PRE_TOKENIZERS``); control and user-defined tokens become added
    tokens (control ones special), matched in text before BPE as llama.cpp does.

    Raises:
        ValueError: a tokenizer model other than ``gpt2`` (byte-level BPE) or an unsupported
            ``tokenizer.ggml.pre``.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {model!r} (folio imports byte-level BPE, 'gpt2')")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    kind = PRE_TOKENIZERS.get(pre)
    if kind is None:
        raise ValueError(f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r} "
                         f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                     ignore_merges=(kind == "llama3"))
    tok = Tokenizer(bpe)
    if kind == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(tokens[i], special=(types[i] == _TOKEN_CONTROL), normalized=False)
             for i in range(len(tokens)) if types[i] in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)]
    # add_tokens keeps the ids the vocab already gives these strings
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[int(bos_id)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _tokenizer_config(reader, tokens: list[str], max_len: int) -> dict:
    def tok(key):
        i = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return None if i is None or int(i) >= len(tokens) else tokens[int(i)]

    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok("bos"),
        "eos_token": tok("eos"),
        "unk_token": tok("unknown"),
        "pad_token": tok("padding"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
    }
    template = _field(reader, "tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    return cfg


def _write_json(path: Path, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def convert_gguf(gguf_path, out_dir, *, weights: bool = True, verbose: bool = False) -> Path:
    """Write a Hugging Face Llama folder for the GGUF file ``gguf_path`` into ``out_dir``.

    With ``weights=False`` the folder gets everything but ``model.safetensors`` (config, tokenizer,
    chat template), and its ``folio_import.json`` names ``gguf_path`` as the source of its weights:
    the model is then served from the GGUF file itself (``gguf_weights.load_gguf_weights``), and
    the import takes a fraction of a second instead of dequantizing every tensor.

    The folder is assembled in a temporary sibling directory and renamed into place, so a reader
    never sees half a folder; ``out_dir`` must not exist or be empty.

    Returns:
        ``Path(out_dir)``.
    Raises:
        FileNotFoundError: no such GGUF file.
        FileExistsError: ``out_dir`` exists and is not empty.
        ValueError: not a llama GGUF, unknown tensors, a tensor type ``gguf`` cannot dequantize,
            or an unsupported tokenizer / pre-tokenizer / rope scaling.
    """
    import gguf
    from safetensors.numpy import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"no such GGUF file: {gguf_path}")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"output folder {out_dir} exists and is not empty")
    t0 = time.perf_counter()
    reader = open_gguf(gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    config = _config_from_gguf(reader, set(tensors))
    tokenizer = build_tokenizer(reader)  # fails early on an unsupported tokenizer
    if "rope_freqs.weight" in tensors:
        t = tensors["rope_freqs.weight"]
        config["rope_scaling"] = _rope_scaling_from_freqs(
            gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1), config["head_dim"], config["rope_theta"])

    names = {}
    for name in tensors:
        if name in GLOBAL_TENSORS:
            names[name] = GLOBAL_TENSORS[name]
        elif name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            if rest not in LAYER_TENSORS:
                raise ValueError(f"unknown GGUF tensor {name} (not a plain Llama layer)")
            names[name] = f"model.layers.{int(layer)}.{LAYER_TENSORS[rest]}"
        elif name not in _IGNORED_TENSORS:
            raise ValueError(f"unknown GGUF tensor {name}")
    tensor_data = {}
    for name, hf_name in (names.items() if weights else ()):
        t = tensors[name]
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"GGUF tensor {name} has type {t.tensor_type.name}, which gguf cannot "
                             f"dequantize: {e}") from None
        w = np.asarray(w, dtype=np.float32).reshape(tuple(int(n) for n in reversed(t.shape)))
        if name.endswith("attn_q.weight"):
            w = unpermute_rows(w, config["num_attention_heads"])
        elif name.endswith("attn_k.weight"):
            w = unpermute_rows(w, config["num_key_value_heads"])
        tensor_data[hf_name] = np.ascontiguousarray(w)
    t_read = time.perf_counter()

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        if weights:
            save_file(tensor_data, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save(str(tmp / "tokenizer.json"))
        tokens = list(_field(reader, "tokenizer.ggml.tokens"))
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "tokenizer_config.json",
                    _tokenizer_config(reader, tokens, config["max_position_embeddings"]))
        gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
        if config["pad_token_id"] is not None:
            gen["pad_token_id"] = config["pad_token_id"]
        _write_json(tmp / "generation_config.json", gen)
        _write_json(tmp / MARKER, {
            "source": str(gguf_path.resolve()), "source_bytes": gguf_path.stat().st_size,
            "weights": "safetensors" if weights else "gguf",
            "gguf_name": _field(reader, "general.name"), "seconds": round(time.perf_counter() - t0, 2)})
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above); a concurrent writer makes this raise
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if verbose:
        print(f"imported {gguf_path.name} -> {out_dir} in {time.perf_counter() - t0:.1f} s "
              f"(read+dequantize {t_read - t0:.1f} s)")
    return out_dir
