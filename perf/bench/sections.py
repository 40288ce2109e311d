"""The measurements of sections 2 and 4-7 of the perf report (1: ``kv_replay``; 3: ``throughput``).

Each ``run_sectionN(host, size)`` runs real engines over the one loaded model (``ModelHost``) and
returns plain figures (JSON-serialisable); ``size`` is a ``ReportSize`` (full or tiny for tests).
"""

from __future__ import annotations

import numpy as np

from .common import (BenchRequest, ModelHost, ignore_eos_params, percentile, poisson_arrivals, random_requests,
                     run_trace)


# ---------------------------------------------------------------------------------------------
# 2. continuous versus static batching on a Poisson trace (Orca, Yu et al., OSDI 2022)
# ---------------------------------------------------------------------------------------------
def run_section2(host: ModelHost, size, bar=None) -> dict:
    base = random_requests(size.s2_num_requests, size.s2_input_len, size.s2_output_len, seed=2)
    rows = []
    for rate in size.s2_rates:
        trace = poisson_arrivals(base, rate, seed=20)
        for policy in ("continuous", "static"):
            eng = host.engine(policy, max_num_seqs=size.s2_max_num_seqs)
            res = run_trace(eng, trace, ignore_eos_params, realtime=True)
            lat = res.latencies()
            rows.append({"rate": rate, "policy": policy, "wall_s": res.wall_s,
                         "throughput_tok_s": res.output_tokens() / res.wall_s,
                         "throughput_req_s": len(trace) / res.wall_s,
                         "latency_mean_s": float(lat.mean()), "latency_p99_s": percentile(lat, 99),
                         "ttft_mean_s": float(res.ttfts().mean())})
            if bar is not None:
                bar.update(1)
    return {"num_requests": len(base), "input_len": list(size.s2_input_len),
            "output_len": list(size.s2_output_len), "max_num_seqs": size.s2_max_num_seqs,
            "rates": list(size.s2_rates), "rows": rows}


# ---------------------------------------------------------------------------------------------
# 4. parallel sampling: prompt blocks shared by the n samples vs n independent requests
# ---------------------------------------------------------------------------------------------
def run_section4(host: ModelHost, size, bar=None) -> dict:
    from folio.runtime.common.sampling_params import SamplingParams
    prompts = random_requests(size.s4_num_prompts, (size.s4_prompt_len, size.s4_prompt_len),
                              (size.s4_output_len, size.s4_output_len), seed=4)
    rows = []
    for n in size.s4_n:
        # shared: one request with n samples (prefix caching on: the default engine)
        eng = host.engine()
        res = run_trace(eng, prompts, lambda r: SamplingParams(n=n, temperature=1.0, seed=7, ignore_eos=True,
                                                              max_tokens=r.output_len), sample_kv=True)
        shared_blocks = max(k[4] for k in res.kv)
        shared = {"wall_s": res.wall_s, "peak_blocks": shared_blocks, "output_tokens": res.output_tokens()}
        # not shared: n separate requests per prompt, prefix caching off (nothing shared)
        eng = host.engine(enable_prefix_caching=False)
        copies = [BenchRequest(p.prompt_token_ids, p.output_len) for p in prompts for _ in range(n)]
        res2 = run_trace(eng, copies, lambda r: SamplingParams(temperature=1.0, seed=7, ignore_eos=True,
                                                              max_tokens=r.output_len), sample_kv=True)
        sep = {"wall_s": res2.wall_s, "peak_blocks": max(k[4] for k in res2.kv), "output_tokens": res2.output_tokens()}
        rows.append({"n": n, "shared": shared, "separate": sep,
                     "memory_saving": 1 - shared["peak_blocks"] / sep["peak_blocks"],
                     "speedup": (shared["output_tokens"] / shared["wall_s"]) / (sep["output_tokens"] / sep["wall_s"])})
        if bar is not None:
            bar.update(1)
    return {"num_prompts": len(prompts), "prompt_len": size.s4_prompt_len, "output_len": size.s4_output_len,
            "block_size": 16, "rows": rows, "beam_rows": run_section4_beams(host, size, prompts, bar)}


