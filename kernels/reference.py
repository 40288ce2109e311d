"""NumPy specifications of every folio kernel.

This module is the spec: the Numba kernels (``kernels/cpu/table.py``) and the CUDA kernels
(``kernels/cuda/*.cu``) are tested against these functions. They favour clarity over speed
(plain loops are fine) and compute in float64 internally, returning float32.

Conventions shared by all kernels (docs/architecture.md, "One step" and "KV cache"):

* A step's batch is *flattened*: ``T`` tokens from ``S`` sequences laid end to end.
  ``query_start_loc [S+1] int32`` gives each sequence's token range
  ``[query_start_loc[s], query_start_loc[s+1])``; rows at or past ``query_start_loc[S]`` are
  padding and produce zeros.
* ``seq_lens [S] int32`` is each sequence's context length *after* this step (cached tokens plus
  the new ones). New token ``i`` of sequence ``s`` (``q_len`` new tokens) sits at position
  ``seq_lens[s] - q_len + i`` and attends causally to keys ``0 .. that position``.
* The paged KV cache of one layer is ``key_cache, value_cache [num_blocks, block_size,
  num_kv_heads, head_dim]``. Logical key ``j`` of sequence ``s`` lives in physical block
  ``block_tables[s, j // block_size]`` at offset ``j % block_size``.
* ``slot_mapping [T] int64``: slot = block_id * block_size + offset; -1 means "do not write".
* The KV cache's dtype is float32, or ``uint16`` holding bfloat16 bit patterns (``--kv-cache-dtype
  bfloat16``): a key or value is stored rounded to the nearest bfloat16, ties to even
  (``float32_to_bf16_bits``: within a relative ``2^-8`` of the float32 value), and read back
  exactly widened to float32 (``kv_cache_values``).

Sources: PagedAttention (Kwon et al., SOSP 2023, "Efficient Memory Management for Large Language
Model Serving with PagedAttention"); RMSNorm (Zhang & Sennrich 2019); RoPE (Su et al. 2021,
RoFormer) in the Hugging Face "rotate_half" (GPT-NeoX) layout; Llama 3 RoPE frequency scaling
(Meta Llama 3.1 reference code, ``apply_scaling``); SwiGLU (Shazeer 2020).
"""

from __future__ import annotations

import math

import numpy as np

