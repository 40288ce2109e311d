"""Weights served straight from a GGUF file, memory-mapped, in the types they are stored in.

``load_gguf_weights`` returns the tensors a Llama forward pass needs (``weights.weight_shapes``) under
their Hugging Face names: each matrix a ``QuantizedWeight`` whose bytes are a view of the mapped file
(nothing copied, nothing dequantized: the CPU kernels read the blocks as llama.cpp lays them out,
``kernels/cpu/quant_linear.py``), the norm vectors as float32. The one copy is of ``attn_q`` and
``attn_k``: llama.cpp's converter permutes their rows for its rotary layout (pairs of adjacent
rows), and folio's rotary kernels use Hugging Face's (halves of each head), so those two are read
into memory with their rows put back in Hugging Face order (a permutation of whole rows: the
blocks are unchanged). They are read with file reads, not through the mapping, so their mapped
pages are never touched and not counted twice in the resident set, and only when first read
(``QuantizedWeight.lazy``): a kernel table that keeps its own layout of them (the CPU's
interleaved rows for int8 activations) drops the copy once that is made (``release_rows``), so
it is never held beside it, nor all layers' copies at once.

Everything is checked before a byte of weight data is read: the architecture, every tensor's
presence, shape and type (a type outside ``quant_reference.QUANT_TYPES`` is refused with
``UnsupportedQuantType``, which names the type and the ways out), and that the file holds each
tensor's bytes in full (a truncated download is named as such).

The tokenizer and config of the file are imported separately, once, into a small Hugging Face
folder (``gguf_import.convert_gguf(..., weights=False)``); that folder's ``folio_import.json``
records this file as the source of its weights (``gguf_source``).

Sources: the GGUF specification (github.com/ggml-org/ggml/blob/master/docs/gguf.md) for the layout
(header, metadata, tensor infos, aligned data; ``read_tensor_infos`` walks it, a few milliseconds
where gguf-py's reader takes seconds); llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) for the q/k row order.
"""

from __future__ import annotations

import json
import mmap
import os
import weakref
from pathlib import Path

import numpy as np

from ..kernels.quant_reference import QuantizedWeight, UnsupportedQuantType, dequantize, quant_type, row_bytes
from .config import ModelConfig
from .gguf_header import read_tensor_infos
from .gguf_import import GLOBAL_TENSORS, LAYER_TENSORS, MARKER, unpermute_rows
from .weights import weight_shapes

__all__ = ["load_gguf_weights", "gguf_source"]


def gguf_source(model_dir) -> Path | None:
    """The GGUF file whose weights a folio import folder serves (its ``folio_import.json`` says
    ``"weights": "gguf"``), or None for a folder that holds its own weights.

    Raises:
        FileNotFoundError: the folder names a GGUF file that is no longer there.
    """
    marker = Path(model_dir) / MARKER
    if not marker.is_file():
        return None
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if info.get("weights") != "gguf":
        return None
    source = Path(info["source"])
    if not source.is_file():
        raise FileNotFoundError(f"{model_dir} serves the weights of {source}, which is gone; give the .gguf "
                                f"file again (or remove {model_dir} to import it afresh)")
    return source


def _gguf_names(config: ModelConfig) -> dict[str, str]:
    # Hugging Face name -> GGUF name for every tensor the forward pass needs
    hf_to_gguf = {hf: g for g, hf in GLOBAL_TENSORS.items()}
    out = {}
    for name in weight_shapes(config):
        if name.startswith("model.layers."):
            layer, rest = name[len("model.layers."):].split(".", 1)
            out[name] = f"blk.{layer}." + {hf: g for g, hf in LAYER_TENSORS.items()}[rest]
        else:
            out[name] = hf_to_gguf[name]
    return out


