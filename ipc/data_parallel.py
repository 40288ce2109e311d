"""The data-parallel door: one ZeroMQ ROUTER for clients, N engine replicas behind it.

``DataParallelRouter`` speaks the client protocol of ``ipc/scheduler_process.py`` to clients (the
HTTP process is one of them) and the same protocol, as a client, to each replica's own
``Server`` (a replica is a scheduler process with its own worker; ``ipc/ray_replicas.py`` places
them on a Ray cluster, but this module knows only their ZeroMQ addresses). Per message:

* ``generate`` / ``chat`` / ``beam_search``: the prompt's token ids are taken (given, or tokenized
  / chat-templated here with the replicas' input processor, only to route), ``ipc/routing.py``
  chooses a replica, and the message goes to it unchanged but for its ``request_id``, rewritten to
  ``<client identity hex>/<request id>`` (unique across clients; the header alone is re-packed,
  array frames pass through untouched);
* ``output`` / ``error`` from a replica: the request id is rewritten back and the message goes to
  its client; a finished request releases its load;
* ``abort``: forwarded to the request's replica;
* ``health`` / ``metrics``: asked of every live replica at once and answered when all replied (or
  after ``fanout_timeout`` s, with the silent ones reported so): totals plus a ``replicas`` list,
  replica ``i`` being vLLM's data-parallel rank / Prometheus ``engine="i"``.

Faults: each replica socket has a ZeroMQ socket monitor and ZMTP heartbeats; a disconnect (a
replica process killed: its kernel closes the TCP connection) or ``heartbeat_timeout`` s of
silence marks the replica dead at once; so does a replica's ``worker_died`` error (its worker died:
the replica answers errors until it exits for Ray to restart it). Its requests that have not streamed anything yet are
**retried** on a live replica (the client sees nothing, at most a later first token); those that
already streamed fail at once with an ``error`` of code ``replica_died`` naming the replica (their
partial output cannot be continued elsewhere: the KV cache and the sampling state died). New
requests go to the living replicas; with none alive they get ``replica_died`` errors. The dead
replica's index goes to ``on_replica_dead`` (the Ray side restarts it); ``replica_restarted(i,
address)``, callable from any thread, connects the new incarnation and routes to it again.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import msgpack
import zmq
import zmq.utils.monitor

from ..runtime.scheduler.spec_decode import derived_metrics
from . import messages as M
from .client_socket import ClientSocket
from .routing import Decision, NoReplicaError, PrefixAwareRouter
from .transport import check_address, cleanup_ipc_address, curve_client, make_socket, recv_frames, send_frames

# engine metrics that are settings or means, not counts: not summed over replicas
_NOT_SUMMED = {"block_size", "max_model_len", "uptime_s", "step_ipc_overhead_us"}


@dataclass
class _Forwarded:
    identity: bytes
    client_request_id: str
    msg_type: str
    frames: list                 # the rewritten request, kept until the first output (for a retry)
    decision: Decision
    ids: list
    max_tokens: int | None
    cache_salt: str | None
    started: bool = False
    tried: list = field(default_factory=list)


@dataclass
class _Fanout:
    identity: bytes
    corr_id: str
    msg_type: str                # "health" or "metrics"
    deadline: float
    replies: dict = field(default_factory=dict)    # replica -> fields
    waiting: set = field(default_factory=set)


class _Replica:
    def __init__(self, index: int):
        self.index = index
        self.address: str | None = None
        self.sock: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.alive = False
        self.info: dict = {}
        self.num_restarts = 0
        self.dead_reason: str | None = None


def rewrite_request_id(frames: list, request_id: str) -> list:
    """The same message with its header's ``request_id`` replaced (array frames untouched)."""
    header = msgpack.unpackb(bytes(M._buffer(frames[0])), raw=False)
    header["request_id"] = request_id
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


