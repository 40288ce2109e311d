"""The HTTP process over raw HTTP (httpx): request forms, SSE framing, every error code, 32 concurrent
streams, client disconnects, /metrics, /tokenize, /detokenize, /v1/models, /version, /health.

The server (``echo_http`` in conftest.py) runs the real scheduler, engine, tokenizer, IPC and HTTP
HTTP process with ``EchoRunner`` in the worker (next id = last id + 1), so every output has an
independently known value: ``echo_chain(last prompt id, n)``, and its text is the tokenizer's
decoding of those ids.
"""

import asyncio
import json
import os
import signal
import socket
import time

import httpx
import pytest
from support.serve_helpers import API_KEY
from prometheus_client.parser import text_string_to_metric_families
from support.serve_helpers import ECHO, echo_chain, echo_env, idle_metrics, poll_until

from folio.cmd_serve import spawn_server, stop_server
from folio.ipc.client import Client

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def http(echo_http):
    _, _, url = echo_http
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def zmq_client(echo_http):
    with Client(echo_http[1], timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from folio.model.tokenizer import Tokenizer
    return Tokenizer.from_pretrained(default_model_dir)


def sse_events(text: str) -> list:
    """Parse an SSE body strictly: every event is one ``data: ...`` line followed by a blank line."""
    assert text.endswith("\n\n"), text[-100:]
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events[:3]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-1]]


# -- request forms -------------------------------------------------------------------------------------

def test_completion_prompt_forms_n_and_echo(http, tokenizer):
    def texts(prompt, **kw):
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "ignore_eos": True, **kw})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion" and body["model"] == "echo"
        assert [c["index"] for c in body["choices"]] == list(range(len(body["choices"])))
        assert all(c["finish_reason"] == "length" for c in body["choices"])
        return [c["text"] for c in body["choices"]], body["usage"]

    want = lambda last: tokenizer.decode(echo_chain(last, 4))   # noqa: E731
    assert texts([1500, 1600]) == ([want(1600)], {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6,
                                                  "prompt_tokens_details": {"cached_tokens": 0}})
    # a list of token-id lists, n = 2: choice k is sample k % n of prompt k // n
    got, usage = texts([[1500], [1700, 1701]], n=2)
    assert got == [want(1500), want(1500), want(1701), want(1701)]
    assert usage["prompt_tokens"] == 3 and usage["completion_tokens"] == 16
    text = "The capital of France is"
    last = tokenizer.encode(text)[-1]
    assert texts(text) == ([want(last)], texts([text])[1])
    assert texts(["Hello", text])[0] == [want(tokenizer.encode("Hello")[-1]), want(last)]
    assert texts(text, echo=True)[0] == [text + want(last)]
    # max_completion_tokens names the chat limit; a chat answer is the echo of its templated prompt
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                "max_completion_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]))
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == tokenizer.decode(echo_chain(prompt_ids[-1], 3))
    assert choice["message"]["role"] == "assistant"
    assert r.json()["usage"]["prompt_tokens"] == len(prompt_ids)


def test_unknown_fields_are_ignored(http):
    r = http.post("/v1/completions", json={"prompt": [1000], "max_tokens": 2, "frobnicate": True,
                                           "stream_options": None, "user": "someone"})
    assert r.status_code == 200, r.text


def test_unknown_fields_are_logged(caplog):
    from folio.api.protocol import ChatCompletionRequest
    from folio.api.serving import log_unknown_fields
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x", "mood": 1}],
                                                "frobnicate": 2, "stream_options": {"include_usage": True, "x": 3}})
    with caplog.at_level("INFO", logger="folio.api"):
        log_unknown_fields(req, "/v1/chat/completions")
    assert "frobnicate" in caplog.text and "stream_options.x" in caplog.text and "messages[0].mood" in caplog.text


# -- streaming --------------------------------------------------------------------------------------------

