"""Client library for ``folio serve``: ``Client`` (blocking, thread-safe) and ``AsyncClient`` (asyncio).

``AsyncClient`` speaks the messages of ``ipc.messages`` over a DEALER socket to the server's ROUTER
and can run many requests at once: replies are routed by request id to per-request queues.
``Client`` runs an ``AsyncClient`` on an event loop of its own (one thread) and waits for it, so
the two have one implementation.

    with folio.Client("tcp://127.0.0.1:5555") as c:
        out = c.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=16))
        for d in c.generate_stream("Hello", {"max_tokens": 32}):
            print(d.text, end="", flush=True)

``generate_stream`` yields ``StreamDelta`` objects (new token ids, new text; ``finish_reason`` set
on a sample's last delta). Leaving a stream early (``break``, an exception, ``close()``, or the
asyncio task being cancelled) sends ``abort`` so the server frees the request's blocks. Errors the
server reports arrive as ``ServerError`` (its message and code); no message for ``timeout``
seconds raises ``ClientTimeoutError``.

Prompts take every form ``folio.LLM.generate`` takes: a string, a dict ``{"prompt": str}`` or
``{"prompt_token_ids": [...]}`` (either with ``"cache_salt"``), or a list of these (``generate``
then returns one ``RequestOutput`` per prompt, in order, running them concurrently).

A client checks at construction that a ZeroMQ peer answers at ``address`` (``connect_timeout``
seconds, a handshake, not a request) and raises ``ConnectionError`` with the address otherwise,
instead of waiting out the request timeout.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator

import numpy as np
import zmq
import zmq.asyncio

from ..runtime.common.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ..runtime.inputs.input_processor import PROMPT_KEYS, InputError, parse_prompt
from . import messages as M
from .transport import DEFAULT_ADDRESS, make_socket, wait_for_server

DEFAULT_CONNECT_TIMEOUT = 5.0   # seconds a client waits at construction for the server's handshake


class ServerError(RuntimeError):
    """An error reply from the server.

    Attributes:
        message: the server's text; code: its category (bad_request, invalid_argument,
        worker_died, engine_error, shutdown, internal); request_id: the request it concerns.
    """

    def __init__(self, message: str, code: str = "error", request_id: str | None = None):
        super().__init__(f"[{code}] {message}")
        self.message, self.code, self.request_id = message, code, request_id


class ClientTimeoutError(TimeoutError):
    """No reply from the server within the client's timeout."""


@dataclass
class StreamDelta:
    """What one streamed message adds to one sample.

    Attributes:
        request_id: the request; index: the sample (0..n-1).
        token_ids: token ids new since the previous delta; text: text new since the previous delta.
        finish_reason: ``None`` until the sample's last delta ("stop", "length" or "abort").
        stop_reason: the stop string / token that ended it, if any.
        finished: the whole request is finished (set on the last delta of the request).
        num_cached_tokens: prompt tokens served from the prefix cache.
        num_prompt_tokens: the prompt's length in tokens.
        time: ``time.monotonic()`` at which the client received it.
        logprobs: per new token ``{token_id: Logprob}`` when logprobs were requested.
        prompt_logprobs: with the request's first delta, when prompt_logprobs were requested:
            ``None`` for the first prompt token, then ``{token_id: Logprob}`` per prompt token.
    """

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    finished: bool = False
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0
    time: float = 0.0
    logprobs: list | None = None
    prompt_logprobs: list | None = None


def _sampling_dict(sampling_params) -> dict:
    from ..runtime.common.sampling_params import SamplingParams
    if sampling_params is None:
        return SamplingParams().to_dict()
    if isinstance(sampling_params, dict):
        return dict(sampling_params)
    return sampling_params.to_dict()


def _split_prompt(prompt, prompt_token_ids, cache_salt):
    """``(text, token_ids, cache_salt)`` of one prompt given as ``LLM.generate`` takes it (a string or a
    ``{"prompt" | "prompt_token_ids", "cache_salt"}`` dict, ``InputProcessor``'s ``parse_prompt``) or as
    the ``prompt_token_ids`` keyword; a dict with both sends the ids (as ``LLM.chat`` builds them).

    Raises:
        ValueError: unknown dict keys, a non-string / non-dict prompt, or not exactly one of text and ids.
    """
    text, ids, cache_salt = parse_prompt(prompt, prompt_token_ids, cache_salt)
    if text is not None and ids is not None:
        if not isinstance(prompt, dict):
            raise InputError("give exactly one of prompt and prompt_token_ids", "prompt")
        text = None          # both given (as LLM.chat builds them): the ids are what runs
    return text, ids, cache_salt


