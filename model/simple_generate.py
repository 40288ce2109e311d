"""A plain single-sequence generation loop over the forward pass, without the engine.

It is the bare model's end-to-end check and the baseline of ``perf/bench_forward.py``: one
sequence, a trivial block table (blocks ``0..n-1``), one prefill step, then one decode step per
token. Serving goes through ``runtime/scheduler/engine.py``; this loop exists to test and time the forward.
"""

from __future__ import annotations

import time

import numpy as np

from ..kernels import to_numpy
from .attention_metadata import AttentionMetadata
from .loader import allocate_kv_caches


def generate_ids(model, config, prompt_ids, max_tokens=32, temperature=0.0, ignore_eos=False,
                 eos_token_ids=None, seed=0, block_size=16) -> dict:
    """Generate up to ``max_tokens`` ids after ``prompt_ids`` with ``model`` (a LlamaForCausalLM).

    Greedy (argmax) when ``temperature == 0``, else one draw from ``softmax(logits / temperature)``
    per step with ``numpy.random.default_rng(seed)``. Generation stops at an EOS id (
    ``eos_token_ids``, default ``config.eos_token_ids``; the EOS id is included in the output)
    unless ``ignore_eos``, or after ``max_tokens``, or at ``max_position_embeddings``.

    Returns:
        dict: ``prompt_ids``, ``generated_ids`` (list[int]), ``finish_reason`` ("stop" | "length"),
        ``prefill_seconds``, ``decode_seconds``, ``decode_tokens_per_s`` (decode steps after the
        first token / decode_seconds; 0.0 when there were none).
    Raises:
        ValueError: empty prompt, negative max_tokens or temperature, or a prompt longer than the
            model's context.
    """
    prompt_ids = [int(t) for t in prompt_ids]
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if max_tokens < 0 or temperature < 0:
        raise ValueError("max_tokens and temperature must be >= 0")
    max_len = config.max_position_embeddings
    if len(prompt_ids) >= max_len:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {max_len}")
    eos = set(config.eos_token_ids if eos_token_ids is None else eos_token_ids)
    xp = model.kernels.xp
    total = min(len(prompt_ids) + max_tokens, max_len)
    n_blocks = (total + block_size - 1) // block_size
    caches = allocate_kv_caches(config, n_blocks, block_size, model.kernels)
    block_table = xp.asarray(np.arange(n_blocks, dtype=np.int32)[None, :])
    rng = np.random.default_rng(seed)

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
        row = to_numpy(logits)[0].astype(np.float64)
        if temperature == 0:
            return int(np.argmax(row))
        p = np.exp((row - row.max()) / temperature)
        return int(rng.choice(len(p), p=p / p.sum()))

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
