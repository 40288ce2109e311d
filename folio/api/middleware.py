"""The checks every HTTP request passes before its route, as ASGI middleware, each answered at once
with an OpenAI-shaped error and before the body is read.

In the order a request meets them:

1. ``OriginCheck``: the ``Host`` header and the browser's ``Origin``.
   - Host (DNS rebinding): on a loopback bind, ``Host`` must name loopback: ``localhost`` or a
     name under ``.localhost``, a loopback IP, or this machine's host name; else 403. A web page
     whose own name was re-pointed at 127.0.0.1 reaches the server with its own name as ``Host``.
     A non-loopback bind (``--allow-remote``) is reached by whatever names its network gives it,
     and ``Host`` is not checked there (as Ollama's ``allowedHostsMiddleware``).
   - Origin (cross-site requests): a request whose ``Origin`` is not the server's own
     (``http://`` + its ``Host``) is refused (403) unless ``allowed_origins`` lists it (``*``:
     any; vLLM's ``--allowed-origins``, Ollama's ``OLLAMA_ORIGINS``). Requests without ``Origin``
     (curl, the SDKs; browsers send it on every cross-origin request and on POSTs) pass.
2. CORS for the allowed origins (Starlette's ``CORSMiddleware``: preflights answered, the
   ``Access-Control-Allow-*`` headers added), when there are any.
3. ``KeyAndTypeCheck``: the API key (``Authorization: Bearer KEY``; 401) on every path but the
   open ones (``/metrics`` among them only with ``metrics_need_key`` false), and the body's type
   on the JSON routes: ``application/json``, an ``application/*+json`` type, or none (as FastAPI
   reads a body); another, such as the ``text/plain`` of a cross-site form, is a 415.
4. ``BodyLimit``: a body over ``--max-request-bytes`` is a 413.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from .protocol import error_body

# paths that need no API key (the chat page asks for the key itself; health for supervisors)
OPEN_PATHS = frozenset({"/", "/health", "/metrics", "/version", "/docs", "/openapi.json", "/docs/oauth2-redirect",
                        "/redoc"})


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def _header(scope, name: bytes) -> str | None:
    value = next((v for k, v in scope["headers"] if k == name), None)
    return value.decode("latin-1") if value is not None else None


def host_name(host: str) -> str:
    """The name or address of a ``Host`` header without its port (``[::1]:8000`` -> ``::1``), lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host[1:]
    if host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    return host.rstrip(".")


def is_loopback_host(name: str) -> bool:
    """Whether a ``Host`` name (``host_name``) can only mean this machine: ``localhost``, a name
    under ``.localhost`` (RFC 6761), a loopback IP, or this machine's host name."""
    if name == "localhost" or name.endswith(".localhost") or name == socket.gethostname().lower():
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def parse_origins(values: list[str] | None) -> list[str]:
    """``--allowed-origins`` values as origins: each value one origin, several separated by
    commas, or a JSON list (vLLM's form, ``'["http://a:3000"]'``); lower case, no trailing ``/``.

    Raises:
        ValueError: a value that is not ``*``, ``null`` or ``scheme://host[:port]``.
    """
    import json
    out = []
    for value in values or []:
        items = json.loads(value) if value.strip().startswith("[") else value.split(",")
        for item in items:
            origin = str(item).strip().lower().rstrip("/")
            if origin not in ("*", "null") and ("://" not in origin or "/" in origin.split("://", 1)[1]):
                raise ValueError(f"--allowed-origins: {item!r} is not an origin (scheme://host[:port], or *)")
            if origin:
                out.append(origin)
    return out


class OriginCheck:
    """ASGI middleware: the ``Host`` check of a loopback bind and the ``Origin`` check (module
    docstring). ``allowed_origins``: lower-case origins, ``*`` for any."""

    def __init__(self, app, allowed_origins: list[str], loopback_bind: bool):
        self.app, self.loopback_bind = app, loopback_bind
        self.allowed = frozenset(allowed_origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host = _header(scope, b"host")
        if self.loopback_bind and host is not None and not is_loopback_host(host_name(host)):
            return await error_response(403, f"Host {host!r} is not this server: it serves on loopback only, "
                                             "as localhost or 127.0.0.1 (a web page's own name pointed at "
                                             "127.0.0.1 is refused)")(scope, receive, send)
        origin = _header(scope, b"origin")
        if origin is not None and "*" not in self.allowed:
            own = f"{scope.get('scheme', 'http')}://{host}".lower() if host is not None else None
            if origin.lower().rstrip("/") != own and origin.lower().rstrip("/") not in self.allowed:
                return await error_response(403, f"requests from the web page origin {origin!r} are not allowed "
                                                 "(folio serve --allowed-origins lists the ones that are)"
                                            )(scope, receive, send)
        await self.app(scope, receive, send)


def _is_json_type(content_type: str | None) -> bool:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return not media or media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class KeyAndTypeCheck:
    """ASGI middleware: the API key and, on ``json_paths``, the body's content type (module docstring)."""

    def __init__(self, app, api_key: str | None, metrics_need_key: bool, json_paths):
        self.app, self.api_key, self.json_paths = app, api_key, frozenset(json_paths)
        self.open_paths = OPEN_PATHS - {"/metrics"} if metrics_need_key else OPEN_PATHS

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if self.api_key is not None and path not in self.open_paths:
            given = _header(scope, b"authorization") or ""
            if not hmac.compare_digest(given.encode("latin-1"), f"Bearer {self.api_key}".encode()):
                return await error_response(401, "invalid or missing API key: send the header "
                                                 "'Authorization: Bearer <key>'")(scope, receive, send)
        if scope["method"] == "POST" and path in self.json_paths:
            content_type = _header(scope, b"content-type")
            if not _is_json_type(content_type):
                return await error_response(415, f"the body must be JSON (Content-Type: application/json), "
                                                 f"got Content-Type {content_type!r}")(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is answered 413 at once, before it is read
    whole: by its ``Content-Length`` before any of it is read, or, sent without one (chunked), as
    soon as the bytes received pass the limit. ``max_bytes`` ``None`` or 0: no limit."""

    def __init__(self, app, max_bytes: int | None):
        self.app, self.max_bytes = app, max_bytes

    def _message(self, size: str) -> str:
        return (f"the request body ({size}) is over this server's limit of {self.max_bytes} bytes "
                "(folio serve --max-request-bytes)")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.max_bytes:
            return await self.app(scope, receive, send)
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await error_response(413, self._message(f"{int(length)} bytes"))(scope, receive, send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:       # the route's handler answers with the 413
                    raise StarletteHTTPException(413, self._message(f"over {received} bytes so far"))
            return message

        await self.app(scope, counted, send)


def add_request_checks(app, serving, json_paths) -> None:
    """Install the checks of the module docstring on ``app`` for an ``OpenAIServing``'s settings
    (Starlette runs the middleware added last first)."""
    app.add_middleware(BodyLimit, max_bytes=serving.max_request_bytes)
    app.add_middleware(KeyAndTypeCheck, api_key=serving.api_key, metrics_need_key=serving.metrics_need_key,
                       json_paths=json_paths)
    if serving.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(serving.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(OriginCheck, allowed_origins=serving.allowed_origins, loopback_bind=serving.loopback_bind)
