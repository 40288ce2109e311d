"""OpenAI requests -> engine requests (through ``AsyncClient``), engine deltas -> OpenAI responses.

One HTTP request becomes one engine request per prompt (each with ``n`` samples, which the engine
runs as parallel sampling); choice ``k`` of the response is sample ``k % n`` of prompt ``k // n``,
as vLLM numbers them. The HTTP process tokenizes (and applies the chat template) itself, with the
same ``InputProcessor`` as the engine (``runtime/inputs/input_processor.py``), on its thread
pool, and sends token ids: it knows each prompt's length and refuses one that cannot fit
``max_model_len`` naming the field at fault; the engine still validates every request (its
message becomes a 400).

Streaming (Server-Sent Events, ``data: {json}`` ... ``data: [DONE]``): the status line is sent only
after every engine request has answered once (first token or error), so a request the engine
rejects gets a 400, not a 200 followed by an error event. Later errors (the engine shutting down)
arrive as a ``data: {"error": ...}`` event before ``[DONE]``. Leaving the response early (client
disconnect) cancels the tasks reading the engine streams, and ``AsyncClient`` then aborts the
requests, which frees their KV blocks at the scheduler's next step.

Shapes: ``vllm/entrypoints/openai/serving_completion.py`` / ``serving_chat.py`` (choices, usage with
``prompt_tokens_details.cached_tokens``, ``stop_reason``, the final usage chunk with empty
``choices`` when ``stream_options.include_usage``), and OpenAI's API reference.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import AsyncIterator

from ..ipc.client import AsyncClient, ClientTimeoutError, ServerError, StreamDelta
from ..runtime.common.sampling_params import BeamSearchParams, SamplingParams
from ..runtime.common.grammar import GrammarError, check_constraint
from ..runtime.inputs.input_processor import InputError, InputProcessor
from .protocol import APIError, ChatMessage

log = logging.getLogger("folio.api")

# ServerError codes (ipc/scheduler_process.py) -> HTTP status
_STATUS = {"invalid_argument": 400, "bad_request": 400, "worker_died": 503, "shutdown": 503}
LOGPROB_FLOOR = -9999.0   # JSON has no -Infinity; vLLM sends this for a zero probability


def api_error_from(exc: Exception) -> APIError:
    """An ``APIError`` for a failure reported by the scheduler (or no answer from it), or for a
    request the client could not send (``_WIRE_ERRORS``: a 400)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InputError):
        return APIError(400, str(exc), exc.param)
    if isinstance(exc, _WIRE_ERRORS):
        return APIError(400, f"the request has a value the engine cannot take (integers must fit in 64 bits, "
                             f"text must be valid Unicode): {exc}")
    if isinstance(exc, ServerError):
        status = _STATUS.get(exc.code, 500)
        param = exc.message.split(" ", 1)[0].rstrip(":") if status == 400 else None
        return APIError(status, exc.message, param if param in _SAMPLING_NAMES else None)
    if isinstance(exc, ClientTimeoutError):
        return APIError(503, f"the engine did not answer: {exc}")
    return APIError(500, f"{type(exc).__name__}: {exc}")


# what encoding an engine request raises for a value JSON allows but msgpack / int64 arrays / UTF-8
# do not: an integer of 64 bits or more (OverflowError), a lone surrogate (UnicodeEncodeError)
_WIRE_ERRORS = (OverflowError, UnicodeEncodeError)
_SAMPLING_NAMES = {f for f in SamplingParams.__dataclass_fields__} | {"prompt", "messages", "max_completion_tokens"}


