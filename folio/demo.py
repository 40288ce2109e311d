"""The `make run` main job: serve the default model, stream concurrent chats, show the metrics and
how to reach the server over HTTP.

    python -m folio.demo [--model M] [--device auto|cpu|cuda] [--max-tokens N] [--address ADDR]

1. starts ``folio serve`` (scheduler, worker and HTTP processes) on a private ``ipc://``
   address and HTTP port 8000 (``--port``, ``$FOLIO_PORT`` or ``make run PORT=N``; any free port if
   it is taken), printing its progress while the
   model loads and warms up; or uses ``--address`` of a server already running;
2. an ``AsyncClient`` streams several chat requests at once (greedy, until the model's end of
   sequence or ``--max-tokens``); their text is printed as it streams, whole words at a time, one
   line per chunk, tagged with the request (``[2] ...``);
3. prints per-request TTFT and decode tokens/s (measured by the client), then the engine's
   metrics: prefix-cache hits (the requests share the chat template's system prompt), peak KV
   blocks used, steps, and the server's per-step IPC overhead;
4. prints a ``curl`` line for the OpenAI-compatible API and the chat page's URL; on a terminal
   it keeps the server up until Enter or Ctrl-C, otherwise it stops it (SIGTERM) at once.

Ctrl-C at any point stops everything without a traceback and counts as the user ending the demo:
exit code 0, so ``make run`` adds no error line either.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
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
LINE_CHARS = 60          # a streamed chunk is printed once it holds this many characters (whole words)


def take_words(buffer: str, final: bool, min_chars: int = LINE_CHARS) -> tuple[str, str]:
    """Split streamed text into ``(to print now, to keep)``: whole words only, once ``min_chars``
    are buffered or a line ends; everything when ``final``. Newlines become spaces."""
    if final:
        return buffer, ""
    if len(buffer) < min_chars and "\n" not in buffer:
        return "", buffer
    cut = max(buffer.rfind(" "), buffer.rfind("\n"))
    if cut <= 0:
        return "", buffer            # one long word so far: wait for its end
    return buffer[:cut], buffer[cut + 1:]


async def run_demo(address: str, max_tokens: int, color: bool) -> dict:
    from .ipc.client import AsyncClient
    sp = {"temperature": 0.0, "max_tokens": max_tokens}
    stats: dict[int, dict] = {}
    peak_blocks = 0

    def show(i: int, text: str) -> None:
        tag = f"[{i}]"
        if color:
            tag = COLORS[i % len(COLORS)] + tag + RESET
        text = " ".join(text.split())
        if text:
            print(f"{tag} {text}", flush=True)

    async with AsyncClient(address, timeout=600) as c:
        before = await c.get_metrics()          # the server's warm-up already counted in its counters
        total_blocks = before["num_total_blocks"]

        async def one(i: int, question: str) -> None:
            t0 = time.monotonic()
            buf, first, last, n, d = "", None, None, 0, None
            show(i, f"Q: {question}")
            async for d in c.generate_stream(messages=[{"role": "user", "content": question}], sampling_params=sp):
                if d.token_ids:
                    first = first or d.time
                    last = d.time
                    n += len(d.token_ids)
                out, buf = take_words(buf + d.text, d.finish_reason is not None)
                show(i, out)
            stats[i] = {"ttft_ms": 1000 * (first - t0) if first else float("nan"), "tokens": n,
                        "tok_s": (n - 1) / (last - first) if first and last and last > first else 0.0,
                        "cached": d.num_cached_tokens if d else 0, "prompt": d.num_prompt_tokens if d else 0,
                        "finish": d.finish_reason if d else None}

        async def watch_blocks() -> None:
            nonlocal peak_blocks
            while True:
                m = await c.get_metrics()
                peak_blocks = max(peak_blocks, m["num_total_blocks"] - m["num_free_blocks"])
                await asyncio.sleep(0.1)

        watcher = asyncio.create_task(watch_blocks())
        t0 = time.monotonic()
        try:
            await asyncio.gather(*[one(i, q) for i, q in enumerate(QUESTIONS)])
        finally:
            watcher.cancel()
        wall = time.monotonic() - t0
        metrics = await c.get_metrics()
    # the demo's share of the engine's cumulative counters
    counted = {k: metrics.get(k, 0) - before.get(k, 0)
               for k in ("prefix_cache_queries", "prefix_cache_hits", "num_steps", "forward_time", "num_preemptions")}

    print()
    print("request  prompt  cached  tokens  finish   TTFT ms  tokens/s")
    for i in sorted(stats):
        s = stats[i]
        print(f"[{i}]      {s['prompt']:6d}  {s['cached']:6d}  {s['tokens']:6d}  {s['finish'] or '-':6s} "
              f"{s['ttft_ms']:8.1f}  {s['tok_s']:8.1f}")
    total_tokens = sum(s["tokens"] for s in stats.values())
    q, h = counted["prefix_cache_queries"], counted["prefix_cache_hits"]
    print()
    print(f"{len(stats)} concurrent requests, {total_tokens} tokens in {wall:.2f} s "
          f"({total_tokens / wall:.1f} output tokens/s overall)")
    print(f"prefix cache: {h} of {q} queried prompt tokens were hits ({100 * h / max(q, 1):.0f}%)")
    print(f"KV blocks: {total_blocks} in all ({metrics.get('block_size')} tokens each), peak used {peak_blocks}, "
          f"cached now {metrics.get('num_cached_blocks')}")
    print(f"engine: {counted['num_steps']} steps, forward {counted['forward_time']:.2f} s, "
          f"IPC + scheduler overhead {metrics.get('step_ipc_overhead_us', 0):.0f} us/step, "
          f"{counted['num_preemptions']} preemptions")
    return metrics


def print_http_help(url: str) -> None:
    body = '{"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 64}'
    print()
    print(f"The same server speaks HTTP (an OpenAI-compatible API) at {url}:")
    print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'")
    print(f"  chat page:  {url}/")
    print(f"  metrics:    {url}/metrics")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    from .cli import HelpFormatter
    p = argparse.ArgumentParser(prog="python -m folio.demo", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", default=None, help="model (None: the server's default model)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="device of the server")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens per answer (answers stop at EOS)")
    p.add_argument("--address", default=None, help="use a running server instead of starting one")
    p.add_argument("--port", type=int, default=os.environ.get("FOLIO_PORT") or 8000,
                   help="HTTP port of the server started (default: $FOLIO_PORT, else 8000; taken: any free one); "
                        "make run PORT=N passes it")
    p.add_argument("--no-color", action="store_true", help="no ANSI colours")
    p.add_argument("--serve-arg", action="append", default=[], help=argparse.SUPPRESS)   # tests: extra flags
    a = p.parse_args(argv)
    from .ipc.client import ServerError
    try:
        return _main(a)
    except KeyboardInterrupt:
        print("\ninterrupted: the demo and its server stopped", file=sys.stderr, flush=True)
        return 0
    except ServerError as e:
        # Ctrl-C in a terminal reaches the server too (same process group): when it stops first,
        # the demo's streams end with its shutdown error before the demo sees the interrupt
        if e.code != "shutdown":
            raise
        print("\ninterrupted: the demo and its server stopped", file=sys.stderr, flush=True)
        return 0


def _main(a) -> int:
    from .cmd_serve import spawn_server, stop_server
    proc = None
    address, url = a.address, None
    try:
        if address is None:
            port = a.port if a.port and _port_free(a.port) else 0
            if a.port and not port:
                print(f"port {a.port} is taken: the HTTP process takes a free port instead", flush=True)
            flags = ["--device", a.device, "--port", str(port)] + (["--model", a.model] if a.model else [])
            print("starting folio serve (scheduler, worker and HTTP processes) ...", flush=True)
            t0 = time.monotonic()
            proc, address = spawn_server(flags + a.serve_arg, on_line=lambda line: print("  " + line, flush=True))
            url = proc.http_url
            print(f"server ready after {time.monotonic() - t0:.1f} s\n", flush=True)
        asyncio.run(run_demo(address, a.max_tokens, color=not a.no_color and sys.stdout.isatty()))
        if url:
            print_http_help(url)
            if sys.stdin.isatty():
                print("\nThe server keeps running: press Enter (or Ctrl-C) to stop it.", flush=True)
                try:
                    sys.stdin.readline()
                except KeyboardInterrupt:
                    pass
            else:
                print("(this demo stops its server now; `make serve` keeps one running)")
    finally:
        if proc is not None:
            code = stop_server(proc)
            print(f"server stopped (exit code {code})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
