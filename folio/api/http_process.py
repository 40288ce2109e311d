"""The HTTP process of ``folio serve`` (``python -m folio.api.http_process``; started by
``folio serve``, not by hand).

``folio serve`` binds the listening socket itself (so a busy port fails before the model loads) and
passes it down as an inherited file descriptor, with a pipe on which this process writes one line
once uvicorn accepts connections. The API key comes in the environment (``FOLIO_API_KEY``), never
on the command line. The process dies with its parent (``PR_SET_PDEATHSIG``, as the worker does).

SIGINT / SIGTERM: uvicorn stops accepting, requests still waiting for the engine get the JSON 503
of a shutdown (``AsyncClient.fail_pending``), open responses finish (at most
``--graceful-shutdown-s`` seconds) and the process exits 0 without a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys


REQUEST_BYTES_PER_TOKEN = 64      # default --max-request-bytes: this many bytes per token of max_model_len,
MIN_MAX_REQUEST_BYTES = 1 << 20   # and at least 1 MiB


def default_max_request_bytes(max_model_len: int) -> int:
    """``folio serve``'s default ``--max-request-bytes``: ``max(1 MiB, 64 * max_model_len)``, room for
    a full-length prompt of long tokens written as JSON escapes (a token is a few characters, a
    character up to 6 bytes as ``\\uXXXX``; a token id up to 8 bytes), plus the other fields."""
    return max(MIN_MAX_REQUEST_BYTES, REQUEST_BYTES_PER_TOKEN * int(max_model_len))


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a path to a jinja2 file, or the template text itself (as vLLM takes it).

    Raises:
        ValueError: the template does not compile.
    """
    if value is None:
        return None
    text = value
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
    elif "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a jinja2 template")
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template does not compile: {e}") from None
    return text


def is_loopback_address(address: str) -> bool:
    """Whether a bound socket's address is a loopback one (127.0.0.0/8, ::1)."""
    import ipaddress
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


async def _serve(server, sock: socket.socket, ready_fd: int | None) -> None:
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if ready_fd is not None:
        os.write(ready_fd, b"ready\n" if server.started else b"failed\n")
        os.close(ready_fd)
    await task


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m folio.api.http_process", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scheduler-address", required=True, help="ZeroMQ address of the scheduler process")
    p.add_argument("--listen-fd", type=int, required=True, help="inherited listening socket")
    p.add_argument("--ready-fd", type=int, default=None, help="inherited pipe: one line once serving")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process dies")
    p.add_argument("--model-dir", required=True, help="the model's folder (tokenizer, chat template)")
    p.add_argument("--model-root", required=True, help="the model as given to folio serve (/v1/models root)")
    p.add_argument("--served-model-name", nargs="+", required=True)
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--kv-capacity-tokens", type=int, required=True)
    p.add_argument("--chat-template", default=None)
    p.add_argument("--max-request-bytes", type=int, default=None, help="largest request body (413 beyond); 0: none")
    p.add_argument("--max-num-seqs", type=int, default=None, help="the engine's max_num_seqs (bounds a request's choices)")
    p.add_argument("--allowed-origins", nargs="*", default=[], help="browser origins allowed besides the server's own")
    p.add_argument("--metrics-without-key", action="store_true", help="/metrics needs no API key")
    p.add_argument("--uvicorn-log-level", default="warning")
    p.add_argument("--graceful-shutdown-s", type=float, default=5.0)
    a = p.parse_args(argv)

    if a.parent_pid is not None:
        from ..ipc.worker_process import _die_with_parent
        _die_with_parent(a.parent_pid, (a.scheduler_address,))
    # uvicorn handles SIGINT/SIGTERM while it serves and re-raises them afterwards: let those land here
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    logging.basicConfig(level=logging.INFO, format="folio api: %(message)s", stream=sys.stderr)

    import uvicorn
    from ..model.tokenizer import Tokenizer
    from .app import build_app
    from .serving import OpenAIServing

    tokenizer = Tokenizer.from_pretrained(a.model_dir)
    template = load_chat_template(a.chat_template)
    if template is not None:
        tokenizer.set_chat_template(template)
    sock = socket.socket(fileno=a.listen_fd)
    serving = OpenAIServing(scheduler_address=a.scheduler_address, tokenizer=tokenizer,
                            served_model_names=a.served_model_name, model_root=a.model_root,
                            max_model_len=a.max_model_len, kv_capacity_tokens=a.kv_capacity_tokens,
                            api_key=os.environ.get("FOLIO_API_KEY") or None,
                            max_request_bytes=a.max_request_bytes or None, max_num_seqs=a.max_num_seqs,
                            allowed_origins=a.allowed_origins, loopback_bind=is_loopback_address(sock.getsockname()[0]),
                            metrics_need_key=not a.metrics_without_key)
    level = a.uvicorn_log_level
    config = uvicorn.Config(build_app(serving), log_level=level, access_log=level in ("info", "debug", "trace"),
                            timeout_graceful_shutdown=a.graceful_shutdown_s, lifespan="on")

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            # the requests still waiting for the engine get its 503 now (the scheduler, stopping
            # first, answered those it had), rather than uvicorn's text/plain 500 when the graceful
            # shutdown's time is out
            if serving.client is not None:
                serving.client.fail_pending("server shutting down", "shutdown")
            await super().shutdown(sockets)

    try:
        asyncio.run(_serve(Server(config), sock, a.ready_fd))
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        # we are the only peer of folio serve's private socket for us: remove it, in case folio
        # serve died without its own clean-up (SIGKILL)
        from ..ipc.transport import cleanup_ipc_address
        cleanup_ipc_address(a.scheduler_address)
    return 0


