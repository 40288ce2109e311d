"""``folio bench serve``: load a running ``folio serve`` like ``vllm bench serve`` does.

Requests from the offline benchmark's random workload (``folio.bench.common.random_requests``:
random token-id prompts with lengths uniform in [min_input_len, max_input_len], output lengths
uniform in [min_output_len, max_output_len] with ``ignore_eos``, fixed seed) are sent at a Poisson rate (``--request-rate``, requests/s; ``inf`` =
all at once), optionally capped at ``--max-concurrency`` in flight, all streamed over one
``AsyncClient``. It prints, as vLLM's benchmark does: successful requests, duration, request
throughput, output and total token throughput, and mean / median / P99 of TTFT (arrival of the
first token), TPOT ((latency - TTFT) / (output tokens - 1), per request) and ITL (gaps between
streamed messages; a message carrying k tokens counts as k gaps of equal share).

    folio serve &                       # or: make serve
    folio bench serve --num-prompts 64 --request-rate 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import numpy as np


def random_workload(num_prompts: int, min_input_len: int, max_input_len: int, min_output_len: int,
                    max_output_len: int, seed: int = 0):
    """``[(prompt_token_ids, output_len)]``: the offline benchmark's workload
    (``folio.bench.common.random_requests``: random token ids, lengths uniform in the inclusive
    ranges, deterministic in ``seed``), so online and offline figures share their requests."""
    from .bench.common import random_requests
    reqs = random_requests(num_prompts, (min_input_len, max_input_len), (min_output_len, max_output_len), seed)
    return [(r.prompt_token_ids, r.output_len) for r in reqs]


@dataclass
class _Result:
    ok: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list = field(default_factory=list)
    error: str = ""


async def _one(client, ids, out_len, sem) -> _Result:
    r = _Result(prompt_len=len(ids))
    sp = {"max_tokens": out_len, "ignore_eos": True, "temperature": 0.0}
    async with sem:
        t0 = time.perf_counter()
        last = None
        try:
            async for d in client.generate_stream(prompt_token_ids=ids, sampling_params=sp):
                if not d.token_ids:
                    continue
                now = time.perf_counter()
                if last is None:
                    r.ttft = now - t0
                else:
                    r.itl += [(now - last) / len(d.token_ids)] * len(d.token_ids)
                last = now
                r.output_len += len(d.token_ids)
            r.latency = time.perf_counter() - t0
            r.ok = True
        except Exception as e:  # a failed request is counted, not fatal
            r.error = str(e)
    return r


async def run_bench(address: str, workload, request_rate: float, max_concurrency: int | None, seed: int,
                    timeout: float) -> dict:
    from .ipc.client import AsyncClient
    from .bench.common import BenchRequest, poisson_arrivals
    arrivals = [0.0] * len(workload)
    if request_rate != float("inf"):     # Poisson arrivals, as the offline benchmark draws them
        arrivals = [r.arrival for r in poisson_arrivals([BenchRequest(ids, n) for ids, n in workload],
                                                         request_rate, seed)]
    sem = asyncio.Semaphore(max_concurrency or len(workload) or 1)
    async with AsyncClient(address, timeout=timeout) as client:
        await client.health()
        tasks = []
        t0 = time.perf_counter()
        for (ids, out_len), at in zip(workload, arrivals):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(client, ids, out_len, sem)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return summarize(results, duration)


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    return {"mean": 1000 * statistics.fmean(xs), "median": 1000 * statistics.median(xs),
            "p99": 1000 * float(np.percentile(xs, 99))}


def summarize(results: list[_Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    return {
        "successful_requests": len(ok), "failed_requests": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration, "total_token_throughput": (in_tokens + out_tokens) / duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats([(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
    }


def print_summary(s: dict, rate: float) -> None:
    line = "=" * 50
    print(line)
    print(f"{'Serving Benchmark Result':^50}")
    print(line)
    print(f"{'Request rate (req/s):':<40}{rate:>10}")
    print(f"{'Successful requests:':<40}{s['successful_requests']:>10}")
    print(f"{'Failed requests:':<40}{s['failed_requests']:>10}")
    print(f"{'Benchmark duration (s):':<40}{s['duration_s']:>10.2f}")
    print(f"{'Total input tokens:':<40}{s['total_input_tokens']:>10}")
    print(f"{'Total generated tokens:':<40}{s['total_output_tokens']:>10}")
    print(f"{'Request throughput (req/s):':<40}{s['request_throughput']:>10.2f}")
    print(f"{'Output token throughput (tok/s):':<40}{s['output_token_throughput']:>10.2f}")
    print(f"{'Total token throughput (tok/s):':<40}{s['total_token_throughput']:>10.2f}")
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency")):
        print(f"{title:-^50}")
        short = key.split("_")[0].upper()
        for stat in ("mean", "median", "p99"):
            label = {"mean": "Mean", "median": "Median", "p99": "P99"}[stat]
            print(f"{f'{label} {short} (ms):':<40}{s[key][stat]:>10.2f}")
    print(line)
    if s["errors"]:
        print("errors:", *s["errors"], sep="\n  ")


def add_parser(bench_subparsers) -> None:
    from .ipc.transport import DEFAULT_ADDRESS
    p = bench_subparsers.add_parser("serve", help="benchmark a running folio serve (like vllm bench serve)",
                                    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default=DEFAULT_ADDRESS)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--min-input-len", type=int, default=32)
    p.add_argument("--max-input-len", type=int, default=512)
    p.add_argument("--min-output-len", type=int, default=16)
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for each streamed message")
    p.add_argument("--result-file", default=None, help="also write the figures as JSON here")
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    if not (0 < a.min_input_len <= a.max_input_len and 0 < a.min_output_len <= a.max_output_len):
        raise ValueError("need 0 < min <= max for input and output lengths")
    if a.request_rate <= 0:
        raise ValueError("--request-rate must be > 0 (inf = all at once)")
    work = random_workload(a.num_prompts, a.min_input_len, a.max_input_len, a.min_output_len, a.max_output_len,
                           a.seed)
    s = asyncio.run(run_bench(a.address, work, a.request_rate, a.max_concurrency, a.seed, a.timeout))
    print_summary(s, a.request_rate)
    if a.result_file:
        with open(a.result_file, "w") as f:
            rate = a.request_rate if a.request_rate != float("inf") else "inf"   # strict JSON has no Infinity
            json.dump({"request_rate": rate, "num_prompts": a.num_prompts, **s}, f, indent=1)
    return 0 if s["failed_requests"] == 0 else 1
