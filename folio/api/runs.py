"""OpenAI responses from engine deltas: one ``CompletionRun`` / ``ChatRun`` per HTTP request.

A run sends the request's engine requests (``serving.RequestGroup`` / ``BeamSearchGroup``), gathers
their ``StreamDelta``s into choices (choice ``k`` is sample ``k % n`` of prompt ``k // n``) and
renders them as one JSON body or as Server-Sent Events chunks, with logprobs, usage and tool calls
in OpenAI's shapes (``vllm/entrypoints/openai/serving_completion.py`` / ``serving_chat.py``).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from ..ipc.client import StreamDelta
from .protocol import APIError, ChatCompletionRequest, CompletionRequest
from .serving import (LOGPROB_FLOOR, BeamSearchGroup, OpenAIServing, RequestGroup, beam_search_params, json_options,
                      response_format_constraint, sampling_params)
from .tool_calls import ToolCallParser, parse_tool_calls, resolve_tool_choice, tool_constraint, validate_tools

log = logging.getLogger("folio.api")


@dataclass
class _Choice:
    text: list = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list = field(default_factory=list)      # (token_id, {token_id: Logprob}) per token
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False                             # streaming: first chunk sent
    tool_parser: ToolCallParser | None = None         # streaming chat with tools: its calls and content
    held_logprobs: list = field(default_factory=list)  # streaming: of tokens whose text is held back
    text_offset: int = 0                              # completions logprobs: offset of the next token


class _Accumulator:
    """Per-choice state and usage of one HTTP request."""

    def __init__(self, num_prompts: int, n: int):
        self.n = n
        self.choices = [_Choice() for _ in range(num_prompts * n)]
        self.prompt_tokens = [0] * num_prompts
        self.cached_tokens = [0] * num_prompts
        self.prompt_logprobs: list = [None] * num_prompts     # per prompt: [None, {id: Logprob}, ...]

    def add(self, i: int, d: StreamDelta) -> tuple[int, _Choice]:
        k = i * self.n + d.index
        c = self.choices[k]
        self.prompt_tokens[i] = d.num_prompt_tokens or self.prompt_tokens[i]
        self.cached_tokens[i] = max(self.cached_tokens[i], d.num_cached_tokens or 0)
        if d.prompt_logprobs is not None:
            self.prompt_logprobs[i] = d.prompt_logprobs
        c.text.append(d.text)
        c.num_tokens += len(d.token_ids)
        if d.logprobs is not None:
            c.logprobs.extend(zip(d.token_ids, d.logprobs))
        if d.finish_reason is not None:
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        return k, c

    def usage(self) -> dict:
        prompt = sum(self.prompt_tokens)
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)}}


def _lp(value: float) -> float:
    return max(float(value), LOGPROB_FLOOR)


def _top(entries: dict, k: int) -> list:
    """The top-``k`` ``(token_id, Logprob)`` of one position, best first."""
    ranked = sorted(((t, lp) for t, lp in entries.items() if lp.rank is not None and lp.rank <= k),
                    key=lambda x: x[1].rank)
    return ranked[:k]


def prompt_logprobs_json(serving: OpenAIServing, positions: list | None) -> list | None:
    """vLLM's ``prompt_logprobs`` in JSON: ``None`` for the first prompt token, then per position
    ``{"token_id": {"logprob", "rank", "decoded_token"}}`` (the prompt token and the top ones)."""
    if positions is None:
        return None
    return [None if pos is None else
            {str(t): {"logprob": _lp(lp.logprob), "rank": lp.rank,
                      "decoded_token": lp.decoded_token if lp.decoded_token is not None
                      else serving.token_text(t, False)} for t, lp in pos.items()}
            for pos in positions]


def completion_logprobs(serving: OpenAIServing, items: list, k: int, offset: int, as_ids: bool) -> tuple[dict, int]:
    """OpenAI's legacy completions ``logprobs`` object for ``items`` [(token_id, {id: Logprob})];
    returns it and the text offset after the last token."""
    out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for tid, entries in items:
        tok = serving.token_text(tid, as_ids)
        out["tokens"].append(tok)
        out["token_logprobs"].append(_lp(entries[tid].logprob))
        top = {serving.token_text(t, as_ids): _lp(lp.logprob) for t, lp in _top(entries, k)}
        top.setdefault(tok, _lp(entries[tid].logprob))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(tok)
    return out, offset


def chat_logprobs(serving: OpenAIServing, items: list, k: int, as_ids: bool) -> dict:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def one(tid, lp):
        tok = serving.token_text(tid, as_ids)
        return {"token": tok, "logprob": _lp(lp.logprob), "bytes": list(tok.encode("utf-8", "replace"))}

    content = []
    for tid, entries in items:
        entry = one(tid, entries[tid])
        entry["top_logprobs"] = [one(t, lp) for t, lp in _top(entries, k)]
        content.append(entry)
    return {"content": content}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------
# /v1/completions
# ---------------------------------------------------------------------------------------------

def num_prompts(prompt) -> int:
    """How many prompts the prompt field's form holds (a text or one list of ids: 1), read before
    anything is tokenized."""
    if isinstance(prompt, str) or not isinstance(prompt, list) or not prompt or all(isinstance(x, int) for x in prompt):
        return 1
    return len(prompt)


def num_samples(req) -> tuple[int, str]:
    """``(samples per prompt, the field that sets it)``: ``n``, or a beam search's width."""
    if req.use_beam_search and req.beam_width is not None:
        return req.beam_width, "beam_width"
    return req.n, "n"


