"""What the CPU kernels compile ahead of a worker's first step: ``NumbaJob``, one compiled function
and one explicit signature.

Each kernel module lists its own jobs beside its kernels (``PRECOMPILE``: ``attention.py``,
``rows.py``, ``forward.py``, ``linear.py``, ``quant_linear.py``, ``quant_x8.py``); the CPU table
gathers those of a weight layout (``table.precompile_jobs``, ``CpuKernelTable``'s member) and
``runtime/worker/precompile.py`` runs them in child processes. The jobs are the signatures a worker
with two or more kernel threads calls (``forward._layers_region``: one parallel region per step);
with one thread the first step compiles its own path.

Signatures are written in the short type names of ``argument_types``: ``F1``..``F3`` C-contiguous
float32 arrays of 1..3 dimensions, ``F4`` a KV cache ``[blocks, block_size, kv_heads, head_dim]``
(the jobs' only 4-D arrays) of the cache dtype (float32, or uint16 bits for ``--kv-cache-dtype
bfloat16``: ``kv_dtype.py``), ``I1``..``I3`` int64 arrays, ``U2`` a uint8 matrix and ``U2r`` a
read-only one (a memory-mapped GGUF tensor), scalars ``i64 u64 f64 f32 b1`` and ``none``. A kernel
whose arguments change needs its declared signature changed with it
(``tests/runtime/worker/test_warm_up.py`` fails until it is).

Groups (``GROUPS``): jobs whose call trees share compiled functions are in one group, compiled in
one process, in order; a group that links the functions of another group, or compiles signatures
of them, is compiled after it (``AFTER``). ``layers`` (the layer loop's work item,
``forward._phase_item``) links the attention, product and row kernels of ``attention`` and
``linear``; ``rest`` (the parallel regions and what only the steps' Python code calls) compiles
signatures of functions ``linear`` compiles too (``linear_item`` called with literal arguments by
``linear_into``, the row kernels under ``fused_add_rms_norm_into``) and links its scratch and
counter functions.

Weight layouts (``VARIANTS``): ``float32`` stacks; ``quantized``, weights in GGUF types (a ``.gguf``
file served as stored, 16-bit safetensors, ``--quantization``) whose products read GGUF blocks with
float32 activations; ``quantized-int8``, the same with int8 activations (the products' entry with
the integer kernels).

Sources: Numba's documentation, "Compiling Python code with @jit" (explicit signatures,
``Dispatcher.compile``) and "Notes on caching".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .kv_dtype import KV_CACHE_DTYPES

__all__ = ["NumbaJob", "VARIANTS", "GROUPS", "AFTER", "argument_types", "in_group_order"]

VARIANTS = ("float32", "quantized", "quantized-int8")
QUANTIZED = ("quantized", "quantized-int8")

GROUPS = ("attention", "linear", "layers", "rest")
AFTER = {"layers": ("attention", "linear"), "rest": ("linear",)}


def argument_types(kv_cache_dtype: str = "auto") -> dict:
    """Numba types of the signature names, for KV caches of ``kv_cache_dtype`` (a
    ``--kv-cache-dtype`` name; ``auto``: float32)."""
    from numba import from_dtype, types
    a = types.Array
    kv = from_dtype(np.dtype(np.float32) if kv_cache_dtype == "auto" else KV_CACHE_DTYPES[kv_cache_dtype])
    return {"F1": a(types.float32, 1, "C"), "F2": a(types.float32, 2, "C"), "F3": a(types.float32, 3, "C"),
            "F4": a(kv, 4, "C"), "I1": a(types.int64, 1, "C"), "I2": a(types.int64, 2, "C"),
            "I3": a(types.int64, 3, "C"), "U2": a(types.uint8, 2, "C"), "U2r": a(types.uint8, 2, "C", readonly=True),
            "i64": types.int64, "u64": types.uint64, "f64": types.float64, "f32": types.float32,
            "none": types.none, "b1": types.boolean}


@dataclasses.dataclass(frozen=True)
class NumbaJob:
    """One compiled function (``dispatcher``, an ``@njit(cache=True)`` function) and one signature
    to compile (a ``kernels.table.CompileJob``)."""
    dispatcher: Any
    signature: str                  # argument types in the names of ``argument_types``
    group: str                      # one of GROUPS
    seconds: float                  # rough cost on a cold cache, in seconds: a progress bar's weight
    what: str                       # for people
    variants: tuple = VARIANTS      # the weight layouts whose steps call it

    @property
    def module(self) -> str:
        """The kernel module's name in ``kernels/cpu`` (``attention``, ...)."""
        return self.dispatcher.py_func.__module__.rsplit(".", 1)[-1]

    @property
    def function(self) -> str:
        return self.dispatcher.py_func.__name__

    @property
    def name(self) -> str:
        return f"{self.module}.{self.function}"

    @property
    def after(self) -> tuple:
        """The groups to compile before this job's group (``AFTER``)."""
        return AFTER.get(self.group, ())

    def types(self, kv_cache_dtype: str = "auto") -> tuple:
        """The signature as Numba types, for KV caches of ``kv_cache_dtype``."""
        names = argument_types(kv_cache_dtype)
        return tuple(names[t] for t in self.signature.split())

    def compile(self, kv_cache_dtype: str = "auto") -> bool:
        """Compile (or load from Numba's cache) in this process; True if it compiled."""
        fn, sig = self.dispatcher, self.types(kv_cache_dtype)
        before = fn.stats.cache_misses.get(sig, 0)
        fn.compile(sig)
        return fn.stats.cache_misses.get(sig, 0) > before

    def in_cache(self, kv_cache_dtype: str = "auto") -> bool:
        """Whether Numba's cache index holds this signature for this machine and the current
        sources, without loading it (Numba's ``Cache._index_key`` and index file; False where they
        differ from the Numba this was written against, 0.59-0.61)."""
        fn, sig = self.dispatcher, self.types(kv_cache_dtype)
        try:
            cache = fn._cache
            return cache._index_key(sig, fn.targetctx.codegen()) in cache._cache_file._load_index()
        except Exception:  # noqa: BLE001 - another Numba's internals: compile (or load) it
            return False


def in_group_order(declared, variant: str) -> tuple:
    """The jobs of ``declared`` (the modules' ``PRECOMPILE``, concatenated) that ``variant`` runs,
    group by group in ``GROUPS`` order, each group's in declared order.

    Raises:
        ValueError: an unknown variant (the message names ``VARIANTS``).
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown kernel variant {variant!r}; one of {', '.join(VARIANTS)}")
    chosen = [j for j in declared if variant in j.variants]
    return tuple(j for g in GROUPS for j in chosen if j.group == g)
