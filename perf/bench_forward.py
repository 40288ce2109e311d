"""Forward-pass figures of one sequence on this machine: prefill tokens/s and decode tokens/s.

Usage:
    .venv/bin/python perf/bench_forward.py [--model smollm2-135m-instruct] [--device cpu]
        [--prompt-len 300] [--decode-tokens 64] [--repeat 3] [--json]

Prefill: one step over a ``--prompt-len`` prompt (the golden file's 300-token prompt d, cycled
if longer), fresh KV cache, best of ``--repeat``. Decode: greedy single-sequence steps after that
prompt (context prompt_len .. prompt_len + decode_tokens), EOS ignored, best of ``--repeat``.
Decode of a float32 model reads every weight once per step, so its bound is
``weight bytes / memory bandwidth``; the bandwidth is measured here with a NumPy copy of a
512 MiB array (bytes read + bytes written per second), which a pure read stream may exceed.
The machine's load average and the CPU time this process got per wall-clock second are printed
because on a shared machine the figures move with them.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np


def memory_bandwidth_gbs(n_bytes: int = 512 << 20, repeat: int = 5) -> float:
    """Best ``(read + write bytes) / s`` of ``np.copyto`` over a float32 array, in GB/s (1e9)."""
    a = np.ones(n_bytes // 4, dtype=np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)  # touch the pages
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    return 2 * a.nbytes / best / 1e9


def weight_bytes(model) -> int:
    """Bytes of distinct weight arrays a decode step reads (the tied lm_head counted once; quantized
    weights at their stored size): ``LlamaForCausalLM.weight_bytes``."""
    return model.weight_bytes()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)

    from folio.model.loader import load_model
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support.greedy import greedy_generate

    model, config, _ = load_model(args.model, device=args.device)
    golden = json.loads((Path(__file__).resolve().parents[1] / "tests" / "data" / "smollm2_135m.json").read_text())
    base = next(c for c in golden["greedy_cases"] if c["id"] == "d")["prompt_ids"]
    prompt = [base[i % len(base)] for i in range(args.prompt_len)]

    greedy_generate(model, config, prompt[:20], max_tokens=3, ignore_eos=True)  # compile / warm caches
    prefill_s, decode_tps = float("inf"), 0.0
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(args.repeat):
        out = greedy_generate(model, config, prompt, max_tokens=args.decode_tokens + 1, ignore_eos=True)
        prefill_s = min(prefill_s, out["prefill_seconds"])
        decode_tps = max(decode_tps, out["decode_tokens_per_s"])
    # CPU seconds this process got per wall second (all its threads); < threads when others compete
    cpu_share = (time.process_time() - cpu0) / (time.perf_counter() - wall0)

    bw = memory_bandwidth_gbs() if args.device == "cpu" else None
    wbytes = weight_bytes(model)
    bound_tps = bw * 1e9 / wbytes if bw else None
    import numba

    result = {
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "model": args.model,
        "device": args.device,
        "cpu_count": os.cpu_count(),
        "numba_threads": numba.get_num_threads(),
        "env": {k: os.environ[k] for k in ("NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
                if k in os.environ},
        "load_average_1m": os.getloadavg()[0],
        "cpu_seconds_per_wall_second": round(cpu_share, 2),
        "prompt_len": args.prompt_len,
        "prefill_seconds": round(prefill_s, 4),
        "prefill_tokens_per_s": round(args.prompt_len / prefill_s, 1),
        "decode_tokens_per_s": round(decode_tps, 2),
        "decode_context": f"{args.prompt_len}..{args.prompt_len + args.decode_tokens}",
        "weight_bytes": wbytes,
        "copy_bandwidth_gbs": round(bw, 2) if bw else None,
        "decode_bound_tokens_per_s": round(bound_tps, 1) if bound_tps else None,
        "decode_fraction_of_bound": round(decode_tps / bound_tps, 3) if bound_tps else None,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"command: {result['command']}")
        print(f"machine: {result['cpu_count']} cores, numba threads {result['numba_threads']}, env {result['env']}, "
              f"load average {result['load_average_1m']:.2f}, this process got {cpu_share:.2f} CPU-s per wall-s")
        print(f"prefill ({args.prompt_len} tokens): {result['prefill_tokens_per_s']} tokens/s "
              f"({result['prefill_seconds']} s)")
        print(f"decode (1 sequence, context {result['decode_context']}): {result['decode_tokens_per_s']} tokens/s")
        if bw:
            print(f"memory bandwidth (numpy copy, read+write): {bw:.1f} GB/s; weights {wbytes / 1e6:.0f} MB per decode "
                  f"step -> bound {bound_tps:.1f} tokens/s; decode at {100 * decode_tps / bound_tps:.0f}% of it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
