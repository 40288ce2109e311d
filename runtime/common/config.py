"""Engine configuration, validated once (names follow vLLM's engine arguments)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields


def cdiv(a: int, b: int) -> int:
    """Ceiling division of ints: the number of ``b``-sized blocks that hold ``a`` items."""
    return -(-a // b)


DEFAULT_MODEL = "smollm2-135m-instruct"
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")
"""``--kv-cache-dtype`` values (vLLM's names); which of them a device runs: ``KernelTable.kv_cache_dtypes``."""
DEFAULT_MAX_STEP_MS = 200.0
"""``folio serve --max-step-ms``' default: a stream beside a long prompt's prefill still gets a token every 200 ms
(reading speed, about 5 tokens/s); docs/cli.md gives the measurements behind it."""
ACTIVATION_QUANTIZATIONS = ("auto", "int8", "none")
"""``--activation-quantization`` values; what each means: ``model.loader.resolve_activation_quantization``
(which checks them again for ``load_model``'s own callers)."""


SPECULATIVE_METHODS = ("ngram",)
"""``SpeculativeConfig.method`` values (vLLM's names; the draft-model method is not implemented)."""


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``--speculative-config``, the same JSON keys): a proposer
    guesses the next tokens of a sequence, one forward pass verifies them all, and the longest
    prefix the target model agrees with is kept, plus the target's own next token (Leviathan et
    al. 2023; Chen et al. 2023). Greedy output is exactly the output without speculation.

    Attributes:
        method: ``"ngram"``: prompt lookup (Saxena 2023, vLLM's ``ngram``): the last n tokens of
            the sequence (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) are looked up
            in its prompt and output, and the tokens that followed their earliest occurrence are
            proposed.
        num_speculative_tokens: most tokens proposed per sequence per step (k, >= 1); a
            speculating sequence computes k + 1 positions in the step.
        prompt_lookup_max / prompt_lookup_min: the longest and shortest n-gram matched (tokens,
            1 <= min <= max); when only one is given the other takes its value, as in vLLM; when
            neither is, 5 and 3.
        disable_by_batch_size: no sequence speculates in a step while more than this many
            sequences are running (vLLM's name): a batch that large is no longer bound by reading
            the weights, so the k extra positions per sequence cost their full compute. How the
            default was chosen: docs/python-api.md ("Speculative decoding").
    Raises:
        ValueError: an unknown method or key, or a value out of range (named in the message).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int = 3

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r} (draft models are not implemented)")
        if self.prompt_lookup_max is None and self.prompt_lookup_min is None:
            self.prompt_lookup_max, self.prompt_lookup_min = 5, 3
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "disable_by_batch_size" else 1):
                raise ValueError(f"speculative_config {name} must be an integer >= "
                                 f"{0 if name == 'disable_by_batch_size' else 1}, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def from_value(cls, value) -> "SpeculativeConfig | None":
        """A ``SpeculativeConfig`` from itself, a dict of its keys or their JSON text (the CLI's
        ``--speculative-config``); ``None`` stays ``None``.

        Raises:
            ValueError: not JSON, not an object, unknown keys, or a bad value.
        """
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative_config is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s): {', '.join(map(str, unknown))}")
        return cls(**value)


