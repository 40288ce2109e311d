"""Decode speed with a float32 and a bfloat16 KV cache (``--kv-cache-dtype``), one sitting.

Usage:
    .venv/bin/python perf/kv_cache_dtype.py [--model smollm2-135m-instruct] [--contexts 256 1024 2048]
        [--seqs 1 16] [--threads 0 1] [--steps 16] [--repeat 3] [--json FILE]

For each cache dtype, thread count (0: every core this process may use), number of sequences
and context length: ``--steps`` decode steps of that many sequences, each at that context (its
keys and values already in the cache), best of ``--repeat``, the two dtypes alternating
repeat by repeat (so that both meet the same spells of load); the figure is output tokens/s
(sequences x steps / seconds), the whole forward pass (weights streamed, attention over the
context, lm_head) as ``model.forward`` runs it in the engine, without sampling. The cache holds
random keys and values written directly (rounded to bfloat16 for the bfloat16 cache), in a
shuffled block table: a decode's time does not depend on the values, and no prefill is needed
to fill 16 sequences x 2048 tokens. The cache's bytes per token (both dtypes) and the machine's
load average are printed: on a shared machine the figures move with the load, so compare
columns of one sitting only.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--seqs", type=int, nargs="+", default=[1, 16])
    p.add_argument("--threads", type=int, nargs="+", default=[0, 1], help="0: every core this process may use")
    p.add_argument("--steps", type=int, default=16, help="decode steps per timing")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    a = p.parse_args(argv)

    from folio.kernels import reference
    from folio.kernels.cpu.threads import num_threads, numba_threads
    from folio.model.attention_metadata import AttentionMetadata
    from folio.model.loader import allocate_kv_caches, load_model

    model, config, _ = load_model(a.model, device="cpu")
    kernels = model.kernels
    bs = 16
    all_threads = num_threads()
    S_max, C_max = max(a.seqs), max(a.contexts) + a.steps * a.repeat + 1
    per_seq = -(-C_max // bs)
    num_blocks = S_max * per_seq
    rng = np.random.default_rng(0)
    table = rng.permutation(num_blocks).astype(np.int32).reshape(S_max, per_seq)
    print(f"command: {shlex.join([sys.executable] + sys.argv)}")
    print(f"model {a.model}: {config.num_hidden_layers} layers, {config.num_key_value_heads} KV heads x "
          f"{config.head_dim}; KV bytes per token: float32 {config.kv_bytes_per_token(4)}, bfloat16 "
          f"{config.kv_bytes_per_token(2)}; cache of {num_blocks} blocks of {bs} tokens")
    dtypes = (("float32", np.float32), ("bfloat16", np.uint16))
    caches = {}
    for name, dtype in dtypes:
        caches[name] = allocate_kv_caches(config, num_blocks, bs, kernels, dtype)
        for kc, vc in caches[name]:   # random keys / values (a decode's time does not depend on them)
            for c in (kc, vc):
                x = rng.standard_normal(c.shape, dtype=np.float32)
                c[...] = reference.float32_to_bf16_bits(x) if dtype == np.uint16 else x

    def step(kv, S, pos):
        slots = table[:S, pos // bs].astype(np.int64) * bs + pos % bs
        md = AttentionMetadata(slot_mapping=slots, query_start_loc=np.arange(S + 1, dtype=np.int32),
                               seq_lens=np.full(S, pos + 1, np.int32), block_tables=np.ascontiguousarray(table[:S]),
                               max_query_len=1, max_seq_len=pos + 1)
        model.forward(np.full(S, 1000, np.int64), np.full(S, pos, np.int64), md, kv, np.arange(S))

    results = []
    for threads in a.threads:
        t_used = threads or all_threads
        with numba_threads(t_used):
            for S in a.seqs:
                for C in a.contexts:
                    # the two dtypes alternate, repeat by repeat: each sees the same spells of load
                    best = {name: float("inf") for name, _ in dtypes}
                    for name, _ in dtypes:
                        step(caches[name], S, C)   # compile / warm
                    for r in range(a.repeat):
                        for name, _ in dtypes:
                            t0 = time.perf_counter()
                            for i in range(a.steps):
                                step(caches[name], S, C + 1 + r * a.steps + i)
                            best[name] = min(best[name], time.perf_counter() - t0)
                    for name, _ in dtypes:
                        tok_s = S * a.steps / best[name]
                        results.append({"kv_cache_dtype": name, "threads": t_used, "seqs": S, "context": C,
                                        "tok_s": round(tok_s, 1), "ms_per_step": round(1e3 * best[name] / a.steps, 2)})
                        print(f"{name:9s} threads {t_used:2d} seqs {S:3d} context {C:5d}: {tok_s:8.1f} tok/s "
                              f"({1e3 * best[name] / a.steps:.2f} ms/step)  load {os.getloadavg()[0]:.2f}", flush=True)
    print("\nratio bfloat16 / float32 (tok/s):")
    f32 = {(r["threads"], r["seqs"], r["context"]): r["tok_s"] for r in results if r["kv_cache_dtype"] == "float32"}
    for r in results:
        if r["kv_cache_dtype"] == "bfloat16":
            k = (r["threads"], r["seqs"], r["context"])
            print(f"  threads {k[0]:2d} seqs {k[1]:3d} context {k[2]:5d}: {r['tok_s'] / f32[k]:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": shlex.join(sys.argv), "load_avg": os.getloadavg(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