def test_sse_streams_equal_the_whole_responses(http):
    body = {"prompt": [[1200], [1300]], "max_tokens": 5, "ignore_eos": True, "n": 2}
    whole = http.post("/v1/completions", json=body).json()
    r = http.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    *chunks, last = events
    assert last["choices"] == [] and last["usage"] == whole["usage"]      # the usage chunk, before [DONE]
    assert all(c["usage"] is None and len(c["choices"]) == 1 and c["id"] == last["id"] for c in chunks)
    texts, reasons = {}, {}
    for c in chunks:
        ch = c["choices"][0]
        texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
        if ch["finish_reason"]:
            reasons[ch["index"]] = ch["finish_reason"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert reasons == {k: "length" for k in range(4)}
    # without include_usage: no usage key and no usage chunk
    events = sse_events(http.post("/v1/completions", json={**body, "stream": True}).text)
    assert all("usage" not in e and e["choices"] for e in events)
    # chat: a role chunk first, then content, then the finish; same text as the whole answer
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "ignore_eos": True}
    whole = http.post("/v1/chat/completions", json=chat).json()
    events = sse_events(http.post("/v1/chat/completions", json={**chat, "stream": True}).text)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == \
        whole["choices"][0]["message"]["content"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_32_concurrent_streams(echo_http, tokenizer):
    _, _, url = echo_http
    # 100 steps of 10 ms: each stream lasts 1 s or more, so they overlap even where a loaded machine
    # spreads the 32 requests' arrival over most of a second
    TOKENS = 100

    async def one(http, i):
        t = []
        text, usage = "", None
        async with http.stream("POST", "/v1/completions", json={
                "prompt": [2000 + 10 * i], "max_tokens": TOKENS, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    for ch in event["choices"]:
                        text += ch["text"]
                        t.append(time.monotonic())
                    usage = event.get("usage") or usage
        return text, usage, t[0], t[-1]

    async def main():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120, limits=limits) as http:
            return await asyncio.gather(*[one(http, i) for i in range(32)])

    results = asyncio.run(main())
    for i, (text, usage, _, _) in enumerate(results):
        assert text == tokenizer.decode(echo_chain(2000 + 10 * i, TOKENS))
        assert usage["completion_tokens"] == TOKENS and usage["prompt_tokens"] == 1
    firsts, lasts = [r[2] for r in results], [r[3] for r in results]
    assert min(lasts) > min(firsts) and sum(f < min(lasts) for f in firsts) >= 2   # streams overlapped


# -- errors ------------------------------------------------------------------------------------------------

DEEP_SCHEMA = {"type": "string"}      # an array of arrays ... 500 deep
for _ in range(500):
    DEEP_SCHEMA = {"type": "array", "items": DEEP_SCHEMA}
# 4,000 properties, 490 KB: a grammar over llguidance's limit of 65,525 symbols
WIDE_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "array", "items": {
    "type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}} for i in range(4000)}}

BAD_REQUESTS = [   # (path, body, text the message must contain, param)
    ("/v1/completions", b"{not json", "not valid JSON", None),
    ("/v1/completions", {}, "prompt", "prompt"),
    ("/v1/completions", {"prompt": 3}, "prompt", "prompt"),
    ("/v1/completions", {"prompt": []}, "empty", "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p", "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n must be", "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop", "stop"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1}}, "logit_bias", "logit_bias"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, "echo", "echo"),
    ("/v1/completions", {"prompt": [[1], [-4]]}, "token ids", "prompt"),
    ("/v1/completions", {"prompt": [10 ** 6]}, "vocabulary", None),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 4095}, "4097 exceeds max_model_len (4096)", "max_tokens"),
    ("/v1/completions", {"prompt": [5], "max_tokens": 1000000},
     "prompt (1 token) + max_tokens (1000000) = 1000001 exceeds max_model_len (4096)", "max_tokens"),
    # provably too long from its length in characters (at most 81 per token for this tokenizer)
    ("/v1/completions", {"prompt": "x" * 400_000}, "prompt (at least", "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 257}, "stop takes at most 256 strings", "stop"),
    ("/v1/completions", {"prompt": "x", "stop": ["s" * 16385]}, "at most 16384 characters", "stop"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "stream", "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs must", "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "use_beam_search": True, "n": 2},
     "use_beam_search", "prompt_logprobs"),
    ("/v1/completions", {"prompt": [1] * 5000}, "max_model_len (4096)", "prompt"),
    ("/v1/completions", {"prompt": "", "max_tokens": 1}, "empty", None),
    ("/v1/chat/completions", {"messages": []}, "messages", "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "role", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "only text", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "logprobs", "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 1000},
     "top_logprobs must be an integer in [0, 20]", "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10 ** 6},
     "+ max_completion_tokens (1000000)", "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tool", "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True,
                              "max_tokens": 5000}, "max_model_len", None),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one", "prompt"),
    ("/detokenize", {"tokens": [-1]}, "vocabulary", "tokens"),
    # values JSON carries but the engine's wire (msgpack, int64 arrays, UTF-8) cannot: a 400, not a
    # request that never answers; lone surrogates written as JSON escapes (valid JSON, invalid text)
    ("/v1/completions", {"prompt": "x", "max_tokens": 2 ** 64}, "max_tokens (18446744073709551616)", "max_tokens"),
    ("/v1/completions", {"prompt": [2 ** 63]}, "64 bits", None),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [2 ** 64]}, "64 bits", None),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"]}', "Unicode", None),
    ("/v1/completions", b'{"prompt": "x", "cache_salt": "\\udcff"}', "Unicode", None),
    ("/v1/completions", b'{"prompt": "x \\ud83d"}', "Unicode", "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', "Unicode", "messages"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "Unicode", "prompt"),
    # a request's choices (prompts x n) run side by side: at most max_num_seqs (256), refused before
    # anything is built for them
    ("/v1/completions", {"prompt": ["a", "b"], "n": 200}, "2 prompts x n (200) = 400 choices exceed max_num_seqs (256)",
     "prompt"),
    ("/v1/completions", {"prompt": [[1]] * 300}, "300 choices exceed max_num_seqs (256)", "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 257},
     "n (257) exceeds max_num_seqs (256)", "n"),
    # nesting that recursive code (the JSON decoder, pydantic, dataclasses.asdict) would not survive
    ("/v1/completions", b'{"prompt": "x", "extra": ' + b"[" * 1000 + b"]" * 1000 + b"}", "nested too deeply", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"json": DEEP_SCHEMA}},
     "nested too deeply", None),
    # roles and tools are checked whatever the tool_choice
    ("/v1/chat/completions", {"messages": [{"role": "banana", "content": "x"}]}, "messages.0.role", "messages"),
    ("/tokenize", {"messages": [{"role": "banana", "content": "x"}]}, "messages.0.role", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools[0].function.parameters (f) is not a valid JSON schema: Invalid type: nonsense", "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}},
        {"type": "function", "function": {"name": "f"}}]}, "tools[2]: the function name 'f' is already used by tools[0]",
     "tools"),
    # llguidance's panic on a grammar over its symbol limit becomes one sentence (no <backtrace>)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                              "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": WIDE_SCHEMA}}},
     "response_format: the constraint is too large or too complex to compile", "response_format"),
    # JSON options of structured_outputs tune another JSON constraint; alone they constrain nothing
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "structured_outputs": {"disable_any_whitespace": True}}, "sets only disable_any_whitespace",
     "structured_outputs"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a+", "whitespace_pattern": " ?"}},
     "whitespace_pattern applies to json and json_object only", "structured_outputs"),
]