def _request_frames(request_id: str, prompt, prompt_token_ids, sampling_params, cache_salt, messages=None) -> list:
    sp = _sampling_dict(sampling_params)
    if messages is not None:
        return M.encode("chat", request_id=request_id, messages=list(messages), sampling=sp, cache_salt=cache_salt)
    prompt, prompt_token_ids, cache_salt = _split_prompt(prompt, prompt_token_ids, cache_salt)
    ids = None if prompt_token_ids is None else np.asarray(prompt_token_ids, dtype=np.int64)
    return M.encode("generate", request_id=request_id, prompt=prompt, prompt_token_ids=ids, sampling=sp,
                    cache_salt=cache_salt)


def _per_prompt(prompts, sampling_params, request_id) -> list:
    """``[(prompt, sampling_params)]`` for a list of prompts (one ``SamplingParams`` / dict for all, or
    a list with one per prompt), as ``LLM.generate`` pairs them. Raises ``ValueError`` on a length mismatch."""
    prompts = list(prompts)
    if not prompts:
        raise ValueError("the list of prompts is empty")
    if request_id is not None:
        raise ValueError("request_id names one request; leave it out for a list of prompts")
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling_params for {len(prompts)} prompts")
        return list(zip(prompts, sampling_params))
    return [(p, sampling_params) for p in prompts]


class _Accumulator:
    """Builds the cumulative ``RequestOutput`` of one request from its messages."""

    def __init__(self, request_id: str):
        self.out = RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[], outputs=[], finished=False)
        self.by_index: dict[int, CompletionOutput] = {}

    def add(self, f: dict) -> list[StreamDelta]:
        now = time.monotonic()
        if f.get("prompt_token_ids") is not None:
            self.out.prompt_token_ids = f["prompt_token_ids"].tolist()
            self.out.prompt = f.get("prompt")
        if f.get("num_cached_tokens") is not None:
            self.out.num_cached_tokens = f["num_cached_tokens"]
        if f.get("metrics"):
            self.out.metrics = RequestMetrics(**f["metrics"])
        if f.get("prompt_logprobs") is not None:
            self.out.prompt_logprobs = [None if pos is None else _logprobs_of(pos) for pos in f["prompt_logprobs"]]
        deltas = []
        for o in f["outputs"]:
            idx = int(o.get("index", 0))
            c = self.by_index.get(idx)
            if c is None:
                c = self.by_index[idx] = CompletionOutput(index=idx, text="", token_ids=[])
                self.out.outputs = [self.by_index[k] for k in sorted(self.by_index)]
            ids = o["token_ids"].tolist()
            c.token_ids.extend(ids)
            c.text += o.get("text", "")
            if o.get("finish_reason") is not None:
                c.finish_reason, c.stop_reason = o["finish_reason"], o.get("stop_reason")
            lps = None
            if o.get("logprobs") is not None:
                lps = [_logprobs_of(pos) for pos in o["logprobs"]]
                c.logprobs = (c.logprobs or []) + lps
            if o.get("cumulative_logprob") is not None:
                c.cumulative_logprob = o["cumulative_logprob"]
            deltas.append(StreamDelta(self.out.request_id, idx, ids, o.get("text", ""), o.get("finish_reason"),
                                      o.get("stop_reason"), False, self.out.num_cached_tokens,
                                      len(self.out.prompt_token_ids), now, lps))
        if f.get("prompt_logprobs") is not None and deltas:
            deltas[0].prompt_logprobs = self.out.prompt_logprobs
        self.out.finished = bool(f["finished"])
        if self.out.finished and deltas:
            deltas[-1].finished = True
        return deltas


def _logprobs_of(pos: list) -> dict:
    return {int(t): Logprob(lp, rank, tok) for t, lp, rank, tok in pos}


