"""The worker process: owns the device, the weights and the KV cache; runs one StepPlan per message.

Life cycle (driven by ``ipc.zmq_executor.ZmqExecutor``, which spawns this module as
``python -m folio.ipc.worker_process --address A --heartbeat-address H``):

1. connect a DEALER to ``A`` and a PUSH to ``H``; start a heartbeat thread (one ``heartbeat`` every
   ``--heartbeat-interval`` seconds, from its own socket, since ZeroMQ sockets are single-threaded);
2. receive ``init`` (the ``EngineConfig`` as a dict), build ``runtime.worker.model_runner.ModelRunner``
   (loads the model, sizes and allocates the KV cache), answer ``ready`` with ``num_blocks``; on
   failure answer ``error`` and exit 1;
3. loop: ``step`` -> ``runner.execute(plan)`` -> ``step_result`` (an exception inside a step
   becomes ``StepResult.error``; a malformed message becomes an ``error`` reply); ``shutdown`` ->
   ``runner.shutdown()``, ``shutdown_ack``, exit 0. Plans queue up in the socket: with overlap
   scheduling the next plan is usually there before the current step ends. Each result carries the
   time the worker waited for its plan after sending the previous result (``idle_time``).

Orphans: the worker asks the kernel for SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``,
Linux) and also polls its parent pid, so it never outlives the scheduler; an orphaned worker removes
the private socket files the dead scheduler bound. SIGINT is ignored (a
terminal's Ctrl-C reaches the whole process group; the scheduler decides how to stop us).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import os
import signal
import sys
import threading
import time
import traceback

import numpy as np
import zmq

from ..runtime.common.step import StepResult
from . import messages as M
from .transport import cleanup_ipc_address, make_socket, recv_frames, send_frames

PR_SET_PDEATHSIG = 1


def _exit_removing_sockets(addresses: tuple[str, ...], code: int) -> None:
    """Exit, removing the private ``ipc://`` socket files the scheduler bound for us: a SIGKILLed
    scheduler can no longer remove them (no /tmp/folio-* is left behind). Safe whenever we exit,
    since this worker is those sockets' only peer (the scheduler's own clean-up then finds nothing)."""
    for address in addresses:
        cleanup_ipc_address(address)
    os._exit(code)


def _die_with_parent(parent_pid: int, addresses: tuple[str, ...]) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except OSError:
        pass
    if os.getppid() != parent_pid:  # parent died before prctl took effect
        _exit_removing_sockets(addresses, 1)


def _load_factory(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _heartbeat_loop(ctx: zmq.Context, address: str, interval: float, parent_pid: int, stop: threading.Event,
                    addresses: tuple[str, ...]):
    sock = make_socket(ctx, zmq.PUSH, hwm=4)
    sock.connect(address)
    pid = os.getpid()
    try:
        while not stop.wait(interval):
            if os.getppid() != parent_pid:      # orphaned: PDEATHSIG missing (non-Linux) or raced
                _exit_removing_sockets(addresses, 1)
            try:
                send_frames(sock, M.encode("heartbeat", pid=pid, time=time.time()), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
    finally:
        sock.close(0)


def run_worker(address: str, heartbeat_address: str, runner_factory: str, heartbeat_interval: float = 0.5,
               max_message_bytes: int = M.DEFAULT_MAX_MESSAGE_BYTES, parent_pid: int | None = None) -> int:
    """Serve StepPlans until ``shutdown``; returns the exit code.

    ``parent_pid``: the scheduler that spawned us (``ZmqExecutor`` passes it); when our parent is
    not (or no longer) that process we exit at once. Without it the parent is whatever
    ``getppid()`` says at start, which is already init's pid when the scheduler died while this
    interpreter was still starting (a signal to ``folio serve`` at start-up): such a worker waited
    for a plan forever, holding the serve process's stdout open."""
    parent_pid = os.getppid() if parent_pid is None else parent_pid
    addresses = (address, heartbeat_address)
    _die_with_parent(parent_pid, addresses)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM: the scheduler stopping us, or PDEATHSIG when it died. The two cannot be told apart
    # reliably (PDEATHSIG fires when the spawning *thread* exits, before getppid() changes), so the
    # socket files are removed either way
    signal.signal(signal.SIGTERM, lambda *_: _exit_removing_sockets(addresses, 0))

    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER, linger_ms=1000)
    sock.connect(address)
    stop = threading.Event()
    hb = threading.Thread(target=_heartbeat_loop, args=(ctx, heartbeat_address, heartbeat_interval, parent_pid,
                                                        stop, addresses), daemon=True, name="folio-heartbeat")
    hb.start()
    try:
        fields = _wait_for_init(sock, max_message_bytes)
        if fields is None:
            return 0
        runner = _start_runner(sock, fields, runner_factory)
        if runner is None:
            return 1
        _serve_steps(sock, runner, max_message_bytes)
        try:
            runner.shutdown()
        finally:
            send_frames(sock, M.encode("shutdown_ack"))
        return 0
    finally:
        stop.set()
        sock.close()
        hb.join(2 * heartbeat_interval + 1.0)
        if not hb.is_alive():
            ctx.term()


