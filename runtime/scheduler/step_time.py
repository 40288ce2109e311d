"""How long a step takes, measured, so that a prefill chunk can be sized to a step-time bound.

Chunked prefill bounds a step by its tokens (``max_num_batched_tokens``); on a CPU a 2048-token
chunk of a long prompt takes seconds, and every running stream waits that long for its next
token. With a bound on the step's time (``EngineConfig.max_step_ms``, vLLM has none; Sarathi-Serve,
Agrawal et al. OSDI 2024, sizes its token budget from the time-between-tokens target the same
way), the scheduler gives a step's prefills only the tokens the measured rate says fit:

    chunk = (max_step_s - decode_s) * prefill_tokens_per_s

``decode_s``: the time of recent steps that only decoded (an exponentially weighted mean);
``prefill_tokens_per_s``: prefill tokens over the time a step with prefill took beyond
``decode_s`` (a weighted mean of seconds per token, so the rate follows a prompt whose chunks
cost more as its context grows; before any step with decodes had prefill, a step's whole time
over its tokens, an upper bound). Times are the worker's (``StepResult.forward_time +
sample_time``). Until a step with prefill was measured (``folio serve``'s warm-up measures
some), chunks are bounded by tokens only; a chunk is never smaller than ``MIN_CHUNK_TOKENS``, so
a prompt always advances however long the decodes alone take.
"""

from __future__ import annotations

MIN_CHUNK_TOKENS = 16    # the smallest chunk a step with decodes gives its prefills
DECAY = 0.7              # weight of the past in the weighted means, per observation


class StepTimeModel:
    """The measured cost of a step: ``decode_s`` and seconds per prefill token.

    Args:
        max_step_s: the bound on a step that decodes running streams.
    """

    def __init__(self, max_step_s: float):
        if not max_step_s > 0:
            raise ValueError(f"max_step_s must be > 0, got {max_step_s}")
        self.max_step_s = float(max_step_s)
        self.decode_s = 0.0                  # recent decode-only steps' time (0 until one is seen)
        self.s_per_token: float | None = None  # recent prefill cost per token
        self._measured_beside_decodes = False

    def observe(self, num_prefill_tokens: int, num_decodes: int, seconds: float) -> None:
        """One step's time: ``num_prefill_tokens`` prefill tokens (0: a decode-only step) beside
        ``num_decodes`` decoding sequences took ``seconds`` on the worker."""
        if seconds <= 0:
            return
        if num_prefill_tokens <= 0:
            if num_decodes:
                self.decode_s = seconds if self.decode_s == 0 else DECAY * self.decode_s + (1 - DECAY) * seconds
            return
        if not num_decodes or not self.decode_s:
            # no decode time to take off: the fixed cost counts as the tokens' (an upper bound),
            # used only until a step with decodes measures the rate
            if self._measured_beside_decodes:
                return
            per = seconds / num_prefill_tokens
        else:
            per = max(seconds - self.decode_s, 0.25 * seconds) / num_prefill_tokens
            if not self._measured_beside_decodes:
                self._measured_beside_decodes = True
                self.s_per_token = None      # (the upper bound is dropped, not averaged in)
        self.s_per_token = per if self.s_per_token is None else DECAY * self.s_per_token + (1 - DECAY) * per

    def prefill_tokens(self) -> int | None:
        """The prefill tokens a step with decodes may take to end within ``max_step_s``; ``None``
        (no bound) until the rate was measured."""
        if self.s_per_token is None:
            return None
        room = self.max_step_s - self.decode_s
        return max(MIN_CHUNK_TOKENS, int(room / self.s_per_token))