def _check_error(r, status):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]
    return err


@pytest.mark.parametrize("path,body,needle,param", BAD_REQUESTS,
                         ids=[f"{i}-{c[2][:20]}" for i, c in enumerate(BAD_REQUESTS)])
def test_invalid_input_is_a_400_in_openai_shape(http, path, body, needle, param):
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    err = _check_error(http.post(path, **kw), 400)
    assert needle in err["message"] and err["type"] == "invalid_request_error", err
    assert "backtrace" not in err["message"] and "panic" not in err["message"], err
    if param is not None:
        assert err["param"] == param


def test_401_404_405_and_the_server_keeps_serving(echo_http, http, zmq_client):
    _, _, url = echo_http
    idle = idle_metrics(zmq_client)["num_free_blocks"]
    ok = {"prompt": [1000], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(url + "/v1/completions", json=ok, headers=headers)
        assert _check_error(r, 401)["type"] == "authentication_error"
    assert _check_error(httpx.get(url + "/v1/models"), 401)
    for path in ("/health", "/version", "/"):          # open without a key
        assert httpx.get(url + path).status_code == 200, path
    assert _check_error(httpx.get(url + "/metrics"), 401)                 # unless --metrics-without-key
    assert httpx.get(url + "/metrics", headers=AUTH).status_code == 200
    err = _check_error(http.post("/v1/completions", json={**ok, "model": "gpt-4"}), 404)
    assert "gpt-4" in err["message"] and err["param"] == "model"
    _check_error(http.get("/v1/models/gpt-4"), 404)
    _check_error(http.get("/v1/completions"), 405)
    _check_error(http.get("/no/such/route"), 404)
    # every error above left the engine as it was: it serves, and no block is held
    assert http.post("/v1/completions", json={**ok, "model": "echo"}).status_code == 200
    assert http.post("/v1/completions", json={**ok, "model": "smollm2-135m-instruct"}).status_code == 200
    assert idle_metrics(zmq_client)["num_free_blocks"] == idle
    assert http.get("/health").status_code == 200


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out + [g for c in out for g in _children(c)]


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")


def _peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) * 1024


