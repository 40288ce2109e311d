"""The CPU kernel table, ``CPU_KERNELS``: the operations of ``kernels/reference.py`` in Numba, float32
(the KV cache float32 or bfloat16 bits as uint16, ``--kv-cache-dtype``: ``kv_dtype.py``).

The parts: the row kernels (KV-cache append, norms, RoPE, activation, embedding) in ``rows.py``,
paged attention in ``attention.py``, matrix products (``linear``) in ``linear.py``, every decoder
layer of a step as one compiled call in ``forward.py``, the vectorised ``exp2`` in ``math.py``,
and the threading policy all of them follow in ``threads.py`` (one pool, Numba's, sized to the
cores this process may run on; BLAS held at one thread and called per tile from that pool; work
items taken from a shared counter). ``CPU_KERNELS`` is the ``kernels.table.CpuKernelTable`` the
forward pass (``model/llama.py``) is written against; ``kernels.get_kernels("cpu")`` returns it.
``precompile_jobs`` gathers what each kernel module compiles ahead (its ``PRECOMPILE``,
``compile_jobs.py``).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np

from .. import reference
from ..quant_reference import QuantizedWeight
from . import attention, compile_jobs, forward, linear as linear_module, quant_int8, quant_linear, quant_x8, rows
from .attention import paged_attention
from .forward import decoder_layers, quantized_linear, stack_quantized
from .kv_dtype import KV_CACHE_DTYPES
from .linear import linear as _float_linear
from .memory import huge_page_zeros
from .quant_linear import interleaved_embedding, kernel_layout, quant_embedding, quant_kernel_type
from .rows import copy_blocks, fused_add_rms_norm, rms_norm, rope_and_cache, silu_and_mul
from .rows import embedding as _float_embedding
from .rows import prepare_weight as _float_prepare_weight


def linear(x, weight, out=None):
    """``x [T, K]`` float32 @ ``weight``.T -> ``[T, N]`` float32: ``weight`` a float32 ``[N, K]`` array
    (``linear.linear``) or a ``QuantizedWeight`` (``forward.quantized_linear``, ``quant_linear``'s
    result: its GGUF blocks read as stored, through the layer loop's compiled product items)."""
    if isinstance(weight, QuantizedWeight):
        return quantized_linear(x, weight, out)
    return _float_linear(x, weight, out)


def embedding(ids, table, out=None):
    """Rows ``ids`` of ``table`` as float32 ``[T, hidden]`` (into ``out`` when given): a float32 table
    (``rows.embedding``) or a ``QuantizedWeight`` one (``quant_embedding``, the rows dequantized)."""
    if isinstance(table, QuantizedWeight):
        rows_ = quant_embedding(table.data, table.qtype, ids, table.shape[1]) if table.packed is None else \
            interleaved_embedding(table.packed[0], table.qtype, ids, table.shape[1])
        if out is None:
            return rows_
        out[...] = rows_
        return out
    return _float_embedding(ids, table, out=out)


def prepare_weight(w):
    """A weight as the kernels read it (the embedding table, ``lm_head``): ``rows.prepare_weight``'s
    float32 array, or a ``QuantizedWeight``, as it is, or with int8 activations in a type the
    products read interleaved (``quant_linear.kernel_layout``: ``X8_TYPES``, ``N % 8 == 0``) a
    new one with those rows as ``packed``, which both ``linear`` and ``embedding`` then read (a
    tied table is copied once); the GGUF rows' pages of a mapped file are handed back
    (``memory.release_mapped_pages``), as the layers' are (``forward.QuantizedStack``)."""
    if not isinstance(w, QuantizedWeight):
        return _float_prepare_weight(w)
    if w.activations == "int8" and w.packed is None:
        data, kind = kernel_layout(w.data, quant_kernel_type(w.qtype, w.activations), release=True)
        if data is not w.data:
            out = QuantizedWeight(w.data, w.qtype, w.shape, w.activations)
            out.packed = (data, kind)
            return out
    return w

def apply_token_bitmask(logits, bitmask):
    """Structured outputs' mask on ``logits [R, V]`` float32 in place: -inf where bit ``t % 32`` of
    ``bitmask [R, W]`` int32 word ``t // 32`` is clear (``reference.apply_token_bitmask``, the spec);
    returns ``logits``."""
    logits[...] = reference.apply_token_bitmask(logits, bitmask)
    return logits


def activate():
    """Nothing to route: the kernels run on the calling thread (and Numba's pool) and return when done."""
    return contextlib.nullcontext()


def synchronize():
    """Nothing to wait for: every kernel call has returned when done."""


def empty_cache():
    """Nothing cached to release: arrays are NumPy's, freed with their last reference."""


def precompile_jobs(variant: str = "float32") -> tuple:
    """The ``compile_jobs.NumbaJob``s a two-thread worker of weight layout ``variant``
    (``compile_jobs.VARIANTS``) calls, from each kernel module's ``PRECOMPILE``, group by group.

    Raises:
        ValueError: an unknown variant.
    """
    declared = (attention.PRECOMPILE + rows.PRECOMPILE + forward.PRECOMPILE + linear_module.PRECOMPILE
                + quant_linear.PRECOMPILE + quant_x8.PRECOMPILE)
    return compile_jobs.in_group_order(declared, variant)


__all__ = [
    "paged_attention",
    "copy_blocks",
    "rms_norm",
    "fused_add_rms_norm",
    "rope_and_cache",
    "silu_and_mul",
    "linear",
    "embedding",
    "prepare_weight",
    "apply_token_bitmask",
    "precompile_jobs",
    "CPU_KERNELS",
]


CPU_KERNELS = SimpleNamespace(
    xp=np,
    name="cpu",
    weight_dtype="float32",
    stacked_layers=True,
    device_sampling=False,
    kv_cache_dtype=np.dtype(np.float32),
    kv_cache_dtypes=KV_CACHE_DTYPES,
    act_dtype=np.dtype(np.float32),
    matmul_input_dtype=np.dtype(np.float32),
    paged_attention=paged_attention,
    copy_blocks=copy_blocks,
    rms_norm=rms_norm,
    fused_add_rms_norm=fused_add_rms_norm,
    rope_inv_freq=reference.rope_inv_freq,
    rope_cos_sin_cache=reference.rope_cos_sin_cache,
    rope_and_cache=rope_and_cache,
    silu_and_mul=silu_and_mul,
    linear=linear,
    embedding=embedding,
    prepare_weight=prepare_weight,
    decoder_layers=decoder_layers,
    stack_quantized=stack_quantized,
    zeros=huge_page_zeros,
    activate=activate,
    synchronize=synchronize,
    empty_cache=empty_cache,
    apply_token_bitmask=apply_token_bitmask,
    integer_products=quant_int8.ISA is not None,
    precompile_variants=compile_jobs.VARIANTS,
    precompile_jobs=precompile_jobs,
)
"""The CPU kernel table (see kernels/__init__.py ``get_kernels``)."""