def run_section4_beams(host: ModelHost, size, prompts, bar=None) -> list:
    """Beam search at each width: beams sharing blocks (forks by reference count, copy-on-write)
    against the same search with every fork copying its parent's blocks (``separate_beams.py``:
    beams as separate sequences, prefix caching off). Same prompts as the n-sample rows."""
    from folio.runtime.common.sampling_params import BeamSearchParams
    rows = []
    for width in size.s4_beam_widths:
        def params(r, width=width):
            return BeamSearchParams(beam_width=width, max_tokens=r.output_len, ignore_eos=True)
        runs = {}
        for name, eng in (("shared", host.engine()),
                          ("separate", host.engine("separate-beams", enable_prefix_caching=False))):
            res = run_trace(eng, prompts, params, sample_kv=True)
            runs[name] = {"wall_s": res.wall_s, "peak_blocks": max(k[4] for k in res.kv),
                          "output_tokens": res.output_tokens(),
                          "sequences": [[c.token_ids for c in o.outputs] for _, o in sorted(res.outputs.items())]}
        same = runs["shared"].pop("sequences") == runs["separate"].pop("sequences")
        rows.append({"beam_width": width, **runs, "same_results": same,
                     "memory_saving": 1 - runs["shared"]["peak_blocks"] / runs["separate"]["peak_blocks"]})
        if bar is not None:
            bar.update(1)
    return rows


# ---------------------------------------------------------------------------------------------
# 5. prefix caching: one long shared system prompt, many short questions
# ---------------------------------------------------------------------------------------------
def run_section5(host: ModelHost, size, bar=None) -> dict:
    rng = np.random.default_rng(5)
    system = rng.integers(100, 49000, size.s5_system_len).tolist()
    questions = [rng.integers(100, 49000, int(rng.integers(*size.s5_question_len))).tolist()
                 for _ in range(size.s5_num_questions)]
    reqs = [BenchRequest(system + q, size.s5_output_len) for q in questions]
    out = {"system_len": size.s5_system_len, "num_questions": len(reqs), "output_len": size.s5_output_len}
    for caching in (False, True):  # on last: its prefix cache stays warm for the lesson below
        eng = host.engine(enable_prefix_caching=caching)
        res = run_trace(eng, reqs, ignore_eos_params)
        m = res.metrics
        ttft = res.ttfts()
        out["on" if caching else "off"] = {
            "total_s": res.wall_s, "ttft_mean_s": float(ttft.mean()), "ttft_p50_s": percentile(ttft, 50),
            "ttft_max_s": float(ttft.max()), "ttfts": ttft.tolist(),
            "hit_rate": m["prefix_cache_hits"] / m["prefix_cache_queries"] if m["prefix_cache_queries"] else 0.0,
            "cached_tokens": sum(o.num_cached_tokens for o in res.outputs.values()),
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in reqs)}
        if caching:
            warm = eng  # its prefix cache holds the original system prompt
        if bar is not None:
            bar.update(1)
    # the prompt-design lesson: one token of the system prompt changed, into a warm prefix cache
    changes = []
    q = questions[0]
    for pos in size.s5_change_positions:
        sys2 = list(system)
        sys2[pos] = 100 + (sys2[pos] + 1 - 100) % 48900
        res = run_trace(warm, [BenchRequest(sys2 + q, size.s5_output_len)], ignore_eos_params)
        o = next(iter(res.outputs.values()))
        changes.append({"position": pos, "cached_tokens": o.num_cached_tokens,
                        "expected_cached_tokens": (pos // 16) * 16,
                        "ttft_s": float(res.ttfts()[0])})
    # the same question with the unchanged system prompt, for reference
    res = run_trace(warm, [BenchRequest(system + q, size.s5_output_len)], ignore_eos_params)
    out["unchanged"] = {"cached_tokens": next(iter(res.outputs.values())).num_cached_tokens,
                        "ttft_s": float(res.ttfts()[0])}
    out["changed_token"] = changes
    if bar is not None:
        bar.update(1)
    return out


# ---------------------------------------------------------------------------------------------
# 6. chunked prefill: streams' inter-token latency while a long prompt arrives
# ---------------------------------------------------------------------------------------------
def run_section6(host: ModelHost, size, bar=None) -> dict:
    streams = random_requests(size.s6_num_streams, size.s6_stream_input_len,
                              (size.s6_stream_output_len, size.s6_stream_output_len), seed=6)
    long_req = random_requests(1, (size.s6_long_len, size.s6_long_len), (size.s6_long_output_len,) * 2, seed=60)[0]
    rows = []
    for budget in list(size.s6_budgets) + [None]:
        if budget is None:  # unchunked: the whole prompt in one step
            eng = host.engine(enable_chunked_prefill=False,
                              max_num_batched_tokens=max(host.base["max_model_len"], size.s6_long_len + 64))
        else:
            eng = host.engine(max_num_batched_tokens=budget)
        state = {"added": False}

        def inject(res, step, state=state):
            # the long prompt arrives once every stream has streamed a few tokens
            if state["added"] or not all(len(res.token_times.get(str(i), [])) >= size.s6_inject_after
                                         for i in range(len(streams))):
                return []
            state["added"] = True
            return [("long", long_req, ignore_eos_params(long_req))]

        res = run_trace(eng, streams, ignore_eos_params, inject=inject)
        ids = [str(i) for i in range(len(streams))]
        itl = res.itls(ids)
        t_in = res.arrivals["long"]
        # ITLs of gaps that overlap the long prompt's prefill (arrival to first token)
        t_ft = res.first_token["long"]
        during = [g for r in ids for a, b in zip(res.token_times[r][:-1], res.token_times[r][1:])
                  for g in [b - a] if b > t_in and a < t_ft]
        rows.append({"budget": budget if budget is not None else "unchunked",
                     "itl_median_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
                     "itl_max_s": float(itl.max()),
                     "itl_during_prefill_max_s": float(max(during)) if during else float("nan"),
                     "long_ttft_s": t_ft - t_in, "total_s": res.wall_s,
                     "itls": itl.tolist()})
        if bar is not None:
            bar.update(1)
    return {"num_streams": len(streams), "long_len": size.s6_long_len,
            "stream_output_len": size.s6_stream_output_len, "rows": rows}


# ---------------------------------------------------------------------------------------------
# 7. KV sizing table
# ---------------------------------------------------------------------------------------------
# Published config.json values of meta-llama/Llama-3.1-8B and Llama-3.1-70B (the keys folio reads).
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
LLAMA31_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
              "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
              "rope_scaling": LLAMA31_ROPE, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
              "max_position_embeddings": 131072, "bos_token_id": 128000,
              "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu"}
