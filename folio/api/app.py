"""The FastAPI application: routes, request checks, OpenAI-shaped errors.

Routes (as vLLM serves them): ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models`` (and ``/v1/models/{id}``), ``GET /health`` (200, or 503 when the engine is
gone; with data-parallel replicas a JSON body gives each replica's health), ``GET /metrics``
(Prometheus), ``POST /tokenize``, ``POST /detokenize``, ``GET /version``, ``GET /`` (the chat
page). ``/docs`` has the generated OpenAPI page.

Errors: every error is ``{"error": {"message", "type", "param", "code"}}``. Invalid input is a
400 (never FastAPI's 422, never a 500), an unknown model a 404, a missing or wrong API key a 401,
a foreign ``Host`` or browser ``Origin`` a 403, a body that is not JSON a 415, a body over
``--max-request-bytes`` a 413 (``middleware.py`` has these checks), an engine that is gone a 503.

The event loop only moves bytes: a request's body is read on it (``BodyLimit`` counting), and
everything that costs CPU per request (JSON parsing and validation, the chat template,
tokenization, decoding) runs on the HTTP process's thread pool (``OpenAIServing.offload``), so a
large request never delays ``/health`` or the other streams.
"""

from __future__ import annotations

import html
import json
import logging
from contextlib import asynccontextmanager
from importlib import resources

import pydantic
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..ipc.client import ClientTimeoutError, ServerError
from .metrics import Metrics
from .middleware import add_request_checks, error_response
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .runs import ChatRun, CompletionRun
from .serving import OpenAIServing, api_error_from, cancel_on_disconnect, log_unknown_fields

log = logging.getLogger("folio.api")

HEALTH_TIMEOUT_S = 5.0
# the deepest nesting of a request body's JSON: deeper bodies (and schemas) are a 400 before any
# recursive code (pydantic, dataclasses.asdict, the grammar compiler) walks them; llguidance's
# JSON parser (serde_json) refuses schemas nested deeper than 128 anyway
MAX_JSON_DEPTH = 128
# the routes' request bodies (parsed by the routes, documented in the OpenAPI schema)
BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """FastAPI's list of validation errors as one sentence, and the first field it names."""
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON ({err.get('ctx', {}).get('error', err.get('msg'))})")
            continue
        where = ".".join(loc) or "body"
        param = param or (loc[0] if loc else None)
        parts.append(f"{where}: {err.get('msg')}")
    return "; ".join(dict.fromkeys(parts)) or "invalid request", param


def _nested_deeper_than(data, limit: int) -> bool:
    """Whether JSON ``data`` has containers nested more than ``limit`` deep (walked without recursion)."""
    stack = [(data, 1)] if isinstance(data, (dict, list)) else []
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        children = value.values() if isinstance(value, dict) else value
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _parse(model: type[pydantic.BaseModel], body: bytes):
    """A request model from the body's JSON, with FastAPI's validation errors (a thread-pool job).

    Raises:
        RequestValidationError: not JSON, or not valid for ``model``.
        APIError(400): nested deeper than ``MAX_JSON_DEPTH``.
    """
    too_deep = APIError(400, f"the body is nested too deeply (at most {MAX_JSON_DEPTH} levels of objects and arrays)")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", getattr(e, "pos", 0)),
                                       "msg": "JSON decode error", "input": {},
                                       "ctx": {"error": getattr(e, "msg", None) or str(e)}}]) from None
    except RecursionError:
        raise too_deep from None
    if _nested_deeper_than(data, MAX_JSON_DEPTH):
        raise too_deep
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None