if __name__ == "__main__":
    sys.exit(main())


# ---------------------------------------------------------------------------------------------
# the parent's side (folio serve)
# ---------------------------------------------------------------------------------------------

def bind_http(host: str, port: int, allow_remote: bool = False) -> socket.socket:
    """The listening socket for the HTTP API, bound now so that a busy port fails before the model
    loads (``port`` 0: any free port). Non-loopback hosts need ``allow_remote``.

    Raises:
        ValueError: a non-loopback host without ``allow_remote``, an unknown host, or a port in use.
    """
    from ..ipc.transport import check_address
    bracketed = f"[{host}]" if ":" in host else host
    try:
        check_address(f"tcp://{bracketed}:{port or 1}", allow_remote)
    except ValueError as e:
        raise ValueError(f"--host {host}: {e}") from None
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: {e}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot serve HTTP on {bracketed}:{port}: {e.strerror or e}"
                         + (" (use another --port, or --port 0 for any free one)" if e.errno == 98 else "")) from None
    sock.set_inheritable(True)
    return sock


def http_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


class HttpProcess:
    """Starts the HTTP process on ``sock`` and waits until it serves.

    Args:
        sock: the listening socket (``bind_http``); scheduler_address: where the HTTP process's
            ``AsyncClient`` connects; args: the remaining ``main`` flags as ``{flag: value}`` (a
            list: several values; True: the flag alone; None, False or []: left out);
            api_key: passed in the environment.
    Raises:
        RuntimeError: the process exited or did not report ready within ``startup_timeout`` s.
    """

    def __init__(self, sock: socket.socket, scheduler_address: str, args: dict, api_key: str | None = None,
                 startup_timeout: float = 300.0):
        import select
        import subprocess
        import time
        env = dict(os.environ)
        env.pop("FOLIO_API_KEY", None)
        if api_key:
            env["FOLIO_API_KEY"] = api_key
        r, w = os.pipe()
        cmd = [sys.executable, "-m", "folio.api.http_process", "--scheduler-address", scheduler_address,
               "--listen-fd", str(sock.fileno()), "--ready-fd", str(w), "--parent-pid", str(os.getpid())]
        for flag, value in args.items():
            if value is None or value is False or value == []:
                continue
            cmd += [flag] if value is True else [flag, *(value if isinstance(value, list) else [str(value)])]
        try:
            # its own session, as the worker's: signals to folio serve's group reach only the
            # scheduler, which stops this process in order
            self.proc = subprocess.Popen(cmd, pass_fds=(sock.fileno(), w), env=env, start_new_session=True)
        finally:
            os.close(w)
        try:
            deadline = time.monotonic() + startup_timeout
            line = b""
            while time.monotonic() < deadline and self.proc.poll() is None:
                if select.select([r], [], [], 0.2)[0]:
                    line = os.read(r, 64)
                    break
            if not line.startswith(b"ready"):
                code = self.proc.poll()
                raise RuntimeError("the HTTP process did not start" +
                                   (f" (exit code {code})" if code is not None else f" within {startup_timeout:g} s"))
        except BaseException:
            self.stop()
            raise
        finally:
            os.close(r)

    def watch(self, on_exit) -> None:
        """Call ``on_exit(returncode)`` from a daemon thread when the process ends."""
        import threading
        threading.Thread(target=lambda: on_exit(self.proc.wait()), daemon=True, name="folio-http-watch").start()

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (graceful: open responses get ``--graceful-shutdown-s``), then SIGKILL after ``timeout``."""
        import subprocess
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
