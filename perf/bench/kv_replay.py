"""Section 1: KV memory waste of paged blocks versus contiguous per-request reservations.

One request trace (arrival step, prompt length, output length) is replayed, in the same amount of
KV memory, through:

- folio's real scheduler + ``BlockPool`` / ``KVCacheManager`` (a model-free executor answers every
  step, so the block bookkeeping is exactly that of a real run with ``ignore_eos``);
- a contiguous allocator reserving ``max_model_len`` slots per request (pre-vLLM systems such as
  FasterTransformer / Orca, as PagedAttention's section 3 describes them);
- a contiguous allocator reserving ``prompt + max_tokens`` slots (the best a contiguous allocator
  can do when the output length is known in advance).

The contiguous ones are simulated in the same step model as folio's scheduler: each step, requests
are admitted first-come-first-served while their reservation fits and the step's token budget
allows their whole prompt; a request's first step computes its prompt and samples its first token,
each later step adds one token; it leaves (freeing its reservation) when its output is complete.
"Holding real tokens" counts computed token slots (K/V written), the same count as folio's
``kv_tokens_held``. Source of the claim: Kwon et al., "Efficient Memory Management for Large
Language Model Serving with PagedAttention", SOSP 2023, Fig. 2 and section 3.
"""

from __future__ import annotations

import numpy as np

from .common import BenchRequest, ignore_eos_params, replay_engine, run_trace


def simulate_contiguous(requests: list[BenchRequest], capacity_tokens: int, reserve, max_num_seqs: int,
                        max_num_batched_tokens: int) -> dict:
    """Replay ``requests`` (arrival in steps) through a contiguous allocator.

    Args:
        reserve: ``BenchRequest -> int`` slots reserved when the request is admitted.
        capacity_tokens: KV slots in total.
    Returns:
        dict of per-step lists: held, reserved, running; and num_steps.
    """
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    waiting: list[int] = []
    running: dict[int, int] = {}  # request -> computed tokens
    nxt, step, reserved_total = 0, 0, 0
    held_l, res_l, run_l = [], [], []
    done = 0
    while done < len(requests):
        while nxt < len(order) and requests[order[nxt]].arrival <= step:
            waiting.append(order[nxt])
            nxt += 1
        if not running and not waiting:
            step = int(np.ceil(requests[order[nxt]].arrival))
            continue
        budget = max_num_batched_tokens - len(running)  # one decode token per running request
        for i in list(running):  # decode
            running[i] += 1
        while waiting and len(running) < max_num_seqs:
            i = waiting[0]
            r = requests[i]
            need = reserve(r)
            if need > capacity_tokens:
                raise ValueError(f"a request reserves {need} slots; capacity is {capacity_tokens}")
            if reserved_total + need > capacity_tokens or len(r.prompt_token_ids) > budget:
                break
            waiting.pop(0)
            budget -= len(r.prompt_token_ids)
            reserved_total += need
            running[i] = len(r.prompt_token_ids)
        step += 1
        held_l.append(sum(running.values()))
        res_l.append(reserved_total)
        run_l.append(len(running))
        # a request that has sampled its last token leaves (tokens sampled = computed - prompt + 1)
        for i in list(running):
            r = requests[i]
            if running[i] - len(r.prompt_token_ids) + 1 >= r.output_len:
                del running[i]
                reserved_total -= reserve(r)
                done += 1
    return {"held": held_l, "reserved": res_l, "running": run_l, "num_steps": step}


def replay_folio(requests: list[BenchRequest], num_blocks: int, block_size: int, model_config, tokenizer,
                 max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int) -> dict:
    """Replay ``requests`` (arrival in steps) through folio's scheduler and block pool, no model."""
    eng = replay_engine(num_blocks, model_config, tokenizer, block_size=block_size, max_model_len=max_model_len,
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    res = run_trace(eng, requests, ignore_eos_params, sample_kv=True, step_clock=True)
    return {"held": [k[1] for k in res.kv], "reserved": [k[2] for k in res.kv], "running": [k[3] for k in res.kv],
            "num_steps": res.num_steps, "num_preemptions": res.metrics["num_preemptions"],
            "waste": res.kv_waste()}


def summarize(run: dict, capacity_tokens: int) -> dict:
    held = np.asarray(run["held"], dtype=np.float64)
    res = np.asarray(run["reserved"], dtype=np.float64)
    busy = res > 0
    return {
        "waste": float(1 - held.sum() / res.sum()) if res.sum() else 0.0,
        "used_fraction_of_reserved_mean": float(np.mean(held[busy] / res[busy])) if busy.any() else 0.0,
        "held_fraction_of_capacity_mean": float(held.mean() / capacity_tokens) if held.size else 0.0,
        "batch_size_mean": float(np.mean(run["running"])) if run["running"] else 0.0,
        "batch_size_max": int(np.max(run["running"])) if run["running"] else 0,
        "num_steps": int(run["num_steps"]),
    }


def run_section1(requests: list[BenchRequest], num_blocks: int, block_size: int, max_model_len: int,
                 model_config, tokenizer, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048) -> dict:
    """All three allocators on one trace in ``num_blocks * block_size`` slots of KV memory."""
    cap = num_blocks * block_size
    runs = {
        "paged (folio block pool)": replay_folio(requests, num_blocks, block_size, model_config, tokenizer,
                                                 max_model_len, max_num_seqs, max_num_batched_tokens),
        "contiguous, max_model_len": simulate_contiguous(requests, cap, lambda r: max_model_len, max_num_seqs,
                                                         max_num_batched_tokens),
        "contiguous, prompt+max_tokens": simulate_contiguous(
            requests, cap, lambda r: len(r.prompt_token_ids) + r.output_len, max_num_seqs, max_num_batched_tokens),
    }
    return {"capacity_tokens": cap, "runs": runs, "summary": {k: summarize(v, cap) for k, v in runs.items()}}
