"""The kernel table: the operations the forward pass calls, one implementation per device.

``get_kernels("cpu")`` returns ``cpu.table.CPU_KERNELS`` (Numba), ``get_kernels("cuda")`` a
``cuda.table.CudaKernels`` (CuPy RawKernels). The model code and the runtime are written against
the protocols here only, never against a device's module, and read a device's differences from
the members declared here instead of testing which device it is:

* ``KernelTable``: what every table has: the operations of the forward pass, what the model and
  the runner ask of the device (``weight_dtype``, ``stacked_layers``, ``device_sampling``,
  ``zeros``, ``activate``, ``synchronize``, ``empty_cache``) and the structured-outputs mask;
* ``CpuKernelTable(KernelTable)``: the CPU table's extras: ``decoder_layers`` (every decoder layer
  of a step in one compiled call, over the weights ``stack_quantized`` or ``model/llama.py`` stacks,
  where ``stacked_layers``) and the kernels compiled ahead (``precompile_jobs``, ``CompileJob``s, for
  ``runtime/worker/precompile.py``);
* ``CudaKernelTable(KernelTable)``: the CUDA table's extras, which ``runtime/worker/device_step.py``
  (the GPU step, where ``device_sampling``), ``runtime/worker/sampler.py`` (device sampling),
  ``runtime/worker/model_runner.py`` and ``model/loader.py`` (dummy weights made on the device)
  call: its ``KernelDevice``, the decode partitioning, scratch buffers, graph capture and the
  sampling kernels.

tests/kernels/test_protocols.py checks each table's members and signatures against its protocols,
and that every member the model and the worker read is declared. The semantics of every
operation are the NumPy specifications in ``reference.py``; shapes below use ``T`` tokens, ``S``
sequences, ``H`` / ``Hkv`` query / KV heads, ``D`` head size. ``out=`` arguments name preallocated
results (the forward pass allocates nothing per layer).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np


def to_numpy(a) -> np.ndarray:
    """A host NumPy array of ``a`` (copied from the device for a CuPy array, as is for NumPy)."""
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


@runtime_checkable
class KernelTable(Protocol):
    """What ``model/llama.py``, ``model/loader.py`` and ``runtime/worker/model_runner.py`` call.

    Attributes:
        name: ``"cpu"`` or ``"cuda"``.
        xp: the array module of the table's arrays (``numpy`` or ``cupy``).
        weight_dtype: the ``--dtype`` its float weights are served in besides ``auto``
            (``float32`` on CPU, ``bfloat16`` on GPU).
        stacked_layers: whether the table runs every decoder layer of a step in one call over
            weights stacked per kind (``CpuKernelTable.decoder_layers``; weights in GGUF types
            only run so); else the model calls the operations layer by layer.
        device_sampling: whether the table samples on its device (``CudaKernelTable.sample``): the
            worker's steps then run through ``runtime/worker/device_step.py`` (one upload, one sync).
        kv_cache_dtype: dtype of the KV cache arrays by default (``--kv-cache-dtype auto``: float32
            on CPU, bf16 bit patterns on GPU).
        kv_cache_dtypes: ``--kv-cache-dtype`` names the table's kernels run -> dtype of the cache
            arrays (CPU: ``float32``, ``bfloat16`` as uint16 bits; GPU: ``bfloat16``).
        act_dtype: dtype of activations (float32).
        matmul_input_dtype: dtype the norms and activations hand to ``linear`` (float32 on CPU,
            bf16 bit patterns on GPU).
    """

    name: str
    xp: Any
    weight_dtype: str
    stacked_layers: bool
    device_sampling: bool
    kv_cache_dtype: np.dtype
    kv_cache_dtypes: dict
    act_dtype: np.dtype
    matmul_input_dtype: np.dtype

    def paged_attention(self, q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, *,
                        max_query_len: int | None = None, max_seq_len: int | None = None, out=None):
        """Causal attention of ``q [T, H, D]`` over the paged cache (``reference.paged_attention``);
        returns ``[T, H, D]`` (into ``out`` when given)."""
        ...

    def rope_and_cache(self, positions, qkv, cos_sin_cache, key_cache, value_cache, slot_mapping, num_heads,
                       num_kv_heads, *, out=None):
        """RoPE on the q and k parts of ``qkv [T, (H + 2 Hkv) * D]``, the rotated keys and the
        values appended to the caches at ``slot_mapping [T]`` (-1 = skip); returns the rotated
        queries ``[T, H, D]`` (``reference.rope_and_cache``)."""
        ...

    def copy_blocks(self, key_caches, value_caches, block_mapping) -> None:
        """Copy whole blocks ``block_mapping [N, 2]`` (src, dst) in every layer's caches."""
        ...

    def rms_norm(self, x, weight, eps, *, out=None):
        """RMSNorm of ``x [T, hidden]``."""
        ...

    def fused_add_rms_norm(self, x, residual, weight, eps, *, out=None, residual_out=None, rows=None):
        """``residual += x`` then RMSNorm (of ``rows`` only, when given); returns ``(normed,
        residual)``."""
        ...

    def silu_and_mul(self, x, *, out=None):
        """SwiGLU: ``silu(x[:, :n]) * x[:, n:]`` for ``x [T, 2n]``."""
        ...

    def linear(self, x, weight, *, out=None):
        """``x [T, in] @ weight.T`` for a weight prepared by ``prepare_weight`` (``[out, in]``)."""
        ...

    def embedding(self, ids, table, *, out=None):
        """Rows ``table[ids]`` as activations."""
        ...

    def prepare_weight(self, w):
        """A host weight array in the table's storage format on its device."""
        ...

    def zeros(self, shape, dtype=np.float32):
        """A zeroed array on the table's device for the large long-lived arrays (KV cache, weight
        stacks): on the CPU on huge pages when large (``cpu/memory.py``)."""
        ...

    def apply_token_bitmask(self, logits, bitmask):
        """Structured outputs: ``logits [R, V]`` float32 set to -inf in place where bit ``t % 32``
        of ``bitmask [R, ceil(V / 32)]`` int32 word ``t // 32`` is clear
        (``reference.apply_token_bitmask``); returns ``logits``."""
        ...

    def activate(self):
        """Context manager under which a step's work goes to the table's stream (CUDA: its
        device's; CPU: nothing to route)."""
        ...

    def synchronize(self):
        """Wait for all work queued on the table's device, every stream (CUDA: set-up ran on the
        legacy default stream, steps on their own); the CPU's kernels return when done."""
        ...

    def empty_cache(self):
        """Release the memory the table's allocator holds for reuse (CUDA: CuPy's pool, at
        shutdown; CPU: nothing held)."""
        ...