def test_a_huge_n_is_refused_before_the_http_process_builds_anything(echo_http, http):
    # the 80-byte request of issue 48: 4 prompts x a million samples. Refused from the numbers alone,
    # the HTTP process's peak memory does not move; built first (4 million choices), it grew by 1.4 GB
    http_pid = next(p for p in _children(echo_http[0].pid) if "folio.api.http_process" in _cmdline(p))
    before = _peak_rss_bytes(http_pid)
    err = _check_error(http.post("/v1/completions", json={"prompt": ["hi", "hi", "hi", "hi"], "max_tokens": 4,
                                                          "n": 1000000}), 400)
    assert err["param"] == "n" and "n (1000000) exceeds max_num_seqs (256)" in err["message"]
    assert _peak_rss_bytes(http_pid) - before < 50 << 20
    assert http.post("/v1/completions", json={"prompt": ["hi"] * 4, "max_tokens": 4, "n": 64}).status_code == 200


def test_cross_site_requests_and_foreign_hosts_are_refused(echo_http, http):
    url = echo_http[2]
    port = url.rsplit(":", 1)[1]
    ok = {"prompt": [1000], "max_tokens": 2}
    # what a web page on another site can send without a preflight: a text/plain (form) POST
    err = _check_error(http.post("/v1/completions", content=json.dumps(ok), headers={"Content-Type": "text/plain"}), 415)
    assert "application/json" in err["message"]
    # and whatever it sends, it sends with its Origin
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("OPTIONS", "/v1/completions")):
        r = http.request(method, path, json=ok if method == "POST" else None,
                         headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert _check_error(r, 403)["type"] == "permission_error" and "access-control-allow-origin" not in r.headers
    # the server's own page (its origin: http:// + the Host it was reached by) is served
    assert http.post("/v1/completions", json=ok, headers={"Origin": url}).status_code == 200
    # DNS rebinding: a name other than loopback's reached this loopback server
    err = _check_error(http.post("/v1/completions", json=ok, headers={"Host": f"evil.example:{port}"}), 403)
    assert "evil.example" in err["message"]
    for host in (f"localhost:{port}", f"[::1]:{port}", "127.0.0.2", f"app.localhost:{port}"):
        assert http.post("/v1/completions", json=ok, headers={"Host": host}).status_code == 200, host
    # JSON types other than application/json itself, and a body without a type (as FastAPI reads it)
    for ctype in ("application/json; charset=utf-8", "application/vnd.api+json", None):
        r = http.post("/v1/completions", content=json.dumps(ok), headers={"Content-Type": ctype} if ctype else {})
        assert r.status_code == 200, (ctype, r.text)


def test_json_options_tune_response_format_and_tool_constraints(http):
    ask = [{"role": "user", "content": "x"}]
    for extra in ({"response_format": {"type": "json_object"}},
                  {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}},
                  {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}):
        for options in ({"disable_any_whitespace": True}, {"whitespace_pattern": "[ ]?"}):
            r = http.post("/v1/chat/completions", json={"messages": ask, "max_tokens": 2, **extra,
                                                        "structured_outputs": options})
            assert r.status_code == 200, (extra, options, r.text)
    err = _check_error(http.post("/v1/chat/completions", json={
        "messages": ask, "response_format": {"type": "json_object"}, "structured_outputs": {"whitespace_pattern": "(["}}),
        400)
    assert err["param"] == "response_format" and "regex" in err["message"]


