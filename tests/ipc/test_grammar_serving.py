"""Constraints in ``folio serve``: compiled once, by the worker, while every other request and
stream goes on (issue 48: slow schemas held up the HTTP process's threads and froze the
scheduler's loop; grammars that admit no output were answered 200 with empty content).

The server runs the echo worker (``support.ipc_fake_runner.EchoRunner``: next id = last id + 1,
10 ms per step), which compiles constraints for real with the model's tokenizer. A "slow" schema
is one of a few thousand properties: llguidance takes about a second of CPU to compile it (and
the assertions below hold for any compile longer than a few steps; none of them measures time:
they count what happened while a compile ran).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from support.serve_helpers import API_KEY, ECHO, echo_env, idle_metrics

from folio.cmd_serve import spawn_server, stop_server
from folio.ipc.client import AsyncClient, Client, ServerError

SLOW_PROPERTIES = 3500


def slow_schema(tag: str) -> dict:
    return {"type": "object", "properties": {f"{tag}_{i}": {"type": "string"} for i in range(SLOW_PROPERTIES)}}


@pytest.fixture(scope="module")
def server():
    proc, addr = spawn_server(ECHO + ["--api-key", API_KEY, "--served-model-name", "echo", "smollm2-135m-instruct"],
                              env=echo_env(step_s=0.01), startup_timeout=180)
    yield proc, addr, proc.http_url
    assert stop_server(proc) == 0


def _headers():
    return {"Authorization": f"Bearer {API_KEY}"}


def test_a_slow_constraint_over_zeromq_freezes_no_stream_and_not_health(server):
    _, addr, _ = server

    async def run():
        events = []
        plain_tokens = 0
        c = AsyncClient(addr, timeout=120)
        try:
            async def plain():
                nonlocal plain_tokens
                async for d in c.generate_stream(prompt_token_ids=[5], sampling_params={"max_tokens": 3000}):
                    plain_tokens += len(d.token_ids)
                    if events and events[-1] == "slow answered":
                        return

            async def slow():
                events.append(("slow sent", plain_tokens))
                sp = {"max_tokens": 2, "structured_outputs": {"json": slow_schema("z")}}
                async for d in c.generate_stream(prompt_token_ids=[7], sampling_params=sp):
                    events.append(("slow answered", plain_tokens))
                    events.append("slow answered")
                    return

            async def health():
                while not events:
                    await asyncio.sleep(0.01)
                h = await c.health(timeout=30)
                events.append(("health", h["healthy"], plain_tokens))

            task = asyncio.ensure_future(plain())
            while plain_tokens < 5:          # the stream runs
                await asyncio.sleep(0.01)
            await asyncio.gather(slow(), health())
            await task
        finally:
            await c.close()
        return events

    events = asyncio.run(run())
    sent = next(e for e in events if e[0] == "slow sent")[1]
    answered = next(e for e in events if e[0] == "slow answered")[1]
    health = next(e for e in events if isinstance(e, tuple) and e[0] == "health")
    # the stream kept its pace while the worker compiled (a frozen loop lets 0-2 tokens through)
    assert answered - sent >= 10, events
    # /health's ZeroMQ call answered during the compile, healthy
    assert health[1] is True and events.index(health) < events.index(next(e for e in events if e[0] == "slow answered"))


def test_slow_constraints_over_http_hold_up_no_plain_request(server):
    _, addr, url = server
    body = {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def run():
        order = []
        async with httpx.AsyncClient(base_url=url, headers=_headers(), timeout=300) as h:
            async def slow(i):
                fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": slow_schema(f"s{i}")}}
                r = await h.post("/v1/chat/completions", json={**body, "response_format": fmt})
                order.append(("slow", r.status_code) if r.status_code == 200 else ("slow", r.status_code, r.text))

            tasks = [asyncio.ensure_future(slow(i)) for i in range(6)]    # six different schemas
            with Client(addr, timeout=60) as zc:       # until the engine holds all six
                deadline = asyncio.get_running_loop().time() + 60
                while zc.get_metrics().get("num_requests_in_flight", 0) < 6 and not order:
                    assert asyncio.get_running_loop().time() < deadline, "the six never reached the engine"
                    await asyncio.sleep(0.02)
            for _ in range(5):                           # plain chats, one after the other
                r = await h.post("/v1/chat/completions", json=body)
                order.append(("plain", r.status_code))
            await asyncio.gather(*tasks)
        return order

    order = asyncio.run(run())
    # the five plain chats were answered while all six constrained ones still waited for their
    # compiles (before: the six held the HTTP process's threads, and each compiled again in the
    # scheduler's loop, so no plain chat got through before the first of them)
    assert order[:5] == [("plain", 200)] * 5, order
    assert sorted(order[5:]) == [("slow", 200)] * 6, order


@pytest.mark.parametrize("field, constraint", [
    ("structured_outputs", {"grammar": "root ::= root"}),
    ("structured_outputs", {"json": {"$ref": "#"}}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "cycle", "schema": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}),
])
def test_a_constraint_that_admits_no_output_is_a_400(server, field, constraint):
    _, addr, url = server
    body = {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, field: constraint}
    for stream in (False, True):
        r = httpx.post(url + "/v1/chat/completions", json={**body, "stream": stream}, headers=_headers(), timeout=120)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and "admits no output" in err["message"] and err["message"].startswith(field)
    if field == "structured_outputs":     # over ZeroMQ too, and the server keeps serving
        with Client(addr, timeout=60) as zc:
            with pytest.raises(ServerError, match="admits no output") as e:
                zc.generate({"prompt_token_ids": [5]}, {"max_tokens": 4, "structured_outputs": constraint})
            assert e.value.code == "invalid_argument"
            assert zc.generate({"prompt_token_ids": [5]}, {"max_tokens": 3}).outputs[0].token_ids == [6, 7, 8]
            assert idle_metrics(zc)["num_free_blocks"] == idle_metrics(zc)["num_total_blocks"]


def test_sigterm_during_slow_compiles_stops_at_once_with_json_503s():
    import json
    import signal
    import threading
    import time

    from support.serve_helpers import pid_gone, poll_until
    proc, addr = spawn_server(ECHO + ["--api-key", API_KEY, "--served-model-name", "echo", "smollm2-135m-instruct"],
                              env=echo_env(step_s=0.01), startup_timeout=180)
    url = proc.http_url
    answers: dict = {}
    body = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}

    def slow(i):      # ~10 s of one core each to compile (9000 properties)
        schema = {"type": "object", "properties": {f"k{i}_{j}": {"type": "string"} for j in range(9000)}}
        r = httpx.post(url + "/v1/chat/completions", headers=_headers(), timeout=120,
                       json={**body, "max_tokens": 2, "structured_outputs": {"json": schema}})
        answers[f"slow{i}"] = (r.status_code, r.headers.get("content-type"), r.text)

    def stream():
        events = []
        with httpx.stream("POST", url + "/v1/chat/completions", headers=_headers(), timeout=120,
                          json={**body, "max_tokens": 3000, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        answers["stream"] = (r.status_code, events)

    try:
        with Client(addr, timeout=60) as zc:
            worker = zc.health()["worker_pid"]
            threads = [threading.Thread(target=slow, args=(i,)) for i in range(2)] + [threading.Thread(target=stream)]
            for t in threads:
                t.start()
            poll_until(lambda: zc.get_metrics()["num_requests_in_flight"] == 3 and
                       zc.get_metrics()["num_streamed_tokens"] > 5, 60, "two compiles and a stream under way")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # (a compile of the worker's is not waited for: the scheduler would kill the worker after 10 s)
        poll_until(lambda: proc.poll() is not None, 8, "folio serve to exit")
        print(f"folio serve exited {time.monotonic() - t0:.2f} s after SIGTERM, two compiles under way")
        assert proc.returncode == 0
        for t in threads:
            t.join(30)
        for i in range(2):
            status, ctype, text = answers[f"slow{i}"]
            assert status == 503 and ctype.startswith("application/json"), (status, ctype, text)
            assert "shutting down" in json.loads(text)["error"]["message"]
        status, events = answers["stream"]
        assert status == 200 and events[-1] == "[DONE]"
        assert "shutting down" in json.loads(events[-2])["error"]["message"]
        poll_until(lambda: pid_gone(worker), 10, "the worker to be gone")
    finally:
        stop_server(proc)