def completion_prompts(serving: OpenAIServing, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    """``[(text or None, token ids)]`` of the prompt field's four forms. Raises ``APIError(400)``."""
    p = req.prompt
    if isinstance(p, str):
        texts_or_ids = [p]
    elif not p:
        raise APIError(400, "prompt must not be an empty list", "prompt")
    elif all(isinstance(x, int) for x in p):
        texts_or_ids = [p]
    else:
        texts_or_ids = list(p)
    out = []
    for x in texts_or_ids:
        if isinstance(x, str):
            out.append((x, serving.encode(x, req.add_special_tokens, max_tokens=req.max_tokens)))
        else:
            if any(t < 0 for t in x):
                raise APIError(400, "prompt token ids must be >= 0", "prompt")
            if x:    # (an empty prompt: the engine's message)
                serving.check_length(len(x), req.max_tokens)
            out.append((None, list(x)))
    return out


class _Run:
    """One generation request: validated and started (``group.start()``), then answered whole
    (``response()``) or as SSE (``stream()``). Subclasses shape the choices."""

    object_name = ""          # of the whole response
    chunk_object_name = ""    # of a streamed chunk

    def __init__(self, serving: OpenAIServing, req, prompts: list[list[int]], sampling: dict, id_prefix: str,
                 constraint_param: str = "structured_outputs"):
        self.serving, self.req, self.sampling = serving, req, sampling
        if req.use_beam_search:   # one choice per result sequence, best first
            beam = beam_search_params(req, sampling)
            req.n = beam["beam_width"]
            self.group = BeamSearchGroup(serving.client, prompts, beam, req.cache_salt)
        else:
            self.group = RequestGroup(serving.client, prompts, sampling, req.cache_salt, constraint_param)
        self.acc = _Accumulator(len(prompts), req.n)
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _choice(self, k: int, c: _Choice) -> dict:
        raise NotImplementedError

    def _stream_choices(self, i: int, k: int, c: _Choice, d: StreamDelta, new_logprobs: list):
        raise NotImplementedError

    def _chunk(self, choices: list, usage=None, with_usage_key: bool = False) -> dict:
        out = {"id": self.id, "object": self.chunk_object_name, "created": self.created,
               "model": self.serving.model_name, "choices": choices}
        if with_usage_key:
            out["usage"] = usage
        return out

    async def response(self) -> dict:
        try:
            async for i, d in self.group.deltas():
                self.acc.add(i, d)
        finally:
            await self.group.close()
        return await self.serving.offload(self._body)     # texts, logprobs: per-request CPU work

    def _body(self) -> dict:
        return {"id": self.id, "object": self.object_name, "created": self.created, "model": self.serving.model_name,
                "choices": [self._choice(k, c) for k, c in enumerate(self.acc.choices)], "usage": self.acc.usage(),
                **self._response_extra()}

    def _response_extra(self) -> dict:
        return {}

    async def stream(self) -> AsyncIterator[str]:
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        try:
            async for i, d in self.group.deltas():
                n_before = len(self.acc.choices[i * self.req.n + d.index].logprobs)
                k, c = self.acc.add(i, d)
                for choice in self._stream_choices(i, k, c, d, c.logprobs[n_before:]):
                    yield sse(self._chunk([choice], None, include_usage))
            if include_usage:
                yield sse(self._chunk([], self.acc.usage(), True))
        except APIError as e:
            yield sse(e.body())
        finally:
            await self.group.close()
        yield SSE_DONE


class CompletionRun(_Run):
    """One ``/v1/completions`` request."""

    object_name = chunk_object_name = "text_completion"

    def __init__(self, serving: OpenAIServing, req: CompletionRequest):
        serving.check_model(req.model)
        serving.check_choices(num_prompts(req.prompt), *num_samples(req))    # before any per-choice work
        if req.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of other than n is not supported", "best_of")
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo with logprobs (prompt logprobs) is not supported over HTTP", "echo")
        sampling = sampling_params(req, req.max_tokens, req.logprobs, structured_outputs=req.structured_outputs)
        self.prompts = completion_prompts(serving, req)
        super().__init__(serving, req, [ids for _, ids in self.prompts], sampling, "cmpl")

    def _echo(self, i: int) -> str:
        text, ids = self.prompts[i]
        return text if text is not None else self.serving.tokenizer.decode(ids, skip_special_tokens=False)

    def _logprobs(self, c: _Choice, items: list):
        if self.req.logprobs is None:
            return None
        lp, c.text_offset = completion_logprobs(self.serving, items, self.req.logprobs, c.text_offset,
                                                self.req.return_tokens_as_token_ids)
        return lp

    def _choice(self, k: int, c: _Choice) -> dict:
        prefix = self._echo(k // self.req.n) if self.req.echo else ""
        return {"index": k, "text": prefix + "".join(c.text), "logprobs": self._logprobs(c, c.logprobs),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                "prompt_logprobs": prompt_logprobs_json(self.serving, self.acc.prompt_logprobs[k // self.req.n])}

    def _stream_choices(self, i, k, c, d, new_logprobs):
        text = d.text
        if not c.started:
            c.started = True
            if self.req.echo:
                text = self._echo(i) + text
        if text or d.token_ids or d.finish_reason is not None:
            yield {"index": k, "text": text, "logprobs": self._logprobs(c, new_logprobs),
                   "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}


class ChatRun(_Run):
    """One ``/v1/chat/completions`` request."""

    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"

    def __init__(self, serving: OpenAIServing, req: ChatCompletionRequest):
        serving.check_model(req.model)
        serving.check_choices(1, *num_samples(req))              # before any per-choice work
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        if req.tools is not None:
            validate_tools(req.tools)
        self.tool_mode, self.tool_name = resolve_tool_choice(req.tools, req.tool_choice)
        structured, so_param = self._constraint(req)
        text = serving.render_chat(req.messages, req.add_generation_prompt, req.continue_final_message,
                                 req.chat_template_kwargs, req.tools if self.tool_mode != "none" else None)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        limit_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        ids = serving.encode(text, param="messages", max_tokens=max_tokens, max_tokens_param=limit_name)
        if max_tokens is None:     # as vLLM: up to the model's length (here also what the KV cache holds)
            room = min(serving.max_model_len, serving.kv_capacity_tokens) - len(ids)
            max_tokens = room if room > 0 else None   # None: the engine explains why nothing fits
        self.top_k = (req.top_logprobs or 0) if req.logprobs else None
        renames = {"logprobs": "top_logprobs", "max_tokens": limit_name, "structured_outputs": so_param}
        sampling = sampling_params(req, max_tokens, self.top_k, renames, structured)
        super().__init__(serving, req, [ids], sampling, "chatcmpl", so_param)

    def _constraint(self, req: ChatCompletionRequest) -> tuple[dict | None, str]:
        """``(structured_outputs dict or None, the field it came from)``: at most one of
        ``response_format``, ``structured_outputs`` and a ``required`` / named ``tool_choice``;
        ``structured_outputs`` that holds only JSON options (``disable_any_whitespace``,
        ``whitespace_pattern``) tunes the JSON of either of the others instead.

        Raises:
            APIError(400): two constraints, or JSON options with no JSON constraint to apply to.
        """
        structured, so_param = response_format_constraint(req.response_format), "response_format"
        options = json_options(req.structured_outputs)
        if req.structured_outputs is not None and options is None:
            if structured is not None:
                raise APIError(400, "response_format and structured_outputs cannot both constrain the output",
                               "structured_outputs")
            structured, so_param = req.structured_outputs, "structured_outputs"
        tool_so = tool_constraint(req.tools, self.tool_mode, self.tool_name, req.parallel_tool_calls) \
            if self.tool_mode in ("required", "named") else None
        if tool_so is not None:
            if structured is not None:
                raise APIError(400, f"tool_choice {self.tool_mode!r} cannot be combined with {so_param}", "tool_choice")
            structured, so_param = tool_so, "tools"
        if options is not None:
            if structured is None:
                raise APIError(400, f"structured_outputs sets only {', '.join(options)}, which tune a JSON "
                                    "constraint, and the request has none (response_format json_object or "
                                    "json_schema, or tool_choice required or named)", "structured_outputs")
            structured = {**structured, **options}
        return structured, so_param

    def _response_extra(self) -> dict:
        return {"prompt_logprobs": prompt_logprobs_json(self.serving, self.acc.prompt_logprobs[0])}   # as vLLM

    def _logprobs(self, items: list):
        if self.top_k is None:
            return None
        return chat_logprobs(self.serving, items, self.top_k, self.req.return_tokens_as_token_ids)

    def _tool_calls(self, text: str, finish_reason: str | None) -> tuple[str | None, list, str | None]:
        """``(content, tool_calls, finish_reason)`` of a finished choice (tool_calls.py)."""
        content, calls = parse_tool_calls(text, self.tool_mode, self.req.tools, self.tool_name,
                                          self.req.parallel_tool_calls)
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return content, calls, finish_reason

    def _choice(self, k: int, c: _Choice) -> dict:
        content, calls, finish = self._tool_calls("".join(c.text), c.finish_reason)
        return {"index": k, "message": {"role": "assistant", "content": content, "tool_calls": calls},
                "logprobs": self._logprobs(c.logprobs), "finish_reason": finish,
                "stop_reason": c.stop_reason}

    def _stream_choices(self, i, k, c, d, new_logprobs):
        if not c.started:          # the first chunk of a choice carries the role
            c.started = True
            if self.tool_mode != "none":
                c.tool_parser = ToolCallParser(self.tool_mode, self.req.tools, self.tool_name,
                                               self.req.parallel_tool_calls)
            yield {"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                   "finish_reason": None}
        if c.tool_parser is not None:
            yield from self._stream_tool_choices(k, c, d, new_logprobs)
            return
        if d.text or d.token_ids or d.finish_reason is not None:
            delta = {"content": d.text} if d.text or d.finish_reason is None else {}
            yield {"index": k, "delta": delta, "logprobs": self._logprobs(new_logprobs),
                   "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}

    def _stream_tool_choices(self, k, c, d, new_logprobs):
        """The chunks of one engine delta when the output may hold tool calls: the parser's events
        (``ToolCallParser``) as OpenAI streams them: content; a call's first delta with ``index``,
        ``id``, ``type`` and ``function.name`` (arguments ``""``); then its arguments in pieces.
        Logprobs of tokens whose text is held back go with the next chunk sent."""
        events = c.tool_parser.feed(d.text)
        if d.finish_reason is not None:
            events += c.tool_parser.finish()
        c.held_logprobs.extend(new_logprobs)
        for delta in _event_deltas(events):
            logprobs, c.held_logprobs = c.held_logprobs, []
            yield {"index": k, "delta": delta, "logprobs": self._logprobs(logprobs) if logprobs else None,
                   "finish_reason": None}
        if d.finish_reason is not None:
            finish = "tool_calls" if c.tool_parser.calls and d.finish_reason == "stop" else d.finish_reason
            logprobs, c.held_logprobs = c.held_logprobs, []
            yield {"index": k, "delta": {}, "logprobs": self._logprobs(logprobs) if logprobs else None,
                   "finish_reason": finish, "stop_reason": d.stop_reason}


def _event_deltas(events: list) -> list[dict]:
    """``ToolCallEvent``s as chat ``delta``s: runs of content (or of one call's arguments) merged
    into one delta, each call's first delta on its own."""
    out: list[dict] = []
    for e in events:
        last = out[-1] if out else None
        if e.kind == "content":
            if last is not None and "content" in last:
                last["content"] += e.text
            else:
                out.append({"content": e.text})
        elif e.kind == "call":
            out.append({"tool_calls": [{"index": e.index, "id": e.call_id, "type": "function",
                                        "function": {"name": e.text, "arguments": ""}}]})
        else:
            item = last["tool_calls"][0] if last is not None and "tool_calls" in last else None
            if item is not None and item["index"] == e.index and "id" not in item:
                item["function"]["arguments"] += e.text
            else:
                out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
    return out
