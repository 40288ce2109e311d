"""Tokenizer of a Hugging Face folder: ``tokenizer.json`` through the ``tokenizers`` library, and the
chat template rendered with jinja2 the way ``transformers``' ``apply_chat_template`` renders it
(https://huggingface.co/docs/transformers/chat_templating: sandboxed environment, ``trim_blocks``,
``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception``, ``strftime_now``, a
``tojson`` that keeps non-ASCII, and the special tokens passed as variables).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(tok) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def _chat_template(model_dir: Path, tok_cfg: dict) -> str | None:
    """The default chat template: tokenizer_config.json, else chat_template.jinja / chat_template.json."""
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}], pick "default"
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template:
        return template
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    return _read_json(model_dir / "chat_template.json").get("chat_template")


class Tokenizer:
    """Text <-> token ids, and chat messages -> prompt text.

    Attributes:
        hf: the ``tokenizers.Tokenizer``.
        chat_template: the jinja2 source of the chat template, or None.
        eos_token_ids: every id that ends generation (generation_config.json, config.json and the
            tokenizer's eos_token, in that order, without repeats).
        bos_token / eos_token: their strings (None when the folder names none).
    """

    def __init__(self, hf_tokenizer, tokenizer_config: dict | None = None, chat_template: str | None = None,
                 eos_token_ids: list[int] | None = None):
        self.hf = hf_tokenizer
        self.config = dict(tokenizer_config or {})
        self.chat_template = chat_template
        self.bos_token = _token_content(self.config.get("bos_token"))
        self.eos_token = _token_content(self.config.get("eos_token"))
        ids = list(eos_token_ids or [])
        if self.eos_token is not None and self.hf.token_to_id(self.eos_token) is not None:
            ids.append(self.hf.token_to_id(self.eos_token))
        self.eos_token_ids = list(dict.fromkeys(ids))

    @classmethod
    def from_pretrained(cls, model_dir) -> "Tokenizer":
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``generation_config.json``,
        ``config.json`` when present) from a Hugging Face folder.

        Raises:
            FileNotFoundError: no tokenizer.json in ``model_dir``.
        """
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        tok_cfg = _read_json(model_dir / "tokenizer_config.json")
        eos = (_ids(_read_json(model_dir / "generation_config.json").get("eos_token_id"))
               + _ids(_read_json(model_dir / "config.json").get("eos_token_id")))
        return cls(HFTokenizer.from_file(str(path)), tok_cfg, _chat_template(model_dir, tok_cfg), eos)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    @cached_property
    def all_special_ids(self) -> set[int]:
        """Ids of the special (control) tokens; ``decode(skip_special_tokens=True)`` drops them."""
        return {i for i, t in self.hf.get_added_tokens_decoder().items() if t.special}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special-token strings in the text become their ids.

        ``add_special_tokens=True`` applies the post-processor (e.g. Llama 3's BOS). Runs through
        ``encode_batch``, which releases the GIL (``encode`` holds it for the whole call), so a long
        text tokenized on a worker thread does not stall the caller's other threads (the HTTP
        process's event loop).
        """
        return self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (any int sequence); special tokens dropped when ``skip_special_tokens``."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids) -> list[str]:
        """Vocabulary strings of ``ids`` (byte-level BPE: bytes as GPT-2's printable characters)."""
        return [self.hf.id_to_token(int(i)) for i in ids]

    def set_chat_template(self, template: str | None) -> None:
        """Replace the chat template (``folio serve --chat-template``); compiled again on next use."""
        self.chat_template = template
        self.__dict__.pop("_compiled_template", None)

    @cached_property
    def _compiled_template(self):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the chat template.

        ``add_generation_prompt`` appends the header that opens the assistant's turn. Extra keyword
        arguments (e.g. ``tools``) are passed to the template. Encode the result with
        ``encode(text)`` (no added special tokens: the template writes them).

        Raises:
            ValueError: the folder has no chat template, a message is not a dict with string
                ``role`` and ``content``, or the template raised (e.g. bad roles).
        """
        import jinja2

        if not self.chat_template:
            raise ValueError("this model has no chat template (tokenizer_config.json chat_template)")
        if not isinstance(messages, (list, tuple)) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ValueError('messages must be a list of {"role": str, "content": str} dicts')
        variables = {k: _token_content(self.config.get(k)) for k in
                     ("bos_token", "eos_token", "unk_token", "pad_token")}
        variables.update(tools=None, documents=None)  # defined, as transformers passes them
        variables.update(kwargs)
        try:
            return self._compiled_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                  **variables)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template: {e}") from None
