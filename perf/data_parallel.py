"""Data-parallel replicas on Ray (issue 32, section 7): 2 replicas x 1 thread against 1 replica x 2 threads.

Starts ``folio serve`` twice on the same cores: ``--data-parallel-size 2 --threads-per-replica 1``
(a local Ray cluster, the prefix-aware router in front) and a plain ``folio serve`` whose worker has
2 Numba threads (``NUMBA_NUM_THREADS=2``). Each gets two workloads over ZeroMQ
(``perf.bench.serve.run_bench``, all requests at once unless ``--request-rate``):

* ``random``: the 64-request workload of ``folio bench serve`` (random token-id prompts of 32..512
  tokens, 16..256 output tokens, ``ignore_eos``; sizes via the flags);
* ``shared-prefix``: ``--prefixes`` groups of ``--per-prefix`` requests sharing a
  ``--prefix-len``-token prompt prefix, each with a ``--tail-len``-token tail of its own.

Per run: request and output-token throughput, TTFT (mean / median / P99), and the prefix-cache hit
rate over the run (``prefix_cache_hits / prefix_cache_queries`` from the server's metrics, totals
over the replicas). Then the routing cost: the router's own time per request as the server counted it
(tokenizing a text prompt, hashing its blocks, choosing: ``router.routing_us_per_request``) and
``ipc/routing.py``'s ``PrefixAwareRouter.route`` + ``release`` alone on the shared-prefix prompts,
in this process.

The 2-core machine this was written on is shared with other work: figures taken there are noisy.

    python perf/data_parallel.py                               # the default model, full sizes
    python perf/data_parallel.py --tiny --num-prompts 16 --max-output-len 32   # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time


def shared_prefix_workload(prefixes: int, per_prefix: int, prefix_len: int, tail_len: int, output_len: int,
                           seed: int = 0):
    """``[(prompt ids, output len)]``: groups interleaved (p0 r0, p1 r0, ...), ids drawn from [100, 20000)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    heads = [rng.integers(100, 20000, prefix_len).tolist() for _ in range(prefixes)]
    return [(heads[p] + rng.integers(100, 20000, tail_len).tolist(), output_len)
            for _ in range(per_prefix) for p in range(prefixes)]


def run_config(name: str, serve_args: list[str], env: dict, workloads: dict, timeout: float) -> dict:
    from folio.cmd_serve import spawn_server, stop_server
    from folio.ipc.client import Client
    from perf.bench.serve import run_bench
    t0 = time.monotonic()
    proc, address = spawn_server(serve_args, env=env, startup_timeout=1800,
                                 on_line=lambda line: print(f"  [{name}] {line}", flush=True))
    print(f"  [{name}] ready in {time.monotonic() - t0:.1f} s", flush=True)
    out = {}
    try:
        with Client(address, timeout=120) as c:
            for wname, (workload, rate) in workloads.items():
                m0 = c.get_metrics()
                s = asyncio.run(run_bench(address, workload, rate, None, 0, timeout))
                m1 = c.get_metrics()
                q = m1["prefix_cache_queries"] - m0["prefix_cache_queries"]
                s["prefix_cache_hit_rate"] = (m1["prefix_cache_hits"] - m0["prefix_cache_hits"]) / q if q else 0.0
                if "router" in m1:
                    s["routing_us_per_request"] = m1["router"]["routing_us_per_request"]
                    s["requests_per_replica"] = [r1["routing"]["num_routed"] - r0["routing"]["num_routed"]
                                                 for r0, r1 in zip(m0["replicas"], m1["replicas"])]
                    s["prefix_routed"] = sum(r1["routing"]["num_prefix_routed"] - r0["routing"]["num_prefix_routed"]
                                             for r0, r1 in zip(m0["replicas"], m1["replicas"]))
                out[wname] = s
                print(f"  [{name}] {wname}: {s['successful_requests']} ok, {s['failed_requests']} failed, "
                      f"{s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.1f} output tok/s, "
                      f"TTFT mean {s['ttft_ms']['mean']:.0f} ms median {s['ttft_ms']['median']:.0f} ms "
                      f"P99 {s['ttft_ms']['p99']:.0f} ms, prefix-cache hit rate {s['prefix_cache_hit_rate']:.3f}"
                      + (f", {s['requests_per_replica']} requests per replica ({s['prefix_routed']} by prefix)"
                         if "requests_per_replica" in s else ""),
                      flush=True)
    finally:
        stop_server(proc)
    return out


def routing_cost(workload, block_size: int, repeats: int = 20) -> float:
    """Microseconds of ``PrefixAwareRouter.route`` + ``release`` per request, in this process."""
    from folio.ipc.routing import PrefixAwareRouter
    r = PrefixAwareRouter(2, block_size, max_blocks=100_000)
    n = 0
    t0 = time.perf_counter()
    for _ in range(repeats):
        for ids, out_len in workload:
            r.release(r.route(ids, out_len))
            n += 1
    return 1e6 * (time.perf_counter() - t0) / n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model (default: folio's default model)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer random-weights model with the default tokenizer "
                                                       "(checks the script quickly; figures mean little)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-input-len", type=int, default=32)
    p.add_argument("--max-input-len", type=int, default=512)
    p.add_argument("--min-output-len", type=int, default=16)
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--per-prefix", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--tail-len", type=int, default=32)
    p.add_argument("--shared-output-len", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--result-file", default=None, help="also write the figures as JSON here")
    a = p.parse_args(argv)
    print("command:", " ".join([os.path.basename(sys.executable), *sys.argv]), flush=True)
    from perf.bench.serve import random_workload
    workloads = {
        "random": (random_workload(a.num_prompts, a.min_input_len, a.max_input_len, a.min_output_len,
                                   a.max_output_len), a.request_rate),
        "shared-prefix": (shared_prefix_workload(a.prefixes, a.per_prefix, a.prefix_len, a.tail_len,
                                                 a.shared_output_len), a.request_rate),
    }
    common = ["--device", "cpu", "--block-size", str(a.block_size)]
    if a.tiny:
        from perf.ipc_overhead import tiny_model_dir
        common += ["--model", tiny_model_dir(), "--load-format", "dummy"]
    elif a.model:
        common += ["--model", a.model]
    results = {}
    configs = [("2 replicas x 1 thread", [*common, "--data-parallel-size", "2", "--threads-per-replica", "1"], {}),
               ("1 replica x 2 threads", common, {"NUMBA_NUM_THREADS": "2"})]
    for name, args, extra in configs:
        print(f"{name}:", flush=True)
        results[name] = run_config(name, args, {**os.environ, **extra}, workloads, a.timeout)
    us = routing_cost(workloads["shared-prefix"][0], a.block_size)
    results["route_us_per_request_in_process"] = us
    print(f"routing cost: PrefixAwareRouter.route + release {us:.1f} us per request (in process, "
          f"{a.prefix_len + a.tail_len}-token prompts); the router's time per request in the server, "
          f"tokenization included: {results['2 replicas x 1 thread']['shared-prefix'].get('routing_us_per_request', float('nan')):.1f} us",
          flush=True)
    if a.result_file:
        with open(a.result_file, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
