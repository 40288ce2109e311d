"""Greedy generation of one sequence on a bare model (a ``LlamaForCausalLM``), without the engine.

The model's end-to-end check against the golden outputs (tests/model/test_forward.py) and the
single-sequence figures of perf/ (``perf/bench_forward.py``, ``perf/bench/kernel_rates.py``,
``perf/int8_activation_agreement.py``, which put the tests folder on their path): one prefill step
over a trivial block table (blocks ``0..n-1``), then one decode step per token, argmax of each step's
last row. Serving goes through the engine (``runtime/scheduler/engine.py``).
"""

from __future__ import annotations

import time

import numpy as np

from folio.kernels import to_numpy
from folio.model.attention_metadata import AttentionMetadata
from folio.model.loader import allocate_kv_caches


def greedy_generate(model, config, prompt_ids, max_tokens: int = 32, ignore_eos: bool = False,
                    block_size: int = 16) -> dict:
    """Up to ``max_tokens`` greedy (argmax) ids after ``prompt_ids``; stops at an id of
    ``config.eos_token_ids`` (included) unless ``ignore_eos``, after ``max_tokens``, or at
    ``max_position_embeddings``.

    Returns:
        ``prompt_ids``, ``generated_ids`` (list[int]), ``finish_reason`` ("stop" | "length"),
        ``prefill_seconds``, ``decode_seconds``, ``decode_tokens_per_s`` (decode steps after the
        first token / decode_seconds; 0.0 when there were none).
    Raises:
        ValueError: an empty prompt, ``max_tokens < 0``, or a prompt that fills the context.
    """
    prompt_ids = [int(t) for t in prompt_ids]
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if max_tokens < 0:
        raise ValueError("max_tokens must be >= 0")
    max_len = config.max_position_embeddings
    if len(prompt_ids) >= max_len:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {max_len}")
    eos = set(config.eos_token_ids)
    xp = model.kernels.xp
    total = min(len(prompt_ids) + max_tokens, max_len)
    n_blocks = (total + block_size - 1) // block_size
    caches = allocate_kv_caches(config, n_blocks, block_size, model.kernels)
    block_table = xp.asarray(np.arange(n_blocks, dtype=np.int32)[None, :])

    def step(ids, start):
        n = len(ids)
        pos = np.arange(start, start + n, dtype=np.int64)
        md = AttentionMetadata(
            slot_mapping=xp.asarray(pos),  # block b holds positions b*bs .. b*bs+bs-1
            query_start_loc=xp.asarray(np.array([0, n], dtype=np.int32)),
            seq_lens=xp.asarray(np.array([start + n], dtype=np.int32)),
            block_tables=block_table, max_query_len=n, max_seq_len=start + n)
        logits = model.forward(xp.asarray(np.asarray(ids, dtype=np.int64)), xp.asarray(pos), md, caches,
                               xp.asarray(np.array([n - 1], dtype=np.int64)))
        return int(np.argmax(to_numpy(logits)[0].astype(np.float64)))

    generated, finish = [], "length"
    t0 = time.perf_counter()
    prefill_s = decode_s = 0.0
    context = len(prompt_ids)
    if max_tokens > 0:
        generated.append(step(prompt_ids, 0))
        prefill_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        while True:
            if not ignore_eos and generated[-1] in eos:
                finish = "stop"
                break
            if len(generated) >= max_tokens or context >= total:  # length / context full
                break
            generated.append(step([generated[-1]], context))
            context += 1
        decode_s = time.perf_counter() - t1
    n_decode = max(len(generated) - 1, 0)
    return {
        "prompt_ids": prompt_ids,
        "generated_ids": generated,
        "finish_reason": finish,
        "prefill_seconds": prefill_s,
        "decode_seconds": decode_s,
        "decode_tokens_per_s": n_decode / decode_s if n_decode and decode_s > 0 else 0.0,
    }
