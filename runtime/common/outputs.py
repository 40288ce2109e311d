"""Request outputs as vLLM shapes them (``vllm/outputs.py``, ``vllm/sequence.py``).

The engine emits *deltas*: each step, one ``RequestDelta`` per request that changed, holding one
``CompletionDelta`` per sample that changed (its new token ids, its new text, its finish reason
exactly once, on its last delta). ``RequestOutput`` / ``CompletionOutput`` are the *cumulative*
view (everything generated so far) that ``LLM.generate`` returns; ``RequestOutput.from_deltas``
builds it from deltas (vLLM's ``RequestOutputKind.DELTA`` versus ``CUMULATIVE``).
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
# One entry per prompt token: None for the first, then {token_id: Logprob} with the prompt token
# (its rank filled in) and the top-k (vLLM's PromptLogprobs).
PromptLogprobs = list[dict[int, Logprob] | None]


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
        prompt_logprobs: per prompt token (``None`` for the first) when asked for, else ``None``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None)
    prompt_logprobs: PromptLogprobs | None = None

    @classmethod
    def from_deltas(cls, deltas: list["RequestDelta"]) -> "RequestOutput":
        """The cumulative output of one request from its deltas so far, in order (texts and
        token lists joined once, not step by step).

        Raises:
            ValueError: no deltas, or deltas of different requests.
        """
        if not deltas:
            raise ValueError("no deltas")
        first, last = deltas[0], deltas[-1]
        texts: dict[int, list[str]] = {}
        comps: dict[int, CompletionOutput] = {}
        prompt_logprobs = None
        for delta in deltas:
            if delta.request_id != first.request_id:
                raise ValueError(f"delta of request {delta.request_id!r} among {first.request_id!r}'s")
            if delta.prompt_logprobs is not None:
                prompt_logprobs = delta.prompt_logprobs
            for d in delta.outputs:
                c = comps.get(d.index)
                if c is None:
                    c = comps[d.index] = CompletionOutput(d.index, "", [])
                    texts[d.index] = []
                c.token_ids.extend(d.token_ids)
                texts[d.index].append(d.text)
                if d.logprobs is not None:
                    c.logprobs = (c.logprobs or []) + list(d.logprobs)
                if d.cumulative_logprob is not None:
                    c.cumulative_logprob = d.cumulative_logprob
                if d.finish_reason is not None:
                    c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        for i, c in comps.items():
            c.text = "".join(texts[i])
        return cls(first.request_id, first.prompt, list(first.prompt_token_ids), [comps[i] for i in sorted(comps)],
                   last.finished, last.num_cached_tokens, last.metrics, prompt_logprobs)


@dataclass(slots=True)
class CompletionDelta:
    """What one engine step added to one sample.

    Attributes:
        index: the sample's index in ``0 .. n-1``.
        token_ids: the token ids generated in this step (usually one; none for an abort).
        text: the text released in this step (whole characters; text held back because it
            could begin a stop string comes later, once, or never if the stop string matched).
        finish_reason: ``None``, or on the sample's last delta only: ``"stop"``, ``"length"``
            or ``"abort"``.
        stop_reason: the stop string or stop token id that ended it (with ``finish_reason``).
        logprobs: ``{token_id: Logprob}`` per new token when asked for, else ``None``.
        cumulative_logprob: the sample's running sum of sampled-token logprobs, or ``None``.
    """

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None


@dataclass(slots=True)
class RequestDelta:
    """What one engine step changed in one request.

    Attributes:
        request_id: the caller's id.
        outputs: one ``CompletionDelta`` per sample that changed in this step.
        finished: every sample has finished (this is the request's last delta).
        num_cached_tokens: prompt tokens served from the prefix cache.
        prompt / prompt_token_ids: the request's prompt (references, not copies).
        metrics: the request's times, on the last delta only.
        prompt_logprobs: the prompt logprobs, on the first delta after they are complete
            (requests that asked for them only).
        error: why the request ended without running, on its only delta (its constraint did not
            compile: ``GrammarError``'s message, naming ``structured_outputs``); its samples then
            finish with ``"abort"``. ``None`` otherwise.
    """

    request_id: str
    outputs: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics | None = None
    prompt_logprobs: PromptLogprobs | None = None
    error: str | None = None