@runtime_checkable
class CpuKernelTable(KernelTable, Protocol):
    """The CPU table's extras (``kernels/cpu/table.py``), used by the model code when a table has
    them.

    Attributes:
        integer_products: whether the products of quantized weights can take int8 activations here
            (integer dot products: AVX2 or AVX512-VNNI, ``cpu/quant_int8.py``); without them every
            product keeps float32 activations.
        precompile_variants: the weight layouts ``precompile_jobs`` takes (``float32``,
            ``quantized``: GGUF types with float32 activations, ``quantized-int8``).
    """

    integer_products: bool
    precompile_variants: tuple

    def decoder_layers(self, weights: dict, buffers: dict, positions, attn_metadata, kv_caches, cos_sin_cache,
                       scale: float, num_heads: int, num_kv_heads: int, eps: float):
        """Every decoder layer of a step in one call over weights stacked per kind, in place in
        ``buffers``; returns ``(hidden, residual)`` ``[T, hidden]`` float32 (``cpu/forward.py``)."""
        ...

    def stack_quantized(self, layers):
        """One kind of layer product for every layer in GGUF types (``layers[i]``: layer ``i``'s tuple
        of ``QuantizedWeight`` segments), as ``decoder_layers`` takes it (``cpu/forward.py``)."""
        ...

    def precompile_jobs(self, variant: str = "float32") -> tuple:
        """The ``CompileJob``s of the kernels a worker of weight layout ``variant`` runs on two or
        more threads, group by group (``cpu/compile_jobs.py``: each kernel module declares its own).

        Raises:
            ValueError: a variant not in ``precompile_variants``.
        """
        ...


