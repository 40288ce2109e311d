"""The n-gram proposer of speculative decoding (prompt lookup decoding, Saxena 2023; vLLM's
``method="ngram"``, ``vllm/v1/spec_decode/ngram_proposer.py``).

It needs only token ids, so it runs in the scheduler process. For a sequence whose known tokens
are ``t[0 .. L-1]`` (prompt and output), the last ``n`` tokens are looked up earlier in ``t``, for
``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``; the longest ``n`` that occurs
wins, and among its occurrences the earliest (vLLM's rule). The proposal is the up to ``k``
tokens that followed that occurrence (fewer when it lies near the end). An occurrence may overlap
the suffix itself, so a repeating pattern proposes its own continuation.

The search is one vectorised comparison over the sequence (the positions holding its last token)
followed by ``prompt_lookup_max - 1`` filters over the surviving positions; no Python loop over
tokens. ``TokenHistory`` keeps each sequence's ids in a NumPy array that grows with the sequence,
so a step converts only the tokens added since the last one.
"""

from __future__ import annotations

import numpy as np


class TokenHistory:
    """A sequence's known token ids as a growing ``int64`` array (capacity doubles).

    ``sync(token_ids)`` appends the ids past the ones it holds (``token_ids`` only ever grows, as
    ``Sequence.all_token_ids`` does) and returns the ``[L]`` view.
    """

    __slots__ = ("_buf", "_n")

    def __init__(self):
        self._buf = np.zeros(0, dtype=np.int64)
        self._n = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        n, L = self._n, len(token_ids)
        if L > n:
            if L > len(self._buf):
                grown = np.zeros(max(2 * len(self._buf), L, 64), dtype=np.int64)
                grown[:n] = self._buf[:n]
                self._buf = grown
            self._buf[n:L] = token_ids[n:L]
            self._n = L
        elif L < n:  # never the case for a sequence; kept exact for any caller
            self._n = L
        return self._buf[:self._n]


class NgramProposer:
    """Prompt-lookup proposals (see the module docstring).

    Args:
        prompt_lookup_min, prompt_lookup_max: the shortest and longest n-gram matched (tokens).
        num_speculative_tokens: the most tokens proposed (k).
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, num_speculative_tokens: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{prompt_lookup_min}, {prompt_lookup_max}")
        self.min_n = int(prompt_lookup_min)
        self.max_n = int(prompt_lookup_max)
        self.k = int(num_speculative_tokens)

    def propose(self, tokens: np.ndarray, k: int | None = None) -> list[int]:
        """Up to ``k`` (default ``num_speculative_tokens``) proposed next tokens after ``tokens``.

        Args:
            tokens: ``[L]`` int64, the sequence's known ids (prompt then output).
            k: the most tokens wanted (the caller's limits: ``max_tokens``, ``max_model_len``,
                the step's token budget).
        Returns:
            the proposal (a list of ints, possibly empty: no n-gram of at least
            ``prompt_lookup_min`` tokens recurs).
        """
        k = self.k if k is None else min(int(k), self.k)
        if k <= 0:
            return []
        ends = _longest_match(tokens, self.min_n, self.max_n)
        if ends is None:
            return []
        start = int(ends[0]) + 1  # the earliest occurrence of the longest n-gram
        return tokens[start:start + k].tolist()

    def may_propose_after(self, tokens: np.ndarray) -> bool:
        """Whether ``tokens`` followed by any one more token could have a proposal: an n-gram
        match ending at that token needs its first ``n - 1`` tokens to match ending at the last
        of ``tokens`` (at a position before it), so with no ``prompt_lookup_min - 1`` gram match
        now there is none after. (Always true for ``prompt_lookup_min == 1``.)"""
        n = self.min_n - 1
        return n == 0 or _longest_match(tokens, n, n) is not None


def _longest_match(tokens: np.ndarray, min_n: int, max_n: int) -> np.ndarray | None:
    """The end positions (ascending) of the earlier occurrences of the longest suffix of
    ``tokens`` with ``min_n <= n <= max_n`` tokens that recurs, or ``None``. An occurrence ends
    before the last position, so at least one token follows it."""
    L = int(tokens.shape[0])
    if L < min_n + 1:
        return None
    # ends: positions e < L - 1 where the match of the last n tokens ends (t[e] == t[L-1] and
    # the n - 1 tokens before agree); its continuation starts at e + 1
    ends = np.flatnonzero(tokens[:L - 1] == tokens[L - 1])
    best = ends if min_n == 1 and len(ends) else None
    for j in range(1, min(max_n, L - 1)):
        if not len(ends):
            break
        ends = ends[ends >= j]
        ends = ends[tokens[ends - j] == tokens[L - 1 - j]]
        if len(ends) and j + 1 >= min_n:
            best = ends
    return best
