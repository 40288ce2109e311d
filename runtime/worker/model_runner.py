"""The worker side of a step: device, weights, KV cache tensors, forward pass and sampling.

``ModelRunner`` is a ``StepRunner`` (``runtime/common/executor.py``: ``.num_blocks``, ``.execute(plan)``,
``.shutdown()``): it gets a ``StepPlan`` and returns a ``StepResult``; in this process the engine
runs it through an ``InlineExecutor`` / ``ThreadedExecutor``, and the IPC layer runs the same
object in a worker process. It never decides what runs (docs/architecture.md, "Processes"). Input
ids that are placeholders (overlap scheduling) become the token the sequence sampled in the step
before (``step.LastSampledTokens``).

KV cache sizing (docs/architecture.md, "KV cache"; vLLM's ``determine_num_available_blocks``):
``num_kv_blocks_override`` blocks if given, else ``kv_cache_memory`` bytes, else on CPU
``cpu_kv_cache_fraction`` of the available RAM (``MemAvailable`` in /proc/meminfo) and on GPU
``gpu_memory_utilization`` of device memory minus what a profiling step of the largest shape used
(``gpu_kv_budget``: memory outside CuPy's pool, such as the CUDA context, plus the pool's *peak*
bytes in use during the step: weights, the cuBLAS workspace, activation buffers, sampler
temporaries; memory the pool holds for reuse but is not using is not counted as used). The
automatic sizes are capped at what
``max_num_seqs`` sequences of ``max_model_len`` tokens could ever need (plus one block per
sequence for copy-on-write).

The runner reads the same on every device: what differs is asked of the kernel table
(``kernels/table.py``: the ``--dtype`` its weights take, ``activate``, ``synchronize``,
``empty_cache``, the structured-outputs mask). On a table that samples on its device
(``device_sampling``: the CUDA table) a step runs through ``runtime/worker/device_step.py``: one
upload, forward, device sampling, one download, one sync per step, and CUDA graphs for decode
steps; the KV budget is then profiled there. A step with prompt logprob rows (rare: only requests
that ask for them, only while their prompt is computed) or a constrained row runs the eager path
below, as every step does on the other tables: the forward returns the sampled rows' logits
followed by the prompt rows', reduced in chunks (``sampler.prompt_logprobs``).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from ...kernels import get_kernels
from ...kernels.table import CudaKernelTable, KernelTable
from ...model.attention_metadata import AttentionMetadata
from ...model.loader import allocate_kv_caches, load_model, resolve_device
from ..common.config import EngineConfig, cdiv
from .device_step import DeviceStep, graph_batch_sizes
from .grammar_matchers import GrammarMatchers, advance, fill_batch_bitmask
from .sampler import SamplingState, prompt_logprobs, sample
from ..common.sampling_params import SamplingParams
from ..common.step import GRAMMAR_POLL_S, LastSampledTokens, StepPlan, StepResult


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


def _check_dtype(dtype: str, kernels: KernelTable, device: str) -> None:
    """Refuse a ``--dtype`` the table's weights are not served in (``auto`` or its ``weight_dtype``).

    Raises:
        ValueError: naming the flag and the values it takes.
    """
    if dtype not in ("auto", kernels.weight_dtype):
        raise ValueError(f"--dtype {dtype} is not available on {device}: it takes auto or {kernels.weight_dtype} "
                         "(on the CPU, auto serves weights in their stored types: bf16 safetensors stay bf16, "
                         "a .gguf file's tensors are read as stored)")


def kv_cache_dtype(kernels: KernelTable, name: str, device: str) -> np.dtype:
    """The KV cache arrays' dtype for ``--kv-cache-dtype name`` on a kernel table: its default
    (``kernels.kv_cache_dtype``) for ``auto``, else ``kernels.kv_cache_dtypes[name]``.

    Raises:
        ValueError: a name the device's kernels do not run, naming the flag and the values it takes.
    """
    if name == "auto":
        return np.dtype(kernels.kv_cache_dtype)
    if name not in kernels.kv_cache_dtypes:
        raise ValueError(f"--kv-cache-dtype {name} is not available on {device}; it takes auto, "
                         + ", ".join(kernels.kv_cache_dtypes))
    return np.dtype(kernels.kv_cache_dtypes[name])


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


def gpu_kv_budget(total: int, free: int, pool_held: int, pool_peak_used: int, profile_kv_bytes: int,
                  gpu_memory_utilization: float) -> int:
    """Bytes the KV cache may take on a GPU, from a profiling step's accounting.

    Args:
        total, free: device memory after the profiling step (``cudaMemGetInfo``).
        pool_held: bytes CuPy's pool holds then (in use, or free and kept for reuse).
        pool_peak_used: the most bytes in use in the pool during the step (weights, buffers,
            temporaries and the profiling step's own KV cache of ``profile_kv_bytes``).
    Returns:
        ``gpu_memory_utilization * total - (total - free - pool_held) - (pool_peak_used -
        profile_kv_bytes)``: the memory outside the pool (CUDA context, libraries) and the
        pool's peak, less the profiling step's KV cache that the real one replaces.
    """
    outside_pool = (total - free) - pool_held
    return int(gpu_memory_utilization * total - outside_pool - (pool_peak_used - profile_kv_bytes))


def profile_step_shape(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Token counts of the sequences of the largest step the scheduler can build: all of
    ``max_num_batched_tokens`` tokens (as many as ``max_num_seqs`` sequences of at most
    ``max_model_len`` tokens can hold) over ``min(max_num_seqs, tokens)`` sequences as even as
    possible; each samples one row."""
    T = min(max_num_batched_tokens, max_num_seqs * max_model_len)
    S = max(1, min(max_num_seqs, T))
    base, extra = divmod(T, S)
    return [base + (1 if i < extra else 0) for i in range(S)]


class ModelRunner:
    """Load the model, allocate the KV cache and run steps: the ``StepRunner`` that an executor
    drives (``InlineExecutor`` / ``ThreadedExecutor`` in this process, ``ipc.zmq_executor.ZmqExecutor``
    in a worker process of ``ipc/worker_process.py``).

    Args:
        engine_config: the engine's ``EngineConfig`` (model, device, block_size, KV sizing, seed).

    Attributes:
        device: ``"cpu"`` or ``"cuda"`` (``"auto"`` resolved).
        kernels: the kernel table; ``xp`` its array module.
        model, model_config, model_dir: from ``model.loader.load_model``.
        max_model_len: ``engine_config.max_model_len`` or the model's max_position_embeddings.
        num_blocks: KV blocks allocated (``kv_caches``: per layer ``(key, value)``
            ``[num_blocks, block_size, num_kv_heads, head_dim]`` of ``kv_cache_dtype``, the
            dtype ``engine_config.kv_cache_dtype`` names on this device).
        block_size: tokens per block.
        device_step: the ``DeviceStep`` of a table with ``device_sampling`` (the CUDA table), else None.

    Raises:
        ValueError / FileNotFoundError / RuntimeError: from loading or sizing (bad model, no
        memory for a single block, cuda without a GPU, a dtype or KV cache dtype the device does
        not run). The CPU serves weights as stored (``--dtype auto``: float32, 16-bit floats, GGUF
        types, or quantized as they load with ``quantization``) or all float32 (``--dtype
        float32``), with float32 activations or, for weights in quantized GGUF types, int8 ones
        (``activation_quantization``), and a float32 or bfloat16 KV cache; CUDA serves bfloat16
        weights and KV cache with float32 math (``model.loader.load_model``).
    """

    def __init__(self, engine_config: EngineConfig):
        cfg = engine_config
        self.config = cfg
        self.device = resolve_device(cfg.device)
        self.kernels: KernelTable = get_kernels(self.device)
        _check_dtype(cfg.dtype, self.kernels, self.device)
        self.kv_cache_dtype = kv_cache_dtype(self.kernels, cfg.kv_cache_dtype, self.device)
        self.xp = self.kernels.xp
        self.model, self.model_config, self.model_dir = load_model(cfg.model, self.device, cfg.load_format,
                                                                     cfg.dtype, cfg.quantization,
                                                                     cfg.activation_quantization)
        self.max_model_len = cfg.max_model_len or self.model_config.max_position_embeddings
        self.block_size = cfg.block_size
        itemsize = self.kv_cache_dtype.itemsize   # a 16-bit cache: twice the blocks for one budget
        self.bytes_per_block = self.block_size * self.model_config.kv_bytes_per_token(itemsize)
        self.device_step = self._device_step() if self.kernels.device_sampling else None
        available = None
        if cfg.num_kv_blocks_override is None and cfg.kv_cache_memory is None:
            available = self._available_kv_bytes()
        self.num_blocks = num_kv_blocks(
            self.bytes_per_block, block_size=self.block_size, max_num_seqs=cfg.max_num_seqs,
            max_model_len=self.max_model_len, num_blocks_override=cfg.num_kv_blocks_override,
            kv_cache_memory=cfg.kv_cache_memory, available_bytes=available)
        self.kv_caches = allocate_kv_caches(self.model_config, self.num_blocks, self.block_size, self.kernels,
                                            self.kv_cache_dtype)
        self.kernels.synchronize()   # set-up may run on another stream than the steps (the CUDA table's)
        self._seqs: dict[int, SamplingState] = {}
        self._last_sampled = LastSampledTokens()
        self._grammars = GrammarMatchers(self._tokenizer_json)

    def _tokenizer_json(self) -> str:
        from ...model.tokenizer import Tokenizer
        return Tokenizer.from_pretrained(self.model_dir).hf.to_str()

    def _device_step(self) -> DeviceStep:
        """The one-sync step of a table that samples on its device, its decode scratch reserved
        for the largest decode graph (``graph_batch_sizes``' last: ``max_num_seqs`` rows)."""
        cfg, mc = self.config, self.model_config
        cuda: CudaKernelTable = self.kernels  # the extras of a table with device_sampling (kernels/table.py)
        graph_rows = graph_batch_sizes(cfg.max_num_seqs)[-1]
        cuda.reserve_decode_scratch(graph_rows, mc.num_attention_heads, mc.head_dim, self.max_model_len)
        return DeviceStep(cuda, self.model, max_num_seqs=cfg.max_num_seqs,
                          max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=self.max_model_len,
                          block_size=self.block_size, enforce_eager=cfg.enforce_eager)

    # --- KV sizing ------------------------------------------------------------------------------
    def _available_kv_bytes(self) -> int:
        """The automatic KV budget: profiled through the device step where there is one (a GPU's
        memory), else ``cpu_kv_cache_fraction`` of the machine's available RAM."""
        if self.device_step is not None:
            return self._profile_gpu_budget()
        return int(self.config.cpu_kv_cache_fraction * mem_available_bytes())

    def _profile_gpu_budget(self) -> int:
        """Bytes left for the KV cache after a profiling step of the largest shape.

        Runs ``profile_step_shape`` (all ``max_num_batched_tokens`` tokens, ``min(max_num_seqs,
        tokens)`` sequences each sampling a row with top-p, penalties and 20 logprobs: the
        sampler's largest working set) through the device step over a temporary cache, tracking
        the peak bytes in use in the memory pool; then ``gpu_kv_budget``.
        """
        cfg = self.config
        dev = self.device_step.dev  # the CUDA table's KernelDevice
        lens = profile_step_shape(cfg.max_num_batched_tokens, cfg.max_num_seqs, self.max_model_len)
        nb = sum(cdiv(n, self.block_size) for n in lens)
        with dev.peak_tracker() as peak:
            tmp = allocate_kv_caches(self.model_config, nb, self.block_size, self.kernels, self.kv_cache_dtype)
            plan, states = _profile_plan(lens, self.block_size, self.model_config.vocab_size, cfg.seed)
            dev.synchronize_device()  # weights and caches were made on the legacy default stream
            self.device_step.run(plan, states, tmp)
            del tmp
        free, total, held = dev.memory()
        return gpu_kv_budget(total, free, held, peak.peak, nb * self.bytes_per_block, cfg.gpu_memory_utilization)

    # --- one step -------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        """Run ``plan``: start its grammar compiles (``GrammarMatchers``, on their own threads),
        drop finished sequences, register new ones, copy blocks, forward, sample. A plan with no
        tokens only waits, at most ``GRAMMAR_POLL_S``, for a compile to end.

        Returns:
            ``StepResult`` with one sampled id per ``plan.logits_indices`` row (in order), raw
            logprobs when asked, timings, and the grammars compiled since the previous result; on
            any exception, ``StepResult.error`` holds ``"<ExceptionType>: <message>"`` and the
            other fields are empty but the grammars (the runner keeps working for the next plan).
        """
        grammars = self._grammars
        for g in plan.grammar_compiles:      # compiled on the grammar pool, never in a step
            grammars.prepare(g["key"], g["structured_outputs"], g["eos_token_ids"])
        for key in plan.grammar_releases:
            grammars.release(key)
        if not plan.num_tokens and not plan.new_seqs:   # a poll: finished sequences, compiles' results
            for sid in plan.finished_seq_ids:
                self._seqs.pop(int(sid), None)
            self._last_sampled.forget(plan.finished_seq_ids)
            return StepResult(step_id=plan.step_id, sampled_token_ids=np.zeros(0, dtype=np.int64),
                              grammar_results=grammars.poll(GRAMMAR_POLL_S) if grammars.pending() else [])
        try:
            result = self._execute(plan)
        except Exception as e:  # noqa: BLE001 - report to the scheduler instead of crashing
            result = StepResult(step_id=plan.step_id, sampled_token_ids=np.zeros(0, dtype=np.int64),
                                error=f"{type(e).__name__}: {e}")
        if grammars.pending():
            result.grammar_results = grammars.poll()
        return result

    def _execute(self, plan: StepPlan) -> StepResult:
        for sid in plan.finished_seq_ids:
            self._seqs.pop(int(sid), None)
        self._last_sampled.forget(plan.finished_seq_ids)
        for ns in plan.new_seqs:
            st = self._seqs[int(ns.seq_id)] = SamplingState(
                ns.seq_id, SamplingParams.from_dict(ns.sampling), ns.prompt_token_ids, ns.output_token_ids,
                ns.seed, ns.eos_token_ids, engine_seed=self.config.seed)
            if ns.grammar_key is not None:
                self._grammars.attach(st, ns.grammar_key)
        sample_ids = [int(s) for s in np.asarray(plan.sample_seq_ids).reshape(-1)]
        missing = [s for s in sample_ids if s not in self._seqs]
        if missing:
            raise KeyError(f"no sampling state for seq_id(s) {missing} (never sent in new_seqs, or finished)")
        R = len(sample_ids)
        if len(plan.logits_indices) != R:
            raise ValueError(f"logits_indices has {len(plan.logits_indices)} rows but sample_seq_ids {R}")

        # overlap scheduling: placeholder inputs are the tokens sampled in the step before
        input_ids = self._last_sampled.resolve(plan)
        if input_ids is not plan.input_ids:
            plan = dataclasses.replace(plan, input_ids=input_ids)

        num_plp = len(plan.prompt_logprob_indices)
        # a step with a constrained row samples eagerly (the device step's graphs and packed upload
        # carry no bitmask yet); the sampler applies its mask with the table's apply_token_bitmask
        if self.device_step is not None and not num_plp and not any(self._seqs[s].matcher is not None
                                                                     for s in sample_ids):
            if R and not plan.num_tokens:
                raise ValueError("plan samples rows but has no tokens")
            states = [self._seqs[s] for s in sample_ids]
            tokens, lp, lp_ids, fwd, smp = self.device_step.run(plan, states, self.kv_caches)
            for st, tok in zip(states, tokens.tolist()):
                st.append(tok)
            self._last_sampled.record(plan, tokens)
            return StepResult(step_id=plan.step_id, sampled_token_ids=tokens, logprobs=lp,
                              logprob_token_ids=lp_ids, forward_time=fwd, sample_time=smp)

        with self.kernels.activate():   # eager, on the table's stream
            return self._execute_eager(plan, sample_ids, R, num_plp)

    def _execute_eager(self, plan: StepPlan, sample_ids: list[int], R: int, num_plp: int) -> StepResult:
        """Forward + sample on any table, one kernel call at a time (every step of a table without
        device sampling; steps with prompt-logprob or constrained rows on one with it)."""
        xp = self.xp
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
            rows = np.asarray(plan.logits_indices, dtype=np.int64) if R else np.zeros(0, np.int64)
            if num_plp:  # the prompt rows' logits come after the sampled rows'
                rows = np.concatenate([rows, np.asarray(plan.prompt_logprob_indices, dtype=np.int64)])
            if not len(rows):
                rows = np.array([T - 1], np.int64)
            logits = self.model.forward(xp.asarray(np.asarray(plan.input_ids, dtype=np.int64)),
                                        xp.asarray(np.asarray(plan.positions, dtype=np.int64)),
                                        md, self.kv_caches, xp.asarray(rows))
        elif R or num_plp:
            raise ValueError("plan samples rows but has no tokens")
        t1 = time.perf_counter()

        result = StepResult(step_id=plan.step_id, sampled_token_ids=np.zeros(0, dtype=np.int64),
                            forward_time=t1 - t0)
        if num_plp:
            result.prompt_logprobs, result.prompt_logprob_token_ids, result.prompt_logprob_ranks = \
                prompt_logprobs(logits[R:], plan.prompt_logprob_token_ids, self._num_prompt_logprobs(plan), xp)
        if R:
            states = [self._seqs[s] for s in sample_ids]
            out = sample(logits[:R] if num_plp else logits, states, xp,
                         bitmask=fill_batch_bitmask(states, int(logits.shape[1])),
                         bitmask_kernel=self.kernels.apply_token_bitmask)
            for st, tok in zip(states, out.token_ids.tolist()):
                st.append(tok)
            advance(states, out.token_ids.tolist())
            self._last_sampled.record(plan, out.token_ids)
            result.sampled_token_ids, result.logprobs, result.logprob_token_ids = \
                out.token_ids, out.logprobs, out.logprob_token_ids
        result.sample_time = time.perf_counter() - t1
        return result

    def _num_prompt_logprobs(self, plan: StepPlan) -> int:
        """The largest ``prompt_logprobs`` of the sequences owning the plan's prompt rows."""
        qsl = np.asarray(plan.query_start_loc)
        owners = np.asarray(plan.seq_ids)[np.searchsorted(qsl, plan.prompt_logprob_indices, side="right") - 1]
        return max(int(self._seqs[int(s)].params.prompt_logprobs or 0) for s in set(owners.tolist()))

    @property
    def num_active_sequences(self) -> int:
        """Sequences whose sampling state the worker holds."""
        return len(self._seqs)

    def shutdown(self) -> None:
        """Release the KV cache and the model (idempotent)."""
        self._grammars.shutdown()
        self.kv_caches = []
        self._seqs.clear()
        self.model = None
        self.device_step = None
        self.kernels.empty_cache()


def _profile_plan(lens: list[int], block_size: int, vocab_size: int, seed: int):
    """A ``StepPlan`` of whole prefills of ``lens`` tokens over consecutive blocks, each sequence
    sampling its last token, and sampling states that take the sampler's longest path."""
    from ..common.step import StepPlan

    S = len(lens)
    T = sum(lens)
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int64)
    nblk = [cdiv(n, block_size) for n in lens]
    first = np.concatenate([[0], np.cumsum(nblk)[:-1]]).astype(np.int64)
    table = np.zeros((S, max(nblk)), np.int32)
    for i, (f, n) in enumerate(zip(first, nblk)):
        table[i, :n] = np.arange(f, f + n)
    seq_of = np.repeat(np.arange(S), lens)
    slots = table[seq_of, pos // block_size].astype(np.int64) * block_size + pos % block_size
    plan = StepPlan(step_id=-1, input_ids=np.zeros(T, np.int64), positions=pos, slot_mapping=slots,
                    query_start_loc=starts.astype(np.int32), seq_lens=np.asarray(lens, np.int32),
                    block_tables=table, seq_ids=np.arange(S, dtype=np.int64),
                    logits_indices=starts[1:] - 1, sample_seq_ids=np.arange(S, dtype=np.int64))
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, repetition_penalty=1.1, logprobs=20)
    states = [SamplingState(i, params, np.arange(min(n, 64)) % vocab_size, [], None, [], engine_seed=seed)
              for i, n in enumerate(lens)]
    return plan, states