def _raise_error(f: dict):
    raise ServerError(f["message"], f["code"], f.get("request_id"))


class _BeamSearches:
    """The ``beam_search`` messages of one client call, one per prompt, and their results. Prompts
    as ``LLM.beam_search`` takes them: a string, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``
    (each optionally with ``"cache_salt"``), or a list of these.

    Raises:
        ValueError: a bad prompt or parameter (nothing is sent then).
    """

    def __init__(self, prompts, params):
        from ..runtime.common.sampling_params import BeamSearchParams
        if isinstance(params, dict):
            params = BeamSearchParams.from_dict(params)
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams or a dict of its fields, got {type(params).__name__}")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        self.requests: list[tuple[str, list]] = []
        for p in prompts:
            if isinstance(p, str):
                p = {"prompt": p}
            if not isinstance(p, dict) or set(p) - PROMPT_KEYS:
                raise ValueError(f"a prompt is a string or a dict with prompt / prompt_token_ids / cache_salt, got {p!r}")
            if ("prompt" in p) == ("prompt_token_ids" in p):
                raise ValueError("give exactly one of prompt and prompt_token_ids")
            ids = p.get("prompt_token_ids")
            rid = uuid.uuid4().hex
            self.requests.append((rid, M.encode(
                "beam_search", request_id=rid, prompt=p.get("prompt"),
                prompt_token_ids=None if ids is None else np.asarray(ids, dtype=np.int64), params=params.to_dict(),
                cache_salt=p.get("cache_salt"))))
        self.accs = [_Accumulator(rid) for rid, _ in self.requests]

    @staticmethod
    def add(acc: "_Accumulator", msg_type: str, f: dict) -> None:
        if msg_type == "error":
            _raise_error(f)
        acc.add(f)

    def unfinished(self, num_sent: int) -> list[tuple[str, bool]]:
        """``(request id, finished)`` of the first ``num_sent`` requests (to release / abort)."""
        return [(rid, acc.out.finished) for (rid, _), acc in zip(self.requests[:num_sent], self.accs)]

    def results(self) -> list:
        from ..runtime.scheduler.beam_search import BeamSearchOutput
        return [BeamSearchOutput.from_request_output(acc.out) for acc in self.accs]


# ---------------------------------------------------------------------------------------------
# asyncio client: the core
# ---------------------------------------------------------------------------------------------

