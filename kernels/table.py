"""The kernel table: the operations the forward pass calls, one implementation per device.

``get_kernels("cpu")`` returns ``cpu.CPU_KERNELS`` (Numba), ``get_kernels("cuda")`` a
``cuda_ops.CudaKernels`` (CuPy RawKernels); both conform to ``KernelTable`` (a test checks the
members and their signatures), and the model code is written against this protocol only. The
semantics of every operation are the NumPy specifications in ``reference.py``; shapes below use
``T`` tokens, ``S`` sequences, ``H`` / ``Hkv`` query / KV heads, ``D`` head size. ``out=``
arguments name preallocated results (the forward pass allocates nothing per layer).

A table may also have ``random_weight(shape, seed, std, mean)`` (the CUDA one does), used by
``model/loader.py`` to make dummy weights on the device, and ``decoder_layers`` (the CPU one
does, ``cpu_forward.py``), which runs every decoder layer of a step in one call over weights
stacked per kind, and ``zeros(shape, dtype)`` (the CPU one does: ``cpu_memory.huge_page_zeros``),
which ``allocate_kv_caches`` and the weight stacks use for their large long-lived arrays; all
three are optional and not part of the protocol.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np


def to_numpy(a) -> np.ndarray:
    """A host NumPy array of ``a`` (copied from the device for a CuPy array, as is for NumPy)."""
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


@runtime_checkable
class KernelTable(Protocol):
    """What ``model/llama.py``, ``model/loader.py`` and ``runtime/worker/model_runner.py`` call.

    Attributes:
        name: ``"cpu"`` or ``"cuda"``.
        xp: the array module of the table's arrays (``numpy`` or ``cupy``).
        kv_cache_dtype: dtype of the KV cache arrays (float32 on CPU, bf16 bit patterns on GPU).
        act_dtype: dtype of activations (float32).
    """

    name: str
    xp: Any
    kv_cache_dtype: np.dtype
    act_dtype: np.dtype

    def paged_attention(self, q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, *,
                        max_query_len: int | None = None, max_seq_len: int | None = None, out=None):
        """Causal attention of ``q [T, H, D]`` over the paged cache (``reference.paged_attention``);
        returns ``[T, H, D]`` (into ``out`` when given)."""
        ...

    def rope_and_cache(self, positions, qkv, cos_sin_cache, key_cache, value_cache, slot_mapping, num_heads,
                       num_kv_heads, *, out=None):
        """RoPE on the q and k parts of ``qkv [T, (H + 2 Hkv) * D]``, the rotated keys and the
        values appended to the caches at ``slot_mapping [T]`` (-1 = skip); returns the rotated
        queries ``[T, H, D]`` (``reference.rope_and_cache``)."""
        ...

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        """Write ``key, value [T, Hkv, D]`` into the caches at ``slot_mapping [T]`` (-1 = skip)."""
        ...

    def copy_blocks(self, key_caches, value_caches, block_mapping) -> None:
        """Copy whole blocks ``block_mapping [N, 2]`` (src, dst) in every layer's caches."""
        ...

    def rms_norm(self, x, weight, eps, *, out=None):
        """RMSNorm of ``x [T, hidden]``."""
        ...

    def fused_add_rms_norm(self, x, residual, weight, eps, *, out=None, residual_out=None, rows=None):
        """``residual += x`` then RMSNorm (of ``rows`` only, when given); returns ``(normed,
        residual)``."""
        ...

    def rotary_embedding(self, positions, q, k, cos_sin_cache):
        """RoPE on ``q [T, H, D]`` and ``k [T, Hkv, D]`` at ``positions [T]``; returns ``(q, k)``."""
        ...

    def silu_and_mul(self, x, *, out=None):
        """SwiGLU: ``silu(x[:, :n]) * x[:, n:]`` for ``x [T, 2n]``."""
        ...

    def linear(self, x, weight, *, out=None):
        """``x [T, in] @ weight.T`` for a weight prepared by ``prepare_weight`` (``[out, in]``)."""
        ...

    def embedding(self, ids, table, *, out=None):
        """Rows ``table[ids]`` as activations."""
        ...

    def prepare_weight(self, w):
        """A host weight array in the table's storage format on its device."""
        ...
