"""Every decoder layer of a step in one compiled call: the CPU table's ``decoder_layers``.

The forward pass of ``model/llama.py`` calls nine kernels per layer. Each call from Python
costs its dispatch (argument typing, the dispatcher's lookup, the interpreter's own objects),
and in a decode step that cost is paid with cold caches: between two calls the step streams
megabytes of weights through the caches. Measured on the 2-vCPU EPYC after 16 MB streamed
(perf/RESULTS.md): a fused residual-add RMSNorm of one token took 32 us against 3.7 us warm, a
``linear`` of a [64, 576] weight 34 against 5.5; 270 such calls per step of the default model
were several milliseconds of a ~35 ms single-sequence decode step.

``decoder_layers`` runs the same kernels (the bodies of ``cpu``, ``cpu_linear`` and
``cpu_attention``, unchanged) in the same order from one ``@njit`` function that loops over the
layers. Everything that depends only on the step's shapes is planned once per step in Python:
the tasks and sgemm tiles of the four matrix products, the tasks of the row kernels, and the
attention work items (the same for every layer: the same sequences and lengths), so the
thresholds stay the module constants the kernel tests set. The layers' weights are stacked per
kind (``[num_layers, ...]``, ``LlamaForCausalLM.layer_stacks``) and the KV caches passed as
tuples, so the compiled loop can index them by layer.

This is the CPU counterpart of replaying a captured CUDA graph: one launch per step instead of
one per kernel. The compiled call releases the GIL (``nogil``): in-process engines run the forward
on a background thread (``ThreadedExecutor``) while the calling thread schedules the next step,
which a GIL held through the whole forward would stall until the forward returned.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .cpu_attention import attention_into, plan
from .cpu_linear import linear_into, linear_plan
from .cpu_math import LOG2E
from .cpu_threads import num_threads, region_guard

__all__ = ["decoder_layers", "LAYER_WEIGHTS"]

LAYER_WEIGHTS = ("input_layernorm", "qkv_proj", "o_proj", "post_attention_layernorm", "gate_up_proj", "down_proj")
"""The per-layer weights ``decoder_layers`` takes, each stacked ``[num_layers, ...]``."""


@njit(cache=True, nogil=True)
def _layers(residual, hidden, x, qkv, q, attn, gate_up, act, ln1, qkv_w, o_w, ln2, gate_up_w, down_w, key_caches,
            value_caches, positions, cos_sin_cache, slot_mapping, block_tables, seq_lens, query_start_loc, H, Hkv,
            eps, qscale, lin, norm_tasks, rope_tasks, silu_tasks, rows_per_item, items, n_parts, attn_tasks):
    T = residual.shape[0]
    attn2 = attn.reshape(T, attn.shape[1] * attn.shape[2])
    for layer in range(ln1.shape[0]):
        if layer == 0:
            rms_norm_into(residual, ln1[0], eps, x, norm_tasks, rows_per_item)
        else:
            fused_add_rms_norm_into(hidden, residual, ln1[layer], eps, x, residual, norm_tasks, rows_per_item)
        linear_into(x, qkv_w[layer], qkv, lin[0, 0], lin[0, 1], lin[0, 2])
        key_cache = key_caches[layer]
        value_cache = value_caches[layer]
        rope_and_cache_into(positions, qkv, cos_sin_cache, key_cache, value_cache, slot_mapping, H, Hkv, q,
                            rope_tasks, rows_per_item)
        attention_into(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, qscale, attn, items,
                       n_parts, attn_tasks)
        linear_into(attn2, o_w[layer], hidden, lin[1, 0], lin[1, 1], lin[1, 2])
        fused_add_rms_norm_into(hidden, residual, ln2[layer], eps, x, residual, norm_tasks, rows_per_item)
        linear_into(x, gate_up_w[layer], gate_up, lin[2, 0], lin[2, 1], lin[2, 2])
        silu_and_mul_into(gate_up, act, silu_tasks, rows_per_item)
        linear_into(act, down_w[layer], hidden, lin[3, 0], lin[3, 1], lin[3, 2])


def _int64(a):
    return np.ascontiguousarray(a, dtype=np.int64)


def decoder_layers(weights: dict, buffers: dict, positions, attn_metadata, kv_caches, cos_sin_cache, scale: float,
                   num_heads: int, num_kv_heads: int, eps: float):
    """Run every decoder layer of a step on the CPU, in place in ``buffers``; returns ``(hidden,
    residual)``, the last layer's output and residual stream (``[T, hidden]`` float32 each).

    Same arithmetic, in the same order, as the per-kernel loop of ``LlamaForCausalLM.forward``
    (RMSNorm, fused QKV product, RoPE and cache append, paged attention, o_proj, residual add and
    RMSNorm, gate/up product, SwiGLU, down product), one compiled call for all layers.

    Args:
        weights: ``LAYER_WEIGHTS`` names -> C-contiguous float32 ``[num_layers, ...]`` stacks.
        buffers: the workspace's ``[T, ...]`` views (``model.llama.Workspace.view``); ``residual``
            holds the embeddings on entry.
        positions: ``[T]`` int positions; ``attn_metadata``: the step's ``AttentionMetadata``.
        kv_caches: per layer ``(key_cache, value_cache)``, C-contiguous float32 ``[num_blocks,
            block_size, num_kv_heads, head_dim]``; this step's keys and values are appended.
        cos_sin_cache: ``[max_position, head_dim]`` float32 RoPE table; ``scale``: softmax scale.
    Raises:
        ValueError: a KV cache that is not C-contiguous (the kernels address blocks directly).
    """
    if not all(c.flags.c_contiguous for pair in kv_caches for c in pair):
        raise ValueError("decoder_layers needs C-contiguous float32 KV caches")
    b, md = buffers, attn_metadata
    residual = b["residual"]
    T, hid = residual.shape
    D = cos_sin_cache.shape[1]
    threads = num_threads()
    seq_lens, query_start_loc = _int64(md.seq_lens), _int64(md.query_start_loc)
    lin = np.array([linear_plan(T, weights[name].shape[1:], threads)
                    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")], dtype=np.int64)
    key_cache = kv_caches[0][0]
    items, n_parts, attn_tasks = plan(seq_lens, query_start_loc, num_heads, num_kv_heads, D, key_cache.shape[1],
                                      threads)
    with region_guard():   # the layers run without the GIL: see region_guard
        _layers(residual, b["hidden"], b["x"], b["qkv"], b["q"], b["attn"], b["gate_up"], b["act"],
                *(weights[name] for name in LAYER_WEIGHTS), tuple(k for k, _ in kv_caches),
                tuple(v for _, v in kv_caches), _int64(positions), cos_sin_cache, _int64(md.slot_mapping),
                _int64(md.block_tables), seq_lens, query_start_loc, num_heads, num_kv_heads, float(eps),
                np.float32(scale * LOG2E), lin, row_tasks(T * hid, T, threads), row_tasks(b["qkv"].size, T, threads),
                row_tasks(b["gate_up"].size, T, threads), cpu._ROWS_PER_ITEM, items, n_parts, attn_tasks)
    return b["hidden"], residual


# Last: cpu.py imports this module for its kernel table, and this one takes the row kernels from
# cpu.py (defined before that import; whichever of the two is imported first, both complete).
from . import cpu  # noqa: E402
from .cpu import fused_add_rms_norm_into, rms_norm_into, rope_and_cache_into, row_tasks, silu_and_mul_into  # noqa: E402