# the kernels of the tables (gumbel_noise, sample_gumbel: the CUDA table's sampler's; float32_to_bf16_bits,
# bf16_bits_to_float32, kv_cache_values: the cache's helpers; reshape_and_cache and rotary_embedding: the
# two parts of rope_and_cache's spec)
__all__ = [
    "paged_attention",
    "copy_blocks",
    "rms_norm",
    "fused_add_rms_norm",
    "rope_inv_freq",
    "rope_cos_sin_cache",
    "rope_and_cache",
    "silu_and_mul",
    "gumbel_noise",
    "sample_gumbel",
    "apply_token_bitmask",
]


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> ``uint16`` bfloat16 bit patterns: the high half of the float32 bits, rounded to
    nearest, ties to even (a NaN stays a quiet NaN; a value rounding past the largest bfloat16
    becomes an infinity, as the IEEE rounding does)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), r)


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """``uint16`` bfloat16 bit patterns -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def kv_cache_values(cache: np.ndarray) -> np.ndarray:
    """A KV cache array's values as float32: itself for float32 (and float64, a test's exact cache),
    widened for bfloat16 bits (uint16).

    Raises:
        ValueError: another dtype.
    """
    if cache.dtype in (np.float32, np.float64):   # float64: the reference's own exact caches
        return cache
    if cache.dtype == np.uint16:
        return bf16_bits_to_float32(cache)
    raise ValueError(f"a KV cache is float32 or bfloat16 bits as uint16, got {cache.dtype}")


def _to_cache(x: np.ndarray, cache: np.ndarray) -> np.ndarray:
    # values as stored in cache: float32, or rounded to bfloat16 bits for a uint16 cache
    kv_cache_values(cache[:0])  # the dtype check
    if cache.dtype == np.uint16:
        return float32_to_bf16_bits(x)
    return np.asarray(x, dtype=cache.dtype)


def paged_attention(
    q: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    query_start_loc: np.ndarray,
    scale: float,
) -> np.ndarray:
    """Causal attention of a flattened varlen batch over a paged KV cache (GQA aware).

    Args:
        q: ``[T, num_heads, head_dim]`` float32, queries of this step's tokens (RoPE applied).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` float32 or
            bfloat16 bits (uint16, read widened: ``kv_cache_values``); the keys and values of this
            step's tokens must already be appended (see ``reshape_and_cache``).
        block_tables: ``[S, max_blocks]`` int32 physical block ids; unused entries are ignored.
        seq_lens: ``[S]`` int32 context length after this step.
        query_start_loc: ``[S+1]`` int32 token offsets of each sequence in ``q``.
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Returns:
        ``[T, num_heads, head_dim]`` float32; padding rows are zero.

    Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
    """
    T, H, D = q.shape
    block_size, Hkv = key_cache.shape[1], key_cache.shape[2]
    group = H // Hkv
    out = np.zeros((T, H, D), dtype=np.float32)
    for s in range(len(seq_lens)):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        q_len, ctx = end - start, int(seq_lens[s])
        if q_len == 0:
            continue
        idx = np.arange(ctx)
        blocks = block_tables[s, idx // block_size]
        k = kv_cache_values(key_cache[blocks, idx % block_size]).astype(np.float64)  # [ctx, Hkv, D]
        v = kv_cache_values(value_cache[blocks, idx % block_size]).astype(np.float64)
        for i in range(q_len):
            pos = ctx - q_len + i
            for h in range(H):
                kvh = h // group
                scores = k[: pos + 1, kvh] @ q[start + i, h].astype(np.float64) * scale
                p = np.exp(scores - scores.max())
                out[start + i, h] = (p / p.sum()) @ v[: pos + 1, kvh]
    return out


def reshape_and_cache(
    key: np.ndarray,
    value: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray,
    slot_mapping: np.ndarray,
) -> None:
    """Write this step's K/V into their cache slots, in place.

    Args:
        key, value: ``[T, num_kv_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (modified),
            float32, or bfloat16 bits (uint16: each value rounded, ``float32_to_bf16_bits``).
        slot_mapping: ``[T]`` int64; token ``t`` goes to block ``slot // block_size``, offset
            ``slot % block_size``; slot -1 is skipped (padding).
    """
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping):
        if slot < 0:
            continue
        key_cache[slot // block_size, slot % block_size] = _to_cache(key[t], key_cache)
        value_cache[slot // block_size, slot % block_size] = _to_cache(value[t], value_cache)


def copy_blocks(key_caches: list, value_caches: list, block_mapping: np.ndarray) -> None:
    """Copy whole blocks in every layer's cache, in place (copy-on-write).

    Args:
        key_caches, value_caches: one ``[num_blocks, block_size, num_kv_heads, head_dim]`` array per
            layer.
        block_mapping: ``[N, 2]`` int64 rows of ``(src_block, dst_block)``.
    """
    for kc, vc in zip(key_caches, value_caches):
        for src, dst in block_mapping:
            kc[dst] = kc[src]
            vc[dst] = vc[src]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x**2, -1) + eps) * weight``.

    Args:
        x: ``[T, hidden]`` float32. weight: ``[hidden]``. eps: e.g. 1e-5.
    Returns:
        ``[T, hidden]`` float32.
    """
    x64 = x.astype(np.float64)
    var = np.mean(x64 * x64, axis=-1, keepdims=True)
    return (x64 / np.sqrt(var + eps) * weight.astype(np.float64)).astype(np.float32)


def fused_add_rms_norm(
    x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray]:
    """Residual add followed by RMSNorm, as one kernel.

    Args:
        x, residual: ``[T, hidden]`` float32.
    Returns:
        ``(rms_norm(x + residual), x + residual)``, both ``[T, hidden]`` float32.
    """
    new_residual = (x.astype(np.float64) + residual.astype(np.float64)).astype(np.float32)
    return rms_norm(new_residual, weight, eps), new_residual


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict | None = None) -> np.ndarray:
    """Inverse frequencies of RoPE, ``[head_dim // 2]`` float64.

    ``rope_scaling`` of ``rope_type``/``type`` ``"llama3"`` applies Llama 3.1's scaling: with
    ``factor``, ``low_freq_factor``, ``high_freq_factor`` and
    ``original_max_position_embeddings``, wavelengths above ``orig / low_freq_factor`` are divided
    by ``factor``, those below ``orig / high_freq_factor`` are kept, and those between are
    interpolated smoothly. ``None`` or ``"default"`` means no scaling.

    Raises:
        ValueError: an unsupported ``rope_type``.
    """
    inv_freq = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if not rope_scaling:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: llama3)")
    factor = float(rope_scaling["factor"])
    low = float(rope_scaling.get("low_freq_factor", 1.0))
    high = float(rope_scaling.get("high_freq_factor", 4.0))
    orig = float(rope_scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen, high_freq_wavelen = orig / low, orig / high
    out = np.empty_like(inv_freq)
    for i, f in enumerate(inv_freq):
        wavelen = 2 * math.pi / f
        if wavelen < high_freq_wavelen:
            out[i] = f
        elif wavelen > low_freq_wavelen:
            out[i] = f / factor
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out[i] = (1 - smooth) * f / factor + smooth * f
    return out


def rope_cos_sin_cache(inv_freq: np.ndarray, max_position: int) -> np.ndarray:
    """``[max_position, head_dim]`` float32: ``cos(p * inv_freq)`` then ``sin(p * inv_freq)``."""
    freqs = np.outer(np.arange(max_position, dtype=np.float64), inv_freq)
    return np.concatenate([np.cos(freqs), np.sin(freqs)], axis=-1).astype(np.float32)


def rotary_embedding(
    positions: np.ndarray, q: np.ndarray, k: np.ndarray, cos_sin_cache: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Apply RoPE to queries and keys in the rotate-half (GPT-NeoX / Hugging Face Llama) layout.

    Args:
        positions: ``[T]`` int64.
        q: ``[T, num_heads, head_dim]``; k: ``[T, num_kv_heads, head_dim]`` float32.
        cos_sin_cache: ``[max_position, head_dim]`` from ``rope_cos_sin_cache``.
    Returns:
        ``(q_rot, k_rot)`` float32 with the input shapes. For ``x = [x1, x2]`` (halves of
        head_dim): ``[x1*cos - x2*sin, x2*cos + x1*sin]``.
    """
    half = cos_sin_cache.shape[1] // 2
    cos = cos_sin_cache[positions, :half].astype(np.float64)[:, None, :]
    sin = cos_sin_cache[positions, half:].astype(np.float64)[:, None, :]

    def rot(x):
        x1, x2 = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(np.float32)

    return rot(q), rot(k)


def rope_and_cache(
    positions: np.ndarray,
    qkv: np.ndarray,
    cos_sin_cache: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray,
    slot_mapping: np.ndarray,
    num_heads: int,
    num_kv_heads: int,
) -> np.ndarray:
    """RoPE on the query and key parts of a fused QKV projection, then the KV-cache append.

    Args:
        positions: ``[T]`` int64.
        qkv: ``[T, (num_heads + 2 * num_kv_heads) * head_dim]`` float32: per row the query heads,
            then the key heads, then the value heads (``model/llama.py``'s fused projection).
        cos_sin_cache: ``[max_position, head_dim]``; key_cache, value_cache, slot_mapping: as in
            ``reshape_and_cache`` (the rotated keys and the values are written, in place).
    Returns:
        the rotated queries ``[T, num_heads, head_dim]`` float32. Equal to ``rotary_embedding`` on
        the q and k slices followed by ``reshape_and_cache`` of the rotated keys and the values.
    """
    T = qkv.shape[0]
    D = cos_sin_cache.shape[1]
    qd, kvd = num_heads * D, num_kv_heads * D
    q = qkv[:, :qd].reshape(T, num_heads, D)
    k = qkv[:, qd:qd + kvd].reshape(T, num_kv_heads, D)
    v = qkv[:, qd + kvd:qd + 2 * kvd].reshape(T, num_kv_heads, D)
    q_rot, k_rot = rotary_embedding(positions, q, k, cos_sin_cache)
    reshape_and_cache(k_rot, v, key_cache, value_cache, slot_mapping)
    return q_rot


def silu_and_mul(x: np.ndarray) -> np.ndarray:
    """SwiGLU activation: ``silu(x[:, :I]) * x[:, I:]``.

    Args:
        x: ``[T, 2 * I]`` float32 (gate projection then up projection).
    Returns:
        ``[T, I]`` float32.
    """
    inter = x.shape[-1] // 2
    g, u = x[..., :inter].astype(np.float64), x[..., inter:].astype(np.float64)
    return (g / (1.0 + np.exp(-g)) * u).astype(np.float32)


# ---- sampling: the device sampler's one-pass path for plain temperature --------------------------

_GAMMA = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on uint64 (wrapping) arithmetic (Steele, Lea and Flood,
    "Fast splittable pseudorandom number generators", OOPSLA 2014)."""
    z = np.asarray(z, dtype=np.uint64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def gumbel_noise(key: int, V: int) -> np.ndarray:
    """``[V]`` float64 standard Gumbel noise of one row: token ``i`` takes output ``i + 1`` of
    SplitMix64 from state ``mix64(key)``, its top 23 bits as ``u = (k + 0.5) / 2^23`` in (0, 1),
    and ``-log(-log(u))``."""
    seed = _mix64(np.array([key], dtype=np.uint64))  # (arrays: NumPy wraps uint64 without warning)
    z = _mix64(seed + np.arange(1, V + 1, dtype=np.uint64) * _GAMMA)
    u = ((z >> np.uint64(41)).astype(np.float64) + 0.5) * 2.0 ** -23
    return -np.log(-np.log(u))


def sample_gumbel(logits: np.ndarray, temperature: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Plain temperature sampling by the Gumbel-max trick (Gumbel 1954; Maddison, Tarlow and
    Minka, "A* Sampling", NeurIPS 2014): ``argmax_i(logits[r, i] / T_r + G_r[i])`` is a draw from
    ``softmax(logits[r] / T_r)`` when ``G_r`` is i.i.d. standard Gumbel noise.

    Args:
        logits: ``[R, V]`` float32 (-inf = masked; never picked unless the whole row is).
        temperature: ``[R]`` > 0.
        keys: ``[R]`` uint64, each row's stream (``gumbel_noise``).
    Returns:
        ``[R]`` int64: the first index of the largest score; ``V - 1`` for a row that is all -inf.
    """
    R, V = logits.shape
    out = np.empty(R, dtype=np.int64)
    for r in range(R):
        x = logits[r].astype(np.float64)
        score = np.where(np.isneginf(x), -np.inf, x / float(temperature[r]) + gumbel_noise(int(keys[r]), V))
        out[r] = V - 1 if np.isneginf(score).all() else int(np.argmax(score))
    return out


def apply_token_bitmask(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """Structured outputs' mask: ``logits [R, V]`` with -inf wherever ``bitmask [R, W]`` int32
    (``W >= ceil(V / 32)``) has the token's bit clear, bit ``t % 32`` of word ``t // 32``
    (llguidance's and xgrammar's layout). Returns a new array; ``logits`` is not written.
    """
    V = logits.shape[1]
    # the bytes of little-endian int32 words, unpacked little bit first, are the token order
    allowed = np.unpackbits(np.ascontiguousarray(bitmask, dtype="<i4").view(np.uint8), axis=1,
                            count=V, bitorder="little").view(bool)
    return np.where(allowed, logits, np.float32(-np.inf))
