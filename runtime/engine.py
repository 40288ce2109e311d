"""The engine loop: requests in, one scheduled step at a time, cumulative outputs out.

``LLMEngine.step()`` = schedule (``scheduler.py``) -> build the ``StepPlan`` -> ``executor.execute``
-> apply the ``StepResult`` (append tokens, detokenize incrementally, check stop conditions) ->
free what finished -> ``RequestOutput`` per request that progressed. The executor is the in-process
``ModelRunner`` by default; ``ipc/`` substitutes a remote one with the same three members
(``num_blocks``, ``execute(plan)``, ``shutdown()``). Loop shape after vLLM's ``LLMEngine``.
"""

from __future__ import annotations

import time
from itertools import chain
from typing import Any, Iterable

import numpy as np

from .config import EngineConfig
from .kv_cache_manager import cdiv
from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Request, Sequence
from .step import NewSequence, StepPlan, StepResult


class LLMEngine:
    """Scheduler-side engine (the whole engine when the executor is in-process).

    Args:
        config: an ``EngineConfig``.
        executor: anything with ``num_blocks``, ``execute(plan) -> StepResult`` and ``shutdown()``
            (optionally ``model_config``); ``None`` builds the in-process ``ModelRunner(config)``.
        tokenizer: a ``folio.model.tokenizer.Tokenizer``-like object; ``None`` loads the model's.
    Attributes:
        tokenizer, max_model_len (tokens), eos_token_ids, scheduler.
    """

    def __init__(self, config: EngineConfig, executor=None, tokenizer=None):
        self.config = config
        if executor is None:
            from .model_runner import ModelRunner
            executor = ModelRunner(config)
        self.executor = executor
        model_config = getattr(executor, "model_config", None)
        if tokenizer is None or model_config is None:
            model_dir = getattr(executor, "model_dir", None)
            if model_dir is None:
                from ..model.registry import resolve_model
                model_dir = resolve_model(config.model)
            if tokenizer is None:
                from ..model.tokenizer import Tokenizer
                tokenizer = Tokenizer.from_pretrained(model_dir)
            if model_config is None:
                from ..model.config import ModelConfig
                model_config = ModelConfig.from_pretrained(model_dir)
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.vocab_size = int(model_config.vocab_size)
        self.max_model_len = config.resolve_max_model_len(model_config.max_position_embeddings)
        self.eos_token_ids = list(dict.fromkeys(list(getattr(model_config, "eos_token_ids", []) or [])
                                                + list(getattr(tokenizer, "eos_token_ids", []) or [])))
        self.scheduler = Scheduler(config, int(executor.num_blocks))
        self._step_id = 0
        self._pending_aborts: list[str] = []
        self._immediate: list[Request] = []  # max_tokens=0: finished without running
        self._token_text: dict[bool, dict[int, str]] = {}  # skip_special_tokens -> single-token texts
        self.stats = {"num_steps": 0, "forward_time": 0.0, "sample_time": 0.0,
                      "num_scheduled_tokens": 0, "num_generated_tokens": 0}

    # requests
    def add_request(self, request_id: str, prompt: str | None, sampling_params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, cache_salt: str | None = None,
                    arrival_time: float | None = None) -> None:
        """Validate, tokenize and queue a request. Nothing is allocated before validation passes.

        ``max_tokens=0`` is a defined prompt-only result: the request finishes at the next step
        with no tokens, empty text and ``finish_reason="length"``; no block is used.
        Raises:
            ValueError: duplicate id, no prompt, empty prompt, a token id outside the vocabulary,
                prompt + max_tokens over ``max_model_len``, more KV blocks than the whole cache,
                a prompt over ``max_num_batched_tokens`` when chunked prefill is off,
                or a bad cache_salt / sampling_params type.
        """
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        if request_id in self.scheduler.requests or any(r.request_id == request_id for r in self._immediate):
            raise ValueError(f"request id {request_id!r} is already in use")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string or None, got {type(cache_salt).__name__}")
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("a request needs a prompt or prompt_token_ids")
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"prompt is not valid Unicode text (lone surrogate at {e.start})") from None
            prompt_token_ids = self.tokenizer.encode(prompt)
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt_token_ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        if not prompt_token_ids:
            raise ValueError("the prompt is empty (0 tokens); at least one token is needed")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        num_prompt = len(prompt_token_ids)
        max_tokens = sampling_params.max_tokens
        if max_tokens is None:
            if num_prompt >= self.max_model_len:
                raise ValueError(f"the prompt has {num_prompt} tokens; max_model_len is {self.max_model_len}, "
                                 "which leaves no room to generate")
            max_tokens = self.max_model_len - num_prompt
        elif num_prompt + max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = "
                             f"{num_prompt + max_tokens} exceeds max_model_len ({self.max_model_len})")
        if not self.config.enable_chunked_prefill and num_prompt > self.config.max_num_batched_tokens:
            raise ValueError(f"the prompt has {num_prompt} tokens; without chunked prefill it must fit "
                             f"max_num_batched_tokens ({self.config.max_num_batched_tokens})")
        need = cdiv(num_prompt + max_tokens, self.config.block_size)
        if need > self.scheduler.kv.num_total_blocks:
            raise ValueError(f"the request needs {need} KV blocks but the whole cache has "
                             f"{self.scheduler.kv.num_total_blocks}")
        request = Request(request_id, prompt, prompt_token_ids, sampling_params, cache_salt, arrival_time,
                          self.eos_token_ids)
        request.max_tokens = max_tokens
        if max_tokens == 0:
            self._immediate.append(request)
            return
        self.scheduler.add_request(request)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests; their blocks are freed at the next step (unknown ids are ignored)."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self._pending_aborts.extend(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._immediate) or bool(self._pending_aborts)

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests) + len(self._immediate)

    # one step
    def step(self) -> list[RequestOutput]:
        """Run one engine step. Returns one cumulative ``RequestOutput`` per request that got a
        token, finished or was aborted in this step.

        Raises:
            RuntimeError: the executor reported an error (every running request stays queued).
        """
        outputs: list[RequestOutput] = []
        now = time.time()
        for request in self._immediate:
            request.finished_time = now
            outputs.append(self._make_output(request, finished=True, force_reason="length"))
        self._immediate = []
        for rid in self._pending_aborts:
            request = self.scheduler.abort_request(rid)
            if request is not None:
                request.finished_time = now
                outputs.append(self._make_output(request, finished=True))
                self.scheduler.remove_finished_request(request)
        self._pending_aborts = []

        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        plan = self._build_plan(sched)
        result: StepResult = self.executor.execute(plan)
        if result.error:
            self._undo_schedule(sched)
            raise RuntimeError(f"step {plan.step_id} failed on the worker: {result.error}")
        self.stats["num_steps"] += 1
        self.stats["forward_time"] += float(result.forward_time)
        self.stats["sample_time"] += float(result.sample_time)
        self.stats["num_scheduled_tokens"] += sched.num_tokens
        self.scheduler.update_from_output(sched)
        outputs.extend(self._apply_result(sched, result))
        return outputs

    def _build_plan(self, sched: SchedulerOutput) -> StepPlan:
        """Flatten the scheduled sequences into the plan's arrays (see runtime/step.py).

        One pass over the sequences gathers their per-sequence numbers and new token ids; every
        per-token array is then computed with NumPy (block tables are rows the KV cache manager
        keeps up to date, so they are one gather)."""
        bs = self.config.block_size
        kv = self.scheduler.kv
        items = sched.scheduled
        S = len(items)
        seqs = [item.seq for item in items]
        num_new = np.fromiter((item.num_new_tokens for item in items), dtype=np.int64, count=S)
        start = np.fromiter((seq.num_computed_tokens for seq in seqs), dtype=np.int64, count=S)
        seq_ids = np.fromiter((seq.seq_id for seq in seqs), dtype=np.int64, count=S)
        sample = np.fromiter((item.sample for item in items), dtype=bool, count=S)
        ids = list(chain.from_iterable(seq.all_token_ids[c:c + n] for seq, c, n
                                       in zip(seqs, start.tolist(), num_new.tolist())))
        # per token: its sequence, position and KV slot
        query_start_loc = np.zeros(S + 1, dtype=np.int32)
        np.cumsum(num_new, out=query_start_loc[1:])
        seq_lens = start + num_new
        token_seq = np.repeat(np.arange(S), num_new)
        positions = np.arange(len(ids), dtype=np.int64) + np.repeat(start - query_start_loc[:-1], num_new)
        width = max(len(kv.seq_blocks[i]) for i in seq_ids.tolist())
        block_tables = kv.block_table[kv.block_table_rows(seq_ids.tolist()), :width]
        slot_mapping = block_tables[token_seq, positions // bs].astype(np.int64) * bs + positions % bs
        new_seqs = [NewSequence(seq_id=s.seq_id, prompt_token_ids=list(s.request.prompt_token_ids),
                                output_token_ids=list(s.output_token_ids),
                                sampling=s.request.sampling_params.to_dict(), seed=s.seed,
                                eos_token_ids=list(s.request.eos_token_ids))
                    for s in sched.new_seqs]
        self._step_id += 1
        return StepPlan(
            step_id=self._step_id,
            input_ids=np.asarray(ids, dtype=np.int64),
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens.astype(np.int32),
            block_tables=block_tables,
            seq_ids=seq_ids,
            logits_indices=(query_start_loc[1:][sample] - 1).astype(np.int64),
            sample_seq_ids=seq_ids[sample],
            new_seqs=new_seqs,
            finished_seq_ids=list(sched.finished_seq_ids),
            block_copies=np.asarray(sched.block_copies, dtype=np.int64).reshape(-1, 2),
        )

    def _undo_schedule(self, sched: SchedulerOutput) -> None:
        """After a failed step: forget the hashes of blocks this step was to fill, preempt what
        ran so the requests are recomputed later, and make sure the worker hears about finished
        sequences again."""
        kv = self.scheduler.kv
        for item in sched.scheduled:
            seq = item.seq
            first = seq.num_computed_tokens // self.config.block_size
            for block in kv.seq_blocks.get(seq.seq_id, [])[first:]:
                kv.pool.drop_hash(block)
        for item in sched.scheduled:
            if item.seq in self.scheduler.running:
                self.scheduler.preempt(item.seq, count=False)
            item.seq.sent_to_worker = False
        self.scheduler._pending_finished_ids[:0] = sched.finished_seq_ids

    def _apply_result(self, sched: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        now = time.time()
        sampled = [item.seq for item in sched.scheduled if item.sample]
        tokens = np.asarray(result.sampled_token_ids).reshape(-1).tolist()
        if len(tokens) != len(sampled):
            raise RuntimeError(f"the worker returned {len(tokens)} tokens for {len(sampled)} rows")
        self.stats["num_generated_tokens"] += len(tokens)
        with_logprobs = result.logprobs is not None
        touched: dict[str, Request] = {}
        for row, (seq, token) in enumerate(zip(sampled, tokens)):
            request = seq.request
            seq.all_token_ids.append(token)
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            if with_logprobs and request.sampling_params.logprobs is not None:
                self._record_logprobs(seq, result, row)
            self._check_stop(seq, token)
            touched[request.request_id] = request
        outputs = []
        for request in touched.values():
            finished = request.is_finished
            if finished:
                request.finished_time = now
            outputs.append(self._make_output(request, finished))
            if finished:
                self.scheduler.remove_finished_request(request)
        return outputs

    def _record_logprobs(self, seq: Sequence, result: StepResult, row: int) -> None:
        k = seq.request.sampling_params.logprobs
        lps = np.asarray(result.logprobs[row])
        ids = np.asarray(result.logprob_token_ids[row])
        entry = {}
        for j in range(1, min(k, len(lps) - 1) + 1):
            entry[int(ids[j])] = Logprob(float(lps[j]), rank=j)
        sampled = int(ids[0])
        if sampled not in entry:
            entry[sampled] = Logprob(float(lps[0]))
        if seq.logprobs is None:
            seq.logprobs = []
            seq.cumulative_logprob = 0.0
        seq.logprobs.append(entry)
        seq.cumulative_logprob += float(lps[0])

    def _detokenizer(self, seq: Sequence):
        if seq.detokenizer is None:
            from .detokenizer import IncrementalDetokenizer
            params = seq.request.sampling_params
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, seq.request.prompt_token_ids, params,
                token_text_cache=self._token_text.setdefault(params.skip_special_tokens, {}))
        return seq.detokenizer

    def _check_stop(self, seq: Sequence, token: int) -> None:
        """Stop conditions in vLLM's order: EOS (unless ignore_eos), stop_token_ids, stop strings,
        max_tokens, max_model_len. None but the last two before ``min_tokens`` tokens are out."""
        request = seq.request
        params = request.sampling_params
        detok = seq.detokenizer or self._detokenizer(seq)
        n_out = len(seq.all_token_ids) - seq.num_prompt_tokens
        may_stop = n_out >= params.min_tokens
        reason, stop_reason = None, None
        if may_stop and not params.ignore_eos and token in request.eos_token_ids:
            reason = "stop"
        elif may_stop and token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        # the detokenizer leaves a stopping token's text out unless include_stop_str_in_output,
        # and checks stop strings only once min_tokens are out
        matched = detok.update((token,), reason is not None)
        if reason is None and matched is not None:
            reason, stop_reason = "stop", matched
        if reason is None and n_out >= request.max_tokens:
            reason = "length"
        if reason is None and len(seq.all_token_ids) >= self.max_model_len:
            reason = "length"
        if reason is not None:
            detok.finish()
            self.scheduler.finish_seq(seq, reason, stop_reason)

    def _make_output(self, request: Request, finished: bool, force_reason: str | None = None) -> RequestOutput:
        completions = []
        seqs = request.seqs if len(request.seqs) <= 1 else sorted(request.seqs, key=lambda s: s.index)
        if not seqs:  # never ran (max_tokens=0)
            completions = [CompletionOutput(index=i, text="", token_ids=[], finish_reason=force_reason)
                           for i in range(request.n)]
        # positional arguments, in field order: this runs for every request in every step, and
        # keyword calls cost about twice as much
        for seq in seqs:
            if seq.is_parent:  # not forked yet: nothing generated
                continue
            detok = seq.detokenizer
            completions.append(CompletionOutput(
                seq.index,
                detok.output_text if detok is not None else "",          # text
                seq.output_token_ids,                                     # token_ids (a fresh slice)
                seq.cumulative_logprob,
                list(seq.logprobs) if seq.logprobs is not None else None,  # logprobs
                seq.finish_reason,
                seq.stop_reason))
        metrics = RequestMetrics(request.arrival_time, request.first_scheduled_time, request.first_token_time,
                                 request.last_token_time, request.finished_time)
        return RequestOutput(request.request_id, request.prompt, list(request.prompt_token_ids), completions,
                             finished, max(0, request.num_cached_tokens), metrics)

    # counters
    def get_metrics(self) -> dict[str, Any]:
        """Counters: num_total_blocks, num_free_blocks, num_cached_blocks, num_evictions,
        prefix_cache_queries, prefix_cache_hits (tokens), num_preemptions, num_running,
        num_waiting (sequences), kv_tokens_held / kv_tokens_allocated (token slots holding K/V vs
        slots in blocks in use), num_steps, forward_time / sample_time (s), num_scheduled_tokens,
        num_generated_tokens,
        block_size."""
        m = self.scheduler.get_metrics()
        m.update(self.stats)
        m["block_size"] = self.config.block_size
        m["max_model_len"] = self.max_model_len
        return m

    def shutdown(self) -> None:
        self.executor.shutdown()