def _wait_for_init(sock: zmq.Socket, max_message_bytes: int) -> dict | None:
    """The fields of the first ``init`` message; ``None`` after a ``shutdown`` (acknowledged).
    Anything else before it gets an ``error`` reply and is skipped."""
    while True:
        try:
            msg_type, fields = M.decode(recv_frames(sock), max_message_bytes)
        except M.MessageError as e:
            send_frames(sock, M.error_reply(str(e)))
            continue
        if msg_type == "shutdown":
            send_frames(sock, M.encode("shutdown_ack"))
            return None
        if msg_type == "init":
            return fields
        send_frames(sock, M.error_reply(f"expected init, got {msg_type}"))


def _start_runner(sock: zmq.Socket, init_fields: dict, runner_factory: str):
    """Build the runner from the ``init`` message's ``EngineConfig`` and answer ``ready`` (its
    ``num_blocks``, our pid, what it runs on); on failure answer a ``worker_init`` error and return
    ``None``."""
    try:
        from ..runtime.common.config import EngineConfig
        config = EngineConfig(**init_fields["config"])
        runner = _load_factory(runner_factory)(config)
        info = {"device": str(getattr(runner, "device", config.device)), "model": config.model}
        act = getattr(getattr(runner, "model", None), "activation_quantization", None)
        if isinstance(act, str):
            info["activation_quantization"] = act
        mc = getattr(runner, "model_config", None)
        if mc is not None and hasattr(mc, "to_dict"):
            info["model_config"] = mc.to_dict()
        send_frames(sock, M.encode("ready", num_blocks=int(runner.num_blocks), pid=os.getpid(), info=info))
        return runner
    except Exception as e:
        traceback.print_exc()   # before the reply: the server may stop the moment it reads it
        send_frames(sock, M.error_reply(f"worker start-up failed: {type(e).__name__}: {e}", code="worker_init"))
        return None


def _serve_steps(sock: zmq.Socket, runner, max_message_bytes: int) -> None:
    """Answer each ``step`` with its ``step_result`` until ``shutdown``. A malformed message gets an
    ``error`` reply; an exception inside a step becomes ``StepResult.error``. Each result carries
    the time the worker waited for its plan after sending the previous result (``idle_time``)."""
    last_sent = None
    while True:
        frames = recv_frames(sock)
        received = time.perf_counter()
        try:
            msg_type, fields = M.decode(frames, max_message_bytes)
            if msg_type == "shutdown":
                return
            if msg_type != "step":
                raise M.MessageError(f"worker expects step or shutdown, got {msg_type}")
            plan = M.plan_from_fields(fields)
        except M.MessageError as e:
            send_frames(sock, M.error_reply(str(e)))
            continue
        try:
            result = runner.execute(plan)
        except Exception as e:
            traceback.print_exc()
            result = StepResult(step_id=plan.step_id, sampled_token_ids=np.zeros(0, np.int64),
                                error=f"{type(e).__name__}: {e}")
        result.idle_time = 0.0 if last_sent is None else received - last_sent
        send_frames(sock, M.encode_result(result))
        last_sent = time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m folio.ipc.worker_process", description="folio worker process")
    p.add_argument("--address", required=True)
    p.add_argument("--heartbeat-address", required=True)
    p.add_argument("--runner", default="folio.runtime.worker.model_runner:ModelRunner",
                   help="module:callable building the runner from an EngineConfig")
    p.add_argument("--heartbeat-interval", type=float, default=0.5)
    p.add_argument("--max-message-bytes", type=int, default=M.DEFAULT_MAX_MESSAGE_BYTES)
    p.add_argument("--parent-pid", type=int, default=None,
                   help="pid of the spawning scheduler: exit if it is not (or no longer) our parent")
    a = p.parse_args(argv)
    return run_worker(a.address, a.heartbeat_address, a.runner, a.heartbeat_interval, a.max_message_bytes,
                      a.parent_pid)


if __name__ == "__main__":
    sys.exit(main())