def test_503_when_the_engine_is_gone():
    proc, addr = spawn_server(ECHO + ["--exit-grace", "60"], env=echo_env(step_s=0.02), startup_timeout=180)
    try:
        url = proc.http_url
        with Client(addr, timeout=30) as c:
            worker = c.health()["worker_pid"]
        assert httpx.get(url + "/health").status_code == 200
        stream = httpx.Client(base_url=url, timeout=60)
        with stream.stream("POST", "/v1/completions", json={"prompt": [5], "max_tokens": 3000, "ignore_eos": True,
                                                            "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            os.kill(worker, signal.SIGKILL)
            rest = [line for line in lines if line]
        # the stream ends with an error event, then [DONE]
        assert rest[-1] == "data: [DONE]"
        err = json.loads(rest[-2][6:])["error"]
        assert err["code"] == 503 and "worker" in err["message"]
        assert "while step" in err["message"] and "idle" not in err["message"], err   # it died mid-step
        poll_until(lambda: httpx.get(url + "/health").status_code == 503, 30, "/health to report 503")
        _check_error(httpx.get(url + "/health"), 503)
        err = _check_error(httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 503)
        assert "worker" in err["message"]
    finally:
        stop_server(proc)


# -- disconnects -------------------------------------------------------------------------------------------

def _raw_post(url: str, path: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=60)
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
              f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


@pytest.mark.parametrize("stream,beam", [(True, False), (False, False), (False, True), (True, True)])
def test_client_disconnect_aborts_and_frees_the_blocks(echo_http, zmq_client, stream, beam):
    _, _, url = echo_http
    idle = idle_metrics(zmq_client)
    before = idle["serving"]["request_success"].get("abort", 0)
    # a beam search answers (streamed or not) only when it ends: the client leaves while it runs
    s = _raw_post(url, "/v1/completions", {"prompt": [300, 301], "max_tokens": 3000, "ignore_eos": True,
                                           "stream": stream, "use_beam_search": beam, "n": 2 if beam else 1})
    if beam:
        poll_until(lambda: zmq_client.get_metrics()["num_running"] == 2, 30, "the beams to run")
    elif stream:
        got = b""
        while got.count(b"data: {") < 3:         # the stream is running
            got += s.recv(65536)
    else:
        poll_until(lambda: zmq_client.get_metrics()["num_running"] == 1, 30, "the request to run")
    s.close()                                    # the client goes away mid-answer
    m = poll_until(lambda: (lambda m: m if m["num_free_blocks"] == idle["num_free_blocks"]
                            and m["num_running"] == 0 else None)(zmq_client.get_metrics()), 30,
                   "the blocks to be free again")
    assert m["serving"]["request_success"]["abort"] == before + 1
    assert m["serving"]["generation_tokens"] - idle["serving"]["generation_tokens"] < 3000


# -- metrics, tokenizer, models, version -----------------------------------------------------------------

def _scrape(http) -> dict:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def test_prometheus_metrics(http, zmq_client):
    from folio.api.metrics import METRIC_NAMES
    idle_metrics(zmq_client)
    before = _scrape(http)
    for name in METRIC_NAMES:
        assert any(k[0].startswith("folio:" + name) for k in before), name
    for i in range(3):
        assert http.post("/v1/completions", json={"prompt": [700 + i, 800], "max_tokens": 5,
                                                  "ignore_eos": True}).status_code == 200
    # a 33-token prompt twice: the second finds its first two 16-token blocks cached (the last
    # prompt token is always computed)
    for _ in range(2):
        assert http.post("/v1/completions", json={"prompt": list(range(900, 933)), "max_tokens": 1,
                                                  "ignore_eos": True}).status_code == 200
    idle = idle_metrics(zmq_client)
    after = _scrape(http)

    def delta(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert idle["block_size"] == 16
    assert delta("folio:generation_tokens_total") == 15 + 2
    assert delta("folio:prompt_tokens_total") == 6 + 66
    assert delta("folio:prefix_cache_queries_total") == 6 + 66 and delta("folio:prefix_cache_hits_total") == 32
    assert delta("folio:num_preemptions_total") == 0                   # 512 blocks: room for all
    assert delta("folio:request_success_total", (("finished_reason", "length"),)) == 5
    assert delta("folio:time_to_first_token_seconds_count") == 5
    assert delta("folio:e2e_request_latency_seconds_count") == 5
    assert delta("folio:request_queue_time_seconds_count") == 5
    assert delta("folio:inter_token_latency_seconds_count") == 12      # 4 gaps per 5-token request
    assert delta("folio:iteration_tokens_total_sum") >= 6 + 12 + 33 + 1  # every token computed
    # idle: nothing running or waiting, every block free (cached blocks count as free)
    assert after[("folio:num_requests_running", ())] == 0 and after[("folio:num_requests_waiting", ())] == 0
    assert after[("folio:kv_cache_usage_perc", ())] == 0.0
    buckets = sorted(((float(dict(k[1])["le"]), v) for k, v in after.items()
                      if k[0] == "folio:time_to_first_token_seconds_bucket"))
    assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:]))     # cumulative
    assert buckets[-1][1] == after[("folio:time_to_first_token_seconds_count", ())]


