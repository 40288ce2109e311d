"""Streaming (incremental) detokenization with stop strings.

Token ids arrive a few at a time; the text shown so far must only ever grow, contain whole UTF-8
characters only, and join up to exactly the final text.

* Byte-level BPE tokenizers (GPT-2, SmolLM2, Llama 3: a ``tokenizers.decoders.ByteLevel``
  decoder), the fast path: the library decodes a list of ids as the UTF-8 decoding (invalid
  bytes replaced) of the concatenation of each token's bytes. ``TokenBytes`` keeps each token's
  bytes, read from the vocabulary through GPT-2's byte <-> character table and checked against
  the library's own ``decode([id])`` the first time the id is seen. A sequence's new text is then
  one table lookup and one C-level UTF-8 decode that holds an incomplete trailing character back
  (``codecs.utf_8_decode(..., final=False)``): no tokenizer call per token.
* Any other tokenizer (Metaspace / byte-fallback decoders, e.g. SentencePiece models): the
  sliding-window technique of Hugging Face text-generation-inference and vLLM (``prefix_offset`` /
  ``read_offset``). We decode ``ids[prefix_offset:]`` and ``ids[prefix_offset:read_offset]``; the
  difference is the new text, accepted only when it does not end in U+FFFD (a token that ends
  inside a multi-byte character decodes to U+FFFD until the rest arrives). The first window starts
  with the last 5 prompt tokens as context (vLLM's ``INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET``)
  so tokenizers that treat a leading space specially decode the first output token as they would
  mid-text. The text of single tokens is cached (``token_text_cache``, shared per engine).
* Stop strings (``SamplingParams.stop``) are searched in the new text plus the ``len(stop) - 1``
  characters before it, so a stop string spanning tokens or ending inside a token is found. The
  text is cut right before the match (or right after it with ``include_stop_str_in_output``).
* Hold-back: the longest tail of the text that is a proper prefix of some stop string is not
  released yet (it could still become a stop string). It is released as soon as the next text
  rules the stop string out, or by ``finish()``. Released text is never taken back.
"""

from __future__ import annotations

import warnings
from codecs import utf_8_decode

from ..common.sampling_params import SamplingParams

# prompt tokens decoded as context before the first output token (as vLLM)
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
_REPLACEMENT = "\ufffd"


def _byte_level_char_to_byte() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable character table (Radford et al. 2019, the public
    ``bytes_to_unicode``), inverted: printable Latin-1 bytes stand for themselves, the other 68
    bytes for the characters from U+0100 on, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenBytes:
    """The bytes each token contributes to decoded text, for byte-level BPE tokenizers.

    Args:
        hf: a ``tokenizers.Tokenizer`` (``is_byte_level(hf)`` must hold).
        skip_special_tokens: special tokens contribute nothing (as ``decode(...,
            skip_special_tokens=True)``).
    ``self[token_id]`` returns the bytes; an id is checked against ``hf.decode([id])`` when first
    asked for (a mismatch, which would mean the library changed its byte-level decoding, warns
    and uses the library's text for that token).
    """

    _CHAR_TO_BYTE: dict[str, int] | None = None

    def __init__(self, hf, skip_special_tokens: bool):
        self._hf = hf
        self._skip = skip_special_tokens
        self._bytes: dict[int, bytes] = {}
        # the text of each token seen whose bytes are whole UTF-8 characters by themselves (most
        # tokens): after anything but an incomplete character, that is exactly the text it adds
        self.text: dict[int, str] = {}
        if TokenBytes._CHAR_TO_BYTE is None:
            TokenBytes._CHAR_TO_BYTE = _byte_level_char_to_byte()

    @staticmethod
    def is_byte_level(hf) -> bool:
        from tokenizers import decoders
        return isinstance(getattr(hf, "decoder", None), decoders.ByteLevel)

    def __getitem__(self, token_id: int) -> bytes:
        b = self._bytes.get(token_id)
        if b is None:
            b = self._bytes[token_id] = self._load(token_id)
            try:
                self.text[token_id] = b.decode("utf-8")
            except UnicodeDecodeError:
                pass
        return b

    def _load(self, token_id: int) -> bytes:
        expected = self._hf.decode([token_id], skip_special_tokens=self._skip)
        if expected == "":
            return b""  # a skipped special token (or an id without text)
        token = self._hf.id_to_token(token_id)
        table = TokenBytes._CHAR_TO_BYTE
        try:
            b = bytes(table[c] for c in token)
        except (KeyError, TypeError):
            b = (token or "").encode("utf-8")  # the decoder's rule for tokens outside the alphabet
        if b.decode("utf-8", "replace") != expected:
            warnings.warn(f"token {token_id}: byte-level bytes {b!r} do not decode to the tokenizer's "
                          f"{expected!r}; using the tokenizer's text", RuntimeWarning, stacklevel=3)
            b = expected.encode("utf-8")
        return b