@dataclass
class OpenAIServing:
    """What the routes share: the scheduler client, the tokenizer and the served model's facts.

    Attributes:
        scheduler_address: the ZeroMQ address of the scheduler process.
        tokenizer: a ``folio.model.tokenizer.Tokenizer`` (chat template included).
        served_model_names: names a request's ``model`` may use (the first names the responses).
        model_root: the model's folder or name (``/v1/models`` ``root``).
        max_model_len: the engine's limit on prompt + output tokens.
        kv_capacity_tokens: token slots of the whole KV cache (caps a chat's default max_tokens).
        api_key: the Bearer key ``/v1`` routes need, or None.
        max_request_bytes: the largest request body taken (413 beyond), or None: no limit.
        max_workers: threads of the pool that runs the per-request CPU work (``offload``).
        max_num_seqs: the engine's most sequences in one step, which bounds one request's choices
            (``check_choices``), or None: not checked here.
        allowed_origins: browser origins allowed besides the server's own (``*``: any).
        loopback_bind: the server listens on a loopback address: the ``Host`` header must name
            loopback (``middleware.py``).
        metrics_need_key: with an ``api_key``, ``/metrics`` needs it too.
    """

    scheduler_address: str
    tokenizer: object
    served_model_names: list[str]
    model_root: str
    max_model_len: int
    kv_capacity_tokens: int
    api_key: str | None = None
    client: AsyncClient | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _token_text: dict = field(default_factory=dict)
    max_request_bytes: int | None = None
    max_workers: int = 4
    max_num_seqs: int | None = None
    allowed_origins: list[str] = field(default_factory=list)
    loopback_bind: bool = False
    metrics_need_key: bool = True
    inputs: InputProcessor = field(init=False)

    def __post_init__(self):
        self.inputs = InputProcessor(self.tokenizer, self.max_model_len)
        # tokenization, chat templates, request parsing: off the event loop (HF tokenizers' batch
        # encode releases the GIL, so /health and the streams run meanwhile)
        self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="folio-api-cpu")

    async def offload(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the HTTP process's thread pool (per-request CPU work)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, partial(fn, *args, **kwargs))

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    async def start(self) -> None:
        # no per-message timeout: a queued request may wait long; the scheduler reports its own death
        self.client = AsyncClient(self.scheduler_address, timeout=None)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_model_names:
            raise APIError(404, f"The model `{name}` does not exist (this server serves "
                                f"{', '.join(self.served_model_names)}).", "model")

    def token_text(self, token_id: int, as_id: bool) -> str:
        """The text of one token for logprobs (``token_id:N`` with return_tokens_as_token_ids)."""
        if as_id:
            return f"token_id:{token_id}"
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    continue_final_message: bool = False, kwargs: dict | None = None,
                    tools: list[dict] | None = None) -> str:
        """The prompt text of a conversation (the model's chat template, or ``--chat-template``);
        ``tools`` are handed to the template, and an assistant message's ``tool_calls`` / a tool
        message's ``tool_call_id`` go with their message.

        Raises:
            APIError(400): content parts other than text, no chat template, or a template error.
        """
        msgs = []
        for i, m in enumerate(messages):
            msg = {"role": m.role, "content": _message_text(m, i)}
            for key in ("tool_calls", "tool_call_id", "name"):
                value = getattr(m, key, None) if key == "name" else (m.model_extra or {}).get(key)
                if value is not None:
                    msg[key] = value
            msgs.append(msg)
        try:
            return self.inputs.render_chat(msgs, add_generation_prompt, continue_final_message, kwargs, tools)
        except InputError as e:
            raise api_error_from(e) from None

    def encode(self, text: str, add_special_tokens: bool = False, param: str = "prompt",
               max_tokens: int | None | bool = False, max_tokens_param: str = "max_tokens") -> list[int]:
        """Token ids of ``text`` (``InputProcessor.tokenize``: with ``max_tokens`` given, a text too
        long for ``max_model_len`` is refused, before tokenizing when its length proves it).

        Raises:
            APIError(400): text that is not valid Unicode, or too long (naming ``param`` or
                ``max_tokens_param``).
        """
        try:
            return self.inputs.tokenize(text, add_special_tokens, param=param, max_tokens=max_tokens,
                                        max_tokens_param=max_tokens_param)
        except InputError as e:
            raise api_error_from(e) from None

    def check_choices(self, num_prompts: int, n: int, n_param: str = "n") -> None:
        """Bound the request's choices before anything is built for them: ``n`` samples (or beams)
        of each of ``num_prompts`` prompts all run side by side, so ``n`` and ``num_prompts x n``
        must each be at most ``max_num_seqs``; each choice is at most ``max_model_len`` tokens
        (``check_length``), so what one request holds is at most ``max_num_seqs x max_model_len``
        tokens of output.

        Raises:
            APIError(400): ``n`` (named ``n_param``) or the prompts (``prompt``) over the limit.
        """
        limit = self.max_num_seqs
        if limit is None or not isinstance(n, int) or n < 1:    # (n < 1: SamplingParams' message)
            return
        if n > limit:
            raise APIError(400, f"{n_param} ({n}) exceeds max_num_seqs ({limit}): the samples of one request run "
                                "side by side", n_param)
        if num_prompts * n > limit:
            raise APIError(400, f"{num_prompts} prompts x {n_param} ({n}) = {num_prompts * n} choices exceed "
                                f"max_num_seqs ({limit}): one request's choices run side by side; send the "
                                "prompts in several requests", "prompt")

    def check_length(self, num_prompt: int, max_tokens: int | None, param: str = "prompt",
                     max_tokens_param: str = "max_tokens") -> None:
        """Raises ``APIError(400)`` when the prompt + ``max_tokens`` cannot fit ``max_model_len``."""
        try:
            self.inputs.check_length(num_prompt, max_tokens, param=param, max_tokens_param=max_tokens_param)
        except InputError as e:
            raise api_error_from(e) from None


