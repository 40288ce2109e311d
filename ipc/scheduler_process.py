"""The scheduler process: clients on a ROUTER socket, the engine in a loop, the worker behind it.

``Server`` binds a ROUTER socket for clients and runs ``runtime.scheduler.engine.LLMEngine`` with a
``ZmqExecutor`` (the forward pass runs in the worker process). The serving loop, all in
``serve_forever``:

1. admit what clients sent since the last turn (new requests into the engine, aborts);
2. ``engine.step(block=False)``: hand the next step(s) to the worker and, if the oldest step's
   result has arrived, apply it (with overlap scheduling the next plan is already queued at the
   worker, so it never waits for this loop);
3. send each request's delta to its client (the first message also carries the prompt ids, the
   last the request's metrics);
4. wait on one poller for whichever comes first, a client message or a step result; client
   messages are received, validated and tokenized / chat-templated right away (while the worker
   computes); health and metrics requests are answered at once; the worker's health is checked.

Nothing calls back into the server from inside the engine or the executor.

Errors: a malformed message (see ``ipc.messages``), invalid sampling parameters or a prompt the
engine rejects (``ValueError``) -> an ``error`` reply to that sender only; nothing else changes.
A client that vanished (its connection closed: ZeroMQ drops the routing id, and a send with
``ROUTER_MANDATORY`` fails with EHOSTUNREACH) has all its requests aborted, which frees their
blocks at the next step.

Worker death: if the worker process dies or stops answering (``WorkerDiedError``, within
``heartbeat_timeout`` seconds) or the engine fails a step, every in-flight request gets an
``error`` reply with the reason (code ``worker_died`` / ``engine_error``), ``health`` reports
unhealthy, new requests are refused with the same reason for ``exit_grace`` seconds, and then the
scheduler EXITS with code 3 (``EXIT_WORKER_DIED``). It does not restart the worker: the KV cache
and every sequence's sampling state died with it, so a restart would only hide the failure; a
supervisor (systemd, k8s, a shell loop) restarts ``folio serve`` if wanted.
"""

from __future__ import annotations

import gc
import os
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import zmq

from ..runtime.scheduler.metrics import ServingStats
from . import messages as M
from .client_socket import ClientSocket
from .transport import check_address, cleanup_ipc_address, curve_server, make_socket

EXIT_WORKER_DIED = 3


@dataclass
class _Request:
    """Server-side bookkeeping of one client request."""

    identity: bytes
    client_request_id: str
    started: bool = False


@dataclass
class _Pending:
    engine_id: str
    inputs: Any              # the request's ProcessedPrompt (runtime/inputs/input_processor.py)
    sampling_params: Any
    arrival_time: float


def _wire_logprobs(pos: dict) -> list:
    """One position's ``{token_id: Logprob}`` as ``[[token, logprob, rank, text], ...]``."""
    return [[int(t), float(lp.logprob), lp.rank, lp.decoded_token] for t, lp in pos.items()]