def merge_metrics(snapshots: list[dict]) -> dict:
    """Totals of several replicas' ``Server.get_metrics`` snapshots: numbers summed (settings and
    means in ``_NOT_SUMMED`` taken from the first / averaged), booleans and-ed, dicts merged key by
    key, equal-length number lists (histogram counts) summed element-wise except ``bounds``."""
    def merge(key, values):
        values = [v for v in values if v is not None]
        if not values:
            return None
        first = values[0]
        if isinstance(first, bool):
            return all(bool(v) for v in values)
        if isinstance(first, (int, float)):
            if key == "step_ipc_overhead_us":
                return sum(values) / len(values)
            return first if key in _NOT_SUMMED else sum(v for v in values if isinstance(v, (int, float)))
        if isinstance(first, dict):
            keys = list(dict.fromkeys(k for v in values if isinstance(v, dict) for k in v))
            return {k: merge(k, [v.get(k) for v in values if isinstance(v, dict)]) for k in keys}
        if isinstance(first, list) and key != "bounds" and all(
                isinstance(v, list) and len(v) == len(first) and all(isinstance(x, (int, float)) for x in v)
                for v in values):
            return [sum(x) for x in zip(*values)]
        return first
    if not snapshots:
        return {}
    total = merge(None, snapshots)
    if "spec_decode_num_drafts" in total:   # the rates of the summed counters, not sums of rates
        total.update(derived_metrics(total))
    return total


