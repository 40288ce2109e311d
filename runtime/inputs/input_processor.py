"""One input processor for every door: prompt forms, chat template, tokenization and the checks
a prompt must pass before a request is queued.

``folio.LLM`` (through ``LLMEngine.add_request``), the ZeroMQ server (``ipc/scheduler_process.py``,
for clients that send text or chat messages) and the HTTP process (``folio/api/serving.py``,
which tokenizes in its own process and sends token ids) all use ``InputProcessor``; modeled on
vLLM V1's ``Processor`` (``vllm/v1/engine/processor.py``: ``process_inputs`` validates and
tokenizes before the engine core sees the request).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})


class InputError(ValueError):
    """A request input that can never run. ``param`` names the request field at fault
    (``prompt``, ``messages``, ``max_tokens``, ``cache_salt``, ...), as OpenAI's error ``param``."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def parse_prompt(prompt, prompt_token_ids=None, cache_salt: str | None = None):
    """``(text, token_ids, cache_salt)`` of one prompt in any form ``LLM.generate`` takes: a string,
    a dict ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}`` (either with ``"cache_salt"``), or
    ``prompt=None`` with the ``prompt_token_ids`` keyword. A dict with both text and ids (as
    ``LLM.chat`` builds them) keeps both; the ids are what runs.

    Raises:
        InputError: unknown dict keys, a prompt that is neither a string nor a dict, ids given twice,
            two different cache salts, neither text nor ids, or a cache_salt that is not a string.
    """
    if isinstance(prompt, dict):
        unknown = set(prompt) - PROMPT_KEYS
        if unknown:
            raise InputError(f"unknown prompt keys: {sorted(unknown)}", "prompt")
        if prompt_token_ids is not None:
            raise InputError("give the token ids either in the prompt dict or as prompt_token_ids, not both",
                             "prompt_token_ids")
        if prompt.get("cache_salt") is not None:
            if cache_salt is not None and cache_salt != prompt["cache_salt"]:
                raise InputError("two different cache_salt values (prompt dict and keyword)", "cache_salt")
            cache_salt = prompt["cache_salt"]
        prompt, prompt_token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
    elif prompt is not None and not isinstance(prompt, str):
        raise InputError(f"a prompt must be a string or a dict, got {type(prompt).__name__}", "prompt")
    if prompt is None and prompt_token_ids is None:
        raise InputError("a request needs a prompt or prompt_token_ids", "prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise InputError(f"prompt must be a string, got {type(prompt).__name__}", "prompt")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise InputError(f"cache_salt must be a string or None, got {type(cache_salt).__name__}", "cache_salt")
    return prompt, prompt_token_ids, cache_salt


def check_text(text: str, param: str = "prompt") -> None:
    """Raises ``InputError`` for text that is not valid Unicode (a lone surrogate, which JSON's
    escapes and Python strings can carry but UTF-8 cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{param}: not valid Unicode text (lone surrogate at {e.start})", param) from None


@dataclass
class ProcessedPrompt:
    """A prompt that passed ``InputProcessor.process``: its text (``None`` when given as ids), token
    ids (ints within the vocabulary, at least one), cache salt, and the ``max_tokens`` that applies
    (the request's, or all the room ``max_model_len`` leaves)."""

    prompt: str | None
    prompt_token_ids: list[int]
    cache_salt: str | None
    max_tokens: int


# tokenizer.json parts that never make the text shorter on its way to tokens (so that a token's
# vocabulary string bounds the characters of input it covers); anything else turns the bound off
_SAFE_NORMALIZERS = {"Prepend", "Replace"}
_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation"}


def _parts(node: dict | None, key: str) -> list[dict]:
    if node is None:
        return []
    if node.get("type") == "Sequence":
        return [p for sub in node.get(key, []) for p in _parts(sub, key)]
    return [node]


class InputProcessor:
    """Prompt forms -> validated token ids, for one tokenizer and one ``max_model_len``.

    Validates (each failure an ``InputError``, a ``ValueError`` whose ``param`` names the field):
    the prompt's form (``parse_prompt``); text is valid Unicode; chat messages are a non-empty list
    of ``{"role": str, "content": str}`` and the chat template renders them; token ids are
    integers in ``[0, vocab_size)``, at least one; the prompt plus ``max_tokens`` fits
    ``max_model_len`` (``max_tokens`` ``None``: the prompt must leave room for one token).

    A text too long to fit is refused before it is tokenized when its length in characters
    already proves it: no token of this tokenizer covers more than ``max_chars_per_token``
    characters of input (its longest vocabulary string, added tokens included; for a byte-level
    vocabulary a character of a vocabulary string is one byte, and a character of text at least
    one byte), so a text of ``c`` characters has at least ``ceil(c / max_chars_per_token)`` tokens.
    The bound is used only for a BPE model whose normalizer and pre-tokenizer never shorten the
    text (``max_chars_per_token`` is ``None`` otherwise).

    Args:
        tokenizer: a ``folio.model.tokenizer.Tokenizer`` (``encode``, ``apply_chat_template``,
            ``vocab_size``, ``hf``).
        max_model_len: the engine's limit on prompt + output tokens.
        vocab_size: ids accepted in a prompt (default: the tokenizer's, added tokens included).
    """

    def __init__(self, tokenizer, max_model_len: int, vocab_size: int | None = None):
        self.tokenizer = tokenizer
        self.max_model_len = int(max_model_len)
        self.vocab_size = int(vocab_size if vocab_size is not None else tokenizer.vocab_size)

    @cached_property
    def max_chars_per_token(self) -> int | None:
        """The most characters of input one token can cover, or ``None`` when not provable (see the
        class docstring)."""
        hf = getattr(self.tokenizer, "hf", None)
        if hf is None:
            return None
        try:
            spec = json.loads(hf.to_str())
        except Exception:
            return None
        model = spec.get("model") or {}
        if model.get("type") != "BPE":
            return None
        for part in _parts(spec.get("normalizer"), "normalizers"):
            pattern = (part.get("pattern") or {}).get("String")
            if part.get("type") not in _SAFE_NORMALIZERS or (
                    part["type"] == "Replace" and (pattern is None or len(part.get("content", "")) < len(pattern))):
                return None
        for part in _parts(spec.get("pre_tokenizer"), "pretokenizers"):
            if part.get("type") not in _SAFE_PRE_TOKENIZERS or part.get("behavior") == "Removed":
                return None
        lengths = [len(t) for t in (model.get("vocab") or {})]
        lengths += [len(t.get("content", "")) for t in spec.get("added_tokens") or []]
        return max(lengths) if lengths else None

    # -- pieces ----------------------------------------------------------------------------------
    def render_chat(self, messages, add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict] | None = None) -> str:
        """The prompt text of a conversation (the chat template; ``continue_final_message`` leaves
        the last message open instead of closing it, as vLLM does). ``tools``: OpenAI tool
        definitions, handed to the template as ``tools`` (a template that ignores them renders none).

        Raises:
            InputError(param="messages"): no messages, a message that is not ``{role: str,
                content: str}``, text that is not valid Unicode, no chat template, or a template
                error; (param="continue_final_message") with ``add_generation_prompt`` too.
        """
        if add_generation_prompt and continue_final_message:
            raise InputError("add_generation_prompt and continue_final_message cannot both be true",
                             "continue_final_message")
        if not isinstance(messages, (list, tuple)) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise InputError("messages must be a non-empty list of {role: str, content: str}", "messages")
        for m in messages:
            check_text(m["content"], "messages")
        try:
            kwargs = dict(chat_template_kwargs or {})
            if tools:
                kwargs["tools"] = tools
            text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                                      **kwargs)
        except (ValueError, TypeError) as e:
            raise InputError(str(e), "messages") from None
        if continue_final_message:
            last = messages[-1]["content"]
            end = text.rfind(last)
            if last and end >= 0:
                text = text[:end + len(last)]
        return text

    def check_length(self, num_prompt: int, max_tokens: int | None, *, param: str = "prompt",
                     max_tokens_param: str = "max_tokens", at_least: str = "") -> int:
        """The ``max_tokens`` that applies to a prompt of ``num_prompt`` tokens (``None``: the room
        left). ``at_least``: words that say ``num_prompt`` is a lower bound (the character bound).

        Raises:
            InputError: the prompt alone fills ``max_model_len`` (param ``param``), or the prompt
                plus ``max_tokens`` exceeds it (param ``max_tokens_param``).
        """
        limit = self.max_model_len
        if max_tokens is None:
            if num_prompt >= limit:
                raise InputError(f"the prompt has {at_least}{_tokens(num_prompt)}; max_model_len is {limit}, "
                                 "which leaves no room to generate", param)
            return limit - num_prompt
        if num_prompt + max_tokens > limit:
            raise InputError(f"{param} ({at_least}{_tokens(num_prompt)}) + {max_tokens_param} ({max_tokens}) = "
                             f"{'at least ' if at_least else ''}{num_prompt + max_tokens} exceeds max_model_len "
                             f"({limit})", param if num_prompt > limit else max_tokens_param)
        return int(max_tokens)

    def tokenize(self, text: str, add_special_tokens: bool = False, *, param: str = "prompt",
                 max_tokens: int | None | bool = False, max_tokens_param: str = "max_tokens") -> list[int]:
        """Token ids of ``text``.

        Args:
            max_tokens: when given (an int or ``None``, not ``False``), the text is checked to fit
                ``max_model_len`` with it: refused before tokenizing when its length in characters
                proves it cannot, and after.
        Raises:
            InputError: not valid Unicode (param ``param``), or too long (``check_length``).
        """
        if not isinstance(text, str):
            raise InputError(f"{param} must be a string, got {type(text).__name__}", param)
        check_text(text, param)
        if max_tokens is not False:
            n = self.max_chars_per_token
            if n:
                self.check_length(-(-len(text) // n), max_tokens, param=param, max_tokens_param=max_tokens_param,
                                  at_least="at least ")
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if max_tokens is not False:
            self.check_length(len(ids), max_tokens, param=param, max_tokens_param=max_tokens_param)
        return ids

    def check_token_ids(self, ids, param: str = "prompt") -> list[int]:
        """``ids`` as a list of ints. Raises ``InputError``: not integers, none, or outside the vocabulary."""
        if isinstance(ids, np.ndarray):
            if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
                raise InputError("prompt_token_ids must be a 1-D integer array", param)
            ids = ids.tolist()
        elif not isinstance(ids, (list, tuple)) or not all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids):
            raise InputError("prompt_token_ids must be a list of integers", param)
        ids = [int(t) for t in ids]
        if not ids:
            raise InputError("the prompt is empty (0 tokens); at least one token is needed", param)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InputError(f"prompt token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}", param)
        return ids

    # -- the whole prompt ----------------------------------------------------------------------------
    def process(self, prompt, max_tokens: int | None, *, prompt_token_ids=None, cache_salt: str | None = None,
                messages=None, add_generation_prompt: bool = True) -> ProcessedPrompt:
        """Validate and tokenize one prompt (any ``parse_prompt`` form, or chat ``messages``).

        Args:
            max_tokens: the request's ``max_tokens`` (``None``: up to ``max_model_len``).
        Returns:
            a ``ProcessedPrompt``.
        Raises:
            InputError: any failure the class docstring lists.
        """
        if messages is not None:
            if prompt is not None or prompt_token_ids is not None:
                raise InputError("give messages or a prompt, not both", "messages")
            text = self.render_chat(messages, add_generation_prompt)
            ids = self.tokenize(text, param="messages", max_tokens=max_tokens)
            if cache_salt is not None and not isinstance(cache_salt, str):
                raise InputError(f"cache_salt must be a string or None, got {type(cache_salt).__name__}",
                                 "cache_salt")
        else:
            text, ids, cache_salt = parse_prompt(prompt, prompt_token_ids, cache_salt)
            if ids is None:
                ids = self.tokenize(text, max_tokens=max_tokens)
        ids = self.check_token_ids(ids)
        return ProcessedPrompt(text, ids, cache_salt, self.check_length(len(ids), max_tokens))