def test_prometheus_metrics_while_busy():
    # room for 2 running sequences and 8 KV blocks of 16 tokens; three requests of 1 + 120 tokens
    # (8 blocks each at most): the third waits, and the two running ones fill the 8 blocks at 64
    # tokens each, so the newest is preempted (recompute); the metrics say so, then it is idle
    import threading
    proc, addr = spawn_server(ECHO + ["--max-num-seqs", "2"], env=echo_env(step_s=0.05, num_blocks=8),
                              startup_timeout=180)
    try:
        with Client(addr, timeout=60) as c, httpx.Client(base_url=proc.http_url, timeout=60) as http:
            sp = {"max_tokens": 120, "ignore_eos": True, "temperature": 0.0}
            streams = [c.generate_stream(prompt_token_ids=[10 + i], sampling_params=sp, request_id=f"busy-{i}")
                       for i in range(3)]
            for s in streams[:2]:
                next(s)
            third = threading.Thread(target=lambda: list(streams[2]))     # sent now, runs to its end
            third.start()

            def scrape_when(want):
                m = _scrape(http)
                got = {k: m[("folio:" + k, ())] for k in want}
                return got if all(want[k](v) for k, v in got.items()) else None
            # 64 steps of 50 ms before the cache is full: time to see the queue
            poll_until(lambda: scrape_when({"num_requests_running": lambda v: v == 2,
                                            "num_requests_waiting": lambda v: v == 1,
                                            "kv_cache_usage_perc": lambda v: 0 < v <= 1}), 30, "2 running, 1 waiting")
            poll_until(lambda: scrape_when({"num_preemptions_total": lambda v: v >= 1}), 60, "a preemption")
            for s in streams[:2]:
                s.close()                          # aborts
            c.abort("busy-2")
            third.join(60)
            idle_metrics(c)
            m = _scrape(http)
            assert m[("folio:num_requests_running", ())] == m[("folio:num_requests_waiting", ())] == 0
            assert m[("folio:kv_cache_usage_perc", ())] == 0.0
            assert m[("folio:num_preemptions_total", ())] == c.get_metrics()["num_preemptions"] >= 1
    finally:
        stop_server(proc)


