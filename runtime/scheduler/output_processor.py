"""From a step's token updates to per-request deltas: detokenization, stop strings, logprobs.

Shape after vLLM V1's ``v1/engine/output_processor.py``: the scheduler hands over which sequences
got which token (``SchedulerUpdate``) and has already applied the token-level stop conditions;
this file turns tokens into text (``detokenizer.py``), finds stop strings (a sequence a stop string
ended is returned to the engine, which finishes it in the scheduler), collects logprobs, and emits
one ``RequestDelta`` per request that changed. Each sample reports its finish exactly once: on its
last delta, or in the ``abort`` delta if it had not finished.

Detokenization runs here, on the scheduler's thread, once per step for all sequences of the step;
with a byte-level BPE tokenizer it is a table lookup and a C-level UTF-8 decode per token (no
tokenizer call), and with overlap scheduling it runs while the worker computes the next step
(docs/architecture.md, "Detokenization").
"""

from __future__ import annotations

import time

import numpy as np

from .detokenizer import IncrementalDetokenizer, TokenBytes
from ..common.outputs import CompletionDelta, Logprob, RequestDelta, RequestMetrics
from .sequence import Request, Sequence


class _RequestState:
    """The output processor's view of one request: which samples have reported their finish, and
    the prompt logprobs received so far (``None`` when not asked for)."""

    __slots__ = ("request", "done", "num_done", "prompt_logprobs")

    def __init__(self, request: Request):
        self.request = request
        self.done = [False] * request.n
        self.num_done = 0
        self.prompt_logprobs = [None] if request.sampling_params.prompt_logprobs is not None else None


