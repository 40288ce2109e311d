"""Weights of a Hugging Face Llama folder: safetensors (single or sharded) read as float32 NumPy arrays.

The safetensors layout (https://huggingface.co/docs/safetensors/index#format): an 8-byte little-endian
header length, a JSON header ``{name: {"dtype", "shape", "data_offsets"}}``, then the raw tensor
bytes. The ``safetensors`` package's NumPy reader has no bfloat16, so the header is parsed here and
the bytes are memory-mapped; bf16 is widened to float32 exactly (its 16 bits are the high half of a
float32).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from ..kernels.quant_reference import QuantizedWeight
from .config import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype -> NumPy dtype of the stored bits
_STORAGE = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The Hugging Face names and NumPy shapes of every tensor the Llama forward pass needs.

    Matrices are ``[out_features, in_features]`` (``y = x @ W.T``). ``lm_head.weight`` is listed only
    when ``config.tie_word_embeddings`` is False.
    """
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def read_safetensors_header(path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the byte offset where its data starts.

    Raises:
        ValueError: the file is not a well-formed safetensors file.
    """
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 1024 * 1024:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: bad safetensors header: {e}") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def _to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> file that holds it (single file or the sharded index)."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return {name: model_dir / fname for name, fname in weight_map.items()}
    single = model_dir / SINGLE_FILE
    if single.is_file():
        header, _ = read_safetensors_header(single)
        return {name: single for name in header}
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")


def load_weights(model_dir, config: ModelConfig, keep_bf16: bool = False, keep_16bit: bool = False) -> dict:
    """Load every tensor ``weight_shapes(config)`` names as a C-contiguous float32 array.

    With ``keep_bf16`` a BF16 tensor is returned as its raw ``uint16`` bit patterns instead (a bf16
    device copies them as they are, with no float32 round trip on the host). With ``keep_16bit``
    (the CPU serving weights in their stored types) every F16 / BF16 matrix is returned as a
    ``QuantizedWeight`` of type F16 / BF16 (its bytes copied once from the file, no float32 copy);
    vectors (the norms) are float32 either way.

    Reads ``model.safetensors`` or the shards listed by ``model.safetensors.index.json``; F32, F16
    and BF16 on disk. Extra tensors in the files are ignored; with tied embeddings a stored
    ``lm_head.weight`` is ignored too.

    Returns:
        dict Hugging Face name -> float32 ndarray (shapes as in ``weight_shapes``), or with the
        options above uint16 arrays / ``QuantizedWeight``.
    Raises:
        FileNotFoundError: no safetensors file / index in ``model_dir``, or a shard listed in the index
            is absent.
        ValueError: tensors missing (all named), a shape that does not match the config, or an
            unsupported dtype.
    """
    model_dir = Path(model_dir)
    expected = weight_shapes(config)
    where = _weight_files(model_dir)
    missing = [name for name in expected if name not in where]
    if missing:
        shown = ", ".join(missing[:20]) + (f" ... ({len(missing)} in all)" if len(missing) > 20 else "")
        raise ValueError(f"{model_dir}: missing tensor(s) for {config.architectures[0]}: {shown}")
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(where[name], []).append(name)
    out: dict[str, np.ndarray] = {}
    for path, names in by_file.items():
        if not path.is_file():
            raise FileNotFoundError(f"shard {path.name} listed in {INDEX_FILE} is missing from {model_dir}")
        header, data_start = read_safetensors_header(path)
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        try:
            for name in names:
                if name not in header:
                    raise ValueError(f"{path.name}: missing tensor {name} (listed in {INDEX_FILE})")
                info = header[name]
                dtype, shape = info["dtype"], tuple(info["shape"])
                if dtype not in _STORAGE:
                    raise ValueError(f"{path.name}: tensor {name} has unsupported dtype {dtype} "
                                     f"(supported: {', '.join(_STORAGE)})")
                if shape != expected[name]:
                    raise ValueError(f"{path.name}: tensor {name} has shape {list(shape)}, "
                                     f"config expects {list(expected[name])}")
                begin, end = info["data_offsets"]
                raw = mm[data_start + begin:data_start + end].view(_STORAGE[dtype]).reshape(shape)
                if keep_16bit and dtype in ("F16", "BF16") and len(shape) == 2:
                    out[name] = QuantizedWeight(np.array(raw, copy=True, order="C").view(np.uint8), dtype, shape)
                elif keep_bf16 and dtype == "BF16":
                    out[name] = np.array(raw, dtype=np.uint16, copy=True, order="C")
                else:
                    out[name] = np.ascontiguousarray(_to_float32(raw, dtype), dtype=np.float32)
        finally:
            del mm
    return out


def stored_16bit(model_dir) -> bool:
    """Whether a Hugging Face folder's safetensors store any matrix in F16 or BF16 (headers only)."""
    model_dir = Path(model_dir)
    try:
        files = set(_weight_files(model_dir).values())
    except FileNotFoundError:
        return False
    for path in files:
        if not path.is_file():
            continue
        header, _ = read_safetensors_header(path)
        if any(info.get("dtype") in ("F16", "BF16") and len(info.get("shape", ())) == 2 for info in header.values()):
            return True
    return False


def dummy_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights of the right names and shapes (for benchmarks and tests).

    Matrices ~ N(0, 0.02^2) (the Llama initializer range); norm weights ~ 1 + N(0, 0.02^2).
    Deterministic for a given ``seed``.
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in weight_shapes(config).items():
        w = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        if len(shape) == 1:
            w += np.float32(1.0)
        out[name] = w
    return out
