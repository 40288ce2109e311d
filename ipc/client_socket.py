"""The client side of a ZeroMQ ROUTER door, shared by the scheduler process's ``Server`` and
the data-parallel ``DataParallelRouter``: drain the queued client messages, hand each to the
owner's ``_handle``, and answer a malformed one (``bad_request``) or one whose handling raised
(``internal``) to its sender alone, so that one bad message never takes the door down.
"""

from __future__ import annotations

import errno
import traceback

import zmq

from . import messages as M
from .transport import recv_frames, send_frames

MAX_MESSAGES_PER_WAKE = 1024  # then the owner's loop gets a turn (steps, heartbeats) before more


class ClientSocket:
    """Mixin: the owner has ``sock`` (the ROUTER), ``stats`` (a dict with ``num_bad_messages``),
    ``_handle(identity, body)`` (may raise ``messages.MessageError``) and ``_client_gone(identity)``
    (abort what a vanished or stuck client asked for)."""

    def _send(self, identity: bytes, frames: list) -> bool:
        """Send now, never blocking; a vanished or stuck client gets its requests aborted
        (``_client_gone``). Returns success."""
        try:
            send_frames(self.sock, frames, identity, flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            if e.errno not in (errno.EHOSTUNREACH, zmq.EAGAIN):
                raise
            self._client_gone(identity)
            return False

    def _on_client_readable(self) -> None:
        """Receive every queued client message (non-blocking) and handle it; never raises."""
        for _ in range(MAX_MESSAGES_PER_WAKE):
            try:
                frames = recv_frames(self.sock, zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, body = bytes(frames[0].buffer), frames[1:]
            try:
                self._handle(identity, body)
            except M.MessageError as e:
                self.stats["num_bad_messages"] += 1
                self._send(identity, M.error_reply(str(e), "bad_request", e.request_id, e.corr_id))
            except Exception as e:  # noqa: BLE001 - a bug must not take the door down for one message
                traceback.print_exc()
                self._send(identity, M.error_reply(f"internal error: {type(e).__name__}: {e}", "internal"))