def _document_bodies(app: FastAPI, bodies: dict[str, type[pydantic.BaseModel]]) -> None:
    """The routes parse their bodies themselves (off the event loop): put their request models
    into the OpenAPI schema as FastAPI would."""
    from pydantic.json_schema import models_json_schema

    def openapi():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in bodies.values()],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            for path, m in bodies.items():
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{m.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def build_app(serving: OpenAIServing) -> FastAPI:
    """The application for one ``OpenAIServing`` (its client is opened and closed with the app's lifespan)."""
    @asynccontextmanager
    async def lifespan(app):
        await serving.start()
        try:
            yield
        finally:
            await serving.close()

    app = FastAPI(title="folio", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API of a folio engine")
    add_request_checks(app, serving, json_paths=BODIES)
    _add_error_handlers(app)
    for routes in (generation_routes, model_routes, tokenizer_routes, engine_routes, page_routes):
        app.include_router(routes(serving))
    _document_bodies(app, BODIES)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: validation (400, never 422), ``APIError``, Starlette's own
    (404, 405, 413), and a 500 for a bug."""
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        status = exc.status_code
        message = f"no route {request.method} {request.url.path}" if status in (404, 405) else str(exc.detail)
        return error_response(status, message)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


async def _parse_body(serving: OpenAIServing, request: Request, model):
    return await serving.offload(_parse, model, await request.body())


def generation_routes(serving: OpenAIServing) -> APIRouter:
    """``POST /v1/completions`` and ``/v1/chat/completions``: whole bodies or Server-Sent Events."""
    router = APIRouter()

    async def run(request: Request, runner):
        async def start():
            await runner.group.start()                   # 400 / 503 here, before any status line
            return True

        # a client that leaves before the first token (a queued request; a beam search, which answers
        # only when it ends) cancels the start, and with it its engine requests (AsyncClient aborts them)
        if not await cancel_on_disconnect(request, start()):
            return Response(status_code=499)
        if runner.req.stream:
            # the background task runs however the response ends, even when the client left before the
            # first chunk (then the stream generator never ran its own clean-up): nothing keeps running
            return StreamingResponse(runner.stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(runner.group.close))
        body = await cancel_on_disconnect(request, runner.response())
        if body is None:                                 # the client left; nobody reads this
            return Response(status_code=499)
        return await serving.offload(JSONResponse, body)   # (it serializes the body as it is made)

    def prepare(run_cls, req, path):
        log_unknown_fields(req, path)
        return run_cls(serving, req)          # validation, chat template, tokenization

    @router.post("/v1/completions")
    async def completions(request: Request):
        req = await _parse_body(serving, request, CompletionRequest)
        return await run(request, await serving.offload(prepare, CompletionRun, req, request.url.path))

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _parse_body(serving, request, ChatCompletionRequest)
        return await run(request, await serving.offload(prepare, ChatRun, req, request.url.path))

    return router


def model_routes(serving: OpenAIServing) -> APIRouter:
    """``GET /v1/models`` and ``/v1/models/{model}``: the served names (``--served-model-name``)."""
    router = APIRouter()

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": serving.created, "owned_by": "folio",
                "root": serving.model_root, "parent": None, "max_model_len": serving.max_model_len}

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(n) for n in serving.served_model_names]}

    @router.get("/v1/models/{model:path}")
    async def model(model: str):
        serving.check_model(model)
        return model_card(model)

    return router


def tokenizer_routes(serving: OpenAIServing) -> APIRouter:
    """``POST /tokenize`` (a prompt, or messages through the chat template) and ``/detokenize``."""
    router = APIRouter()

    def tokenize_body(req: TokenizeRequest, path: str) -> dict:
        log_unknown_fields(req, path)
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        text = req.prompt if req.prompt is not None else serving.render_chat(req.messages, req.add_generation_prompt)
        ids = serving.encode(text, req.add_special_tokens)
        return {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids,
                "token_strs": serving.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None}

    def detokenize_body(req: DetokenizeRequest, path: str) -> dict:
        log_unknown_fields(req, path)
        serving.check_model(req.model)
        vocab = serving.tokenizer.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}", "tokens")
        return {"prompt": serving.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @router.post("/tokenize")
    async def tokenize(request: Request):
        req = await _parse_body(serving, request, TokenizeRequest)
        return await serving.offload(tokenize_body, req, request.url.path)

    @router.post("/detokenize")
    async def detokenize(request: Request):
        req = await _parse_body(serving, request, DetokenizeRequest)
        return await serving.offload(detokenize_body, req, request.url.path)

    return router


def engine_routes(serving: OpenAIServing) -> APIRouter:
    """``GET /health``, ``/metrics`` (the scheduler's snapshot in Prometheus' format) and ``/version``."""
    router = APIRouter()
    metrics = Metrics(serving.model_name)

    @router.get("/health")
    async def health():
        try:
            h = await serving.client.health(timeout=HEALTH_TIMEOUT_S)
        except (ServerError, ClientTimeoutError) as e:
            err = api_error_from(e)
            return error_response(503, f"engine unavailable: {err.message}")
        if not h.get("healthy"):
            return error_response(503, f"engine unhealthy: {h.get('reason')}")
        if "replicas" in h:     # data-parallel replicas: each one's state (healthy while one is)
            return JSONResponse({"healthy": True, "num_replicas_healthy": h.get("num_replicas_healthy"),
                                 "replicas": h["replicas"]})
        return Response(status_code=200)

    @router.get("/metrics")
    async def prometheus_metrics():
        try:
            snapshot = await serving.client.get_metrics(timeout=HEALTH_TIMEOUT_S)
        except (ServerError, ClientTimeoutError) as e:
            return error_response(503, f"engine unavailable: {api_error_from(e).message}")
        return Response(metrics.render(snapshot), media_type="text/plain; version=0.0.4; charset=utf-8")

    @router.get("/version")
    async def version():
        return {"version": __version__}

    return router


def page_routes(serving: OpenAIServing) -> APIRouter:
    """``GET /``: the chat page (``chat.html``, the served model's name filled in)."""
    router = APIRouter()
    page = resources.files("folio.api").joinpath("chat.html").read_text(encoding="utf-8")

    @router.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def chat_page():
        return HTMLResponse(page.replace("{{MODEL}}", html.escape(serving.model_name, quote=True)))

    return router
