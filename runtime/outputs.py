"""Request outputs as vLLM shapes them (``vllm/outputs.py``, ``vllm/sequence.py``).

Outputs are cumulative: ``CompletionOutput.text`` / ``.token_ids`` hold everything generated so
far; a streaming consumer derives the new part from the lengths it has already seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log probability of one candidate token at one generated position.

    Attributes:
        logprob: natural-log probability under the model's raw output distribution (before
            penalties / temperature / top-k / top-p, as vLLM V1's default ``raw_logprobs``).
        rank: 1-based rank of the token in that distribution (``None`` when not known: a
            sampled token outside the returned top-k).
        decoded_token: the token's text, when the producer filled it in.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: {token_id: Logprob} with the top-k and the sampled token.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class RequestMetrics:
    """Wall-clock times of one request (seconds since the epoch, ``time.time()``).

    Attributes:
        arrival_time: when the engine accepted the request.
        first_scheduled_time: first step that ran any of its tokens.
        first_token_time: when its first output token was sampled (TTFT = this - arrival).
        last_token_time: when its latest output token was sampled.
        finished_time: when it finished (None while running).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    """One sample (sequence) of a request.

    Attributes:
        index: the sample's index in ``0 .. n-1``.
        text: detokenized text so far (held-back text that could start a stop string excluded
            until ruled out).
        token_ids: generated token ids so far.
        cumulative_logprob: sum of the sampled tokens' logprobs (``None`` unless logprobs were
            requested).
        logprobs: per generated token ``{token_id: Logprob}`` (top-k plus the sampled token), or
            ``None`` when not requested.
        finish_reason: ``None`` while running, then ``"stop"`` (EOS, stop string or stop token),
            ``"length"`` (max_tokens / max_model_len) or ``"abort"``.
        stop_reason: the stop string or stop token id that ended it; ``None`` for EOS / length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step.

    Attributes:
        request_id: the caller's id.
        prompt: the prompt text (``None`` when given as token ids).
        prompt_token_ids: the prompt's token ids.
        outputs: one ``CompletionOutput`` per sample (``n`` of them).
        finished: all samples finished.
        num_cached_tokens: prompt tokens served from the prefix cache.
        metrics: the request's times.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None)