class IncrementalDetokenizer:
    """Detokenize one sequence's output as it is generated.

    Args:
        tokenizer: a ``folio.model.tokenizer.Tokenizer`` (its ``.hf`` is used) or a
            ``tokenizers.Tokenizer``.
        prompt_token_ids: the prompt (its last tokens are decoding context of the sliding-window
            path only; never output).
        params: the request's ``SamplingParams`` (stop, stop_token_ids, min_tokens,
            include_stop_str_in_output, skip_special_tokens).
        token_text_cache: ``{token_id: decode([token_id])}`` for this tokenizer and this
            ``skip_special_tokens`` value, shared by the caller between sequences (``None``: a
            private one); sliding-window path only.
        token_bytes: a ``TokenBytes`` for this tokenizer and ``skip_special_tokens`` value,
            shared by the caller (``None``: a private one when the tokenizer is byte-level).
        byte_level: ``False`` forces the sliding-window path (tests compare the two).

    Attributes:
        output_text: text released so far (property): whole characters only, without the tail
            that could still begin a stop string. Only ever grows.
        stop_reason: the stop string that ended the text, else ``None``.
        finished: no more text will be added (a stop string matched, or ``finish()`` ran).
        num_output_tokens: tokens passed to ``update`` so far (``add_token`` on the simple path,
            which has no stop string and so no use for it, does not count).
    """

    def __init__(self, tokenizer, prompt_token_ids, params: SamplingParams,
                 token_text_cache: dict[int, str] | None = None, token_bytes: TokenBytes | None = None,
                 byte_level: bool | None = None):
        self._hf = getattr(tokenizer, "hf", tokenizer)
        self.params = params
        self._skip_special = params.skip_special_tokens
        self._stops = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._stop_token_ids = set(params.stop_token_ids)
        self._min_tokens = params.min_tokens
        if byte_level is None:
            byte_level = token_bytes is not None or TokenBytes.is_byte_level(self._hf)
        if byte_level and token_bytes is None:
            token_bytes = TokenBytes(self._hf, self._skip_special)
        self._token_bytes = token_bytes if byte_level else None
        self._pending = b""   # byte-level path: bytes of an incomplete trailing character
        # the common case gets its own path in add_token: byte-level, no stop string to match or
        # hold back, no stop token whose text must be left out
        self.simple = self._token_bytes is not None and not self._stops and (
            self._include_stop or not self._stop_token_ids)
        self._parts: list[str] | None = None   # the text on the simple path (joined when needed)
        if self.simple:
            self._text_of = self._token_bytes.text.get
            self._parts = []
        if self._token_bytes is None:
            self._token_text = {} if token_text_cache is None else token_text_cache
            prompt = [int(t) for t in prompt_token_ids]
            self._ids = prompt[len(prompt) - min(len(prompt), INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET):]
            self._prefix_offset = 0
            self._read_offset = len(self._ids)
            self._prefix_text = self._decode(self._ids)
        self._text = ""      # decoded output so far (whole characters), released or held back
        self._released = 0   # length of self._text released through output_text
        self._taken = 0      # length of self._text handed out by take_new_text
        self.stop_reason: str | None = None
        self.finished = False
        self.num_output_tokens = 0

    def _decode(self, ids) -> str:
        return self._hf.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_window(self, start: int, end: int) -> str:
        """``decode(self._ids[start:end])``, from the cache for a single token."""
        if end - start != 1:
            return self._decode(self._ids[start:end])
        tid = self._ids[start]
        text = self._token_text.get(tid)
        if text is None:
            text = self._token_text[tid] = self._decode(self._ids[start:end])
        return text

    @property
    def output_text(self) -> str:
        if self._parts is not None:
            return "".join(self._parts)
        return self._text[: self._released]

    def take_new_text(self) -> str:
        """The text released since the previous call (each character is handed out once)."""
        if self._parts is not None:
            return ""   # add_token handed everything out
        new = self._text[self._taken:self._released]
        self._taken = self._released
        return new

    def _leave_simple_path(self) -> None:
        """From here on ``_text`` holds the text; everything so far was handed out by add_token."""
        self._text = "".join(self._parts)
        self._released = self._taken = len(self._text)
        self._parts = None
        self.simple = False

    def add_token(self, token_id: int, stop_terminated: bool = False) -> str:
        """``update([token_id], stop_terminated)`` then ``take_new_text()``: the new text this token
        releases (the output processor's call, once per sequence per step). A stop string that
        matched shows as ``finished`` with ``stop_reason`` set. On the simple path (byte-level, no
        stop string, no stop token text to leave out) that is a table lookup, at most one UTF-8
        decode, and an append."""
        if not self.simple or stop_terminated:
            self.update((token_id,), stop_terminated)
            return self.take_new_text()
        pending = self._pending
        if not pending:
            text = self._text_of(token_id)
            if text is not None:   # whole characters: no decoding at all
                if text:
                    self._parts.append(text)
                return text
            data = self._token_bytes[token_id]
        else:
            data = pending + self._token_bytes[token_id]
            self._pending = b""
        text, used = utf_8_decode(data, "replace", False)
        if used != len(data):
            self._pending = data[used:]
        if text:
            self._parts.append(text)
        return text

    def update(self, new_token_ids, stop_terminated: bool = False) -> str | None:
        """Add generated tokens.

        Args:
            new_token_ids: the sequence's new token ids (usually one).
            stop_terminated: the last of them ended the sequence (EOS or a stop token id); its
                text is left out unless ``include_stop_str_in_output`` (as vLLM V1). Tokens in
                ``stop_token_ids`` are always left out unless ``include_stop_str_in_output``.

        Returns:
            The stop string matched (the text is then cut and ``finished`` is set), else ``None``.
            After ``finished``, further tokens are ignored.
        """
        if self.finished:
            return None
        if self._parts is not None:
            self._leave_simple_path()
        ids = new_token_ids if type(new_token_ids) is list else list(new_token_ids)
        self.num_output_tokens += len(ids)
        if stop_terminated and ids and not self._include_stop:
            ids = ids[:-1]
        start_len = len(self._text)
        table = self._token_bytes
        if table is not None:
            data = self._pending
            for tid in ids:
                if tid in self._stop_token_ids and not self._include_stop:
                    continue
                data += table[tid]
            if data:
                text, used = utf_8_decode(data, "replace", False)
                self._pending = data[used:] if used < len(data) else b""
                if text:
                    self._text += text
        else:
            self._update_window(ids)
        if not self._stops:  # nothing to match or hold back
            self._released = len(self._text)
            return None
        return self._after_new_text(start_len)

    def _update_window(self, ids) -> None:
        all_ids = self._ids
        for tid in ids:
            tid = int(tid)
            if tid in self._stop_token_ids and not self._include_stop:
                continue
            all_ids.append(tid)
            new_text = self._decode(all_ids[self._prefix_offset:])
            n_prefix = len(self._prefix_text)
            if len(new_text) > n_prefix and not new_text.endswith(_REPLACEMENT):
                self._text += new_text[n_prefix:]
                self._prefix_offset, self._read_offset = self._read_offset, len(all_ids)
                self._prefix_text = self._decode_window(self._prefix_offset, self._read_offset)

    def finish(self) -> str:
        """End of the sequence: flush undecodable trailing bytes (as U+FFFD, exactly as a full
        decode shows them) and release held-back text. Returns the final ``output_text``."""
        if self._parts is not None:
            self._leave_simple_path()
        if not self.finished:
            start_len = len(self._text)
            if self._token_bytes is not None:
                if self._pending:
                    self._text += utf_8_decode(self._pending, "replace", True)[0]
                    self._pending = b""
            else:
                new_text = self._decode(self._ids[self._prefix_offset:])
                if len(new_text) > len(self._prefix_text):
                    self._text += new_text[len(self._prefix_text):]
                    self._prefix_offset = self._read_offset = len(self._ids)
                    self._prefix_text = ""
            if self._stops:
                self._after_new_text(start_len)
            self.finished = True
        self._released = len(self._text)
        return self.output_text

    # --- stop strings ----------------------------------------------------------------------------
    def _after_new_text(self, start_len: int) -> str | None:
        text = self._text
        if self.num_output_tokens >= self._min_tokens and len(text) > start_len:
            best, best_stop = -1, None
            for s in self._stops:
                # a match must end in the new text; the cut must not take back released text
                lo = start_len - len(s) + 1
                i = text.find(s, max(lo, 0) if self._include_stop else max(self._released, lo, 0))
                if i != -1 and (best == -1 or i < best):
                    best, best_stop = i, s
            if best_stop is not None:
                self._text = text[: best + len(best_stop)] if self._include_stop else text[:best]
                self._released = len(self._text)
                self.stop_reason = best_stop
                self.finished = True
                return best_stop
        self._released = max(self._released, len(text) - self._held_back_len(text))
        return None

    def _held_back_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        if not self._stops or self._include_stop:
            return 0
        hold = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return hold