class AsyncClient:
    """asyncio client (one event loop); use as ``async with AsyncClient(addr) as c:``. ``Client``
    runs this one on a loop of its own, so both have the same methods and semantics.

    ``generate_stream`` is an async generator. Cancelling the task that iterates a stream, or
    leaving the loop early, sends ``abort`` to the server.

    Args:
        address: the server's address (``tcp://127.0.0.1:5555`` by default).
        timeout: seconds to wait for each reply / next streamed message (``None`` = forever).
        connect_timeout: seconds to wait at construction for a ZeroMQ handshake with the server
            (``None``: no check; requests then wait up to ``timeout``); it blocks the calling thread.
    Raises:
        ConnectionError: nothing at ``address`` answered within ``connect_timeout``.
    """

    def __init__(self, address: str = DEFAULT_ADDRESS, timeout: float | None = 120.0,
                 max_message_bytes: int = M.DEFAULT_MAX_MESSAGE_BYTES,
                 connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT):
        self.address = address
        self.timeout = timeout
        self.max_message_bytes = max_message_bytes
        if connect_timeout is not None:
            wait_for_server(address, connect_timeout)    # blocks this thread; only at construction
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = make_socket(self._ctx, zmq.DEALER, linger_ms=500)
        self._sock.connect(address)
        self._routes: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._closed = False

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def _read_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                msg_type, f = M.decode(frames, self.max_message_bytes)
            except M.MessageError as e:
                msg_type, f = "error", {"message": f"bad reply from server: {e}", "code": "bad_reply",
                                        "request_id": e.request_id, "corr_id": e.corr_id}
            key = f.get("request_id") or f.get("corr_id")
            q = self._routes.get(key) if key else None
            if q is not None:
                q.put_nowait((msg_type, f))

    def _send_now(self, frames: list) -> None:
        # a zmq.asyncio send that can complete at once does so; the future needs no await then
        self._sock.send_multipart(frames, copy=False)

    async def _get(self, q: asyncio.Queue, timeout):
        try:
            return await asyncio.wait_for(q.get(), timeout)
        except asyncio.TimeoutError:
            raise ClientTimeoutError(f"no reply from {self.address} within {timeout} s") from None

    def _open(self, key: str, frames: list) -> asyncio.Queue:
        if self._closed:
            raise RuntimeError("client is closed")
        if key in self._routes:
            raise ValueError(f"request id {key!r} is already in use by this client")
        self._ensure_reader()
        q: asyncio.Queue = asyncio.Queue()
        self._routes[key] = q
        self._send_now(frames)
        return q

    async def _stream(self, rid, frames, timeout, acc) -> AsyncIterator[StreamDelta]:
        q = self._open(rid, frames)
        done = False
        try:
            while True:
                msg_type, f = await self._get(q, timeout)
                if msg_type == "error":
                    done = True
                    _raise_error(f)
                for d in acc.add(f):
                    yield d
                if acc.out.finished:
                    done = True
                    return
        finally:
            self._routes.pop(rid, None)
            if not done and not self._closed:
                self._send_now(M.encode("abort", request_id=rid))

    def generate_stream(self, prompt: str | dict | None = None, sampling_params=None, *, prompt_token_ids=None,
                        request_id: str | None = None, cache_salt: str | None = None,
                        messages: list | None = None, timeout: float | None = -1) -> AsyncIterator[StreamDelta]:
        """Stream one request: an async generator of ``StreamDelta``s (the request is sent at the first
        iteration; leaving early aborts it).

        Raises:
            ValueError: a malformed prompt (at the call, nothing is sent). ServerError: the server
            rejected or failed the request. ClientTimeoutError: no message for ``timeout`` seconds
            (default: the client's).
        """
        rid = request_id or uuid.uuid4().hex
        frames = _request_frames(rid, prompt, prompt_token_ids, sampling_params, cache_salt, messages)
        return self._stream(rid, frames, self.timeout if timeout == -1 else timeout, _Accumulator(rid))

    async def generate(self, prompt=None, sampling_params=None, *, prompt_token_ids=None,
                       request_id: str | None = None, cache_salt: str | None = None,
                       timeout: float | None = -1):
        """Run requests to the end, like ``LLM.generate``.

        Args:
            prompt: a string, a ``{"prompt" | "prompt_token_ids", "cache_salt"}`` dict, or a list of these.
            sampling_params: a ``SamplingParams`` or dict of its fields; for a list of prompts also a
                list with one per prompt.
        Returns:
            a ``RequestOutput`` (cumulative, finished) for one prompt; a list of them, in prompt
            order, for a list of prompts (all submitted at once, so the server batches them).
        Raises:
            ValueError: a malformed prompt (nothing is sent). ServerError: the server rejected or
            failed a request (the others of the list are cancelled, hence aborted).
        """
        if isinstance(prompt, (list, tuple)):
            if prompt_token_ids is not None:
                raise ValueError("give a list of prompts or prompt_token_ids, not both")
            pairs = _per_prompt(prompt, sampling_params, request_id)
            for p, sp in pairs:                  # check every prompt before sending any
                _request_frames("check", p, None, sp, cache_salt)
            tasks = [asyncio.ensure_future(self.generate(p, sp, cache_salt=cache_salt, timeout=timeout))
                     for p, sp in pairs]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                for t in tasks:
                    t.cancel()
        return await self._run_to_end(request_id, prompt, prompt_token_ids, sampling_params, cache_salt, timeout)

    async def _run_to_end(self, request_id, prompt, prompt_token_ids, sampling_params, cache_salt, timeout,
                          messages=None) -> RequestOutput:
        rid = request_id or uuid.uuid4().hex
        acc = _Accumulator(rid)
        frames = _request_frames(rid, prompt, prompt_token_ids, sampling_params, cache_salt, messages)
        agen = self._stream(rid, frames, self.timeout if timeout == -1 else timeout, acc)
        try:
            async for _ in agen:
                pass
        finally:
            await agen.aclose()
        return acc.out

    async def chat(self, messages: list[dict], sampling_params=None, *, request_id: str | None = None,
                   cache_salt: str | None = None, timeout: float | None = -1) -> RequestOutput:
        """Chat with the model's chat template (rendered by the server); the finished ``RequestOutput``."""
        return await self._run_to_end(request_id, None, None, sampling_params, cache_salt, timeout, messages)

    async def abort(self, request_id: str) -> None:
        """Abort a request (its stream then ends with finish_reason "abort")."""
        self._send_now(M.encode("abort", request_id=request_id))

    async def beam_search(self, prompts, params, *, timeout: float | None = -1) -> list:
        """Beam search on the server (``LLM.beam_search``'s semantics): one ``BeamSearchOutput`` per
        prompt, in order, ``sequences`` best first. Every prompt is sent at once; each answers with
        one message when its search ends (``timeout``: the longest wait for each). Cancelling the
        task aborts the searches.

        Args:
            prompts: a string, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}`` (optionally
                with ``"cache_salt"``), or a list of these.
            params: a ``BeamSearchParams`` or a dict of its fields.
        Raises:
            ValueError: a bad prompt or parameter (before anything is sent). ServerError: the
            server rejected or failed a search (the others are aborted). ClientTimeoutError.
        """
        timeout = self.timeout if timeout == -1 else timeout
        batch = _BeamSearches(prompts, params)
        queues = []
        try:
            for rid, frames in batch.requests:
                queues.append(self._open(rid, frames))
            for q, acc in zip(queues, batch.accs):
                while not acc.out.finished:
                    batch.add(acc, *(await self._get(q, timeout)))
        finally:
            for rid, finished in batch.unfinished(len(queues)):
                self._routes.pop(rid, None)
                if not finished and not self._closed:
                    self._send_now(M.encode("abort", request_id=rid))
        return batch.results()

    async def _call(self, msg_type: str, timeout) -> dict:
        cid = uuid.uuid4().hex
        q = self._open(cid, M.encode(msg_type, corr_id=cid))
        try:
            t, f = await self._get(q, self.timeout if timeout == -1 else timeout)
        finally:
            self._routes.pop(cid, None)
        if t == "error":
            _raise_error(f)
        return f

    async def health(self, timeout: float | None = -1) -> dict:
        """``{"healthy": bool, **detail}``."""
        f = await self._call("health", timeout)
        return {"healthy": f["healthy"], **f["detail"]}

    async def get_metrics(self, timeout: float | None = -1) -> dict:
        """The server's metrics (engine + server counters; see ``Server.get_metrics`` in
        ``ipc/scheduler_process.py``)."""
        return (await self._call("metrics", timeout))["metrics"]

    def fail_pending(self, message: str, code: str = "shutdown") -> None:
        """End every call and stream waiting for the server with ``ServerError(message, code)``
        (a process that stops answers its callers instead of leaving them waiting)."""
        for key, q in list(self._routes.items()):
            q.put_nowait(("error", {"message": message, "code": code, "request_id": key}))

    async def close(self) -> None:
        if self._closed:
            return
        self.fail_pending("the client was closed")
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        self._sock.close(linger=500)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


