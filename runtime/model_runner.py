"""The worker side of a step: device, weights, KV cache tensors, forward pass and sampling.

``ModelRunner`` is a ``StepRunner`` (``runtime/executor.py``: ``.num_blocks``, ``.execute(plan)``,
``.shutdown()``): it gets a ``StepPlan`` and returns a ``StepResult``; in this process the engine
runs it through an ``InlineExecutor`` / ``ThreadedExecutor``, and the IPC layer runs the same
object in a worker process. It never decides what runs (docs/architecture.md, "Processes"). Input
ids that are placeholders (overlap scheduling) become the token the sequence sampled in the step
before (``step.LastSampledTokens``).

KV cache sizing (docs/architecture.md, "KV cache"; vLLM's ``determine_num_available_blocks``):
``num_kv_blocks_override`` blocks if given, else ``kv_cache_memory`` bytes, else on CPU
``cpu_kv_cache_fraction`` of the available RAM (``MemAvailable`` in /proc/meminfo) and on GPU
``gpu_memory_utilization`` of device memory minus what a profiling forward pass of
``max_num_batched_tokens`` tokens used (weights, activations, the CUDA context). The automatic
sizes are capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens could ever need
(plus one block per sequence for copy-on-write).
"""

from __future__ import annotations

import time

import numpy as np

from ..kernels import get_kernels
from ..kernels.table import KernelTable
from ..model.attention import AttentionMetadata
from ..model.loader import allocate_kv_caches, load_model, resolve_device
from .config import EngineConfig
from .sampler import SamplingState, sample
from .sampling_params import SamplingParams
from .step import LastSampledTokens, StepPlan, StepResult


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_useful_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """Most blocks ``max_num_seqs`` sequences of ``max_model_len`` tokens could hold at once, plus
    one spare block per sequence (copy-on-write)."""
    return cdiv(max_num_seqs * max_model_len, block_size) + max_num_seqs


def num_kv_blocks(bytes_per_block: int, *, block_size: int, max_num_seqs: int, max_model_len: int,
                  num_blocks_override: int | None = None, kv_cache_memory: int | None = None,
                  available_bytes: int | None = None) -> int:
    """How many KV blocks to allocate.

    Args:
        bytes_per_block: ``block_size * ModelConfig.kv_bytes_per_token(itemsize)``.
        num_blocks_override: explicit block count (wins; not capped).
        kv_cache_memory: explicit KV budget in bytes (next; not capped).
        available_bytes: the automatic budget in bytes (CPU RAM share / profiled GPU budget);
            capped by ``max_useful_blocks``.
    Returns:
        the number of blocks (>= 1).
    Raises:
        ValueError: the budget holds no block (the message gives the numbers).
    """
    if num_blocks_override is not None:
        n = int(num_blocks_override)
        source = "num_kv_blocks_override"
    elif kv_cache_memory is not None:
        n = int(kv_cache_memory) // bytes_per_block
        source = f"kv_cache_memory={kv_cache_memory} bytes"
    else:
        if available_bytes is None:
            raise ValueError("no KV cache budget: give num_kv_blocks_override, kv_cache_memory or "
                             "available_bytes")
        n = min(max(int(available_bytes), 0) // bytes_per_block,
                max_useful_blocks(max_num_seqs, max_model_len, block_size))
        source = f"an automatic budget of {int(available_bytes)} bytes"
    if n < 1:
        raise ValueError(f"the KV cache gets no block of {bytes_per_block} bytes from {source}; "
                         "free memory or lower the model / max_model_len")
    return n


def mem_available_bytes(path: str = "/proc/meminfo") -> int:
    """``MemAvailable`` of the machine in bytes (Linux).

    Raises:
        RuntimeError: the file or the field is missing.
    """
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError as e:
        raise RuntimeError(f"cannot read {path}: {e}") from None
    raise RuntimeError(f"no MemAvailable in {path}; set kv_cache_memory or num_kv_blocks_override")