@dataclass
class EngineConfig:
    """Everything that shapes one engine instance.

    Attributes:
        model: a model name known to folio (``smollm2-135m-instruct``) or a Hugging Face Llama
            folder (config.json, *.safetensors, tokenizer.json).
        device: ``"cpu"``, ``"cuda"`` or ``"auto"`` (cuda when a GPU is usable, else cpu).
        block_size: tokens per KV block (PagedAttention's block size).
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: token budget of one step (decode tokens + prefill chunks).
        max_model_len: longest prompt + output in tokens; ``None`` = the model's
            ``max_position_embeddings``.
        enable_prefix_caching: automatic prefix caching (hash-chained full blocks).
        enable_chunked_prefill: split prefills that do not fit the step's token budget.
        max_step_ms: a bound, in milliseconds, on a step that decodes running streams (their
            inter-token latency): its prefill chunk is sized from the measured prefill rate
            (``runtime/scheduler/step_time.py``); ``None`` or 0: chunks by tokens only. Needs
            chunked prefill. Default ``None`` here (offline use: throughput first, as vLLM's offline
            ``LLM`` keeps larger steps than its server); ``folio serve`` defaults to
            ``DEFAULT_MAX_STEP_MS`` (docs/cli.md says how it was chosen).
        num_kv_blocks_override / kv_cache_memory: size the KV cache by block count (any device),
            or by bytes (CPU; default: ``cpu_kv_cache_fraction`` of available RAM, capped by what
            max_num_seqs x max_model_len could ever use).
        gpu_memory_utilization: fraction of device memory folio may use (GPU).
        load_format: ``"auto"`` (weights from files) or ``"dummy"`` (random weights of the config's
            shapes, for benchmarks).
        dtype: ``"auto"`` (on CPU the weights' stored types: a GGUF file's quantized tensors served
            from the file, 16-bit safetensors kept 16-bit; bfloat16 on GPU), ``"float32"`` (every
            weight float32) or ``"bfloat16"`` (GPU).
        quantization: ``None`` or ``"q8_0"`` / ``"q4_k"``: float weights quantized into that GGUF type
            as they load (CPU; ``model/quantize.py``).
        activation_quantization: what the CPU products of weights in quantized GGUF types take:
            ``"int8"`` (activations quantized per 32 values, integer dot products where the CPU has
            them, as llama.cpp computes: faster, outputs differ slightly), ``"none"`` (float32
            activations: the dequantized weights' exact products) or ``"auto"`` (the default: int8,
            except for the embedded default model's own file, whose golden outputs are float32
            products; ``model.loader.resolve_activation_quantization``, docs/kernels.md).
        kv_cache_dtype: storage of the KV cache (vLLM's ``--kv-cache-dtype``): ``"auto"`` (the
            device's own: float32 on CPU, bfloat16 on GPU), ``"float32"`` (CPU) or ``"bfloat16"``
            (CPU: half the memory per block, so twice the blocks for one budget; keys and values
            rounded to bfloat16 as they are stored, attention computed in float32). A value the
            device does not run is refused when the worker starts (``ModelRunner``).
        seed: base seed of the engine (random prefix-hash root is separate and per process).
        enforce_eager: never capture CUDA graphs for decode steps (vLLM's flag of the same name).
        async_scheduling: overlap scheduling (SGLang's overlap scheduler, vLLM's
            ``--async-scheduling``): the scheduler prepares and sends step N+1 while the worker runs
            step N, the tokens sampled in N being fed on the worker's side. Outputs are the same
            either way; ``False`` runs one step at a time.
        speculative_config: a ``SpeculativeConfig`` (or its dict or JSON text), or ``None`` (the
            default): no speculative decoding.
    Raises:
        ValueError: on any inconsistent value, at construction.
    """

    model: str = DEFAULT_MODEL
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_step_ms: float | None = None
    num_kv_blocks_override: int | None = None
    kv_cache_memory: int | None = None
    cpu_kv_cache_fraction: float = 0.25
    gpu_memory_utilization: float = 0.92
    load_format: str = "auto"
    dtype: str = "auto"
    quantization: str | None = None
    activation_quantization: str = "auto"
    kv_cache_dtype: str = "auto"
    seed: int = 0
    enforce_eager: bool = False
    async_scheduling: bool = True
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self):
        self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"device must be cpu, cuda or auto, got {self.device!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_model_len is not None \
                and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")
        if self.max_step_ms is not None and (isinstance(self.max_step_ms, bool) or
                                             not isinstance(self.max_step_ms, (int, float)) or
                                             not 0 <= self.max_step_ms < float("inf")):
            raise ValueError(f"max_step_ms must be a number of milliseconds >= 0 (0: no bound), got "
                             f"{self.max_step_ms!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not 0.0 < self.cpu_kv_cache_fraction <= 1.0:
            raise ValueError(f"cpu_kv_cache_fraction must be in (0, 1], got {self.cpu_kv_cache_fraction}")
        if self.num_kv_blocks_override is not None and self.num_kv_blocks_override < 1:
            raise ValueError("num_kv_blocks_override must be >= 1")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be > 0 bytes")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.quantization not in (None, "q8_0", "q4_k"):
            raise ValueError(f"quantization must be q8_0 or q4_k (or unset), got {self.quantization!r}")
        if self.activation_quantization not in ACTIVATION_QUANTIZATIONS:
            raise ValueError(f"activation_quantization must be auto, int8 or none, got {self.activation_quantization!r} "
                             f"(float32 activations are \"none\")")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool, got {self.async_scheduling!r}")

    def resolve_max_model_len(self, max_position_embeddings: int) -> int:
        """The engine's max_model_len: ``max_model_len`` if set, else the model's
        ``max_position_embeddings`` (tokens).

        Raises:
            ValueError: ``max_model_len`` exceeds ``max_position_embeddings`` (positions the model
                was not trained for; RoPE would extrapolate), naming both numbers.
        """
        limit = int(max_position_embeddings)
        if self.max_model_len is None:
            return limit
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's max_position_embeddings "
                             f"({limit}); use --max-model-len {limit} or less")
        return int(self.max_model_len)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from keyword arguments; unknown names raise ``TypeError`` naming them."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