# the fields of ``structured_outputs`` that tune a JSON constraint rather than set one: a chat
# request may send them beside ``response_format`` or a tool constraint
JSON_OPTIONS = ("disable_any_whitespace", "whitespace_pattern")


def json_options(so) -> dict | None:
    """``structured_outputs``' JSON options when that is all it holds (``JSON_OPTIONS``), else None."""
    if isinstance(so, dict) and so and set(so) <= set(JSON_OPTIONS):
        return dict(so)
    return None


def response_format_constraint(fmt: dict | None) -> dict | None:
    """The ``structured_outputs`` dict of OpenAI's ``response_format``: ``text`` (none),
    ``json_object`` (any JSON object) or ``json_schema`` (``{"json_schema": {"name", "schema",
    "strict"}}``: the schema; folio always enforces it, ``strict`` or not).

    Raises:
        APIError(400, param response_format): another type, or a json_schema without a schema.
    """
    if fmt is None:
        return None
    kind = fmt.get("type", "text") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "response_format json_schema needs {json_schema: {name, schema}} with schema "
                                "a JSON object", "response_format")
        return {"json": schema}
    raise APIError(400, f"response_format type must be text, json_object or json_schema, got {kind!r}",
                   "response_format")


def _message_text(m: ChatMessage, i: int) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for p in m.content:
        if p.type != "text" or p.text is None:
            raise APIError(400, f"messages[{i}]: only text content parts are supported, got {p.type!r}",
                           "messages")
        parts.append(p.text)
    return "\n".join(parts)


def log_unknown_fields(body, path: str) -> None:
    """One log line naming the fields a request had that folio ignores (nested ones included)."""
    names = list(body.model_extra or {})
    for key in ("stream_options",):
        sub = getattr(body, key, None)
        if sub is not None and sub.model_extra:
            names += [f"{key}.{k}" for k in sub.model_extra]
    for i, m in enumerate(getattr(body, "messages", None) or []):
        if m.model_extra:
            names += [f"messages[{i}].{k}" for k in m.model_extra]
    if names:
        log.info("%s: ignoring unknown field(s): %s", path, ", ".join(names))