class DataParallelRouter(ClientSocket):
    """The door of ``folio serve --data-parallel-size N``.

    Args:
        address: client bind address (as ``Server``'s; non-loopback needs ``allow_remote``).
        replica_addresses: each replica's ZeroMQ address (``Server`` client address), by index.
        input_processor: ``runtime.inputs.InputProcessor`` of the model (tokenizes text and chat
            prompts to route them; the replica tokenizes again for itself).
        block_size, max_blocks: ``PrefixAwareRouter`` arguments (the replicas' block size, the
            prefix map's bound in blocks).
        on_replica_dead: ``f(index, reason)`` called (on this loop's thread) when a replica dies.
        heartbeat_timeout: seconds of silence from a replica's connection that count as death.
        fanout_timeout: seconds a ``health`` / ``metrics`` waits for the replicas.
        curve: the cluster's ``transport.CurveKeys``: the router connects to the replicas as their
            CURVE client (the replicas' doors admit only it), or ``None`` (doors without
            authentication).
    Raises:
        ValueError: bad address.
    """

    def __init__(self, address: str, replica_addresses: list[str], input_processor, *, block_size: int,
                 max_blocks: int, allow_remote: bool = False, max_message_bytes: int = M.DEFAULT_MAX_MESSAGE_BYTES,
                 on_replica_dead: Callable[[int, str], None] | None = None, heartbeat_timeout: float = 10.0,
                 fanout_timeout: float = 3.0, replica_info: list[dict] | None = None, curve=None):
        self.address = check_address(address, allow_remote)
        self.curve = curve
        self.inputs = input_processor
        self.max_message_bytes = max_message_bytes
        self.on_replica_dead = on_replica_dead
        self.heartbeat_timeout = heartbeat_timeout
        self.fanout_timeout = fanout_timeout
        self.policy = PrefixAwareRouter(len(replica_addresses), block_size, max_blocks)
        self._ctx = zmq.Context.instance()
        self._stop = False
        self._requests: dict[str, _Forwarded] = {}
        self._fanouts: dict[str, _Fanout] = {}
        self._restarted: queue.SimpleQueue = queue.SimpleQueue()
        self._extra_addresses: list[str] = []
        self._seq = 0
        self.started_time = time.time()
        self.stats = {"num_requests": 0, "num_retried": 0, "num_failed_replica_died": 0, "num_bad_messages": 0,
                      "routing_time_s": 0.0}
        self.sock = make_socket(self._ctx, zmq.ROUTER, linger_ms=2000)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 4 * max_message_bytes)
        try:
            self.sock.bind(self.address)
        except zmq.ZMQError as e:
            self.sock.close(0)
            raise ValueError(f"cannot bind {self.address}: {e}") from None
        self.replicas = [_Replica(i) for i in range(len(replica_addresses))]
        for i, a in enumerate(replica_addresses):
            self._connect(i, a, (replica_info or [{}] * len(replica_addresses))[i])

    # -- public -------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the loop to finish (safe from a signal handler)."""
        self._stop = True

    def bind_extra(self, address: str) -> str:
        """Also accept clients on ``address`` (the HTTP process's private ``ipc://`` path)."""
        try:
            self.sock.bind(address)
        except zmq.ZMQError as e:
            raise ValueError(f"cannot bind {address}: {e}") from None
        self._extra_addresses.append(address)
        return address

    def replica_restarted(self, index: int, address: str, info: dict | None = None) -> None:
        """A new incarnation of replica ``index`` serves on ``address`` (thread-safe: applied by the loop)."""
        self._restarted.put((index, address, info or {}))

    def num_alive(self) -> int:
        return sum(r.alive for r in self.replicas)

    def serve_forever(self) -> int:
        """Route until ``stop()``; returns 0. In-flight requests then get a ``shutdown`` error."""
        try:
            while not self._stop:
                self._apply_restarts()
                poller = zmq.Poller()
                poller.register(self.sock, zmq.POLLIN)
                for r in self.replicas:
                    if r.sock is not None:
                        poller.register(r.sock, zmq.POLLIN)
                        poller.register(r.monitor, zmq.POLLIN)
                ready = dict(poller.poll(100))
                for r in self.replicas:
                    if r.monitor is not None and r.monitor in ready:
                        self._on_monitor(r)
                    if r.sock is not None and r.sock in ready:
                        self._on_replica_readable(r)
                if self.sock in ready:
                    self._on_client_readable()
                self._expire_fanouts()
            for eid, f in list(self._requests.items()):
                self._send(f.identity, M.error_reply("server shutting down", "shutdown", f.client_request_id))
            self._requests.clear()
            return 0
        finally:
            self.close()

    def close(self) -> None:
        for r in self.replicas:
            self._disconnect(r)
        if not self.sock.closed:
            self.sock.close(linger=1000)
            for address in [self.address, *self._extra_addresses]:
                cleanup_ipc_address(address)

    # -- replica connections -----------------------------------------------------------------------
    def _connect(self, index: int, address: str, info: dict) -> None:
        r = self.replicas[index]
        self._disconnect(r)
        s = make_socket(self._ctx, zmq.DEALER)
        # ZMTP heartbeats: a replica whose machine vanished (no FIN) disconnects after the timeout
        s.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        s.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(1000 * self.heartbeat_timeout))
        s.setsockopt(zmq.MAXMSGSIZE, -1)
        if self.curve is not None:
            curve_client(s, self.curve)
        r.monitor = s.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
        s.connect(address)
        r.sock, r.address, r.info, r.alive, r.dead_reason = s, address, dict(info), True, None
        self.policy.set_alive(index, True)

    def _disconnect(self, r: _Replica) -> None:
        if r.sock is not None:
            try:
                r.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            r.monitor.close(0)
            r.sock.close(0)
        r.sock = r.monitor = None

    def _apply_restarts(self) -> None:
        while True:
            try:
                index, address, info = self._restarted.get_nowait()
            except queue.Empty:
                return
            self.replicas[index].num_restarts += 1
            self._connect(index, address, info)
            print(f"folio serve: replica {index} rejoined on {address}", flush=True)

    def _on_monitor(self, r: _Replica) -> None:
        while r.monitor is not None and r.monitor.poll(0):
            event = zmq.utils.monitor.recv_monitor_message(r.monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED and r.alive:
                self._replica_died(r, f"replica {r.index} ({r.address}) disconnected: its process died")
                return

    def _replica_died(self, r: _Replica, reason: str) -> None:
        """Mark dead, retry or fail its requests, answer its part of pending fan-outs, tell the owner."""
        r.alive, r.dead_reason = False, reason
        self._disconnect(r)
        self.policy.set_alive(r.index, False)
        print(f"folio serve: {reason}", flush=True)
        for eid, f in list(self._requests.items()):
            if f.decision.replica != r.index:
                continue
            if f.started:
                self._requests.pop(eid)
                self.stats["num_failed_replica_died"] += 1
                self._send(f.identity, M.error_reply(
                    f"engine replica {r.index} died while streaming this request ({reason}); "
                    "its partial output cannot be continued", "replica_died", f.client_request_id))
            else:
                f.tried.append(r.index)
                self._dispatch(eid, f, retry=True)
        for fo in self._fanouts.values():
            if r.index in fo.waiting:
                fo.waiting.discard(r.index)
        self._finish_ready_fanouts()
        if self.on_replica_dead is not None:
            try:
                self.on_replica_dead(r.index, reason)
            except Exception:
                traceback.print_exc()

    # -- clients ---------------------------------------------------------------------------------------
    def _handle(self, identity: bytes, body: list) -> None:
        msg_type, f = M.decode(body, self.max_message_bytes)
        if msg_type in ("health", "metrics"):
            self._start_fanout(identity, msg_type, f["corr_id"])
            return
        if msg_type == "abort":
            eid = f"{identity.hex()}/{f['request_id']}"
            fw = self._requests.get(eid)
            if fw is not None:
                self._to_replica(fw.decision.replica, M.encode("abort", request_id=eid))
            return
        if msg_type not in ("generate", "chat", "beam_search"):
            raise M.MessageError(f"clients may not send {msg_type}")
        rid = f["request_id"]
        eid = f"{identity.hex()}/{rid}"
        if eid in self._requests:
            raise M.MessageError(f"request id {rid!r} is already in flight", request_id=rid)
        t0 = time.perf_counter()
        ids, max_tokens = self._routing_input(msg_type, f)
        fw = _Forwarded(identity, rid, msg_type, rewrite_request_id(body, eid), None, ids, max_tokens,
                        f.get("cache_salt"))
        self.stats["num_requests"] += 1
        self._dispatch(eid, fw, retry=False)
        self.stats["routing_time_s"] += time.perf_counter() - t0

    def _routing_input(self, msg_type: str, f: dict) -> tuple[list, int | None]:
        """The prompt's token ids and max_tokens, for routing only. A prompt that cannot be
        tokenized routes with no ids (least loaded): the replica's own checks answer it."""
        params = f.get("params") if msg_type == "beam_search" else f.get("sampling")
        max_tokens = params.get("max_tokens") if isinstance(params, dict) else None
        max_tokens = max_tokens if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) else None
        try:
            if msg_type == "chat":
                prompt = self.inputs.render_chat(f["messages"], f.get("add_generation_prompt", True))
                return self.inputs.tokenize(prompt, param="messages"), max_tokens
            if f.get("prompt_token_ids") is not None:
                return [int(t) for t in f["prompt_token_ids"].tolist()], max_tokens
            if isinstance(f.get("prompt"), str):
                return self.inputs.tokenize(f["prompt"]), max_tokens
        except (ValueError, TypeError):
            pass
        return [], max_tokens

    def _dispatch(self, eid: str, fw: _Forwarded, retry: bool) -> None:
        if fw.decision is not None:
            self.policy.release(fw.decision)
        try:
            fw.decision = self.policy.route(fw.ids, fw.max_tokens, fw.cache_salt, exclude=fw.tried)
        except NoReplicaError:
            self._requests.pop(eid, None)
            reasons = "; ".join(r.dead_reason or f"replica {r.index} dead" for r in self.replicas if not r.alive)
            self._send(fw.identity, M.error_reply(f"no engine replica is alive ({reasons})", "replica_died",
                                                  fw.client_request_id))
            return
        if retry:
            self.stats["num_retried"] += 1
        self._requests[eid] = fw
        self._to_replica(fw.decision.replica, fw.frames)

    def _to_replica(self, index: int, frames: list) -> None:
        r = self.replicas[index]
        if r.sock is None:
            return
        send_frames(r.sock, frames)

    def _client_gone(self, identity: bytes) -> None:
        for eid, f in list(self._requests.items()):
            if f.identity == identity:
                self._to_replica(f.decision.replica, M.encode("abort", request_id=eid))

    # -- replica messages ----------------------------------------------------------------------------
    def _on_replica_readable(self, r: _Replica) -> None:
        for _ in range(1024):
            if r.sock is None:
                return
            try:
                frames = recv_frames(r.sock, zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                header = msgpack.unpackb(bytes(frames[0].buffer), raw=False)
                self._on_replica_message(r, header, frames)
            except Exception:
                traceback.print_exc()

    def _on_replica_message(self, r: _Replica, header: dict, frames: list) -> None:
        t = header.get("type")
        if t in ("health_reply", "metrics_reply"):
            fo = self._fanouts.get(header.get("corr_id"))
            if fo is not None and r.index in fo.waiting:
                _, f = M.decode(frames, 1 << 62)
                fo.replies[r.index] = f
                fo.waiting.discard(r.index)
                self._finish_ready_fanouts()
            return
        eid = header.get("request_id")
        fw = self._requests.get(eid) if isinstance(eid, str) else None
        if fw is None or fw.decision.replica != r.index:
            return                                     # aborted, retried elsewhere, or a stale reply
        if t == "error" and header.get("code") == "worker_died" and r.alive:
            # the replica's worker died: the replica answers errors until it exits (and Ray restarts
            # it); treat it as dead now, so that this request and its other unstarted ones are retried
            self._replica_died(r, f"replica {r.index} ({r.address}): {header.get('message')}")
            return
        finished = t == "error" or bool(header.get("finished"))
        if t == "output":
            fw.started = True
            fw.frames = []                             # no retry after the first output
        if finished:
            self._requests.pop(eid, None)
            self.policy.release(fw.decision)
        header["request_id"] = fw.client_request_id
        self._send(fw.identity, [msgpack.packb(header, use_bin_type=True), *frames[1:]])

    # -- health / metrics ---------------------------------------------------------------------------------
    def _start_fanout(self, identity: bytes, msg_type: str, corr_id: str) -> None:
        self._seq += 1
        key = f"dp-{self._seq}"
        fo = _Fanout(identity, corr_id, msg_type, time.monotonic() + self.fanout_timeout)
        for r in self.replicas:
            if r.alive and r.sock is not None:
                fo.waiting.add(r.index)
                self._to_replica(r.index, M.encode(msg_type, corr_id=key))
        self._fanouts[key] = fo
        self._finish_ready_fanouts()

    def _expire_fanouts(self) -> None:
        now = time.monotonic()
        for fo in self._fanouts.values():
            if fo.deadline <= now:
                fo.waiting.clear()
        self._finish_ready_fanouts()

    def _finish_ready_fanouts(self) -> None:
        for key, fo in list(self._fanouts.items()):
            if fo.waiting:
                continue
            del self._fanouts[key]
            if fo.msg_type == "health":
                healthy, detail = self._health(fo.replies)
                self._send(fo.identity, M.encode("health_reply", corr_id=fo.corr_id, healthy=healthy, detail=detail))
            else:
                self._send(fo.identity, M.encode("metrics_reply", corr_id=fo.corr_id,
                                                 metrics=self._metrics(fo.replies)))

    def _replica_common(self, r: _Replica) -> dict:
        d = {"engine": r.index, "alive": r.alive, "address": r.address, "num_restarts": r.num_restarts,
             "reason": r.dead_reason}
        d.update({k: v for k, v in r.info.items() if isinstance(v, (str, int, float, bool, type(None)))})
        return d

    def _health(self, replies: dict) -> tuple[bool, dict]:
        """Healthy while at least one replica is healthy (the others' requests go to it)."""
        reps = []
        for r in self.replicas:
            d = self._replica_common(r)
            rep = replies.get(r.index)
            if rep is not None:
                d.update({"healthy": bool(rep["healthy"]), **{k: v for k, v in rep["detail"].items()
                                                               if k not in ("reason",) or v is not None}})
            else:
                d["healthy"] = False
                d.setdefault("reason", None)
                if r.alive:
                    d["reason"] = f"no answer within {self.fanout_timeout:g} s"
            reps.append(d)
        healthy = any(d["healthy"] for d in reps)
        detail = {"reason": None if healthy else "no healthy engine replica",
                  "num_requests_in_flight": len(self._requests), "pid": os.getpid(),
                  "uptime_s": time.time() - self.started_time, "data_parallel_size": len(self.replicas),
                  "num_replicas_healthy": sum(d["healthy"] for d in reps), "replicas": reps}
        return healthy, detail

    def _metrics(self, replies: dict) -> dict:
        """Totals (``merge_metrics`` of the replicas that answered) with the router's own counters,
        and ``replicas``: each replica's snapshot with ``engine`` (its index), ``alive`` and its
        routing load."""
        loads = self.policy.snapshot()
        reps = []
        for r in self.replicas:
            d = dict(replies[r.index]["metrics"]) if r.index in replies else {}
            d.update(self._replica_common(r))
            d["routing"] = loads[r.index]
            reps.append(d)
        m = merge_metrics([replies[i]["metrics"] for i in sorted(replies)])
        m.update({"num_requests_in_flight": len(self._requests), "uptime_s": time.time() - self.started_time,
                  "healthy": any(r.alive for r in self.replicas) and bool(replies),
                  "data_parallel_size": len(self.replicas), "num_replicas_alive": self.num_alive(),
                  "router": {**self.stats, "num_prefix_entries": self.policy.num_prefix_entries(),
                             "routing_us_per_request": 1e6 * self.stats["routing_time_s"] / max(1, self.stats["num_requests"])},
                  "replicas": reps})
        m.setdefault("serving", merge_metrics([]) or {})
        return m
