"""The Llama forward pass driven over a paged KV cache, its dense float64 reference, and the bounds
between them.

``run_paged`` feeds one sequence through a model a chunk at a time over a fresh cache (optionally
on shuffled blocks); ``dense_llama_logits`` is a float64 NumPy Llama written from the Hugging Face
definition (full causal attention, no cache); ``max_dot_len`` and ``tiny_atol`` give the rounding
bound (``numerics.forward_logit_atol``) for a model's longest dot product and for the tiny random
models of the tests, whose weights are scaled x10.
"""

from __future__ import annotations

import numpy as np

from folio.kernels import reference
from folio.model.attention_metadata import AttentionMetadata
from folio.model.config import ModelConfig
from folio.model.loader import allocate_kv_caches
from support.numerics import forward_logit_atol

BLOCK_SIZE = 16


def max_dot_len(config: ModelConfig) -> int:
    """The longest dot product of a layer (the down projection's, in these models)."""
    c = config
    return max(c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim)


def run_paged(model, config, ids, chunk, block_size=BLOCK_SIZE, shuffle_seed=None, all_logits=True,
              kv_cache_dtype=None):
    """Feed ``ids`` through ``model`` ``chunk`` tokens per step, one sequence, fresh KV cache (of
    ``kv_cache_dtype``, default the table's).

    The sequence's blocks are ``0..n-1`` or, with ``shuffle_seed``, a random permutation of a larger
    pool. Returns the logits of every position ``[len(ids), vocab]`` (or only the last row).
    """
    n = len(ids)
    n_blocks = (n + block_size - 1) // block_size
    pool = n_blocks + 5
    if shuffle_seed is None:
        table = np.arange(n_blocks, dtype=np.int32)
    else:
        table = np.random.default_rng(shuffle_seed).permutation(pool)[:n_blocks].astype(np.int32)
    kernels = model.kernels
    caches = allocate_kv_caches(config, pool, block_size, kernels, kv_cache_dtype)
    out = []
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        pos = np.arange(start, end, dtype=np.int64)
        md = AttentionMetadata(
            slot_mapping=(table[pos // block_size].astype(np.int64) * block_size + pos % block_size),
            query_start_loc=np.array([0, end - start], dtype=np.int32),
            seq_lens=np.array([end], dtype=np.int32),
            block_tables=table[None, :].copy(),
            max_query_len=end - start,
            max_seq_len=end,
        )
        rows = np.arange(end - start) if all_logits else np.array([end - start - 1])
        out.append(model.forward(np.asarray(ids[start:end], dtype=np.int64), pos, md, caches, rows))
    return np.concatenate(out, axis=0)


def dense_llama_logits(config: ModelConfig, w: dict, ids, stats: dict | None = None) -> np.ndarray:
    """Logits of every position, float64, full causal attention (Hugging Face LlamaModel semantics).

    ``stats``, if given, receives ``max_score``: the largest |attention score| of any layer."""
    c = config
    H, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    T = len(ids)

    def norm(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.rms_norm_eps) * g

    inv_freq = reference.rope_inv_freq(D, c.rope_theta, c.rope_scaling)
    ang = np.outer(np.arange(T), inv_freq)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(x):
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    W = {k: v.astype(np.float64) for k, v in w.items()}
    x = W["model.embed_tokens.weight"][np.asarray(ids)]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        h = norm(x, W[p + "input_layernorm.weight"])
        q = rope((h @ W[p + "self_attn.q_proj.weight"].T).reshape(T, H, D))
        k = rope((h @ W[p + "self_attn.k_proj.weight"].T).reshape(T, Hkv, D))
        v = (h @ W[p + "self_attn.v_proj.weight"].T).reshape(T, Hkv, D)
        k, v = np.repeat(k, H // Hkv, axis=1), np.repeat(v, H // Hkv, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(D)
        if stats is not None:
            stats["max_score"] = max(stats.get("max_score", 0.0), float(np.abs(s).max()))
        s = s + mask
        p_ = np.exp(s - s.max(-1, keepdims=True))
        p_ /= p_.sum(-1, keepdims=True)
        a = np.einsum("hts,shd->thd", p_, v).reshape(T, H * D)
        x = x + a @ W[p + "self_attn.o_proj.weight"].T
        h = norm(x, W[p + "post_attention_layernorm.weight"])
        g, u = h @ W[p + "mlp.gate_proj.weight"].T, h @ W[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ W[p + "mlp.down_proj.weight"].T
    x = norm(x, W["model.norm.weight"])
    lm = W["model.embed_tokens.weight"] if c.tie_word_embeddings else W["lm_head.weight"]
    return x @ lm.T


def tiny_atol(config, want, stats) -> float:
    """The bound of the tiny model against the dense float64 reference: forward_logit_atol times
    its largest attention score. Its weights are scaled x10, so scores reach ~13 (trained models:
    order one): a score's rounding error is absolute, and it becomes a relative error of the
    softmax weights, amplified by the scores' magnitude."""
    return forward_logit_atol(config.num_hidden_layers, max_dot_len(config), want, schedules=1) * \
        max(1.0, stats["max_score"])

