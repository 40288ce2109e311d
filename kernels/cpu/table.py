"""The CPU kernel table, ``CPU_KERNELS``: the operations of ``kernels/reference.py`` in Numba, float32
(the KV cache float32 or bfloat16 bits as uint16, ``--kv-cache-dtype``: ``kv_dtype.py``).

The parts: the row kernels (KV-cache append, norms, RoPE, activation, embedding) in ``rows.py``,
paged attention in ``attention.py``, matrix products (``linear``) in ``linear.py``, every decoder
layer of a step as one compiled call in ``forward.py``, the vectorised ``exp2`` in ``math.py``,
and the threading policy all of them follow in ``threads.py`` (one pool, Numba's, sized to the
cores this process may run on; BLAS held at one thread and called per tile from that pool; work
items taken from a shared counter). ``CPU_KERNELS`` is the ``kernels.table.KernelTable`` the
forward pass (``model/llama.py``) is written against; ``kernels.get_kernels("cpu")`` returns it.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from .. import reference
from .attention import paged_attention
from .forward import decoder_layers
from .kv_dtype import KV_CACHE_DTYPES
from .linear import linear
from .memory import huge_page_zeros
from .rows import (copy_blocks, embedding, fused_add_rms_norm, prepare_weight, reshape_and_cache, rms_norm,
                   rope_and_cache, rotary_embedding, silu_and_mul)

__all__ = [
    "paged_attention",
    "reshape_and_cache",
    "copy_blocks",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "rope_and_cache",
    "silu_and_mul",
    "linear",
    "embedding",
    "prepare_weight",
    "CPU_KERNELS",
]


CPU_KERNELS = SimpleNamespace(
    xp=np,
    name="cpu",
    kv_cache_dtype=np.dtype(np.float32),
    kv_cache_dtypes=KV_CACHE_DTYPES,
    act_dtype=np.dtype(np.float32),
    matmul_input_dtype=np.dtype(np.float32),
    paged_attention=paged_attention,
    reshape_and_cache=reshape_and_cache,
    copy_blocks=copy_blocks,
    rms_norm=rms_norm,
    fused_add_rms_norm=fused_add_rms_norm,
    rope_inv_freq=reference.rope_inv_freq,
    rope_cos_sin_cache=reference.rope_cos_sin_cache,
    rotary_embedding=rotary_embedding,
    rope_and_cache=rope_and_cache,
    silu_and_mul=silu_and_mul,
    linear=linear,
    embedding=embedding,
    prepare_weight=prepare_weight,
    decoder_layers=decoder_layers,
    zeros=huge_page_zeros,
)
"""The CPU kernel table (see kernels/__init__.py ``get_kernels``)."""