# ---------------------------------------------------------------------------------------------
# blocking client: the asyncio client on an event loop of its own
# ---------------------------------------------------------------------------------------------

_END = object()


async def _construct(*args) -> AsyncClient:
    return AsyncClient(*args)       # in the loop's thread: its socket belongs to that loop


async def _next(agen):
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return _END


async def _aclose(agen) -> None:
    """Close a stream (aborting its request if it has not finished). Right after the caller's wait
    was interrupted (Ctrl-C) its cancelled ``__anext__`` may still be unwinding on the loop (its own
    clean-up sends the abort): closing then raises "already running", so try again once it ended."""
    for _ in range(1000):
        try:
            return await agen.aclose()
        except RuntimeError:
            await asyncio.sleep(0.001)


class Client:
    """Blocking client; safe to share between threads. It runs an ``AsyncClient`` on an event loop
    of its own (one daemon thread, which owns the socket), and each method is the ``AsyncClient``
    method of the same name run there: the two share every line of protocol code.

    Args:
        address: the server's address (``tcp://127.0.0.1:5555`` by default).
        timeout: seconds to wait for each reply / next streamed message (``None`` = forever).
        connect_timeout: seconds to wait at construction for a ZeroMQ handshake with the server
            (``None``: no check; requests then wait up to ``timeout``).
    Raises:
        ConnectionError: nothing at ``address`` answered within ``connect_timeout``.
    """

    def __init__(self, address: str = DEFAULT_ADDRESS, timeout: float | None = 120.0,
                 max_message_bytes: int = M.DEFAULT_MAX_MESSAGE_BYTES,
                 connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT):
        self.address = address
        self.max_message_bytes = max_message_bytes
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="folio-client-io")
        self._thread.start()
        try:
            self._async = self._run(_construct(address, timeout, max_message_bytes, connect_timeout))
        except BaseException:
            self._stop_loop()
            raise

    @property
    def timeout(self) -> float | None:
        return self._async.timeout

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._async.timeout = value

    def _run(self, coro):
        """Run ``coro`` on the client's loop and wait for it; an exception here (Ctrl-C) cancels it,
        which aborts its requests."""
        if self._closed:
            coro.close()
            raise RuntimeError("client is closed")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()
            raise

    def _iterate(self, agen) -> Iterator[StreamDelta]:
        # a generator: the request is sent at the first next(), as a stream is consumed; leaving
        # it early closes the async stream, which aborts the request
        try:
            while (d := self._run(_next(agen))) is not _END:
                yield d
        finally:
            if self._closed:
                pass
            elif threading.current_thread() is self._thread:   # collected on the loop's thread
                self._loop.create_task(_aclose(agen))
            else:
                self._run(_aclose(agen))

    def generate_stream(self, prompt: str | dict | None = None, sampling_params=None, *, prompt_token_ids=None,
                        request_id: str | None = None, cache_salt: str | None = None,
                        messages: list | None = None, timeout: float | None = -1) -> Iterator[StreamDelta]:
        """Stream one request (``AsyncClient.generate_stream``); closing the iterator early aborts it."""
        return self._iterate(self._async.generate_stream(
            prompt, sampling_params, prompt_token_ids=prompt_token_ids, request_id=request_id,
            cache_salt=cache_salt, messages=messages, timeout=timeout))

    def generate(self, prompt=None, sampling_params=None, *, prompt_token_ids=None,
                 request_id: str | None = None, cache_salt: str | None = None, timeout: float | None = -1):
        """Run requests to the end (``AsyncClient.generate``)."""
        return self._run(self._async.generate(prompt, sampling_params, prompt_token_ids=prompt_token_ids,
                                              request_id=request_id, cache_salt=cache_salt, timeout=timeout))

    def chat(self, messages: list[dict], sampling_params=None, *, request_id: str | None = None,
             stream: bool = False, cache_salt: str | None = None, timeout: float | None = -1):
        """Chat with the model's chat template; ``RequestOutput``, or a delta iterator if ``stream``."""
        if stream:
            return self.generate_stream(None, sampling_params, request_id=request_id, cache_salt=cache_salt,
                                        messages=messages, timeout=timeout)
        return self._run(self._async.chat(messages, sampling_params, request_id=request_id, cache_salt=cache_salt,
                                          timeout=timeout))

    def abort(self, request_id: str) -> None:
        """Abort a request (its stream then ends with finish_reason "abort")."""
        self._run(self._async.abort(request_id))

    def beam_search(self, prompts, params, *, timeout: float | None = -1) -> list:
        """Beam search on the server (``AsyncClient.beam_search``)."""
        return self._run(self._async.beam_search(prompts, params, timeout=timeout))

    def health(self, timeout: float | None = -1) -> dict:
        """``{"healthy": bool, **detail}``."""
        return self._run(self._async.health(timeout))

    def get_metrics(self, timeout: float | None = -1) -> dict:
        """The server's metrics (``AsyncClient.get_metrics``)."""
        return self._run(self._async.get_metrics(timeout))

    def close(self) -> None:
        """Close the socket and stop the loop; a call still waiting in another thread is cancelled."""
        if self._closed:
            return
        try:
            self._run(self._async.close())
        finally:
            self._closed = True
            self._stop_loop()

    def _stop_loop(self) -> None:
        async def cancel_all():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(2.0)
            except Exception:
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(2.0)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
