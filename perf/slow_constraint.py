"""What a slow-compiling JSON schema does to the other clients of ``folio serve``.

A server with the echo worker (``tests/support/ipc_fake_runner.EchoRunner``: the real scheduler,
HTTP process, IPC and grammar compiles; next id = last id + 1 at ``--step-s`` per step). One
stream decodes over ZeroMQ; then a request with a ``--properties``-property schema is sent, over
ZeroMQ and then over HTTP (``response_format``), each while ``/health`` is polled and a plain
chat is sent over HTTP. Printed per door: the compile's time (until its request's first token or
error), the stream's longest gap between tokens during it, ``/health``'s slowest answer, and the
plain chat's latency.

    python perf/slow_constraint.py [--properties 9000] [--step-s 0.01]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "perf"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from engine_overhead import cpu_model  # noqa: E402


async def probe(addr: str, url: str, key: str, door: str, schema: dict) -> dict:
    import httpx

    from folio.ipc.client import AsyncClient
    headers = {"Authorization": f"Bearer {key}"}
    c = AsyncClient(addr, timeout=600)
    stamps: list[float] = []
    done = asyncio.Event()

    async def stream():
        async for d in c.generate_stream(prompt_token_ids=[5], sampling_params={"max_tokens": 4000}):
            stamps.append(time.perf_counter())
            if done.is_set():
                return

    async def constrained(h):
        t0 = time.perf_counter()
        if door == "zmq":
            try:
                async for _ in c.generate_stream(prompt_token_ids=[7], sampling_params={
                        "max_tokens": 2, "structured_outputs": {"json": schema}}):
                    break
                status = "ok"
            except Exception as e:  # noqa: BLE001 - reported
                status = f"error: {str(e)[:60]}"
        else:
            fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
            r = await h.post("/v1/chat/completions", json={"model": "echo", "max_tokens": 2, "response_format": fmt,
                                                           "messages": [{"role": "user", "content": "hi"}]})
            status = str(r.status_code)
        return t0, time.perf_counter(), status

    async def health(h, out):
        while not done.is_set():
            t = time.perf_counter()
            r = await h.get("/health")
            out.append((time.perf_counter() - t, r.status_code))
            await asyncio.sleep(0.05)

    async def plain(h):
        await asyncio.sleep(0.5)
        t = time.perf_counter()
        r = await h.post("/v1/chat/completions", json={"model": "echo", "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "hi"}]})
        return time.perf_counter() - t, r.status_code

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as h:
        s = asyncio.ensure_future(stream())
        while len(stamps) < 5:
            await asyncio.sleep(0.01)
        healths: list = []
        hp = asyncio.ensure_future(health(h, healths))
        pl = asyncio.ensure_future(plain(h))
        t0, t1, status = await constrained(h)
        done.set()
        await asyncio.gather(hp, s)
        plain_s, plain_status = await pl
    await c.close()
    gaps = [b - a for a, b in zip(stamps, stamps[1:]) if b > t0 and a < t1]
    return {"compile s": t1 - t0, "status": status, "stream max gap s": max(gaps) if gaps else float("nan"),
            "health max s": max(t for t, _ in healths), "health statuses": sorted({s for _, s in healths}),
            "plain chat s": plain_s, "plain status": plain_status}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--properties", type=int, default=9000)
    p.add_argument("--step-s", type=float, default=0.01)
    a = p.parse_args(argv)
    from folio.cmd_serve import spawn_server, stop_server
    from support.serve_helpers import ECHO, echo_env
    key = "sk-probe"
    proc, addr = spawn_server(ECHO[:-2] + ["--max-message-bytes", str(8 << 20), "--max-request-bytes", str(8 << 20),
                                           "--api-key", key, "--served-model-name", "echo", "smollm2-135m-instruct"],
                              env=echo_env(step_s=a.step_s), startup_timeout=300)
    print(f"# {cpu_model()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; echo worker, "
          f"{a.step_s * 1e3:g} ms steps; a {a.properties}-property schema")
    try:
        for door in ("zmq", "http"):
            schema = {"type": "object", "properties": {f"{door}{i}": {"type": "string"} for i in range(a.properties)}}
            r = asyncio.run(probe(addr, proc.http_url, key, door, schema))
            print(door, " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()),
                  flush=True)
    finally:
        stop_server(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
