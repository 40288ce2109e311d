"""ZeroMQ plumbing shared by folio's processes: address checks, socket set-up, framed send/recv.

Sockets (ZeroMQ guide, ch. 3 "Advanced Request-Reply Patterns"):
  clients  DEALER --> ROUTER  scheduler     (many clients, many requests each, replies by identity)
  scheduler DEALER <-> DEALER worker        (one plan out, one result back, per step)
  worker   PUSH  -->  PULL    scheduler     (heartbeats, from a thread of their own)

Arrays go out as separate frames with ``copy=False`` (pyzmq then sends the NumPy buffer without
copying it) and come in with ``copy=False`` (``zmq.Frame`` buffers that ``messages.decode`` views).
"""

from __future__ import annotations

import ipaddress
import os
import socket as _socket
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Sequence

import zmq
import zmq.utils.monitor

DEFAULT_ADDRESS = "tcp://127.0.0.1:5555"


def check_address(address: str, allow_remote: bool = False) -> str:
    """Validate a bind address: ``tcp://HOST:PORT`` or ``ipc://PATH``.

    Binding to anything other than a loopback host needs ``allow_remote=True`` (folio has no
    authentication; exposing it is an explicit choice).

    Raises:
        ValueError: malformed address, or a non-loopback host without ``allow_remote``.
    """
    if address.startswith("ipc://"):
        if len(address) <= len("ipc://"):
            raise ValueError(f"empty ipc path in {address!r}")
        return address
    if not address.startswith("tcp://"):
        raise ValueError(f"address must be tcp://HOST:PORT or ipc://PATH, got {address!r}")
    host, sep, port = address[len("tcp://"):].rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {address!r} needs a port (1-65535)")
    host = host.strip("[]")
    if host in ("localhost",):
        return address
    try:
        ip = ipaddress.ip_address(host)
        loopback = ip.is_loopback
    except ValueError:
        if host == "*":
            loopback = False
        else:
            try:
                loopback = ipaddress.ip_address(_socket.gethostbyname(host)).is_loopback
            except OSError as e:
                raise ValueError(f"cannot resolve host {host!r}: {e}") from None
    if not loopback and not allow_remote:
        raise ValueError(f"refusing to bind {address!r}: not a loopback address (pass --allow-remote to expose "
                         f"the server; it has no authentication)")
    return address


def private_ipc_address(tag: str) -> str:
    """A fresh ``ipc://`` path in a private temporary directory (for scheduler <-> worker)."""
    d = tempfile.mkdtemp(prefix="folio-")
    os.chmod(d, 0o700)
    return f"ipc://{os.path.join(d, f'{tag}-{uuid.uuid4().hex[:8]}.sock')}"


def cleanup_ipc_address(address: str) -> None:
    """Remove the socket file behind an ``ipc://`` address, and its directory if that is an empty
    private one made by ``private_ipc_address`` (a user's own folder is left alone)."""
    if not address.startswith("ipc://"):
        return
    path = address[len("ipc://"):]
    steps = [(path, os.unlink)]
    if os.path.basename(os.path.dirname(path)).startswith("folio-"):
        steps.append((os.path.dirname(path), os.rmdir))
    for p, fn in steps:
        try:
            fn(p)
        except OSError:
            pass


