"""The `make run` main job: serve the default model, stream concurrent requests, show the metrics.

    python -m folio.demo [--model M] [--device auto|cpu|cuda] [--max-tokens N] [--address ADDR]

1. starts ``folio serve`` (scheduler + worker processes) on a private ``ipc://`` address, or uses
   ``--address`` of a server already running;
2. an ``AsyncClient`` streams several chat requests at once; their text is printed as it streams,
   one line per chunk, tagged with the request (``[2] ...``);
3. prints per-request TTFT and decode tokens/s (measured by the client), then the engine's
   metrics: prefix-cache hits (the requests share the chat template's system prompt), peak KV
   blocks used, steps, and the server's per-step IPC overhead;
4. stops the server (SIGTERM) and checks it exited cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for writing clean Python code.",
    "Explain in two sentences what a KV cache is.",
    "Write a haiku about the sea.",
    "What is 17 times 3?",
    "Name three planets of the solar system.",
]
COLORS = ["\033[36m", "\033[33m", "\033[35m", "\033[32m", "\033[34m", "\033[31m"]
RESET = "\033[0m"


async def run_demo(address: str, max_tokens: int, color: bool) -> dict:
    from .ipc.client import AsyncClient
    sp = {"temperature": 0.0, "max_tokens": max_tokens}
    stats: dict[int, dict] = {}
    peak_blocks = 0

    def show(i: int, text: str) -> None:
        tag = f"[{i}]"
        if color:
            tag = COLORS[i % len(COLORS)] + tag + RESET
        print(f"{tag} {text.strip()}", flush=True)

    async with AsyncClient(address, timeout=600) as c:
        total_blocks = (await c.get_metrics())["num_total_blocks"]

        async def one(i: int, question: str) -> None:
            t0 = time.monotonic()
            buf, first, last, n = "", None, None, 0
            show(i, f"Q: {question}")
            async for d in c.generate_stream(messages=[{"role": "user", "content": question}], sampling_params=sp):
                if d.token_ids:
                    first = first or d.time
                    last = d.time
                    n += len(d.token_ids)
                buf += d.text
                if len(buf) >= 48 or "\n" in buf or d.finished:   # print in readable chunks as they arrive
                    if buf.strip():
                        show(i, buf.replace("\n", " "))
                    buf = ""
            stats[i] = {"ttft_ms": 1000 * (first - t0) if first else float("nan"), "tokens": n,
                        "tok_s": (n - 1) / (last - first) if first and last and last > first else 0.0,
                        "cached": d.num_cached_tokens, "prompt": d.num_prompt_tokens}

        async def watch_blocks() -> None:
            nonlocal peak_blocks
            while True:
                m = await c.get_metrics()
                peak_blocks = max(peak_blocks, m["num_total_blocks"] - m["num_free_blocks"])
                await asyncio.sleep(0.1)

        watcher = asyncio.create_task(watch_blocks())
        t0 = time.monotonic()
        await asyncio.gather(*[one(i, q) for i, q in enumerate(QUESTIONS)])
        wall = time.monotonic() - t0
        watcher.cancel()
        metrics = await c.get_metrics()

    print()
    print("request  prompt  cached  tokens   TTFT ms  tokens/s")
    for i in sorted(stats):
        s = stats[i]
        print(f"[{i}]      {s['prompt']:6d}  {s['cached']:6d}  {s['tokens']:6d}  {s['ttft_ms']:8.1f}  {s['tok_s']:8.1f}")
    total_tokens = sum(s["tokens"] for s in stats.values())
    q, h = metrics.get("prefix_cache_queries", 0), metrics.get("prefix_cache_hits", 0)
    print()
    print(f"{len(stats)} concurrent requests, {total_tokens} tokens in {wall:.2f} s "
          f"({total_tokens / wall:.1f} output tokens/s overall)")
    print(f"prefix cache: {h} of {q} queried prompt tokens were hits ({100 * h / max(q, 1):.0f}%)")
    print(f"KV blocks: {total_blocks} in all ({metrics.get('block_size')} tokens each), peak used {peak_blocks}, "
          f"cached now {metrics.get('num_cached_blocks')}")
    print(f"engine: {metrics.get('num_steps')} steps, forward {metrics.get('forward_time', 0):.2f} s, "
          f"IPC + scheduler overhead {metrics.get('step_ipc_overhead_us', 0):.0f} us/step, "
          f"{metrics.get('num_preemptions', 0)} preemptions")
    return metrics


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m folio.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model (default: the server's default model)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--address", default=None, help="use a running server instead of starting one")
    p.add_argument("--no-color", action="store_true")
    a = p.parse_args(argv)
    from .cmd_serve import spawn_server, stop_server
    proc = None
    address = a.address
    if address is None:
        flags = ["--device", a.device] + (["--model", a.model] if a.model else [])
        print("starting folio serve (scheduler + worker processes) ...", flush=True)
        t0 = time.monotonic()
        proc, address = spawn_server(flags)
        print(f"server ready on {address} after {time.monotonic() - t0:.1f} s", flush=True)
    try:
        asyncio.run(run_demo(address, a.max_tokens, color=not a.no_color and sys.stdout.isatty()))
    finally:
        if proc is not None:
            code = stop_server(proc)
            print(f"server stopped (exit code {code})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
