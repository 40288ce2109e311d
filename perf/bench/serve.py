"""``folio bench serve``: load a running ``folio serve`` like ``vllm bench serve`` does.

Two backends reach the same server: ``--backend folio`` streams over ZeroMQ with ``AsyncClient``
(``--address``); ``--backend openai`` streams ``POST /v1/completions`` over HTTP (Server-Sent
Events, ``--base-url``), as vLLM's benchmark does for an OpenAI-compatible server (prompts as token
ids, ``ignore_eos``, ``stream_options.include_usage``; a server other than folio must accept vLLM's
``ignore_eos`` extension). The same workload through both measures what the HTTP layer costs.

Requests from the offline benchmark's random workload (``perf.bench.common.random_requests``:
random token-id prompts with lengths uniform in [min_input_len, max_input_len], output lengths
uniform in [min_output_len, max_output_len] with ``ignore_eos``, fixed seed) are sent at a Poisson rate (``--request-rate``, requests/s; ``inf`` =
all at once), optionally capped at ``--max-concurrency`` in flight, all streamed over one
``AsyncClient``. It prints, as vLLM's benchmark does: successful requests, duration, request
throughput, output and total token throughput, and mean / median / P99 of TTFT (arrival of the
first token), TPOT ((latency - TTFT) / (output tokens - 1), per request) and ITL (gaps between
streamed messages; a message carrying k tokens counts as k gaps of equal share).

    folio serve &                       # or: make serve
    folio bench serve --num-prompts 64 --request-rate 2
    folio bench serve --backend openai --base-url http://127.0.0.1:8000 --num-prompts 64 --request-rate 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from dataclasses import dataclass, field

import numpy as np


def random_workload(num_prompts: int, min_input_len: int, max_input_len: int, min_output_len: int,
                    max_output_len: int, seed: int = 0):
    """``[(prompt_token_ids, output_len)]``: the offline benchmark's workload
    (``perf.bench.common.random_requests``: random token ids, lengths uniform in the inclusive
    ranges, deterministic in ``seed``), so online and offline figures share their requests."""
    from .common import random_requests
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


async def _one_openai(http, url: str, model: str | None, ids, out_len, sem) -> _Result:
    """One streamed ``/v1/completions`` request; each SSE chunk with text or a finish counts as a
    token arrival (folio sends one chunk per generated token); ``usage`` gives the token count."""
    r = _Result(prompt_len=len(ids))
    body = {"prompt": ids, "max_tokens": out_len, "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    async with sem:
        t0 = time.perf_counter()
        last, chunks, usage = None, 0, None
        try:
            async with http.stream("POST", url, json=body) as resp:
                if resp.status_code != 200:
                    raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(event["error"].get("message"))
                    if event.get("usage"):
                        usage = event["usage"]
                    if not event.get("choices"):
                        continue
                    now = time.perf_counter()
                    if last is None:
                        r.ttft = now - t0
                    else:
                        r.itl.append(now - last)
                    last = now
                    chunks += 1
            r.latency = time.perf_counter() - t0
            r.output_len = usage["completion_tokens"] if usage else chunks
            r.ok = True
        except Exception as e:  # a failed request is counted, not fatal
            r.error = f"{type(e).__name__}: {e}"
    return r


async def run_bench(address: str, workload, request_rate: float, max_concurrency: int | None, seed: int,
                    timeout: float, backend: str = "folio", base_url: str | None = None,
                    model: str | None = None, api_key: str | None = None) -> dict:
    """Send ``workload`` ([(prompt ids, output len)]) at ``request_rate`` and summarize the results.

    ``backend="folio"``: ``AsyncClient(address)``; ``"openai"``: ``POST {base_url}/v1/completions``
    (``Authorization: Bearer api_key`` when given).
    """
    from .common import BenchRequest, poisson_arrivals
    arrivals = [0.0] * len(workload)
    if request_rate != float("inf"):     # Poisson arrivals, as the offline benchmark draws them
        arrivals = [r.arrival for r in poisson_arrivals([BenchRequest(ids, n) for ids, n in workload],
                                                         request_rate, seed)]
    limit = max_concurrency or len(workload) or 1
    sem = asyncio.Semaphore(limit)

    async def send_all(one):
        tasks = []
        t0 = time.perf_counter()
        for (ids, out_len), at in zip(workload, arrivals):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(ids, out_len)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0

    if backend == "openai":
        import httpx
        if not base_url:
            raise ValueError("--backend openai needs --base-url (e.g. http://127.0.0.1:8000)")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        url = base_url.rstrip("/") + "/v1/completions"
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), headers=headers,
                                     limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit)) as http:
            results, duration = await send_all(lambda ids, n: _one_openai(http, url, model, ids, n, sem))
    elif backend == "folio":
        from folio.ipc.client import AsyncClient
        async with AsyncClient(address, timeout=timeout) as client:
            await client.health()
            before = await client.get_metrics()
            results, duration = await send_all(lambda ids, n: _one(client, ids, n, sem))
            after = await client.get_metrics()
        s = summarize(results, duration)
        s["spec_decode"] = spec_decode_figures(before, after)
        return s
    else:
        raise ValueError(f"unknown backend {backend!r} (folio or openai)")
    return summarize(results, duration)


def spec_decode_figures(before: dict, after: dict) -> dict | None:
    """The server's speculative decoding over the run (its ``spec_decode_*`` counters after minus
    before, as vLLM's bench serve reports them), or ``None`` for a server without it."""
    if "spec_decode_num_drafts" not in after:
        return None
    d = {k: after[k] - before.get(k, 0) for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                                  "spec_decode_num_accepted_tokens")}
    drafts, proposed, accepted = d.values()
    pos0 = before.get("spec_decode_num_accepted_tokens_per_pos") or []
    per_pos = [a - (pos0[i] if i < len(pos0) else 0)
               for i, a in enumerate(after.get("spec_decode_num_accepted_tokens_per_pos") or [])]
    return {"drafts": drafts, "draft_tokens": proposed, "accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "per_position_acceptance_rate": [a / drafts if drafts else 0.0 for a in per_pos]}


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
    sd = s.get("spec_decode")
    if sd is not None:
        print(f"{'Speculative Decoding':-^50}")
        print(f"{'Acceptance rate (%):':<40}{100 * sd['acceptance_rate']:>10.2f}")
        print(f"{'Acceptance length:':<40}{sd['mean_acceptance_length']:>10.2f}")
        print(f"{'Drafts:':<40}{sd['drafts']:>10}")
        print(f"{'Draft tokens:':<40}{sd['draft_tokens']:>10}")
        print(f"{'Accepted tokens:':<40}{sd['accepted_tokens']:>10}")
        print("Per-position acceptance (%): " + ", ".join(f"{100 * r:.1f}" for r in sd["per_position_acceptance_rate"]))
    print(line)
    if s["errors"]:
        print("errors:", *s["errors"], sep="\n  ")


def add_parser(bench_subparsers) -> None:
    from folio.ipc.transport import DEFAULT_ADDRESS
    p = bench_subparsers.add_parser("serve", help="benchmark a running folio serve (like vllm bench serve)",
                                    description=__doc__)
    p.add_argument("--backend", default="folio", choices=["folio", "openai"],
                   help="folio: ZeroMQ (AsyncClient, --address); openai: HTTP /v1/completions (--base-url)")
    p.add_argument("--address", default=DEFAULT_ADDRESS, help="the server's ZeroMQ address (backend folio)")
    p.add_argument("--base-url", default=None, help="the server's HTTP base URL, e.g. http://127.0.0.1:8000 "
                                                    "(backend openai)")
    p.add_argument("--model", default=None, help="model name sent to the OpenAI API (None: the server's default)")
    p.add_argument("--api-key", default=None,
                   help="Bearer key for the OpenAI API (default: $OPENAI_API_KEY if set)%(default).0s")
    p.add_argument("--num-prompts", type=int, default=64, help="number of requests")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (None: no limit)")
    p.add_argument("--min-input-len", type=int, default=32, help="shortest prompt (random token ids)")
    p.add_argument("--max-input-len", type=int, default=512, help="longest prompt")
    p.add_argument("--min-output-len", type=int, default=16, help="fewest output tokens (ignore_eos)")
    p.add_argument("--max-output-len", type=int, default=256, help="most output tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and the arrival times")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for each streamed message")
    p.add_argument("--result-file", default=None, help="also write the figures as JSON here")
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    if not (0 < a.min_input_len <= a.max_input_len and 0 < a.min_output_len <= a.max_output_len):
        raise ValueError("need 0 < min <= max for input and output lengths")
    if a.request_rate <= 0:
        raise ValueError("--request-rate must be > 0 (inf = all at once)")
    if a.backend == "openai" and not a.base_url:
        raise ValueError("--backend openai needs --base-url (e.g. http://127.0.0.1:8000)")
    work = random_workload(a.num_prompts, a.min_input_len, a.max_input_len, a.min_output_len, a.max_output_len,
                           a.seed)
    s = asyncio.run(run_bench(a.address, work, a.request_rate, a.max_concurrency, a.seed, a.timeout,
                              backend=a.backend, base_url=a.base_url, model=a.model,
                              api_key=a.api_key or os.environ.get("OPENAI_API_KEY")))
    print(f"backend: {a.backend} ({a.base_url if a.backend == 'openai' else a.address})")
    print_summary(s, a.request_rate)
    if a.result_file:
        with open(a.result_file, "w") as f:
            rate = a.request_rate if a.request_rate != float("inf") else "inf"   # strict JSON has no Infinity
            json.dump({"backend": a.backend, "request_rate": rate, "num_prompts": a.num_prompts, **s}, f, indent=1)
    return 0 if s["failed_requests"] == 0 else 1
