"""The CPU kernels, in Numba: the CPU kernel table (``table.CPU_KERNELS``) and what it is built from.

``table`` (the ``KernelTable`` for ``"cpu"``), ``forward`` (the decoder layers as one parallel
region per step), ``rows`` (RMSNorm, RoPE + KV-cache append, SiLU-and-mul over token rows),
``attention`` (paged attention, prefill tiles and decode), ``linear`` (matrix products),
``quant_linear`` (products and embedding rows read straight from GGUF quantized blocks, with
``quant_fused``, ``quant_int8`` and ``quant_x8``: float32 or int8 activations, rows interleaved by 8),
``simd`` (explicit vector code), ``math`` (exp2), ``memory`` (huge-page buffers), ``threads``
(the worker threads, atomics, BLAS) and ``jit_cache`` (Numba's on-disk compile cache, keyed on
the kernels' sources). ``kernels/reference.py`` is the specification each kernel is tested
against.
"""

# installed before any kernel module defines a kernel, whichever of them a process imports first
# (the quant_* modules do not import threads, whose import installs it too)
from . import jit_cache as _jit_cache  # noqa: E402,F401