@runtime_checkable
class CompileJob(Protocol):
    """One compiled kernel and one signature, compiled ahead of a step by
    ``runtime/worker/precompile.py`` (the CPU's ``cpu/compile_jobs.NumbaJob``).

    Attributes:
        name: ``module.function`` (unique among a variant's jobs); function: the function's name.
        group: jobs of one group share compiled callees: one process compiles them, in order.
        after: the groups whose jobs must be compiled before this job's group.
        seconds: a rough cost on a cold cache (a progress bar's weight); what: for people.
    """

    name: str
    function: str
    group: str
    after: tuple
    seconds: float
    what: str

    def compile(self, kv_cache_dtype: str = "auto") -> bool:
        """Compile (or load from the cache) in this process, for KV caches of ``kv_cache_dtype``
        (a ``--kv-cache-dtype`` name); True if it compiled."""
        ...

    def in_cache(self, kv_cache_dtype: str = "auto") -> bool:
        """Whether the on-disk cache holds it for this machine and the current sources, without
        loading it."""
        ...


@runtime_checkable
class KernelDevice(Protocol):
    """The device services under the CUDA table (``kernels/cuda/device.py``: ``CupyDevice`` on a
    GPU, ``HostDevice`` on the CPU for tests and dry runs). The GPU step touches the device only
    through these."""

    def activate(self):
        """Context manager under which all of a step's work goes to the device's stream."""
        ...

    def launch(self, fn, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` on the device's stream (recorded instead while capturing); a
        kernel launch passes CuPy's ``(grid, block, args)`` positionally and ``shared_mem=`` by keyword."""
        ...

    def empty(self, shape, dtype):
        """A device array."""
        ...

    def pinned_empty(self, nbytes: int):
        """``[nbytes]`` uint8 page-locked host memory."""
        ...

    def h2d(self, dst, src):
        """One asynchronous host-to-device copy of a contiguous uint8 buffer."""
        ...

    def d2h(self, dst, src):
        """One asynchronous device-to-host copy of a contiguous uint8 buffer."""
        ...

    def synchronize(self):
        """Wait for the device's stream (the one host sync of a step)."""
        ...

    def synchronize_device(self):
        """Wait for all work on the device, every stream included (``cudaDeviceSynchronize``): set-up
        runs on the legacy default stream, steps on their own non-blocking stream."""
        ...

    def capture(self):
        """Context manager capturing the launches of its body into a graph (``.replay()``)."""
        ...

    def timer(self):
        """``(mark, elapsed)``: ``mark()`` records a point on the stream; after a sync
        ``elapsed(a, b)`` is the seconds between two marks."""
        ...

    def memory(self):
        """``(free_bytes, total_bytes, pool_held_bytes)``."""
        ...

    def peak_tracker(self):
        """Context manager whose ``.peak`` is the most bytes the memory pool held inside it."""
        ...


@runtime_checkable
class CudaKernelTable(KernelTable, Protocol):
    """The CUDA table's extras (``kernels/cuda/table.py``), all the runtime calls beyond
    ``KernelTable``.

    Attributes:
        device: the ``KernelDevice`` the table launches on and the GPU step copies and syncs with.
        decode_partition_size: tokens per split-K partition of the decode attention kernel.
        max_decode_partitions: partitions grow past ``decode_partition_size`` rather than exceed this.
        scratch_generation: bumped whenever a scratch buffer moves (captured graphs hold addresses
            and must then be captured again).
    """

    device: KernelDevice
    decode_partition_size: int
    max_decode_partitions: int
    scratch_generation: int

    def reserve_decode_scratch(self, max_num_seqs: int, num_heads: int, head_dim: int, max_model_len: int):
        """Allocate the split-K partials of the largest decode step now (fixed addresses for
        graphs, and counted by the KV sizing's profile)."""
        ...

    def capture(self):
        """Context manager capturing the launches of its body into a graph (``.replay()``)."""
        ...

    def sample(self, logits, params, uniforms, out):
        """One token per row of ``logits [R, V]`` float32 into ``out [R]`` int64; ``params [R, 4]``
        float32 ``(temperature, top_k, top_p, min_p)``, ``uniforms [R]`` float64 (the semantics of
        ``runtime/worker/sampler.py``)."""
        ...

    def apply_penalties(self, logits, entries, row_params, num_entries: int):
        """Penalties and min_tokens masks on ``logits [R, V]`` in place: ``entries [N, 3]`` int64
        ``(row * V + token, output count, flags)``, ``row_params [R, 3]`` float32."""
        ...

    def random_weight(self, shape, seed: int = 0, std: float = 0.02, mean: float = 0.0):
        """A random weight of ``shape`` made on the device, in the storage format of
        ``prepare_weight`` (dummy weights without a host copy)."""
        ...