LLAMA31_70B = {**LLAMA31_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
               "num_attention_heads": 64, "num_key_value_heads": 8}


def count_params(c) -> int:
    """Parameters of a Llama model from its config (embeddings, attention, MLP, norms, lm_head)."""
    H, L, V, I = c.hidden_size, c.num_hidden_layers, c.vocab_size, c.intermediate_size
    q = H * c.num_attention_heads * c.head_dim
    kv = 2 * H * c.num_key_value_heads * c.head_dim
    o = c.num_attention_heads * c.head_dim * H
    per_layer = q + kv + o + 3 * H * I + 2 * H
    return V * H * (1 if c.tie_word_embeddings else 2) + L * per_layer + H


def run_section7(default_model_dir, gpu_bytes: int = 80 * 2**30) -> dict:
    from folio.model.config import ModelConfig
    cfgs = {"Llama 3.1 8B": ModelConfig.from_dict(LLAMA31_8B), "Llama 3.1 70B": ModelConfig.from_dict(LLAMA31_70B),
            "SmolLM2-135M (default)": ModelConfig.from_pretrained(default_model_dir)}
    rows = []
    for name, c in cfgs.items():
        kv = c.kv_bytes_per_token(2)
        params = count_params(c)
        weights = 2 * params
        free = gpu_bytes - weights
        rows.append({"model": name, "layers": c.num_hidden_layers, "kv_heads": c.num_key_value_heads,
                     "head_dim": c.head_dim, "kv_bytes_per_token_bf16": kv, "params": params,
                     "weights_bytes_bf16": weights, "tokens_in_80gb": max(0, free // kv),
                     "fits": free > 0})
    return {"gpu_bytes": gpu_bytes, "rows": rows}