class ModelRunner:
    """Load the model, allocate the KV cache and run steps (the in-process Executor).

    Args:
        engine_config: the engine's ``EngineConfig`` (model, device, block_size, KV sizing, seed).

    Attributes:
        device: ``"cpu"`` or ``"cuda"`` (``"auto"`` resolved).
        kernels: the kernel table; ``xp`` its array module.
        model, model_config, model_dir: from ``model.loader.load_model``.
        max_model_len: ``engine_config.max_model_len`` or the model's max_position_embeddings.
        num_blocks: KV blocks allocated (``kv_caches``: per layer ``(key, value)``
            ``[num_blocks, block_size, num_kv_heads, head_dim]``).
        block_size: tokens per block.

    Raises:
        ValueError / FileNotFoundError / RuntimeError: from loading or sizing (bad model, no
        memory for a single block, cuda without a GPU, a dtype the device does not run: CPU
        runs float32 weights and activations, CUDA bfloat16 weights with float32 math).
    """

    def __init__(self, engine_config: EngineConfig):
        cfg = engine_config
        self.config = cfg
        self.device = resolve_device(cfg.device)
        native = {"cpu": "float32", "cuda": "bfloat16"}[self.device]
        if cfg.dtype not in ("auto", native):
            raise ValueError(f"dtype {cfg.dtype!r} is not available on {self.device} (it runs {native}); "
                             "use --dtype auto")
        self.kernels: KernelTable = get_kernels(self.device)
        self.xp = self.kernels.xp
        self.model, self.model_config, self.model_dir = load_model(cfg.model, self.device, cfg.load_format)
        self.max_model_len = cfg.max_model_len or self.model_config.max_position_embeddings
        self.block_size = cfg.block_size
        itemsize = np.dtype(self.kernels.kv_cache_dtype).itemsize
        self.bytes_per_block = self.block_size * self.model_config.kv_bytes_per_token(itemsize)
        available = None
        if cfg.num_kv_blocks_override is None and cfg.kv_cache_memory is None:
            available = self._profile_gpu_budget() if self.device == "cuda" else \
                int(cfg.cpu_kv_cache_fraction * mem_available_bytes())
        self.num_blocks = num_kv_blocks(
            self.bytes_per_block, block_size=self.block_size, max_num_seqs=cfg.max_num_seqs,
            max_model_len=self.max_model_len, num_blocks_override=cfg.num_kv_blocks_override,
            kv_cache_memory=cfg.kv_cache_memory, available_bytes=available)
        self.kv_caches = allocate_kv_caches(self.model_config, self.num_blocks, self.block_size, self.kernels)
        self._seqs: dict[int, SamplingState] = {}
        self._last_sampled = LastSampledTokens()

    # --- KV sizing on GPU ----------------------------------------------------------------------
    def _profile_gpu_budget(self) -> int:
        """Bytes left for the KV cache after a profiling forward of the largest step.

        Runs ``min(max_num_batched_tokens, max_model_len)`` tokens as one sequence (and the
        sampler's largest logits batch) over a temporary cache, then reads the device's free
        memory (CuPy's pool keeps the peak allocations, so used = peak).
        """
        xp = self.xp
        T = max(1, min(self.config.max_num_batched_tokens, self.max_model_len))
        nb = cdiv(T, self.block_size)
        tmp = allocate_kv_caches(self.model_config, nb, self.block_size, self.kernels)
        R = min(self.config.max_num_seqs, T)
        md = AttentionMetadata(
            slot_mapping=xp.arange(T, dtype=xp.int64),
            query_start_loc=xp.asarray(np.array([0, T], dtype=np.int32)),
            seq_lens=xp.asarray(np.array([T], dtype=np.int32)),
            block_tables=xp.arange(nb, dtype=xp.int32)[None, :],
            max_query_len=T, max_seq_len=T)
        logits = self.model.forward(xp.zeros(T, dtype=xp.int64), xp.arange(T, dtype=xp.int64), md, tmp,
                                    xp.arange(T - R, T, dtype=xp.int64))
        from .sampler import log_softmax

        log_softmax(logits, xp)  # the sampler's working set is of this size
        xp.cuda.runtime.deviceSynchronize()
        free, total = xp.cuda.runtime.memGetInfo()
        tmp_bytes = nb * self.bytes_per_block
        del tmp, logits, md
        non_kv = (total - free) - tmp_bytes
        return int(self.config.gpu_memory_utilization * total - non_kv)

    # --- one step -------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        """Run ``plan``: drop finished sequences, register new ones, copy blocks, forward, sample.

        Returns:
            ``StepResult`` with one sampled id per ``plan.logits_indices`` row (in order), raw
            logprobs when asked, and timings; on any exception, ``StepResult.error`` holds
            ``"<ExceptionType>: <message>"`` and the other fields are empty (the runner keeps
            working for the next plan).
        """
        try:
            return self._execute(plan)
        except Exception as e:  # noqa: BLE001 - report to the scheduler instead of crashing
            return StepResult(step_id=plan.step_id, sampled_token_ids=np.zeros(0, dtype=np.int64),
                              error=f"{type(e).__name__}: {e}")

    def _execute(self, plan: StepPlan) -> StepResult:
        xp = self.xp
        for sid in plan.finished_seq_ids:
            self._seqs.pop(int(sid), None)
        self._last_sampled.forget(plan.finished_seq_ids)
        for ns in plan.new_seqs:
            self._seqs[int(ns.seq_id)] = SamplingState(
                ns.seq_id, SamplingParams.from_dict(ns.sampling), ns.prompt_token_ids, ns.output_token_ids,
                ns.seed, ns.eos_token_ids, engine_seed=self.config.seed)
        sample_ids = [int(s) for s in np.asarray(plan.sample_seq_ids).reshape(-1)]
        missing = [s for s in sample_ids if s not in self._seqs]
        if missing:
            raise KeyError(f"no sampling state for seq_id(s) {missing} (never sent in new_seqs, or finished)")
        R = len(sample_ids)
        if len(plan.logits_indices) != R:
            raise ValueError(f"logits_indices has {len(plan.logits_indices)} rows but sample_seq_ids {R}")

        t0 = time.perf_counter()
        copies = np.asarray(plan.block_copies, dtype=np.int64).reshape(-1, 2)
        if len(copies):
            keys = [k for k, _ in self.kv_caches]
            values = [v for _, v in self.kv_caches]
            self.kernels.copy_blocks(keys, values, xp.asarray(copies))
        logits = None
        T = plan.num_tokens
        if T:
            qsl = np.asarray(plan.query_start_loc, dtype=np.int32)
            seq_lens = np.asarray(plan.seq_lens, dtype=np.int32)
            md = AttentionMetadata(
                slot_mapping=xp.asarray(np.asarray(plan.slot_mapping, dtype=np.int64)),
                query_start_loc=xp.asarray(qsl),
                seq_lens=xp.asarray(seq_lens),
                block_tables=xp.asarray(np.ascontiguousarray(plan.block_tables, dtype=np.int32)),
                max_query_len=int(np.diff(qsl).max()) if len(qsl) > 1 else 0,
                max_seq_len=int(seq_lens.max()) if len(seq_lens) else 0)
            rows = np.asarray(plan.logits_indices, dtype=np.int64) if R else np.array([T - 1], np.int64)
            logits = self.model.forward(xp.asarray(self._last_sampled.resolve(plan)),
                                        xp.asarray(np.asarray(plan.positions, dtype=np.int64)),
                                        md, self.kv_caches, xp.asarray(rows))
            self._synchronize()
        elif R:
            raise ValueError("plan samples rows but has no tokens")
        t1 = time.perf_counter()

        if not R:
            return StepResult(step_id=plan.step_id, sampled_token_ids=np.zeros(0, dtype=np.int64),
                              forward_time=t1 - t0)
        states = [self._seqs[s] for s in sample_ids]
        out = sample(logits, states, xp)
        for st, tok in zip(states, out.token_ids.tolist()):
            st.append(tok)
        self._last_sampled.record(plan, out.token_ids)
        t2 = time.perf_counter()
        return StepResult(step_id=plan.step_id, sampled_token_ids=out.token_ids, logprobs=out.logprobs,
                          logprob_token_ids=out.logprob_token_ids, forward_time=t1 - t0,
                          sample_time=t2 - t1)

    def _synchronize(self):
        if self.device == "cuda":
            self.xp.cuda.runtime.deviceSynchronize()

    @property
    def num_active_sequences(self) -> int:
        """Sequences whose sampling state the worker holds."""
        return len(self._seqs)

    def shutdown(self) -> None:
        """Release the KV cache and the model (idempotent)."""
        self.kv_caches = []
        self._seqs.clear()
        self.model = None
        if self.device == "cuda":
            try:
                self.xp.get_default_memory_pool().free_all_blocks()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