def sampling_params(req, max_tokens: int | None, logprobs: int | None, renames: dict | None = None,
                    structured_outputs: dict | None = None) -> dict:
    """The ``SamplingParams`` fields of a request (defaults where the request leaves one out).

    Args:
        renames: ``{SamplingParams field: request field}`` where the request names a value
            differently (chat's ``top_logprobs`` is ``logprobs``): an error names the request's field.
    Raises:
        APIError(400): an unsupported feature, an invalid value (message from ``SamplingParams``),
            or a constraint over ``MAX_GRAMMAR_CHARS`` (param: what ``renames`` calls
            ``structured_outputs``). The constraint is compiled by the engine's worker, which
            refuses it there (a 400 from ``RequestGroup.start``) if it does not compile.
    """
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", "logit_bias")
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "prompt_logprobs are not available when stream is true (as vLLM)", "prompt_logprobs")
    d = {"n": req.n, "max_tokens": max_tokens, "presence_penalty": req.presence_penalty,
         "frequency_penalty": req.frequency_penalty, "seed": req.seed, "stop": req.stop,
         "stop_token_ids": req.stop_token_ids, "min_tokens": req.min_tokens, "ignore_eos": req.ignore_eos,
         "include_stop_str_in_output": req.include_stop_str_in_output,
         "skip_special_tokens": req.skip_special_tokens, "logprobs": logprobs,
         "prompt_logprobs": req.prompt_logprobs, "structured_outputs": structured_outputs}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if getattr(req, name) is not None:
            d[name] = getattr(req, name)
    if d.get("top_k") == -1:
        d["top_k"] = 0                  # vLLM's "off"; folio takes -1 as well, keep one spelling
    try:
        sp = SamplingParams.from_dict(d)
        if sp.structured_outputs is not None:   # its size here; the engine's worker compiles it
            check_constraint(sp.structured_outputs, (renames or {}).get("structured_outputs", "structured_outputs"))
        return sp.to_dict()
    except GrammarError as e:
        raise APIError(400, str(e), e.param) from None
    except ValueError as e:
        message = str(e)
        name = message.split(" ", 1)[0]
        if renames and name in renames:
            name = renames[name]
            message = name + message[message.index(" "):]
        raise APIError(400, message, name if name in _SAMPLING_NAMES | set((renames or {}).values()) else None) \
            from None


def beam_search_params(req, sampling: dict) -> dict:
    """The ``BeamSearchParams`` of a request with vLLM's ``use_beam_search`` extension: width
    ``beam_width`` or else ``n`` (vLLM), the request's max_tokens, ignore_eos, length_penalty,
    include_stop_str_in_output; temperature 0 unless given (vLLM's completions default to 1,
    which adds a random candidate per beam; folio's search stays deterministic).

    Raises:
        APIError(400): stop strings / stop tokens / min_tokens / logprobs, which folio's beam search
            does not take, or an invalid value.
    """
    for name in ("stop", "stop_token_ids", "min_tokens"):
        if sampling.get(name):
            raise APIError(400, f"{name} is not supported with use_beam_search", name)
    for name in ("logprobs", "prompt_logprobs"):
        if sampling.get(name) is not None:
            raise APIError(400, f"{name} are not supported with use_beam_search", name)
    if sampling.get("structured_outputs") is not None:
        raise APIError(400, "use_beam_search cannot be combined with a constraint (structured_outputs, "
                            "response_format, tool_choice required or named)", "use_beam_search")
    try:
        return BeamSearchParams(
            beam_width=req.beam_width if req.beam_width is not None else req.n,
            # (None: the prompt alone fills the model; the engine says so, naming the numbers)
            max_tokens=sampling["max_tokens"] if sampling["max_tokens"] is not None else 1,
            ignore_eos=req.ignore_eos, temperature=req.temperature or 0.0, length_penalty=req.length_penalty,
            include_stop_str_in_output=req.include_stop_str_in_output).to_dict()
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), name if name in ("beam_width", "length_penalty", "temperature") else None) from None


# ---------------------------------------------------------------------------------------------
# engine requests of one HTTP request
# ---------------------------------------------------------------------------------------------

