"""GGUF blocks for the quantized-weight tests: random ones and edge cases, raw bytes per type.

Blocks are built byte by byte from ``quant_reference.QUANT_TYPES``' field layouts, not with a
quantizer, so they reach every code a file may hold (a quantizer writes only some of them).
"""

from __future__ import annotations

import itertools

import numpy as np

from folio.kernels import quant_reference as qr

__all__ = ["F16_EDGES", "random_blocks", "edge_blocks", "random_weight"]

F16_EDGES = np.array([0.0, -0.0, 2.0 ** -24, -(2.0 ** -24), 1023 * 2.0 ** -24, 2.0 ** -14, -(2.0 ** -14), 65504.0,
                      -65504.0, 1.0, -0.5, 0.000123], dtype=np.float16)
"""binary16 scales at the edges: zeros, the smallest and largest subnormal, the smallest normal, the
largest normal, ordinary values (each also negative where the sign matters)."""


def _f16_fields(q: qr.QuantType) -> list[tuple[int, int]]:
    return [(off, ln) for _name, off, ln, kind in q.fields if kind == "f16"]


def random_blocks(q: qr.QuantType, n: int, rng: np.random.Generator, scale: float | None = None) -> np.ndarray:
    """``[n, block_bytes]`` uint8: random bytes, each binary16 field of a quantized type a random finite
    binary16 (any sign, exponent and significand: zeros, subnormals, normals up to 65504), or, with
    ``scale``, uniform in ``[-scale, scale]`` (moderate values for products). F32 / F16 / BF16 blocks
    are random finite values of that type."""
    b = rng.integers(0, 256, (n, q.block_bytes), dtype=np.uint8)
    if q.id == qr.F32:
        return rng.standard_normal((n, 1)).astype("<f4").view(np.uint8) if scale else \
            _finite_bits(rng, n, 32).view(np.uint8).reshape(n, 4)
    if q.id in (qr.F16, qr.BF16):
        if scale:
            v = rng.uniform(-scale, scale, (n, 1)).astype(np.float32)
            return qr.quantize(v, q.id)
        return _finite_bits(rng, n, 16, 8 if q.id == qr.BF16 else 5).view(np.uint8).reshape(n, 2)
    for off, _ln in _f16_fields(q):
        if scale:
            v = rng.uniform(-scale, scale, (n, 1)).astype("<f2")
        else:
            v = _finite_bits(rng, n, 16, 5).view("<f2").reshape(n, 1)
        b[:, off:off + 2] = v.view(np.uint8)
    return b


def _finite_bits(rng, n, bits, exp_bits=8):
    # random bit patterns of a float of ``bits`` bits whose exponent field is not all ones
    dt = {16: "<u2", 32: "<u4"}[bits]
    v = rng.integers(0, 2 ** bits, n, dtype=np.uint64).astype(dt)
    mant_bits = bits - 1 - exp_bits
    exp_mask = ((1 << exp_bits) - 1) << mant_bits
    full = (v & exp_mask) == exp_mask
    v[full] &= np.array(~(1 << mant_bits) & (2 ** bits - 1), dtype=dt)   # one exponent bit cleared
    return v


def edge_blocks(q: qr.QuantType) -> np.ndarray:
    """Blocks that together hold every byte value at every byte position of the non-binary16 fields,
    and random bytes (so every code of every quant, every 6-bit scale and min of the K types, every
    qh bit pattern),
    for each combination of ``F16_EDGES`` values of the binary16 fields (``d`` with ``m`` / ``dmin``:
    the min and offset fields meet zero, subnormal and extreme scales). F32 / F16 / BF16: every bit
    pattern of F16 and BF16, float32 specials."""
    if q.id in (qr.F16, qr.BF16):
        return np.arange(1 << 16, dtype="<u2").view(np.uint8).reshape(-1, 2)
    if q.id == qr.F32:
        v = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1.17549435e-38, 3.4028235e38, -1.0],
                     dtype="<f4")
        return v.view(np.uint8).reshape(-1, 4)
    fields = _f16_fields(q)
    combos = list(itertools.product(range(len(F16_EDGES)), repeat=len(fields)))
    pos = np.arange(q.block_bytes)
    cycle = (np.arange(256)[:, None] + 37 * pos[None, :]) % 256   # block i, byte j: (i + 37 j) mod 256
    # and 256 blocks of random bytes: codes built from bytes at two positions (Q5 / Q6_K high bits,
    # K-type scales) meet in every combination, not only the cycle's
    cycle = np.concatenate([cycle, np.random.default_rng(q.id).integers(0, 256, (256, q.block_bytes))])
    out = []
    for combo in combos:
        b = cycle.astype(np.uint8).copy()
        for (off, _ln), e in zip(fields, combo):
            b[:, off:off + 2] = np.full((b.shape[0], 1), F16_EDGES[e], dtype="<f2").view(np.uint8)
        out.append(b)
    return np.concatenate(out)


def random_weight(q: qr.QuantType, N: int, K: int, rng: np.random.Generator, scale: float = 0.05) -> np.ndarray:
    """``[N, row_bytes(q, K)]`` uint8: ``N`` rows of random blocks with moderate binary16 fields
    (``random_blocks(..., scale)``)."""
    nb = K // q.block_values
    return random_blocks(q, N * nb, rng, scale).reshape(N, nb * q.block_bytes)