def test_a_fresh_server_key_file_open_metrics_allowed_origins_and_the_models_own_name(tmp_path, default_model_dir):
    # the model given as its folder; the key in a file (in no process's command line); /metrics
    # left open for a scraper; one other web origin allowed
    key = "sk-folio-from-a-file"
    (tmp_path / "key").write_text(key + "\n")
    app = "http://app.example:3000"
    proc, addr = spawn_server(ECHO + ["--model", str(default_model_dir), "--api-key-file", str(tmp_path / "key"),
                                      "--metrics-without-key", "--allowed-origins", app], env=echo_env(), startup_timeout=180)
    try:
        url = proc.http_url
        for pid in [proc.pid, *_children(proc.pid)]:
            assert key not in _cmdline(pid), _cmdline(pid)
        with Client(addr, timeout=60) as c:
            steps = c.get_metrics()["num_steps"]
        metrics = _scrape(httpx.Client(base_url=url, timeout=60))          # no key
        # the warm-up ran (its kernels are compiled) but is not counted: a fresh server counts from zero
        assert steps == 0
        assert metrics[("folio:prefix_cache_queries_total", ())] == 0
        assert metrics[("folio:prompt_tokens_total", ())] == 0
        assert _check_error(httpx.get(url + "/v1/models"), 401)
        auth = {"Authorization": f"Bearer {key}"}
        models = httpx.get(url + "/v1/models", headers=auth).json()
        assert [m["id"] for m in models["data"]] == [str(default_model_dir), "smollm2-135m-instruct"]
        for name in ("smollm2-135m-instruct", str(default_model_dir)):
            r = httpx.post(url + "/v1/completions", headers=auth, json={"model": name, "prompt": [1000], "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == str(default_model_dir), r.text
        # the allowed origin: preflight answered, CORS headers on the answer; another origin: 403
        pre = httpx.options(url + "/v1/completions", headers={"Origin": app, "Access-Control-Request-Method": "POST",
                                                             "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == app
        r = httpx.post(url + "/v1/completions", headers={**auth, "Origin": app}, json={"prompt": [1000], "max_tokens": 2})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == app
        r = httpx.post(url + "/v1/completions", headers={**auth, "Origin": "http://app.example:3001"},
                       json={"prompt": [1000], "max_tokens": 2})
        assert _check_error(r, 403)
    finally:
        stop_server(proc)


def test_tokenize_detokenize_models_version(http, golden):
    case = golden["tokenizer_cases"][0]
    r = http.post("/tokenize", json={"prompt": case["text"], "return_token_strs": True}).json()
    assert r["tokens"] == case["ids"] and r["count"] == len(case["ids"]) and r["max_model_len"] == 4096
    assert len(r["token_strs"]) == len(case["ids"])
    assert http.post("/detokenize", json={"tokens": case["ids"]}).json() == {"prompt": case["text"]}
    chat = next(c for c in golden["greedy_cases"] if c["chat_messages"])
    r = http.post("/tokenize", json={"messages": chat["chat_messages"]}).json()
    assert r["tokens"] == chat["prompt_ids"]
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["echo", "smollm2-135m-instruct"]
    assert models["data"][0]["max_model_len"] == 4096 and models["data"][0]["owned_by"] == "folio"
    assert http.get("/v1/models/echo").json()["id"] == "echo"
    import folio
    assert http.get("/version").json() == {"version": folio.__version__}
    assert http.get("/health").status_code == 200


# -- prompt logprobs -----------------------------------------------------------------------------------------

def test_prompt_logprobs_in_vllms_shape(http, tokenizer):
    from support.ipc_fake_runner import echo_logprobs
    prompt = [100, 200, 300]
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    expected = [None]
    for pos in (1, 2):       # EchoRunner: the prompt token at -3.0, rank 7; candidates after the token before
        ids, lps = echo_logprobs([prompt[pos - 1]], 2)
        # the same float32 values, as Python floats through JSON (exact: the shortest round trip)
        entry = {str(t): {"logprob": float(lp), "rank": j} for j, (t, lp) in
                 enumerate(zip(ids[0, 1:].tolist(), lps[0, 1:].tolist()), 1)}
        entry[str(prompt[pos])] = {"logprob": -3.0, "rank": 7}
        for t, e in entry.items():
            e["decoded_token"] = tokenizer.decode([int(t)], skip_special_tokens=False)
        expected.append(entry)
    assert got == expected
    assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()["choices"][0][
        "prompt_logprobs"] is None
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                                   "prompt_logprobs": 0}).json()
    lps = chat["prompt_logprobs"]     # as vLLM: on the response, not on a choice
    assert lps[0] is None and len(lps) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 and list(e.values())[0]["rank"] == 7 for e in lps[1:])


# -- the door under big requests ------------------------------------------------------------------------

def _send_head(url: str, headers: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=60)
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
              f"Authorization: Bearer {API_KEY}\r\n{headers}\r\n".encode())
    return s