def wait_for_server(address: str, timeout: float, refused_grace: float = 1.0) -> None:
    """Check that a ZeroMQ peer listens at ``address``: connect a probe socket and wait for the
    ZMTP handshake (a socket-monitor event; no message is sent to the server's application).

    Fails fast: at once for an ``ipc://`` path that does not exist, ``refused_grace`` seconds after
    a TCP connection was first refused (a server just starting gets that long to bind), else after
    ``timeout`` seconds.

    Raises:
        ConnectionError: no handshake; the message names the address and what to do.
        ValueError: a malformed address.
    """
    hint = "is `folio serve` running there? (start one with `folio serve`)"
    if address.startswith("ipc://") and not os.path.exists(address[len("ipc://"):]):
        raise ConnectionError(f"no folio server at {address}: the socket file does not exist; {hint}")
    ctx = zmq.Context.instance()
    sock = make_socket(ctx, zmq.DEALER)
    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CONNECT_RETRIED)
    try:
        try:
            sock.connect(address)
        except zmq.ZMQError as e:
            raise ValueError(f"cannot connect to {address!r}: {e}") from None
        end = time.monotonic() + timeout
        refused_at = None
        while True:
            now = time.monotonic()
            limit = end if refused_at is None else min(end, refused_at + refused_grace)
            if now >= limit:
                why = "the connection was refused" if refused_at is not None else \
                    f"nothing answered within {timeout:g} s"
                raise ConnectionError(f"no folio server at {address}: {why}; {hint}")
            if mon.poll(max(1, int(1000 * (limit - now)))):
                event = zmq.utils.monitor.recv_monitor_message(mon)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    return
                refused_at = refused_at or time.monotonic()
    finally:
        sock.disable_monitor()
        mon.close(0)
        sock.close(0)


def make_socket(ctx: zmq.Context, kind: int, *, linger_ms: int = 0, hwm: int = 0) -> zmq.Socket:
    """A socket with folio's defaults: bounded linger (close never hangs), unlimited HWM unless set."""
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, linger_ms)
    s.setsockopt(zmq.SNDHWM, hwm)
    s.setsockopt(zmq.RCVHWM, hwm)
    return s


def send_frames(sock: zmq.Socket, frames: Sequence, identity: bytes | None = None, flags: int = 0) -> None:
    """Send one message (prefixing a ROUTER identity when given); array frames go without a copy."""
    if identity is not None:
        frames = [identity, *frames]
    sock.send_multipart(frames, flags=flags, copy=False)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list:
    """Receive one message as ``zmq.Frame`` objects (zero-copy)."""
    return sock.recv_multipart(flags=flags, copy=False)


@dataclass(frozen=True)
class CurveKeys:
    """The ZeroMQ CURVE keys of one data-parallel cluster (Z85-encoded, 40 bytes each): the
    replicas' doors share the server pair, the router holds the one client pair they admit.

    CURVE (CurveZMQ, ZeroMQ RFC 26) encrypts each connection and authenticates both ends in its
    handshake; a peer without the client secret is refused there, before any message reaches
    folio (``curve_server`` installs the check, ZeroMQ's ZAP handler as pyzmq implements it).
    The keys are made per cluster by the door (``generate``) and reach the replicas as their
    actors' arguments; nothing is written to disk.
    """

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes = b""      # the router's alone: not given to the replicas

    @classmethod
    def generate(cls) -> "CurveKeys":
        """Fresh key pairs (``zmq.curve_keypair``). Raises RuntimeError if libzmq lacks CURVE."""
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE security (needed to authenticate the replicas' doors)")
        sp, ss = zmq.curve_keypair()
        cp, cs = zmq.curve_keypair()
        return cls(sp, ss, cp, cs)

    def for_replicas(self) -> "CurveKeys":
        """The keys without the client secret: what a replica needs."""
        return CurveKeys(self.server_public, self.server_secret, self.client_public)


class _OneClientKey:
    """pyzmq's CURVE credentials provider admitting one client public key."""

    def __init__(self, client_public: bytes):
        self._key = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self._key


def curve_server(ctx: zmq.Context, sock: zmq.Socket, keys: CurveKeys):
    """Make ``sock`` (before it binds) a CURVE server admitting only ``keys.client_public``; starts
    the context's ZAP handler (``zmq.auth.thread.ThreadAuthenticator``, one per context) and returns
    it (``stop()`` it when the socket closes)."""
    from zmq.auth.thread import ThreadAuthenticator
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=_OneClientKey(keys.client_public))
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True
    return auth


def curve_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` (before it connects) the CURVE client of ``keys``' servers."""
    sock.curve_secretkey = keys.client_secret
    sock.curve_publickey = keys.client_public
    sock.curve_serverkey = keys.server_public
