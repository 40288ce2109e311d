"""Worker side of structured outputs: one grammar matcher per constrained sequence.

Why the matchers live here (and not in the scheduler, as vLLM V1 and SGLang keep them), and how
they behave under overlap scheduling, ``n > 1``, preemption, prefix caching and stop strings:
``runtime/common/grammar.py``. In short: the worker runs plans in order and advances
each matcher with the token it has just sampled (``advance``), so the mask of the next step
(``fill_bitmask``) is ready without a round trip; a sequence (re)introduced with tokens already
generated gets a matcher replayed over them (``attach``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from ..common.grammar import CACHE_SIZE, GrammarError, bitmask_words, fill_bitmask, \
    grammar_text, grammar_tokenizer, new_matcher


class GrammarMatchers:
    """Builds matchers for sequences and fills the batch's bitmask.

    Args:
        tokenizer_json: a zero-argument callable returning the model's ``tokenizer.json`` text
            (called once, when the first constrained sequence arrives: building the grammar
            tokenizer walks the whole vocabulary, so engines that never constrain never pay it).
    """

    def __init__(self, tokenizer_json):
        self._tokenizer_json = tokenizer_json
        self._json_text: str | None = None
        self._fresh: OrderedDict[tuple, object] = OrderedDict()  # (grammar text, eos) -> unused matcher
        self._lock = threading.Lock()

    def _tokenizer(self, eos_token_ids):
        if self._json_text is None:
            self._json_text = self._tokenizer_json()
        return grammar_tokenizer(self._json_text, eos_token_ids)

    def attach(self, state) -> None:
        """Give ``state`` (a ``SamplingState`` whose params have ``structured_outputs``) its matcher,
        replayed over the tokens it already generated.

        Raises:
            GrammarError: the grammar does not build, or the replayed tokens are not accepted
                (a sequence restored after a preemption replays its own output, always accepted).
        """
        so = state.params.structured_outputs
        text = grammar_text(so)
        key = (text, tuple(state.eos_token_ids))
        with self._lock:
            base = self._fresh.get(key)
            if base is None:
                base = new_matcher(self._tokenizer(state.eos_token_ids), text)
                self._fresh[key] = base
                while len(self._fresh) > CACHE_SIZE:
                    self._fresh.popitem(last=False)
            else:
                self._fresh.move_to_end(key)
            m = base.deep_copy()
        done = state.output_token_ids.tolist()
        if done and not m.consume_tokens(done):
            raise GrammarError(f"seq {state.seq_id}: its generated tokens do not replay through its grammar: "
                               f"{m.get_error()}")
        state.matcher = m
        state.grammar_vocab = int(self._tokenizer(state.eos_token_ids).vocab_size)


def fill_batch_bitmask(states, vocab_size: int) -> np.ndarray | None:
    """The step's bitmask ``[R, ceil(V / 32)]`` int32 (bit ``t % 32`` of word ``t // 32`` set =
    token ``t`` allowed), or ``None`` when no row is constrained. Unconstrained rows are all ones;
    a constrained row allows what its matcher allows (ids past the grammar tokenizer's vocabulary,
    a model's padding rows, never); a matcher that is stopped or in error allows EOS only (its
    sequence has ended; with overlap scheduling a token computed after the end is discarded)."""
    rows = [i for i, s in enumerate(states) if s.matcher is not None]
    if not rows:
        return None
    W = bitmask_words(vocab_size)
    mask = np.full((len(states), W), -1, dtype=np.int32)
    par = []  # rows whose matcher fills a whole row: computed together, on the executor's threads
    for i in rows:
        st = states[i]
        mask[i] = 0
        m = st.matcher
        if m.is_error() or m.is_stopped():
            for t in st.eos_token_ids:
                if 0 <= t < vocab_size:
                    mask[i, t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))
            continue
        if bitmask_words(st.grammar_vocab) == W:
            par.append((m, i))
        else:  # a model whose vocabulary is padded past the tokenizer's: the row's prefix
            fill_bitmask(m, mask[i, :bitmask_words(min(st.grammar_vocab, vocab_size))])
    if len(par) > 1:
        _executor().unsafe_compute_mask_ptr(par, mask.ctypes.data, W * 4, len(states))
    elif par:
        fill_bitmask(par[0][0], mask[par[0][1]])
    return mask


_EXECUTOR = None


def _executor():
    """llguidance's thread pool for batched masks (one per process, as many threads as cores)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        import os

        import llguidance
        _EXECUTOR = llguidance.LLExecutor(num_threads=max(1, len(os.sched_getaffinity(0))))
    return _EXECUTOR


def advance(states, tokens) -> None:
    """Advance each constrained row's matcher with the token sampled for it (a matcher already
    stopped, its sequence over, is left alone)."""
    for st, t in zip(states, tokens):
        m = st.matcher
        if m is not None and not m.is_stopped() and not m.is_error():
            m.consume_token(int(t))
