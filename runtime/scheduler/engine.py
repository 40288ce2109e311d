"""The engine: requests in, steps scheduled and run, per-request deltas out.

One step, as ``LLMEngine.step()`` runs it (docs/architecture.md has the whole data flow)::

    plan = make_step_plan(scheduler.schedule())       # what runs, flattened to arrays
    executor.submit(plan)                             # the worker runs plans in order
    result = executor.get_result()                    # the oldest step's sampled tokens
    update = scheduler.update_from_output(step, result)        # append, stop, fork, finish, free
    deltas, stopped = output_processor.process(update, result)  # text, stop strings, logprobs
    scheduler.finish_seq(seq, "stop", stop_string) for each stopped sequence

With overlap scheduling (``EngineConfig.async_scheduling``, the default; SGLang's overlap
scheduler, vLLM's async scheduling) the engine keeps one more step handed over than it waits
for: step N+1 is scheduled and submitted before step N's result is read, its decode inputs being
placeholders the worker fills with the tokens it sampled in step N (``step.py``). A sequence that
ends in step N (EOS, stop token or string, abort) may then compute one token in N+1 that the
scheduler discards; one that reaches ``max_tokens`` or ``max_model_len`` is not scheduled again.
Outputs are the same with and without overlap.

The executor is an ``executor.Executor``; a ``StepRunner`` (``ModelRunner`` by default) is run in
this process by an ``InlineExecutor`` (no overlap) or a ``ThreadedExecutor`` (overlap); ``ipc/``
passes a ``ZmqExecutor`` (a worker process). Loop shape after vLLM's ``LLMEngine`` / ``EngineCore``.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterable

from ..common.config import EngineConfig
from ..common.executor import Executor, InlineExecutor, StepRunner, ThreadedExecutor
from ..common.config import cdiv
from .output_processor import OutputProcessor
from ..common.outputs import RequestDelta
from ..common.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from ..common.grammar import check_constraint, grammar_key
from .grammar_gate import GrammarGate
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Request
from ..common.step import make_step_plan, poll_plan
from ..inputs.input_processor import InputProcessor, ProcessedPrompt


class LLMEngine:
    """Scheduler-side engine (the whole engine when the executor is in-process).

    Args:
        config: an ``EngineConfig``.
        executor: an ``Executor``, or a ``StepRunner`` to run in this process (the worker side's
            ``runtime.worker.model_runner.ModelRunner(config)``, as ``folio.LLM`` passes it).
        tokenizer: a ``folio.model.tokenizer.Tokenizer``-like object; ``None`` loads the model's.
        scheduler_cls: the ``Scheduler`` class (benchmarks pass a policy subclass).
    Attributes:
        tokenizer, model_config, max_model_len (tokens), eos_token_ids, scheduler, executor,
        output_processor.
    Raises:
        TypeError: ``executor`` is neither an ``Executor`` nor a ``StepRunner``.
    """

    def __init__(self, config: EngineConfig, executor, tokenizer=None, scheduler_cls=Scheduler):
        self.config = config
        if not isinstance(executor, Executor):
            if not isinstance(executor, StepRunner):
                raise TypeError(f"executor must be an Executor or a StepRunner, got {type(executor).__name__}")
            executor = ThreadedExecutor(executor) if config.async_scheduling else InlineExecutor(executor)
        self.executor: Executor = executor
        model_config = executor.model_config
        if tokenizer is None or model_config is None:
            from ...model.registry import resolve_model
            model_dir = resolve_model(config.model)
            if tokenizer is None:
                from ...model.tokenizer import Tokenizer
                tokenizer = Tokenizer.from_pretrained(model_dir)
            if model_config is None:
                from ...model.config import ModelConfig
                model_config = ModelConfig.from_pretrained(model_dir)
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.vocab_size = int(model_config.vocab_size)
        self.max_model_len = config.resolve_max_model_len(model_config.max_position_embeddings)
        self.eos_token_ids = list(dict.fromkeys(list(getattr(model_config, "eos_token_ids", []) or [])
                                                + list(getattr(tokenizer, "eos_token_ids", []) or [])))
        self.scheduler = scheduler_cls(config, int(executor.num_blocks), self.max_model_len)
        self.output_processor = OutputProcessor(tokenizer)
        self.input_processor = InputProcessor(tokenizer, self.max_model_len, self.vocab_size)
        # steps handed to the executor whose results were not read yet, oldest first:
        # (the step, whether the worker's idle time before it counts as time between steps)
        self._in_flight: deque[tuple[SchedulerOutput, bool]] = deque()
        self._depth = 1 if config.async_scheduling and not isinstance(executor, InlineExecutor) else 0
        self._busy = False             # a step was handed over and work remained since
        self._pending: list[RequestDelta] = []  # deltas of requests that ended outside a step
        self.grammar_gate = GrammarGate()      # constrained requests until the worker compiled their grammar
        self.stats = {"num_steps": 0, "forward_time": 0.0, "sample_time": 0.0, "num_scheduled_tokens": 0,
                      "num_generated_tokens": 0, "worker_idle_time": 0.0, "worker_busy_time": 0.0,
                      "num_decode_only_steps": 0, "decode_only_forward_time": 0.0}

    # -- requests ------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | dict | None,
                    sampling_params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, cache_salt: str | None = None,
                    arrival_time: float | None = None) -> None:
        """Validate, tokenize and queue a request. Nothing is allocated before validation passes.

        ``prompt`` takes every form ``folio.LLM.generate`` takes (vLLM's ``add_request`` too): a
        string, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}`` (either with
        ``"cache_salt"``), or ``None`` with ``prompt_token_ids``. The prompt goes through the
        ``InputProcessor`` (``runtime/inputs/input_processor.py``), then the engine's own checks;
        a ``ProcessedPrompt`` (what ``InputProcessor.process`` returns, for the same
        ``max_tokens``) is taken as it is, not checked again.

        A request with ``structured_outputs`` waits, outside the scheduler's queues, until the
        worker has compiled its grammar (``grammar_gate.py``); one whose grammar fails then ends
        with a delta whose ``error`` says why.

        ``max_tokens=0`` is a defined prompt-only result: the request's only delta comes with the
        next step, with no tokens, empty text and ``finish_reason="length"``; no block is used.
        ``sampling_params`` may be a ``BeamSearchParams``: the request is then a beam search
        (``runtime/scheduler/beam_search.py``) whose only delta, when it ends, carries one completion per
        result sequence, best first.
        Raises:
            ValueError: a request that could never run, before it is admitted (``InputError``, a
                ``ValueError`` naming the field, for the prompt's own checks): duplicate id, no
                prompt, a bad prompt form, empty prompt, a token id outside the vocabulary,
                prompt + max_tokens over ``max_model_len``, more KV blocks for one sample than
                the whole cache, ``n`` (or ``beam_width``) over ``max_num_seqs``, beams that could
                not all fit the cache unshared, ``prompt_logprobs`` with ``max_tokens=0``, a prompt over
                ``max_num_batched_tokens`` when chunked prefill is off, or a bad cache_salt /
                sampling_params type; ``GrammarError`` (a ``ValueError`` with ``param``
                ``structured_outputs``) for a constraint that is too large, or whose grammar the
                worker already refused.
        """
        if sampling_params is None:
            sampling_params = SamplingParams()
        beam = None
        if isinstance(sampling_params, BeamSearchParams):  # a beam search (runtime/scheduler/beam_search.py)
            beam, sampling_params = sampling_params, sampling_params.worker_params()
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams or BeamSearchParams, got "
                             f"{type(sampling_params).__name__}")
        if request_id in self.scheduler.requests or self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, ProcessedPrompt):   # validated where it entered (ipc/scheduler_process.py)
            if prompt_token_ids is not None or cache_salt is not None:
                raise ValueError("a ProcessedPrompt carries its own token ids and cache_salt")
            inputs = prompt
        else:
            inputs = self.input_processor.process(prompt, sampling_params.max_tokens,
                                                  prompt_token_ids=prompt_token_ids, cache_salt=cache_salt)
        prompt, prompt_token_ids, cache_salt = inputs.prompt, inputs.prompt_token_ids, inputs.cache_salt
        num_prompt, max_tokens = len(prompt_token_ids), inputs.max_tokens
        so = sampling_params.structured_outputs
        if so is not None:
            if beam is not None:  # not reachable through BeamSearchParams; kept for subclasses
                raise ValueError("beam search cannot be combined with structured_outputs")
            check_constraint(so)      # its size; the worker compiles it (grammar_gate.py)
        if sampling_params.n > self.config.max_num_seqs:
            raise ValueError(f"n ({sampling_params.n}) exceeds max_num_seqs ({self.config.max_num_seqs}): "
                             "the samples of one request run side by side")
        if beam is not None and beam.beam_width > self.config.max_num_seqs:
            raise ValueError(f"beam_width ({beam.beam_width}) exceeds max_num_seqs ({self.config.max_num_seqs}): "
                             "the beams of one request run side by side")
        if sampling_params.prompt_logprobs is not None and max_tokens == 0:
            raise ValueError("prompt_logprobs needs max_tokens >= 1 (the prompt is computed with the first token)")
        if not self.config.enable_chunked_prefill and num_prompt > self.config.max_num_batched_tokens:
            raise ValueError(f"the prompt has {num_prompt} tokens; without chunked prefill it must fit "
                             f"max_num_batched_tokens ({self.config.max_num_batched_tokens})")
        need = cdiv(num_prompt + max_tokens, self.config.block_size)
        total = int(self.executor.num_blocks)
        if need > total:
            raise ValueError(f"the request needs {need} KV blocks per sample but the whole cache has {total}")
        if beam is not None and beam.beam_width * need > total:
            # recomputed after a preemption, beams may share nothing: the search must fit alone
            raise ValueError(f"beam search with beam_width {beam.beam_width} needs up to {beam.beam_width * need} "
                             f"KV blocks ({need} per beam, nothing shared) but the whole cache has {total}")
        request = Request(request_id, prompt, prompt_token_ids, sampling_params, max_tokens, cache_salt,
                          arrival_time, self.eos_token_ids, beam_params=beam)
        runnable = True
        if so is not None:
            request.grammar_key = grammar_key(so, self.eos_token_ids)
            runnable = self.grammar_gate.admit(request, so, self.eos_token_ids)   # (GrammarError: known bad)
        self.output_processor.add_request(request)
        if runnable:
            self._start(request)

    def _start(self, request: Request) -> None:
        """Queue a validated request whose grammar, if any, is compiled on the worker."""
        if request.max_output_tokens == 0:
            self._pending.append(self.output_processor.finish_beams(request) if request.beam is not None
                                 else self.output_processor.finish_request(request, "length"))
            return
        self.scheduler.add_request(request)

    def _grammar_results(self, results) -> None:
        """Apply the worker's grammar answers: start the requests whose grammar compiled, end
        those whose grammar failed (their only delta carries the error)."""
        runnable, failed = self.grammar_gate.on_results(results) if results else ([], [])
        failed += self.grammar_gate.expired()
        for request in runnable:
            self._start(request)
        for request, error in failed:
            delta = self.output_processor.finish_request(request, "abort")
            if delta is not None:
                delta.error = error
                self._pending.append(delta)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests now: their blocks are freed, their last delta (``finish_reason="abort"``
        for every sample that had not finished) comes with the next ``step()``. Unknown or
        finished ids are ignored. A token of theirs still being computed is discarded."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            request = self.scheduler.abort_request(rid) or self.grammar_gate.drop(rid)
            if request is not None:
                delta = self.output_processor.finish_request(request, "abort")
                if delta is not None:
                    self._pending.append(delta)

    def has_unfinished_requests(self) -> bool:
        """Whether ``step()`` has anything left to do (requests, also those waiting for their
        grammar, deltas to hand out, steps in flight)."""
        return self.scheduler.has_unfinished() or bool(self._pending) or bool(self._in_flight) \
            or self.grammar_gate.has_held()

    # -- steps ---------------------------------------------------------------------------------------
    def step(self, block: bool = True) -> list[RequestDelta]:
        """Run the engine one step on: hand over the next step(s), read the oldest result, and
        return what changed.

        Args:
            block: wait for the oldest step's result; ``False`` reads it only if it is already
                there (a serving loop polls the executor in between).
        Returns:
            one ``RequestDelta`` per request that got tokens, finished or was aborted.
        Raises:
            RuntimeError: the worker failed a step (every request it ran is requeued and
                recomputed later), or requests are waiting that the scheduler cannot run.
        """
        outputs = self._step(block)
        outputs.extend(self._pending)   # (requests whose grammar failed in this step)
        self._pending = []
        gate = self.grammar_gate
        for d in outputs:
            if d.finished:
                gate.finished(d.request_id)
        return outputs

    def _step(self, block: bool) -> list[RequestDelta]:
        outputs, self._pending = self._pending, []
        self._fill()
        if not self._in_flight:
            if self.scheduler.has_unfinished():
                raise RuntimeError(f"the scheduler cannot run any of {len(self.scheduler.waiting)} waiting "
                                   "sequences (a request bigger than the engine passed validation)")
            return outputs
        if block or self.executor.result_ready():
            outputs.extend(self._collect())
            if self._depth:
                self._fill()   # overlap: the next plan leaves before the caller sees these outputs
        if not self.scheduler.has_unfinished():
            # nothing left to schedule: read the steps still in flight (their tokens are discarded)
            while self._in_flight and (block or self.executor.result_ready()):
                outputs.extend(self._collect())
        return outputs

    def _fill(self) -> None:
        """Hand over steps until ``1 + depth`` are in flight or nothing can be scheduled; with
        nothing to schedule and nothing in flight, a plan of no tokens carries the grammar gate's
        compiles and releases, and waits for its answers (``step.poll_plan``)."""
        gate = self.grammar_gate
        while len(self._in_flight) <= self._depth and self.scheduler.has_unfinished():
            out = self.scheduler.schedule()
            if out.is_empty:
                # a pass that only preempted (its own sequence, or idle beams) admits at a later
                # pass; each such pass moves running sequences to waiting, so this ends
                if out.num_preempted:
                    continue
                break
            plan = make_step_plan(out, self.config.block_size)
            plan.grammar_compiles, plan.grammar_releases = gate.take_compiles(), gate.take_releases()
            self.executor.submit(plan)
            self._in_flight.append((out, self._busy))
            self._busy = True
            self.stats["num_scheduled_tokens"] += plan.num_tokens
        if not self._in_flight and gate.waiting_for_worker():
            out = self.scheduler.empty_step()
            self.executor.submit(poll_plan(out.step_id, gate.take_compiles(), gate.take_releases()))
            self._in_flight.append((out, False))

    def _collect(self) -> list[RequestDelta]:
        """Read the oldest step's result and apply it (see the module docstring)."""
        out, counts_idle = self._in_flight.popleft()
        result = self.executor.get_result()
        self._grammar_results(result.grammar_results)
        if out.is_empty and not result.error and result.step_id == out.step_id:   # a poll plan
            return []
        if result.error or result.step_id != out.step_id:
            # the later steps in flight were built on this one: wait for them, then undo all
            failed = [out] + [o for o, _ in self._in_flight]
            for _ in range(len(self._in_flight)):
                self._grammar_results(self.executor.get_result().grammar_results)
            self._in_flight.clear()
            self._busy = False
            self.scheduler.rollback(failed)
            why = result.error or f"the worker answered step {result.step_id} to step {out.step_id}"
            raise RuntimeError(f"step {out.step_id} failed on the worker: {why}")
        stats = self.stats
        stats["num_steps"] += 1
        stats["forward_time"] += float(result.forward_time)
        if out.num_new_tokens and max(out.num_new_tokens) == 1:   # every sequence computes one token
            stats["num_decode_only_steps"] += 1
            stats["decode_only_forward_time"] += float(result.forward_time)
        stats["sample_time"] += float(result.sample_time)
        stats["worker_busy_time"] += float(result.forward_time) + float(result.sample_time)
        if counts_idle:
            stats["worker_idle_time"] += float(result.idle_time)
        self.scheduler.observe_step(out, float(result.forward_time) + float(result.sample_time))
        update = self.scheduler.update_from_output(out, result)
        stats["num_generated_tokens"] += sum(update.num_tokens) if update.num_tokens else len(update.seqs)
        deltas, stopped = self.output_processor.process(update, result)
        for seq, stop_string in stopped:
            self.scheduler.finish_seq(seq, "stop", stop_string)
        if not self.scheduler.has_unfinished() and not self._in_flight:
            self._busy = False
        return deltas

    # -- warm-up -------------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Run throwaway requests so that every kernel a first batch of clients meets is compiled
        (Numba; minutes on a cold compile cache) or loaded before any timed or served request.

        Shapes, one phase after the other (run together they would make one batch, and the
        single-sequence shapes would never run): one prompt shorter than a block (the serial
        kernels), ten short prompts at once (the parallel prefill kernels, then a decode of ten
        sequences: the batched products), one long prompt (a decode cut into key ranges, the
        single-sequence products), one prompt sampled with n = 2 (its shared partial block is
        copied on write: the block-copy kernel), one constrained by a grammar (the worker builds
        its grammar tokenizer, a pass over the vocabulary that holds its interpreter for about a
        second, now rather than during a client's stream). Each makes at most two tokens. Prompts
        that do not fit the model's length or the KV cache are left out, and so is the n = 2 request where ``max_num_seqs`` is 1
        (``add_request`` would refuse it); the prefix cache is emptied after, so no warm-up
        block is ever a hit, and the counters of ``get_metrics()`` start again from zero (as
        vLLM's ``reset_prefix_cache`` resets its prefix-cache stats): the warm-up is not counted.

        Raises:
            RuntimeError: the engine has unfinished requests (they would share the warm-up's steps).
        """
        if self.has_unfinished_requests():
            raise RuntimeError("warm_up() needs an idle engine: it has unfinished requests")
        text = "Warming up: requests run through prefill and decode before any client comes."
        base = self.tokenizer.encode(text) or [0]
        bs = self.config.block_size
        longest = self.max_model_len - 2
        greedy = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
        forked = SamplingParams(n=2, max_tokens=2, ignore_eos=True, temperature=1.0, seed=0)
        constrained = SamplingParams(max_tokens=2, temperature=0.0,
                                     structured_outputs=StructuredOutputsParams(choice=["warm"]))
        phases = [([min(bs - 1, longest)], greedy), ([min(40, longest)] * 10, greedy),
                  ([min(600, longest)], greedy), ([min(bs + bs // 2, longest)], forked),
                  ([min(bs - 1, longest)], constrained)]
        room = int(self.get_metrics()["num_total_blocks"])
        for p, (lengths, params) in enumerate(phases):
            if any(n < 1 for n in lengths) or sum(params.n * cdiv(n + 2, bs) for n in lengths) > room \
                    or params.n > self.config.max_num_seqs:
                continue
            for i, n in enumerate(lengths):
                ids = (base * (n // len(base) + 1))[:n]
                self.add_request(f"folio-warm-up-{p}-{i}", None, params, prompt_token_ids=ids)
            while self.has_unfinished_requests():
                self.step()
        self.scheduler.reset_prefix_cache()
        self.reset_counters()

    def reset_counters(self) -> None:
        """Zero the cumulative counters of ``get_metrics()`` (steps, tokens, times, prefix-cache
        queries and hits, preemptions, evictions); the gauges (blocks, sequences) stay as they are."""
        self.stats = {k: type(v)() for k, v in self.stats.items()}
        self.scheduler.reset_counters()

    # -- counters ------------------------------------------------------------------------------------
    def get_metrics(self) -> dict[str, Any]:
        """Counters: num_total_blocks, num_free_blocks, num_cached_blocks (full blocks registered
        in the prefix cache), num_evictions, prefix_cache_queries, prefix_cache_hits (tokens),
        num_preemptions, num_running, num_waiting (sequences), kv_tokens_held /
        kv_tokens_allocated (token slots holding K/V vs slots in blocks in use), num_steps,
        forward_time / sample_time (s), num_decode_only_steps / decode_only_forward_time (s: the
        steps in which every scheduled sequence computes one token, memory-bound on a CPU, apart
        from the steps with prompt tokens), num_scheduled_tokens, num_generated_tokens,
        worker_idle_time / worker_busy_time (s: the worker waiting for the next plan while the
        engine had work, and running forward + sampling), block_size, max_model_len,
        async_scheduling; with ``speculative_config``, vLLM's spec_decode counters and their
        rates (``spec_decode.SpecDecoding.get_metrics``)."""
        m = self.scheduler.get_metrics()
        m.update(self.stats)
        m["block_size"] = self.config.block_size
        m["max_model_len"] = self.max_model_len
        m["async_scheduling"] = bool(self._depth)
        return m

    def shutdown(self) -> None:
        self.executor.shutdown()