def _read_response(s: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
            [h for h in data.split(b"\r\n") if h.lower().startswith(b"content-length:")][0].split(b":")[1]):
        chunk = s.recv(65536)
        assert chunk, data
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), json.loads(body)


def test_a_20_mb_body_is_refused_by_its_content_length_before_it_is_sent(echo_http):
    s = _send_head(echo_http[2], f"Content-Length: {20 * 10 ** 6}\r\n")
    try:
        s.sendall(b'{"prompt": "' + b"x" * 1000)      # the rest of the 20 MB is never sent
        status, body = _read_response(s)
    finally:
        s.close()
    assert status == 413 and body["error"]["code"] == 413 and "--max-request-bytes" in body["error"]["message"]


def test_a_chunked_body_is_refused_once_it_passes_the_limit(echo_http):
    limit = 1 << 20        # the default for max_model_len 4096: max(1 MiB, 64 bytes x 4096)
    s = _send_head(echo_http[2], "Transfer-Encoding: chunked\r\n")
    try:
        chunk = b"x" * 65536
        s.sendall(b'c\r\n{"prompt": "\r\n')
        for _ in range(limit // len(chunk) + 1):      # past the limit, and no final chunk
            s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        status, body = _read_response(s)
    finally:
        s.close()
    assert status == 413 and "over this server's limit of 1048576 bytes" in body["error"]["message"]


def test_health_answers_while_a_large_body_is_tokenized(echo_http, tokenizer):
    # the HTTP process in this process, on the running scheduler, with a tokenizer that holds a long
    # text until /health has answered: were tokenization on the event loop, /health would wait
    import threading

    from folio.api.app import build_app
    from folio.api.serving import OpenAIServing
    entered, release = threading.Event(), threading.Event()

    class HeldTokenizer:
        def encode(self, text, add_special_tokens=False):
            if len(text) > 100_000:
                entered.set()
                release.wait(60)
            return tokenizer.encode(text, add_special_tokens)

        def __getattr__(self, name):
            return getattr(tokenizer, name)

    front = OpenAIServing(scheduler_address=echo_http[1], tokenizer=HeldTokenizer(), served_model_names=["echo"],
                     model_root="echo", max_model_len=4096, kv_capacity_tokens=8192, max_request_bytes=1 << 20)
    app = build_app(front)

    async def main():
        await front.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://front") as c:
                # 300,000 characters: under the character bound (81 x 4096), so it is tokenized
                big = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "hello " * 50_000}))
                while not entered.is_set():
                    assert not big.done(), big.result().text
                    await asyncio.sleep(0.01)
                health = await c.get("/health")
                assert health.status_code == 200 and not big.done()
                release.set()
                r = await big
                assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"   # 50,000 tokens
        finally:
            release.set()
            await front.close()

    asyncio.run(main())