class Server(ClientSocket):
    """The scheduler process's main object.

    Args:
        config: ``EngineConfig``.
        address: client address to bind (``tcp://HOST:PORT`` or ``ipc://PATH``); non-loopback
            hosts need ``allow_remote``.
        engine: an engine object to use instead of building ``LLMEngine(config, ZmqExecutor)``
            (tests); it needs the ``LLMEngine`` methods used here.
        runner: the worker's runner factory (``module:callable``), passed to ``ZmqExecutor``.
        max_message_bytes: largest client message accepted (larger -> error reply).
        heartbeat_timeout: seconds of worker silence that count as death.
        exit_grace: seconds to keep answering (with errors) after the worker died, then exit.
        curve: ``transport.CurveKeys`` every client must hold (CURVE encryption; only their client
            key is admitted: a data-parallel replica's door), or ``None`` (no authentication).
    Raises:
        ValueError: bad address; ``WorkerDiedError``: the worker failed to start.
    """

    def __init__(self, config, address: str, *, allow_remote: bool = False, engine=None,
                 runner: str = "folio.runtime.worker.model_runner:ModelRunner",
                 max_message_bytes: int = M.DEFAULT_MAX_MESSAGE_BYTES, heartbeat_timeout: float = 10.0,
                 exit_grace: float = 2.0, curve=None):
        self.address = check_address(address, allow_remote)
        self.config = config
        self.max_message_bytes = max_message_bytes
        self.exit_grace = exit_grace
        self.executor = None
        self.engine = engine
        self._requests: dict[str, _Request] = {}       # engine request id -> state
        self._pending_adds: list[_Pending] = []
        self._pending_aborts: list[str] = []
        self._outbox: list[tuple[bytes, list]] = []
        self._stop = False
        self.healthy = True
        self.unhealthy_reason: str | None = None
        self.started_time = time.time()
        self.serving_stats = ServingStats()      # TTFT / ITL / ... histograms for the /metrics HTTP process
        self._extra_addresses: list[str] = []
        self._last_scheduled_tokens = 0
        self.stats = {"num_requests": 0, "num_finished": 0, "num_aborted": 0, "num_errors": 0,
                      "num_streamed_tokens": 0, "num_bad_messages": 0, "num_vanished_clients": 0}
        # bind first: a busy address fails at once, before any model is loaded
        self._ctx = zmq.Context.instance()
        self.sock = make_socket(self._ctx, zmq.ROUTER, linger_ms=2000)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 4 * max_message_bytes)  # beyond this zmq drops the peer
        self._auth = curve_server(self._ctx, self.sock, curve) if curve is not None else None
        try:
            self.sock.bind(self.address)
        except zmq.ZMQError as e:
            self.sock.close(0)
            if self._auth is not None:
                self._auth.stop()
            raise ValueError(f"cannot bind {self.address}: {e}") from None
        if engine is None:
            from ..runtime.scheduler.engine import LLMEngine
            from .zmq_executor import ZmqExecutor
            try:
                self.executor = ZmqExecutor(config, runner=runner, heartbeat_timeout=heartbeat_timeout,
                                            max_message_bytes=max(M.DEFAULT_MAX_MESSAGE_BYTES, max_message_bytes))
                self.engine = LLMEngine(config, executor=self.executor)
            except BaseException:
                self.close()
                raise
        self.tokenizer = getattr(self.engine, "tokenizer", None)

    # -- public ---------------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the loop to finish (safe from a signal handler)."""
        self._stop = True

    def bind_extra(self, address: str) -> str:
        """Also accept clients on ``address`` (e.g. a private ``ipc://`` path for the HTTP process);
        its socket file is removed on close. Raises ``ValueError`` if it cannot be bound."""
        try:
            self.sock.bind(address)
        except zmq.ZMQError as e:
            raise ValueError(f"cannot bind {address}: {e}") from None
        self._extra_addresses.append(address)
        return address

    def serve_forever(self) -> int:
        """Run the serving loop (module docstring) until ``stop()``; returns the exit code (0, or
        ``EXIT_WORKER_DIED``)."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        if self.executor is not None:
            poller.register(self.executor.result_socket, zmq.POLLIN)
        engine = self.engine
        # what start-up built (tokenizer, configs, the engine) lives as long as the process: keep
        # it out of the garbage collector's full passes (as vLLM's engine core does)
        gc.collect()
        gc.freeze()
        try:
            while not self._stop:
                self._apply_pending()                                   # 1. client input
                busy = engine.has_unfinished_requests()
                if busy:
                    try:
                        deltas = engine.step(block=False)               # 2. hand over, apply
                    except Exception as e:
                        return self._fail_all(e)
                    self._emit(deltas)                                  # 3. deltas out
                    busy = engine.has_unfinished_requests()
                self._flush()
                if self._pending_adds or self._pending_aborts:
                    timeout_ms = 0
                elif busy:
                    timeout_ms = self.POLL_MS if self.executor is not None else 1
                else:
                    timeout_ms = 100
                ready = dict(poller.poll(timeout_ms))                   # 4. wait for input
                if self.sock in ready:
                    self._on_client_readable()
                if self.executor is not None:
                    try:
                        self.executor.check_health()                    # a worker that died
                    except Exception as e:
                        return self._fail_all(e)
            self._shutdown_requests("server shutting down")
            return 0
        finally:
            self.close()

    # the longest the loop sleeps while a step runs (it wakes at once when the result arrives)
    POLL_MS = 50

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None
        elif self.engine is not None and hasattr(self.engine, "shutdown"):
            try:
                self.engine.shutdown()
            except Exception:
                pass
        if not self.sock.closed:
            self._flush()
            self.sock.close(linger=1000)
            for address in [self.address, *self._extra_addresses]:
                cleanup_ipc_address(address)
            if self._auth is not None:
                self._auth.stop()

    # -- client side ------------------------------------------------------------------------------
    def _poll_clients(self, timeout_ms: int) -> None:
        if self.sock.poll(timeout_ms, zmq.POLLIN):
            self._on_client_readable()

    def _handle(self, identity: bytes, body: list) -> None:
        msg_type, f = M.decode(body, self.max_message_bytes)
        if msg_type == "health":
            self._send(identity, M.encode("health_reply", corr_id=f["corr_id"], healthy=self.healthy,
                                          detail=self._health_detail()))
            return
        if msg_type == "metrics":
            self._send(identity, M.encode("metrics_reply", corr_id=f["corr_id"], metrics=self.get_metrics()))
            return
        if msg_type == "abort":
            eid = self._engine_id(identity, f["request_id"])
            if eid in self._requests:
                self._pending_aborts.append(eid)
            return
        if msg_type not in ("generate", "chat", "beam_search"):
            raise M.MessageError(f"clients may not send {msg_type}")
        rid = f["request_id"]
        if not self.healthy:
            self._send(identity, M.error_reply(f"server unhealthy: {self.unhealthy_reason}", "worker_died", rid))
            return
        eid = self._engine_id(identity, rid)
        if eid in self._requests:
            raise M.MessageError(f"request id {rid!r} is already in flight", request_id=rid)
        try:
            inputs, sp = self._prepare(msg_type, f)
        except (ValueError, TypeError) as e:
            self.stats["num_errors"] += 1
            self._send(identity, M.error_reply(str(e), "invalid_argument", rid))
            return
        self._requests[eid] = _Request(identity, rid)
        self._pending_adds.append(_Pending(eid, inputs, sp, time.time()))
        self.stats["num_requests"] += 1

    def _prepare(self, msg_type: str, f: dict):
        """``(processed prompt, params)`` of a client's request, validated once, here, where it
        enters: its parameters built from the message, its prompt rendered, tokenized and checked
        by the engine's ``InputProcessor`` (``ProcessedPrompt``, which ``engine.add_request`` takes
        as it is) while the worker computes. Raises ``ValueError`` (``InputError``) / ``TypeError``."""
        from ..runtime.common.sampling_params import BeamSearchParams, SamplingParams
        sp = BeamSearchParams.from_dict(f["params"]) if msg_type == "beam_search" else \
            SamplingParams.from_dict(f["sampling"])
        inputs = self.engine.input_processor
        salt = f.get("cache_salt")
        if msg_type == "chat":
            return inputs.process(None, sp.max_tokens, messages=f["messages"], cache_salt=salt,
                                  add_generation_prompt=f.get("add_generation_prompt", True)), sp
        prompt, ids = f.get("prompt"), f.get("prompt_token_ids")
        if (prompt is None) == (ids is None):
            raise ValueError("give exactly one of prompt and prompt_token_ids")
        return inputs.process(prompt, sp.max_tokens, prompt_token_ids=ids, cache_salt=salt), sp

    @staticmethod
    def _engine_id(identity: bytes, rid: str) -> str:
        return f"{identity.hex()}/{rid}"

    def _client_gone(self, identity: bytes) -> None:
        gone = [eid for eid, r in self._requests.items() if r.identity == identity]
        if gone:
            self.stats["num_vanished_clients"] += 1
        self._pending_aborts.extend(gone)

    def _flush(self) -> None:
        out, self._outbox = self._outbox, []
        for identity, frames in out:
            self._send(identity, frames)

    # -- engine side --------------------------------------------------------------------------------
    def _apply_pending(self) -> None:
        aborts, self._pending_aborts = self._pending_aborts, []
        live = [eid for eid in dict.fromkeys(aborts) if eid in self._requests]
        if live:
            adds = {p.engine_id for p in self._pending_adds}
            self._pending_adds = [p for p in self._pending_adds if p.engine_id not in live]
            in_engine = [eid for eid in live if eid not in adds]
            if in_engine:   # their last delta (abort, once per unfinished sample) comes from the engine
                self.engine.abort_request(in_engine)
            for eid in live:
                self.stats["num_aborted"] += 1
                if eid in adds:   # never reached the engine
                    r = self._requests.pop(eid)
                    self._outbox.append((r.identity, M.encode(
                        "output", request_id=r.client_request_id, finished=True,
                        outputs=[{"index": 0, "token_ids": np.zeros(0, np.int64), "text": "",
                                  "finish_reason": "abort", "stop_reason": None}])))
        adds, self._pending_adds = self._pending_adds, []
        for p in adds:
            r = self._requests.get(p.engine_id)
            if r is None:
                continue
            try:
                self.engine.add_request(p.engine_id, p.inputs, p.sampling_params, arrival_time=p.arrival_time)
            except (ValueError, TypeError) as e:
                self._requests.pop(p.engine_id, None)
                self.stats["num_errors"] += 1
                self._outbox.append((r.identity, M.error_reply(str(e), "invalid_argument", r.client_request_id)))

    def _emit(self, deltas) -> None:
        """One ``output`` message per request delta: only the samples that changed, each sample's
        finish reason on its last message only. The step's deltas also feed the serving statistics."""
        scheduled = self.engine.stats["num_scheduled_tokens"]
        failed = [d for d in deltas if getattr(d, "error", None) is not None]
        if failed:     # requests whose constraint did not compile on the worker: an error reply each
            deltas = [d for d in deltas if getattr(d, "error", None) is None]
            for d in failed:
                r = self._requests.pop(d.request_id, None)
                if r is not None:
                    self.stats["num_errors"] += 1
                    self._outbox.append((r.identity, M.error_reply(d.error, "invalid_argument", r.client_request_id)))
        self.serving_stats.on_step(deltas, scheduled - self._last_scheduled_tokens)
        self._last_scheduled_tokens = scheduled
        for d in deltas:
            r = self._requests.get(d.request_id)
            if r is None:          # aborted meanwhile
                continue
            comps = []
            for c in d.outputs:
                self.stats["num_streamed_tokens"] += len(c.token_ids)
                o = {"index": c.index, "token_ids": np.asarray(c.token_ids, dtype=np.int64), "text": c.text,
                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if c.logprobs is not None:
                    o["logprobs"] = [_wire_logprobs(pos) for pos in c.logprobs]
                if c.cumulative_logprob is not None:
                    o["cumulative_logprob"] = c.cumulative_logprob
                comps.append(o)
            extra: dict = {"num_cached_tokens": int(d.num_cached_tokens)}
            if d.prompt_logprobs is not None:
                extra["prompt_logprobs"] = [None if pos is None else _wire_logprobs(pos) for pos in d.prompt_logprobs]
            if not r.started:
                r.started = True
                extra["prompt"] = d.prompt
                extra["prompt_token_ids"] = np.asarray(d.prompt_token_ids, dtype=np.int64)
            if d.finished:
                self._requests.pop(d.request_id, None)
                self.stats["num_finished"] += 1
                if d.metrics is not None:
                    extra["metrics"] = asdict(d.metrics)
            self._outbox.append((r.identity, M.encode("output", request_id=r.client_request_id, outputs=comps,
                                                      finished=bool(d.finished), **extra)))

    def _fail_all(self, exc: BaseException) -> int:
        """The worker died or the engine failed: error every request, stay unhealthy, then exit."""
        from .zmq_executor import WorkerDiedError
        if self._stop:       # asked to stop (SIGTERM to the process group reaches the worker too)
            self._shutdown_requests("server shutting down")
            return 0
        code = "worker_died" if isinstance(exc, WorkerDiedError) else "engine_error"
        if code == "engine_error":
            traceback.print_exc()
        self.healthy = False
        self.unhealthy_reason = f"{type(exc).__name__}: {exc}"
        self._shutdown_requests(self.unhealthy_reason, code)
        print(f"folio serve: {self.unhealthy_reason}; exiting in {self.exit_grace:.1f} s", flush=True)
        deadline = time.monotonic() + self.exit_grace
        while not self._stop and time.monotonic() < deadline:
            self._poll_clients(50)
            self._flush()
        return EXIT_WORKER_DIED

    def _shutdown_requests(self, reason: str, code: str = "shutdown") -> None:
        for eid, r in list(self._requests.items()):
            self._outbox.append((r.identity, M.error_reply(reason, code, r.client_request_id)))
        self._requests.clear()
        self._pending_adds.clear()
        self._flush()

    # -- health / metrics ---------------------------------------------------------------------------
    def _health_detail(self) -> dict:
        return {"worker_alive": bool(self.executor.is_alive()) if self.executor is not None else self.healthy,
                "reason": self.unhealthy_reason, "num_requests_in_flight": len(self._requests),
                "pid": os.getpid(), "worker_pid": getattr(self.executor, "worker_pid", None),
                "uptime_s": time.time() - self.started_time}

    def get_metrics(self) -> dict:
        """Engine metrics (``LLMEngine.get_metrics``) plus the server's own counters.

        Server keys: step_ipc_overhead_us (mean per step: ``ZmqExecutor.ipc_time`` / num_steps,
        the time a step's result took beyond the worker's forward + sample time once the worker
        could start it), num_requests, num_finished, num_aborted, num_errors,
        num_streamed_tokens, num_bad_messages, num_vanished_clients, num_requests_in_flight,
        uptime_s, healthy, serving (``runtime.metrics.ServingStats.to_dict``: token counters, finished
        requests by reason, TTFT / ITL / latency / iteration histograms).
        """
        try:
            m = dict(self.engine.get_metrics())
        except Exception as e:
            m = {"engine_metrics_error": str(e)}
        s = dict(self.stats)
        if self.executor is not None:
            s["step_ipc_overhead_us"] = 1e6 * self.executor.ipc_time / max(1, int(m.get("num_steps", 0) or 0))
        s["num_requests_in_flight"] = len(self._requests)
        s["uptime_s"] = time.time() - self.started_time
        s["healthy"] = self.healthy
        s["serving"] = self.serving_stats.to_dict()
        m.update(s)
        return {k: (v if isinstance(v, (int, float, str, bool, type(None), list, dict)) else str(v))
                for k, v in m.items()}