class OutputProcessor:
    """Per-request deltas of every step for one engine.

    Args:
        tokenizer: a ``folio.model.tokenizer.Tokenizer`` (or any object whose ``.hf`` is a
            ``tokenizers.Tokenizer``, or such a tokenizer itself).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._hf = getattr(tokenizer, "hf", tokenizer)
        self._byte_level = TokenBytes.is_byte_level(self._hf)
        self._token_bytes: dict[bool, TokenBytes] = {}       # skip_special_tokens -> token bytes
        self._token_text: dict[bool, dict[int, str]] = {}    # skip_special_tokens -> single-token texts
        self._states: dict[str, _RequestState] = {}
        self._prompt_logprobs_ready: dict[str, list] = {}  # complete, for the request's next delta
        self._decoded: dict[int, str] = {}                 # token id -> its text alone (Logprob.decoded_token)

    def decoded_token(self, token_id: int) -> str:
        """A token's text on its own, special tokens kept (``Logprob.decoded_token``; vLLM decodes
        each logprob's token alone too); a partial UTF-8 character shows as U+FFFD."""
        text = self._decoded.get(token_id)
        if text is None:
            text = self._decoded[token_id] = self._hf.decode([token_id], skip_special_tokens=False)
        return text

    def add_request(self, request: Request) -> None:
        state = self._states[request.request_id] = _RequestState(request)
        if state.prompt_logprobs is not None and len(request.prompt_token_ids) == 1:
            self._prompt_logprobs_ready[request.request_id] = state.prompt_logprobs

    def has_request(self, request_id: str) -> bool:
        return request_id in self._states

    def _detokenizer(self, seq: Sequence) -> IncrementalDetokenizer:
        params = seq.request.sampling_params
        skip = params.skip_special_tokens
        if self._byte_level:
            table = self._token_bytes.get(skip)
            if table is None:
                table = self._token_bytes[skip] = TokenBytes(self._hf, skip)
            detok = IncrementalDetokenizer(self._hf, seq.request.prompt_token_ids, params, token_bytes=table)
        else:
            detok = IncrementalDetokenizer(self._hf, seq.request.prompt_token_ids, params,
                                           token_text_cache=self._token_text.setdefault(skip, {}),
                                           byte_level=False)
        seq.detokenizer = detok
        return detok

    # -- one step ------------------------------------------------------------------------------------
    def process(self, update, result) -> tuple[list[RequestDelta], list[tuple[Sequence, str]]]:
        """Turn a ``SchedulerUpdate`` (and the step's ``StepResult``, for logprobs) into deltas.

        Returns:
            ``(deltas, stopped)``: one ``RequestDelta`` per request that changed, in the order of
            the step's rows; and ``(sequence, stop string)`` for each sequence a stop string ended
            that the scheduler has not finished yet (the engine finishes them).
        """
        deltas: list[RequestDelta] = []
        stopped: list[tuple[Sequence, str]] = []
        by_request: dict[str, RequestDelta] = {}
        if update.prompt_logprob_spans:
            self._add_prompt_logprobs(update.prompt_logprob_spans, result)
        with_logprobs = result.logprobs is not None
        counts = update.num_tokens
        for i, (seq, row) in enumerate(zip(update.seqs, update.rows)):
            request = seq.request
            detok = seq.detokenizer or self._detokenizer(seq)
            token = seq.all_token_ids[-1]
            reason = seq.finish_reason
            if counts and counts[i] > 1:  # several tokens (speculative decoding)
                comp = self._several_tokens(seq, detok, row, counts[i], result, with_logprobs, stopped)
                reason = comp.finish_reason
            elif reason is None:
                text = detok.add_token(token)
                stop_reason = None
                if detok.finished:  # a stop string: the engine finishes the sequence
                    reason = "stop"
                    stop_reason = detok.stop_reason
                    stopped.append((seq, stop_reason))
            else:
                # the text of a stopping EOS / stop token is left out (unless include_stop_str_in_output)
                text = detok.add_token(token, reason == "stop")
                if detok.finished and detok.stop_reason is not None:
                    reason, stop_reason = "stop", detok.stop_reason   # a stop string wins over length
                else:
                    stop_reason = seq.stop_reason
                    detok.finish()
                    text += detok.take_new_text()
            if not counts or counts[i] == 1:
                lps = None
                if with_logprobs and request.sampling_params.logprobs is not None:
                    lps = [self._logprobs_entry(seq, result, row)]
                comp = CompletionDelta(seq.index, [token], text, reason, stop_reason, lps, seq.cumulative_logprob)
            if request.n == 1:
                delta = RequestDelta(request.request_id, [comp], False, request.num_prefix_hit_tokens,
                                     request.prompt, request.prompt_token_ids)
                deltas.append(delta)
            else:
                delta = by_request.get(request.request_id)
                if delta is None:
                    delta = by_request[request.request_id] = RequestDelta(
                        request.request_id, [], False, request.num_prefix_hit_tokens, request.prompt,
                        request.prompt_token_ids)
                    deltas.append(delta)
                delta.outputs.append(comp)
            if reason is not None:
                state = self._states[request.request_id]
                state.done[seq.index] = True
                state.num_done += 1
                if state.num_done == request.n:
                    self._finish(delta, state)
        for request in update.finished_beams:
            deltas.append(self.finish_beams(request))
        if self._prompt_logprobs_ready:
            for delta in deltas:
                lps = self._prompt_logprobs_ready.pop(delta.request_id, None)
                if lps is not None:
                    delta.prompt_logprobs = lps
        return deltas, stopped

    def _several_tokens(self, seq: Sequence, detok, row: int, n: int, result, with_logprobs: bool,
                        stopped: list) -> CompletionDelta:
        """The completion delta of a sequence that got ``n > 1`` tokens in one step (its last
        ``n``; their logprobs at rows ``row .. row + n - 1``): each goes through the detokenizer
        as it would one step at a time, and a stop string found at one of them drops the ones
        after it (the sequence joins ``stopped`` unless the scheduler already ended it)."""
        new = seq.all_token_ids[-n:]
        text = ""
        reason = stop_reason = None
        kept = n
        for j, t in enumerate(new[:-1]):
            text += detok.add_token(t)
            if detok.finished:  # a stop string before the last token
                kept = j + 1
                reason, stop_reason = "stop", detok.stop_reason
                if seq.finish_reason is None:
                    stopped.append((seq, stop_reason))
                break
        if reason is None:
            token = new[-1]
            reason = seq.finish_reason
            if reason is None:
                text += detok.add_token(token)
                if detok.finished:
                    reason, stop_reason = "stop", detok.stop_reason
                    stopped.append((seq, stop_reason))
            else:
                text += detok.add_token(token, reason == "stop")
                if detok.finished and detok.stop_reason is not None:
                    reason, stop_reason = "stop", detok.stop_reason
                else:
                    stop_reason = seq.stop_reason
                    detok.finish()
                    text += detok.take_new_text()
        lps = None
        if with_logprobs and seq.request.sampling_params.logprobs is not None:
            lps = [self._logprobs_entry(seq, result, r) for r in range(row, row + kept)]
        return CompletionDelta(seq.index, new[:kept], text, reason, stop_reason, lps, seq.cumulative_logprob)

    def _add_prompt_logprobs(self, spans, result) -> None:
        """Append each span's prompt logprobs (rows of ``result.prompt_logprobs`` in span order) to
        its request; a request whose prompt is complete gets them with its next delta."""
        lps, ids, ranks = result.prompt_logprobs, result.prompt_logprob_token_ids, result.prompt_logprob_ranks
        row = 0
        for request, pos, count in spans:
            state = self._states.get(request.request_id)
            if state is None or state.prompt_logprobs is None:  # finished or aborted meanwhile
                row += count
                continue
            k = request.sampling_params.prompt_logprobs
            entries = state.prompt_logprobs
            if len(entries) != pos + 1:
                raise RuntimeError(f"prompt logprobs of {request.request_id!r} at {pos} after {len(entries) - 1}")
            decoded = self.decoded_token
            for r in range(row, row + count):
                entry = {int(t): Logprob(float(lps[r, j]), j, decoded(int(t)))
                         for j, t in enumerate(ids[r, 1:k + 1], 1)}
                t = int(ids[r, 0])
                entry[t] = Logprob(float(lps[r, 0]), int(ranks[r]), decoded(t))
                entries.append(entry)
            row += count
            if len(entries) == len(request.prompt_token_ids):
                self._prompt_logprobs_ready[request.request_id] = entries

    def finish_beams(self, request: Request) -> RequestDelta:
        """The one delta of a finished beam search: one completion per result sequence, best first
        (``CompletionDelta.index`` = rank), with its whole token ids, text and cumulative logprob."""
        state = self._states[request.request_id]
        comps = [CompletionDelta(i, h.token_ids, self._hf.decode(h.token_ids, skip_special_tokens=True),
                                 h.finish_reason, None, None, h.cum_logprob)
                 for i, h in enumerate(request.beam.ranked())]
        delta = RequestDelta(request.request_id, comps, False, request.num_prefix_hit_tokens or 0, request.prompt,
                             request.prompt_token_ids)
        self._finish(delta, state)
        return delta

    def _logprobs_entry(self, seq: Sequence, result, row: int) -> dict[int, Logprob]:
        k = seq.request.sampling_params.logprobs
        lps = np.asarray(result.logprobs[row])
        ids = np.asarray(result.logprob_token_ids[row])
        entry = {}
        for j in range(1, min(k, len(lps) - 1) + 1):
            t = int(ids[j])
            entry[t] = Logprob(float(lps[j]), j, self.decoded_token(t))
        sampled = int(ids[0])
        if sampled not in entry:
            entry[sampled] = Logprob(float(lps[0]), None, self.decoded_token(sampled))
        if seq.logprobs is None:
            seq.logprobs = []
            seq.cumulative_logprob = 0.0
        seq.logprobs.append(entry)
        seq.cumulative_logprob += float(lps[0])
        return entry

    def _finish(self, delta: RequestDelta, state: _RequestState) -> None:
        request = state.request
        if request.finished_time is None:
            request.finished_time = time.time()
        delta.finished = True
        delta.metrics = RequestMetrics(request.arrival_time, request.first_scheduled_time, request.first_token_time,
                                       request.last_token_time, request.finished_time)
        del self._states[request.request_id]
        lps = self._prompt_logprobs_ready.pop(request.request_id, None)
        if lps is not None:
            delta.prompt_logprobs = lps

    # -- requests that end without a step ------------------------------------------------------------
    def finish_request(self, request: Request, reason: str) -> RequestDelta | None:
        """The last delta of a request that ends outside a step (``"abort"``, or ``"length"`` for
        ``max_tokens=0``): every sample that has not reported its finish reports ``reason`` now,
        with no new token. ``None`` when the request is unknown or already finished."""
        state = self._states.get(request.request_id)
        if state is None:
            return None
        outputs = [CompletionDelta(i, [], "", reason) for i in range(request.n) if not state.done[i]]
        delta = RequestDelta(request.request_id, outputs, False, request.num_prefix_hit_tokens or 0,
                             request.prompt, request.prompt_token_ids)
        self._finish(delta, state)
        return delta