def load_gguf_weights(path, config: ModelConfig) -> dict:
    """The tensors of ``weight_shapes(config)`` from the GGUF file ``path``, in their stored types.

    Returns:
        dict Hugging Face name -> ``QuantizedWeight`` for every matrix (``[N, K]``; F32, F16, BF16,
        Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K as stored, views of the mapped file except
        ``q_proj`` / ``k_proj``, see the module docstring) and float32 ``[hidden]`` arrays for the
        norms.
    Raises:
        FileNotFoundError: no such file.
        ValueError: not a llama GGUF, truncated or corrupt, a tensor missing or of another shape
            than ``config`` says (named).
        UnsupportedQuantType: a tensor in a type folio does not read (named, with the ways out).
    """
    path = Path(path)
    arch, tensors = read_tensor_infos(path)
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r}; folio serves llama GGUF files only")
    expected = weight_shapes(config)
    names = _gguf_names(config)
    size = path.stat().st_size
    plan = {}
    for hf_name, g in names.items():
        t = tensors.get(g)
        if t is None:
            raise ValueError(f"{path}: tensor {g} ({hf_name}) is missing")
        try:
            q = quant_type(t.type_id)
        except UnsupportedQuantType as e:
            raise UnsupportedQuantType(f"{path}: tensor {g}: {e}") from None
        if t.shape != expected[hf_name]:
            raise ValueError(f"{path}: tensor {g} has shape {list(t.shape)}, the model's config expects "
                             f"{list(expected[hf_name])}")
        nbytes = int(np.prod(t.shape[:-1], dtype=np.int64)) * row_bytes(q, t.shape[-1])
        if t.offset + nbytes > size:
            raise ValueError(f"{path} is truncated: tensor {g} needs bytes {t.offset}..{t.offset + nbytes} "
                             f"of a {size}-byte file")
        plan[hf_name] = (g, t, q, nbytes)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    _advise_willneed(mapped)
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    out, source = {}, None
    for hf_name, (g, t, q, nbytes) in plan.items():
        shape = t.shape
        if len(shape) == 1:
            out[hf_name] = np.ascontiguousarray(dequantize(np.asarray(mapped[t.offset:t.offset + nbytes]), q),
                                                dtype=np.float32).reshape(shape)
            continue
        kind = hf_name.rsplit(".", 2)[-2]
        if kind in heads:   # rows back into Hugging Face's rotary order: a copy, made when first read
            if source is None:
                source = _OpenFile(path)
            out[hf_name] = QuantizedWeight.lazy(_RotaryRows(source, g, t.offset, shape[0], nbytes, heads[kind]),
                                                q.id, shape)
        else:   # a read-only view of the mapping (np.asarray: a plain ndarray, the map its base)
            out[hf_name] = QuantizedWeight(np.asarray(mapped[t.offset:t.offset + nbytes]).reshape(shape[0], -1),
                                           q.id, shape)
    return out


class _OpenFile:
    # the GGUF file, open for reading while a weight may read from it: the same file even where
    # the path is later replaced (as the mapping is)
    def __init__(self, path: Path):
        self.path, self.fd = path, os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)

    def __deepcopy__(self, memo):   # a copy of a weight reads the same open file
        return self

    def __reduce__(self):   # another process opens the path again (a descriptor number means nothing there)
        return _OpenFile, (self.path,)


class _RotaryRows:
    # make() of a lazy q / k weight: its rows read from the file (with file reads, not through the
    # mapping, so that no mapped page is touched and counted twice in the resident set) and put
    # back in Hugging Face's order
    def __init__(self, source: _OpenFile, name: str, offset: int, rows: int, nbytes: int, n_heads: int):
        self.source, self.name, self.offset, self.rows, self.nbytes, self.n_heads = \
            source, name, offset, rows, nbytes, n_heads

    def __call__(self) -> np.ndarray:
        raw = np.empty((self.rows, self.nbytes // self.rows), np.uint8)
        view, done = memoryview(raw).cast("B"), 0
        while done < self.nbytes:
            n = os.preadv(self.source.fd, [view[done:]], self.offset + done)
            if n <= 0:
                raise ValueError(f"{self.source.path} is shorter than when it was loaded: tensor {self.name} is "
                                 f"cut off (the file changed since; load the model again)")
            done += n
        return unpermute_rows(raw, self.n_heads)


def _advise_willneed(mapped: np.memmap) -> None:
    # ask the kernel to read the file ahead (the first steps then find the weights in memory
    # instead of faulting them in page by page); best effort
    mm = getattr(mapped, "_mmap", None)
    advice = getattr(mmap, "MADV_WILLNEED", None)
    if mm is not None and advice is not None and hasattr(mm, "madvise"):
        try:
            mm.madvise(advice)
        except OSError:
            pass
