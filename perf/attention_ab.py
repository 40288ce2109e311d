"""Paged attention of two versions of ``kernels/cpu/attention.py``, interleaved in one process.

    python perf/attention_ab.py REV [--model smol|llama3] [--threads 1 2] [--cases "16x512x1 1x2048xp"] [--hot]

``REV`` is a git revision whose ``kernels/cpu/attention.py`` is loaded beside the working tree's
(``folio.kernels.cpu.attention``). Each case ``SEQSxCTXxTOKENS`` is that many sequences (contexts
uniform within +-25% of CTX) with TOKENS new tokens each (decodes), or ``p``: the whole context
is the new tokens (a prompt's prefill), over caches of enough layers to exceed 128 MB (so K/V
come from memory), shuffled block tables of 16-token blocks. Both versions run the same calls
alternately, 5 rounds, best time each; printed: GB/s of K/V read and GFLOP/s (causal QK^T and PV,
4 flops per head_dim element of each (query row, key) pair), the ratio new / old, and the
largest output difference. ``--hot`` points every block table entry at one of the first two
blocks of a single layer: the same arithmetic with K/V in the core's caches, so that a kernel
whose hot rate is no better than its rate from memory is shown to be bound by its own
instructions, not by memory (perf/JOURNAL.md, seventh and ninth passes). The VM this project measures on drifts 10-30% from
minute to minute: only figures from one run of this script compare (perf/JOURNAL.md, fifth pass).
"""

from __future__ import annotations

import argparse
import sys
import time

import numba
import numpy as np
from revision import load_kernel_module

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))  # perf.bench

import folio.kernels.cpu.attention as current
from perf.bench.kernel_rates import attention_case, layers_call

SHAPES = {"smol": (9, 3, 64), "llama3": (32, 8, 128)}   # (query heads, KV heads, head_dim)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("rev")
    p.add_argument("--model", choices=sorted(SHAPES), default="smol")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--cases", default="16x512x1 16x2048x1 1x2048x1 1x600x1 8x512x2")
    p.add_argument("--hot", action="store_true",
                   help="every block table entry points at one of the first two blocks: K/V stay in the "
                        "core's caches, so the figures are the kernels' rates without memory traffic")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (best of)")
    a = p.parse_args(argv)
    print("command: python " + " ".join(sys.argv), flush=True)
    old = load_kernel_module(a.rev, "attention")
    H, Hkv, D = SHAPES[a.model]
    rng = np.random.default_rng(0)
    for spec in a.cases.split():
        n, ctx, t = spec.split("x")
        n, ctx = int(n), int(ctx)
        layers = 1 if a.hot else int(min(30, max(1, -(-128e6 // (n * ctx * Hkv * D * 8)))))
        seqs = [(c, c if t == "p" else int(t)) for c in (int(ctx + rng.integers(-ctx // 4, ctx // 4 + 1)) for _ in range(n))]
        q, caches, tables, seq_lens, qsl = attention_case(rng, seqs, layers=layers, heads=(H, Hkv, D), dtype=np.int64)
        if a.hot:
            tables %= 2        # one layer's first two blocks: in L1/L2
        kv_bytes = int(seq_lens.sum()) * Hkv * D * 8 * layers
        flops = layers * H * 4 * D * sum(k * (c - (k - 1) / 2) for c, k in seqs)
        outs = {"old": np.zeros_like(q), "new": np.zeros_like(q)}
        for threads in a.threads:
            numba.set_num_threads(threads)
            best = {"old": 1e9, "new": 1e9}
            calls = {name: layers_call(q, caches, tables, seq_lens, qsl, threads, module=mod, out=outs[name])
                     for name, mod in (("old", old), ("new", current))}
            for rnd in range(a.rounds + 1):            # the first round compiles and warms: not timed
                for name in ("old", "new"):
                    t0 = time.perf_counter()
                    calls[name]()
                    if rnd:
                        best[name] = min(best[name], time.perf_counter() - t0)
            err = float(np.abs(outs["old"] - outs["new"]).max())
            print(f"{a.model} {n} seqs x ~{ctx} keys x {t} tokens, {threads} thread(s): old "
                  f"{kv_bytes / best['old'] / 1e9:5.1f} GB/s {flops / best['old'] / 1e9:5.1f} GFLOP/s, new "
                  f"{kv_bytes / best['new'] / 1e9:5.1f} GB/s {flops / best['new'] / 1e9:5.1f} GFLOP/s, "
                  f"x{best['old'] / best['new']:.2f}, max |diff| {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
