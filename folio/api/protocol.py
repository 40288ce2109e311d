"""Request bodies of the OpenAI-compatible API, as pydantic models, and the error shape.

Field names, types and defaults follow OpenAI's API reference (completions, chat completions) and
vLLM's extensions of it (``vllm/entrypoints/openai/protocol.py``: top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output,
skip_special_tokens, cache_salt, add_generation_prompt, chat_template_kwargs, structured_outputs,
return_tokens_as_token_ids, prompt_logprobs, use_beam_search with length_penalty; folio's beam_width). Unknown fields are accepted and ignored (the app logs their names).
Value ranges are checked by ``SamplingParams`` (one place for the rules, offline and served).

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` with ``code`` the
HTTP status, as vLLM sends it.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
               415: "invalid_request_error", 500: "server_error", 503: "service_unavailable_error"}
# the roles of OpenAI's chat messages (an unknown role is a 400 naming ``messages``)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class APIError(Exception):
    """An error to answer with: HTTP ``status``, a message, and the request field it concerns."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}`` for an HTTP status."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error" if status >= 500
                                                                    else "invalid_request_error"),
                      "param": param, "code": status}}


class _Body(BaseModel):
    # unknown fields are kept in model_extra (and logged), never an error
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    return_tokens_as_token_ids: bool = False
    # per prompt token after the first: its logprob and this many top ones (not with stream)
    prompt_logprobs: int | None = None
    # beam search (vLLM's extension: the width is ``n``; ``beam_width``, when given, sets it instead)
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    # vLLM's structured outputs: {json | regex | choice | grammar | json_object}
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a text, a list of texts, a list of token ids, or a list
    of lists of token ids; ``logprobs``: how many top candidates per token (0-20)."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = False


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal[CHAT_ROLES]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. ``logprobs``: a bool; ``top_logprobs``: candidates per token."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    # vLLM's extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Body):
    """``POST /tokenize``: ``prompt`` text, or chat ``messages`` rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
