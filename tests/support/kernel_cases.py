"""Random test cases for the kernels, shared by the CPU and CUDA kernel tests.

Each ``*_case`` function returns a dict of NumPy inputs whose keys are exactly the keyword
arguments of the matching function in ``kernels/reference.py``, so that
``reference.op(**case)`` and ``kernels.op(**case)`` (after moving arrays to the device) are
called the same way. In-place ops (``copy_blocks``) must be given copies: use ``copy_case(case)``.

``CASES`` maps an op name to a list of ``(case_id, builder)`` pairs; ``builder()`` returns a
fresh case dict (deterministic: every builder has its own seed). Tests parametrize over
``cases_for(op)``.
"""

from __future__ import annotations

import copy

import numpy as np

from folio.kernels import reference

__all__ = [
    "paged_attention_case",
    "copy_blocks_case",
    "rms_norm_case",
    "fused_add_rms_norm_case",
    "rotary_embedding_case",
    "silu_and_mul_case",
    "copy_case",
    "CASES",
    "cases_for",
]

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def paged_attention_case(seed, seqs, num_heads=6, num_kv_heads=2, head_dim=32, block_size=16,
                         shuffle_blocks=True, num_pad_tokens=0, extra_blocks=3):
    """A varlen batch over a paged cache already holding every sequence's keys/values.

    Args:
        seed: RNG seed.
        seqs: list of ``(context_len_after_step, q_len)``; ``q_len == 1`` is a decode,
            ``q_len == context_len`` a whole prefill, anything between a prefill chunk after a
            cached context. ``q_len == 0`` (a sequence with no token this step) is allowed.
        num_heads, num_kv_heads: GQA ratio ``num_heads // num_kv_heads``.
        shuffle_blocks: physical block ids are a random permutation (non-contiguous tables);
            otherwise sequences get consecutive blocks.
        num_pad_tokens: padding rows appended after ``query_start_loc[S]`` (expected output 0).
        extra_blocks: unused physical blocks (filled with noise) besides those the sequences use.
    Returns:
        dict with q, key_cache, value_cache, block_tables (int32, unused entries a random valid
        id), seq_lens (int32), query_start_loc (int32), scale (float).
    """
    rng = np.random.default_rng(seed)
    n_blocks_per = [(ctx + block_size - 1) // block_size for ctx, _ in seqs]
    total = sum(n_blocks_per) + extra_blocks
    ids = rng.permutation(total) if shuffle_blocks else np.arange(total)
    max_blocks = max(max(n_blocks_per), 1) + 1
    block_tables = rng.integers(0, total, size=(len(seqs), max_blocks)).astype(np.int32)
    k = 0
    for s, n in enumerate(n_blocks_per):
        block_tables[s, :n] = ids[k:k + n]
        k += n
    q_lens = [ql for _, ql in seqs]
    T = sum(q_lens) + num_pad_tokens
    return {
        "q": rng.standard_normal((T, num_heads, head_dim)).astype(np.float32),
        "key_cache": rng.standard_normal((total, block_size, num_kv_heads, head_dim)).astype(np.float32),
        "value_cache": rng.standard_normal((total, block_size, num_kv_heads, head_dim)).astype(np.float32),
        "block_tables": block_tables,
        "seq_lens": np.array([ctx for ctx, _ in seqs], dtype=np.int32),
        "query_start_loc": np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
        "scale": float(head_dim ** -0.5),
    }


def copy_blocks_case(seed, num_layers=3, num_blocks=10, block_size=16, num_kv_heads=2, head_dim=8,
                     num_copies=4):
    """Block copies ``(src, dst)`` with distinct destinations, none of which is also a source."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(num_blocks)
    mapping = np.stack([perm[:num_copies], perm[num_copies:2 * num_copies]], axis=1).astype(np.int64)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return {
        "key_caches": [rng.standard_normal(shape).astype(np.float32) for _ in range(num_layers)],
        "value_caches": [rng.standard_normal(shape).astype(np.float32) for _ in range(num_layers)],
        "block_mapping": mapping,
    }


def rms_norm_case(seed, num_tokens=7, hidden=576, eps=1e-5, offset=0.0):
    rng = np.random.default_rng(seed)
    return {
        "x": (rng.standard_normal((num_tokens, hidden)) * 3 + offset).astype(np.float32),
        "weight": rng.standard_normal(hidden).astype(np.float32),
        "eps": eps,
    }


def fused_add_rms_norm_case(seed, num_tokens=7, hidden=576, eps=1e-5):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((num_tokens, hidden)).astype(np.float32),
        "residual": (rng.standard_normal((num_tokens, hidden)) * 10).astype(np.float32),
        "weight": rng.standard_normal(hidden).astype(np.float32),
        "eps": eps,
    }


def rotary_embedding_case(seed, num_tokens=37, num_heads=9, num_kv_heads=3, head_dim=64,
                          rope_theta=100000.0, rope_scaling=None, max_position=10000):
    """Random positions in ``[0, max_position)``; the cos/sin cache from the reference builders."""
    rng = np.random.default_rng(seed)
    inv_freq = reference.rope_inv_freq(head_dim, rope_theta, rope_scaling)
    return {
        "positions": rng.integers(0, max_position, size=num_tokens).astype(np.int64),
        "q": rng.standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32),
        "k": rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32),
        "cos_sin_cache": reference.rope_cos_sin_cache(inv_freq, max_position),
    }


def silu_and_mul_case(seed, num_tokens=5, intermediate=1536):
    rng = np.random.default_rng(seed)
    return {"x": (rng.standard_normal((num_tokens, 2 * intermediate)) * 4).astype(np.float32)}


def copy_case(case: dict) -> dict:
    """A deep copy of a case (for in-place ops, so the reference and the kernel each get one)."""
    return copy.deepcopy(case)


def _pa(seed, seqs, **kw):
    return lambda: paged_attention_case(seed, seqs, **kw)


CASES: dict[str, list] = {
    "paged_attention": [
        # decode, context lengths around the block size, GQA 3 and 1
        *[(f"decode_ctx{c}_gqa3", _pa(10 + c, [(c, 1)], num_heads=6, num_kv_heads=2))
          for c in (1, 15, 16, 17, 203)],
        *[(f"decode_ctx{c}_gqa1", _pa(20 + c, [(c, 1)], num_heads=4, num_kv_heads=4))
          for c in (1, 15, 16, 17, 203)],
        # whole prefills
        *[(f"prefill_len{c}_gqa3", _pa(30 + c, [(c, c)], num_heads=9, num_kv_heads=3, head_dim=64))
          for c in (1, 15, 16, 17, 210)],
        ("prefill_len33_gqa1", _pa(41, [(33, 33)], num_heads=2, num_kv_heads=2)),
        # prefill chunks after a cached context
        ("chunk_7_after_10", _pa(42, [(17, 7)])),
        ("chunk_16_after_16", _pa(43, [(32, 16)])),
        ("chunk_50_after_203", _pa(44, [(253, 50)], num_heads=9, num_kv_heads=3, head_dim=64)),
        # mixed varlen batches (decodes + chunks + whole prefills), shuffled blocks, padding rows
        ("mixed_batch_gqa3", _pa(45, [(1, 1), (15, 15), (16, 1), (17, 5), (230, 1), (40, 24)],
                                 num_pad_tokens=3)),
        ("mixed_batch_gqa1", _pa(46, [(200, 1), (17, 17), (16, 3), (1, 1)], num_heads=3,
                                 num_kv_heads=3, num_pad_tokens=2)),
        ("mixed_with_empty_seq", _pa(47, [(20, 1), (9, 0), (18, 2)])),
        # several tokens under TILE_MIN_ROWS rows (the decode path, causal within the step), long
        # enough to be cut into key ranges when the parallel drivers are forced
        ("multi_token_decodes_gqa1", _pa(50, [(250, 2), (90, 5), (33, 7)], num_heads=4, num_kv_heads=4)),
        ("multi_token_decodes_gqa3", _pa(51, [(260, 2), (70, 1)], num_heads=6, num_kv_heads=2)),
        ("contiguous_blocks", _pa(48, [(40, 4), (33, 1)], shuffle_blocks=False)),
        ("block_size_8", _pa(49, [(29, 3), (8, 8), (9, 1)], block_size=8)),
    ],
    "copy_blocks": [
        ("four_copies", lambda: copy_blocks_case(1)),
        ("one_copy_one_layer", lambda: copy_blocks_case(2, num_layers=1, num_copies=1)),
    ],
    "rms_norm": [
        ("T7", lambda: rms_norm_case(1)),
        ("T1", lambda: rms_norm_case(2, num_tokens=1)),
        ("large_offset", lambda: rms_norm_case(3, offset=100.0, hidden=64)),
    ],
    "fused_add_rms_norm": [
        ("T7", lambda: fused_add_rms_norm_case(1)),
        ("T1", lambda: fused_add_rms_norm_case(2, num_tokens=1, hidden=64)),
    ],
    "rotary_embedding": [
        ("default_rope", lambda: rotary_embedding_case(1)),
        ("llama3_scaling", lambda: rotary_embedding_case(2, head_dim=128, num_heads=8, num_kv_heads=2,
                                                         rope_theta=500000.0, rope_scaling=LLAMA3_SCALING,
                                                         max_position=20000)),
        ("one_token", lambda: rotary_embedding_case(3, num_tokens=1)),
    ],
    "silu_and_mul": [
        ("T5", lambda: silu_and_mul_case(1)),
        ("T1_small", lambda: silu_and_mul_case(2, num_tokens=1, intermediate=7)),
    ],
}


def cases_for(op: str) -> list:
    """``[(case_id, builder), ...]`` for ``op`` (a key of ``CASES``)."""
    return CASES[op]


def force_parallel_kernels(monkeypatch):
    """Every CPU kernel on its parallel driver whatever the size (several row items per call),
    decode attention split into key ranges from 32 keys on 2 threads too: the paths a 2-core
    machine would otherwise only take for large steps."""
    from folio.kernels.cpu import attention as cpu_attention
    from folio.kernels.cpu import linear as cpu_linear
    from folio.kernels.cpu import rows as cpu_rows
    monkeypatch.setattr(cpu_rows, "_PARALLEL_MIN_ELEMENTS", 0)
    monkeypatch.setattr(cpu_rows, "_ROWS_PER_ITEM", 2)  # several work items per call
    monkeypatch.setattr(cpu_attention, "_PARALLEL_MIN_WORK", 0)
    monkeypatch.setattr(cpu_attention, "SPLIT_MIN_KEYS", 16)  # decodes of 32+ keys split into key ranges
    monkeypatch.setattr(cpu_attention, "SPLIT_MIN_THREADS", 2)  # ... on 2 threads too
    monkeypatch.setattr(cpu_linear, "_PARALLEL_MIN_WEIGHTS", 0)
