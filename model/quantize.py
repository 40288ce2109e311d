"""Load-time quantization of float weights (``--quantization``): matrices into GGUF block types.

``quantize_weights`` turns every matrix of a float checkpoint (float32, or 16-bit kept as F16 / BF16
``QuantizedWeight``) into a ``QuantizedWeight`` of the chosen type as the model loads, one tensor at
a time, so the CPU kernels then read 8.5 (``q8_0``) or 4.5 (``q4_k``) bits per weight instead of 32
or 16. The norm vectors stay float32.

The names (``QUANTIZATIONS``) are llama.cpp's type names in lower case:

- ``q8_0``: blocks of 32 values, one binary16 scale, int8 codes (llama.cpp's reference quantizer,
  bit-identical to gguf-py's).
- ``q4_k``: the 4-bit k-quant, super-blocks of 256 values in 8 sub-blocks with 6-bit scales and
  mins (``quant_reference.quantize``'s quantizer: simpler than llama.cpp's iterative search, every
  value off by at most half its sub-block's step). A matrix whose rows are not whole super-blocks
  of 256 values (the default model's 576-wide ones) falls back to ``q8_0``, as llama.cpp's
  quantizer falls back to another type for such tensors.

Sources: llama.cpp ``ggml-quants.c`` (``quantize_row_q8_0_ref``, the k-quants of PR 1684) and its
``llama-quant.cpp`` (the fallback for rows that are not whole super-blocks).
"""

from __future__ import annotations

import numpy as np

from ..kernels.quant_reference import Q4_K, Q8_0, QUANT_TYPES, QuantizedWeight, quantize

__all__ = ["QUANTIZATIONS", "quantize_weights"]

QUANTIZATIONS = {"q8_0": Q8_0, "q4_k": Q4_K}
"""``--quantization`` names -> GGML type ids."""


def _values(w) -> np.ndarray:
    if isinstance(w, QuantizedWeight):
        return w.dequantize()
    if w.dtype == np.uint16:   # bfloat16 bit patterns
        return (w.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(w, dtype=np.float32)


def quantize_weights(weights: dict, name: str) -> dict:
    """``weights`` with every matrix quantized to ``QUANTIZATIONS[name]`` (entries replaced one by one,
    each float copy dropped as soon as it is quantized); vectors unchanged.

    Args:
        weights: Hugging Face name -> float32 / float16 / bfloat16-bits arrays or F32 / F16 / BF16
            ``QuantizedWeight`` (``weights.load_weights``, ``weights.dummy_weights``).
        name: ``"q8_0"`` or ``"q4_k"``.
    Returns:
        the same dict, modified.
    Raises:
        ValueError: an unknown name, or a matrix already in a quantized GGUF type.
    """
    if name not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {name!r}; choose one of {', '.join(QUANTIZATIONS)}")
    want = QUANTIZATIONS[name]
    for key in list(weights):
        w = weights[key]
        if len(w.shape) != 2:
            continue
        if isinstance(w, QuantizedWeight) and QUANT_TYPES[w.qtype].block_values > 1:
            raise ValueError(f"{key} is already quantized ({w.type_name}); --quantization applies to float weights "
                             f"(serve the file as it is, or re-quantize it with llama.cpp's llama-quantize)")
        K = w.shape[1]
        qtype = want if K % QUANT_TYPES[want].block_values == 0 else Q8_0
        if K % QUANT_TYPES[qtype].block_values:
            continue   # rows that are not whole blocks of 32 stay float (no Llama shape has them)
        values = _values(w)
        weights[key] = QuantizedWeight(quantize(values, qtype), qtype, w.shape)
        del values
    return weights
