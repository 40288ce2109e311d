"""The offline API: ``LLM(model).generate(prompts, sampling_params)``, shaped like vLLM's ``LLM``.

All prompts of one call are queued at once and the engine's continuous batching runs them
together; the call returns one finished ``RequestOutput`` per prompt, in prompt order (the
cumulative view, built from the engine's per-step deltas when each request finishes).
"""

from __future__ import annotations

import itertools
import sys
from typing import Any, Sequence

from .runtime.scheduler.beam_search import BeamSearchOutput
from .runtime.common.config import DEFAULT_MODEL, EngineConfig
from .runtime.common.grammar import GrammarError
from .runtime.scheduler.engine import LLMEngine
from .runtime.common.outputs import RequestOutput
from .runtime.common.sampling_params import BeamSearchParams, SamplingParams

PromptType = str | dict


class LLM:
    """An engine in this process.

    Args:
        model: a folio model name (default ``smollm2-135m-instruct``) or a Hugging Face Llama folder.
        **engine_args: any ``EngineConfig`` field (``block_size``, ``max_num_seqs``,
            ``max_num_batched_tokens``, ``enable_prefix_caching``, ``num_kv_blocks_override``,
            ``kv_cache_dtype``, ...).
    Raises:
        TypeError: an unknown engine argument. ValueError: an invalid value.
    Attributes:
        llm_engine: the ``LLMEngine`` (step-level access, e.g. for streaming).
    """

    def __init__(self, model: str = DEFAULT_MODEL, executor=None, **engine_args):
        self.config = EngineConfig.from_kwargs(model=model, **engine_args)
        if executor is None:
            from .model.loader import check_quantization
            from .runtime.worker import precompile
            # refused from the file's header, before the kernels compile for a model that cannot load
            check_quantization(self.config.model, self.config.quantization, self.config.dtype, self.config.load_format)
            from .runtime.worker.model_runner import ModelRunner  # the worker side, in this process
            # a cold Numba cache: the kernels compiled in parallel processes, with progress
            # (a bar on a terminal), instead of silently inside the first step
            precompile.precompile_for(self.config, lambda m: print(f"folio: {m}", file=sys.stderr, flush=True))
            executor = ModelRunner(self.config)
        self.llm_engine = LLMEngine(self.config, executor=executor)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt.

        Args:
            prompts: a string, a dict ``{"prompt_token_ids": [...], "cache_salt": str}`` (or
                ``{"prompt": str, "cache_salt": ...}``), or a list of these.
            sampling_params: one ``SamplingParams`` for all prompts, a list with one per prompt,
                or ``None`` (defaults: ``SamplingParams()``).
            use_tqdm: show a progress bar of finished requests.
        Returns:
            one finished ``RequestOutput`` per prompt, in the order given.
        Raises:
            ValueError: a bad prompt or parameter (raised before anything runs; no request of
                the call is left queued); ``GrammarError`` (a ``ValueError``) for a constraint
                the worker could not compile, raised when it fails (before that request runs;
                the call's other requests are aborted).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        return self._run(self._add_all(prompts, params), use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for every prompt (vLLM's ``LLM.beam_search``; the algorithm, and where
        folio differs from vLLM, in ``runtime/scheduler/beam_search.py``). The beams of a prompt are
        sequences of one request sharing KV blocks; all prompts run together.

        Args:
            prompts: as ``generate`` takes them (a string, a dict, or a list of these).
            params: a ``BeamSearchParams``.
            use_tqdm: show a progress bar of finished prompts.
        Returns:
            one ``BeamSearchOutput`` per prompt, in order; its ``sequences`` best first.
        Raises:
            ValueError: a bad prompt or parameter (before anything runs).
        """
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        outs = self._run(self._add_all(prompts, [params] * len(prompts)), use_tqdm)
        return [BeamSearchOutput.from_request_output(o) for o in outs]

    def _add_all(self, prompts: list, params: list) -> list[str]:
        """Queue one request per prompt; on an error none of them stays queued."""
        ids = []
        try:
            for prompt, sp in zip(prompts, params):
                rid = str(next(self._counter))
                self._add(rid, prompt, sp)
                ids.append(rid)
        except Exception:
            self.llm_engine.abort_request(ids)
            self._drain(set(ids))
            raise
        return ids

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to chat conversations (the model's chat template makes the prompt).

        Args:
            messages: one conversation (a list of ``{"role", "content"}`` dicts) or a list of them.
        Returns:
            one ``RequestOutput`` per conversation.
        Raises:
            ValueError (``InputError``): no messages, a malformed message, no chat template, or a
            prompt that does not fit (before anything runs).
        """
        if not messages:
            raise ValueError("messages is empty")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        render = self.llm_engine.input_processor.render_chat
        prompts = [{"prompt": render(c, add_generation_prompt)} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_metrics(self) -> dict[str, Any]:
        """The engine's counters (see ``LLMEngine.get_metrics``)."""
        return self.llm_engine.get_metrics()

    # helpers
    def _add(self, rid: str, prompt: PromptType, sp: SamplingParams) -> None:
        self.llm_engine.add_request(rid, prompt, sp)    # every PromptType form (InputProcessor)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step the engine until every request of ``ids`` finished; the engine emits deltas, and
        each request's cumulative output is built once, when it finishes."""
        pending = set(ids)
        deltas: dict[str, list] = {rid: [] for rid in ids}
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while pending or self.llm_engine.has_unfinished_requests():
                if not self.llm_engine.has_unfinished_requests():
                    raise RuntimeError(f"engine idle with {len(pending)} requests unfinished")
                for delta in self.llm_engine.step():
                    rid = delta.request_id
                    if rid not in pending:
                        continue
                    if delta.error is not None:     # its constraint did not compile (the worker's message)
                        pending.discard(rid)
                        raise GrammarError(delta.error)
                    deltas[rid].append(delta)
                    if delta.finished:
                        final[rid] = RequestOutput.from_deltas(deltas.pop(rid))
                        pending.discard(rid)
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            self.llm_engine.abort_request(list(pending))
            self._drain(pending)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [final[i] for i in ids]

    def _drain(self, ids: set[str]) -> None:
        """Let pending aborts take effect and steps in flight end, so no request of a failed call
        stays queued and the worker is idle."""
        try:
            while self.llm_engine.has_unfinished_requests():
                self.llm_engine.step()
        except Exception:
            pass
