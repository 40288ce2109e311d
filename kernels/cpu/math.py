"""Vectorisable float32 math for the Numba CPU kernels.

``exp2(x)`` is inlined into the caller's loop, which LLVM then vectorises (8 lanes with AVX2):
``2^x = 2^k * 2^f`` with ``k = round(x)`` built directly in the exponent bits and ``2^f =
e^(f ln 2)`` (``|f| <= 1/2``) from its Taylor series to degree 7, whose truncation error
``(ln 2 / 2)^8 / 8!`` is below 6e-9 relative, under float32's rounding (6e-8). Arguments are
clamped to ``[-126, 126]`` (normal float32 results). A loop of scalar ``math.exp`` calls is not
vectorised (no SVML in the PyPI llvmlite).

Source: the range reduction of Cody & Waite (1980) as used by vector math libraries (e.g. SLEEF).
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = ["exp2", "LOG2E"]

LOG2E = 1.4426950408889634
_F32 = np.float32
_C0, _C1, _C2, _C3, _C4, _C5, _C6, _C7 = (_F32(math.log(2.0) ** n / math.factorial(n)) for n in range(8))


@intrinsic
def _f32_from_bits(typingctx, bits):
    """The float32 whose IEEE-754 bits are the int32 ``bits``."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@njit(inline="always", fastmath=True)
def exp2(x):
    """``2^x`` in float32 for float32 ``x`` (clamped to [-126, 126]); relative error ~1e-7."""
    x = min(max(x, _F32(-126.0)), _F32(126.0))
    k = np.floor(x + _F32(0.5))
    f = x - k
    p = _C7
    p = p * f + _C6
    p = p * f + _C5
    p = p * f + _C4
    p = p * f + _C3
    p = p * f + _C2
    p = p * f + _C1
    p = p * f + _C0
    return p * _f32_from_bits((np.int32(k) + np.int32(127)) << 23)
