"""Storage types of the CPU KV cache: float32 (the default) or 16 bits, read and written as float32.

``--kv-cache-dtype`` (vLLM's flag) picks how the cache stores keys and values:

* ``float32``: as computed;
* ``bfloat16``: the high half of the float32 bits, rounded to nearest even, held as ``uint16``
  bit patterns (NumPy has no bfloat16; the CUDA table stores its cache the same way). 8 bits of
  significand: a stored value is within a relative ``2^-8`` of the float32 one; same range as
  float32;

``float16`` is not offered: Numba has no float16 arrays on the CPU (no data model for the type),
and its bit patterns in ``uint16`` would collide with bfloat16's, which the kernels tell apart by
the arrays' dtype.

A 16-bit cache halves the KV memory (twice the blocks for one budget) and the bytes a decode
reads per key. Every kernel that touches the cache computes in float32: writers round
their float32 result once on the store (``from_f32``), readers widen each element as they load it
(``to_f32``, and ``kernels/cpu/simd.py``'s vector loads), exactly (every bfloat16 value is a
float32). The kernels are generic in the cache's dtype: Numba compiles a variant per dtype when it
is first called with it, so a float32 cache compiles only the float32 variant.

Sources: bfloat16 (Kalamkar et al., "A Study of BFLOAT16 for Deep Learning Training", 2019;
rounding as PyTorch's ``round_to_nearest_even`` and ggml's ``ggml_compute_fp32_to_bf16``, NaN kept
quiet); vLLM's ``--kv-cache-dtype`` for the option.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

__all__ = ["KV_CACHE_DTYPES", "to_f32", "from_f32", "is_float32", "line_elems"]

KV_CACHE_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(np.uint16)}
"""``--kv-cache-dtype`` names the CPU kernels run -> the NumPy dtype of the cache arrays."""

_STORAGE = (types.float32, types.uint16)
_I16, _I32, _F32 = ir.IntType(16), ir.IntType(32), ir.FloatType()


def widen(builder, v, ty):
    """LLVM: a value (scalar or vector) of storage type ``ty`` as float32 (exact)."""
    if ty == types.float32:
        return v
    # bfloat16 bits: the high half of a float32
    if isinstance(v.type, ir.VectorType):
        i32 = ir.VectorType(_I32, v.type.count)
        return builder.bitcast(builder.shl(builder.zext(v, i32), ir.Constant(i32, [16] * v.type.count)),
                               ir.VectorType(_F32, v.type.count))
    return builder.bitcast(builder.shl(builder.zext(v, _I32), ir.Constant(_I32, 16)), _F32)


def storage_ir(ty):
    """The LLVM scalar type a storage type's elements are loaded as."""
    return {types.float32: _F32, types.uint16: _I16}[ty]


@intrinsic
def to_f32(typingctx, x):
    """A cache element (float32, or bfloat16 bits as uint16) as float32, exactly."""
    if x not in _STORAGE:
        return None

    def codegen(context, builder, sig, args):
        return widen(builder, args[0], sig.args[0])
    return types.float32(x), codegen


@intrinsic
def from_f32(typingctx, x, like):
    """float32 (or float64, first rounded to float32) ``x`` as an element of ``like``'s dtype:
    itself for float32, bfloat16 bits rounded to nearest even (a NaN stays a quiet NaN) for
    uint16."""
    if not (isinstance(like, types.Array) and like.dtype in _STORAGE and x in (types.float32, types.float64)):
        return None
    dt = like.dtype

    def codegen(context, builder, sig, args):
        v = args[0]
        if sig.args[0] == types.float64:
            v = builder.fptrunc(v, _F32)
        if dt == types.float32:
            return v
        u = builder.bitcast(v, _I32)
        lsb = builder.and_(builder.lshr(u, ir.Constant(_I32, 16)), ir.Constant(_I32, 1))
        rounded = builder.trunc(builder.lshr(builder.add(builder.add(u, ir.Constant(_I32, 0x7FFF)), lsb),
                                             ir.Constant(_I32, 16)), _I16)
        quiet = builder.trunc(builder.or_(builder.lshr(u, ir.Constant(_I32, 16)), ir.Constant(_I32, 0x40)), _I16)
        nan = builder.icmp_unsigned(">", builder.and_(u, ir.Constant(_I32, 0x7FFFFFFF)), ir.Constant(_I32, 0x7F800000))
        return builder.select(nan, quiet, rounded)
    return dt(x, like), codegen


@intrinsic
def is_float32(typingctx, a):
    """Whether array ``a`` holds float32 (a constant of the compiled specialization)."""
    def codegen(context, builder, sig, args):
        return ir.Constant(ir.IntType(1), int(sig.args[0].dtype == types.float32))
    return types.boolean(a), codegen


@intrinsic
def line_elems(typingctx, a):
    """Elements of array ``a`` per 64-byte cache line (a constant of the compiled specialization)."""
    def codegen(context, builder, sig, args):
        return ir.Constant(ir.IntType(64), 512 // sig.args[0].dtype.bitwidth)
    return types.int64(a), codegen