class RequestGroup:
    """The engine requests of one HTTP request (one per prompt), their deltas merged as they arrive.

    ``start()`` sends them and waits until each has answered once; ``deltas()`` yields
    ``(prompt_index, StreamDelta)``; ``close()`` cancels what still runs (the client aborts it).
    """

    def __init__(self, client: AsyncClient, prompts: list[list[int]], sampling: dict, cache_salt: str | None,
                 constraint_param: str = "structured_outputs"):
        self.client, self.prompts, self.sampling, self.cache_salt = client, prompts, sampling, cache_salt
        self.constraint_param = constraint_param   # the request's field the constraint came from
        self.rid = uuid.uuid4().hex
        self._q: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._buffer: list = []
        self._open = len(prompts)

    async def _pump(self, i: int, ids: list[int]) -> None:
        try:
            async for d in self.client.generate_stream(prompt_token_ids=ids, sampling_params=self.sampling,
                                                       request_id=f"{self.rid}-{i}", cache_salt=self.cache_salt):
                self._q.put_nowait((i, d, None))
        except Exception as e:      # start() must never wait for an answer that cannot come
            if not isinstance(e, (ServerError, ClientTimeoutError, *_WIRE_ERRORS)):
                log.exception("engine request %s-%d failed", self.rid, i)     # a bug
            self._q.put_nowait((i, None, e))
            return
        self._q.put_nowait((i, None, None))

    async def start(self) -> None:
        """Raises ``APIError`` if the engine rejected one of the requests (the others are aborted)."""
        self._tasks = [asyncio.ensure_future(self._pump(i, ids)) for i, ids in enumerate(self.prompts)]
        answered: set[int] = set()
        try:
            while len(answered) < len(self.prompts):
                item = await self._q.get()
                i, d, exc = item
                if exc is not None:
                    raise self._named(api_error_from(exc))
                answered.add(i)
                self._buffer.append(item)
        except BaseException:
            await self.close()
            raise

    def _named(self, err: APIError) -> APIError:
        """An engine error about the constraint names the request's own field (``response_format``,
        ``tools``) rather than ``structured_outputs``."""
        if err.param == "structured_outputs" and self.constraint_param != "structured_outputs":
            err.param = self.constraint_param
            err.message = err.message.replace("structured_outputs", self.constraint_param, 1)
        return err

    async def deltas(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        """Raises ``APIError`` for an engine error after the start (e.g. shutdown)."""
        while self._open:
            i, d, exc = self._buffer.pop(0) if self._buffer else await self._q.get()
            if exc is not None:
                raise api_error_from(exc)
            if d is None:
                self._open -= 1
                continue
            yield i, d

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


class BeamSearchGroup:
    """``RequestGroup``'s interface over beam searches (one per prompt): ``start()`` runs them to
    the end (a beam search answers once), ``deltas()`` yields each result sequence as one finished
    delta of choice ``rank``."""

    def __init__(self, client: AsyncClient, prompts: list[list[int]], params: dict, cache_salt: str | None):
        self.client, self.prompts, self.params, self.cache_salt = client, prompts, params, cache_salt
        self.outputs: list = []

    async def start(self) -> None:
        salt = {"cache_salt": self.cache_salt} if self.cache_salt is not None else {}
        try:
            self.outputs = await self.client.beam_search([{"prompt_token_ids": ids, **salt} for ids in self.prompts],
                                                         self.params)
        except (ServerError, ClientTimeoutError) as e:
            raise api_error_from(e) from None

    async def deltas(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        for i, (ids, out) in enumerate(zip(self.prompts, self.outputs)):
            for rank, s in enumerate(out.sequences):
                yield i, StreamDelta("", rank, s.token_ids, s.text, s.finish_reason, s.stop_reason, True, 0,
                                     len(ids), time.monotonic())

    async def close(self) -> None:
        pass


async def cancel_on_disconnect(request, coro):
    """Run ``coro``; if the HTTP client disconnects first, cancel it (its engine requests are aborted)
    and return ``None``."""
    task = asyncio.ensure_future(coro)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    return None if task.cancelled() else task.result()


# ---------------------------------------------------------------------------------------------
# choices
# ---------------------------------------------------------------------------------------------
