"""The CUDA kernel table: folio's kernels in ``kernels/cuda/*.cu`` launched through CuPy.

``get_cuda_kernels()`` returns a ``CudaKernels`` whose operations have the signatures of
``kernels/reference.py`` (the spec) plus ``linear``, ``embedding``, ``rope_and_cache``,
``prepare_weight``, ``random_weight`` and the device sampler ``sample``. Storage is bfloat16
(weights and the KV cache), held as ``uint16`` bit patterns because CuPy has no bfloat16 dtype.

Numerics (where values are rounded to bf16, each inside the kernel that produces them, so no cast
runs on its own): the residual stream, the matrix products' outputs, softmax and every
accumulation are float32; RMSNorm, SiLU-and-mul, the rotated queries (``rope_and_cache``) and the
attention output are rounded to bf16, because each is the input of a matrix product (or of the
tensor-core attention); keys and values are rounded as they enter the cache; the prefill kernel
rounds its softmax probabilities to bf16 as the A operand of P @ V (FlashAttention-2). Every
operation takes an optional ``out=`` buffer, so a forward pass allocates nothing per layer.

``CudaKernels`` only needs an array module, a way to fetch a kernel by name with CuPy's calling
convention ``kernel(grid, block, args, *, shared_mem=0)`` (CuPy's ``RawKernel.__call__``:
shared_mem only as a keyword), a GEMM and a device (kernels/cuda/device.py).
On a GPU those are ``cupy``, ``cupy.RawModule``, cuBLAS (kernels/cuda/cublas.py) and ``CupyDevice``;
the tests pass ``numpy``, the SIMT emulator (``tests/simt``), a NumPy GEMM and ``HostDevice``, so
this launch code runs without a GPU too.

Attention dispatch (documented rule): a step whose sequences all have one new token
(``max_query_len == 1``) uses the decode kernel, one block per (KV head, sequence) serving the whole
GQA group with 16-byte loads in one online-softmax pass (FlashDecoding-style: K and V of two keys
in flight per lane, the block-table row in shared memory; ``_h4`` for groups of up to 4 heads,
``_h8`` in passes of 8 for larger ones); when the longest context exceeds
``decode_partition_size`` (512 tokens) the context is split into partitions, one block each, and a
reduce kernel combines them (split-K, vLLM's "v2"); partitions grow beyond 512 tokens so that there
are never more than ``MAX_DECODE_PARTITIONS``. Any other step uses the tensor-core prefill kernel
(64 rows of (token, head of the GQA group) per block, K/V tiles read once for the group, mma.sync
bf16), which also handles the decode rows of a mixed step. head_dim must be 32, 64, 128 or 256.
"""

from __future__ import annotations

import math
import os
import numpy as np

from .. import reference
from ..table import to_numpy
from .device import CupyDevice, HostDevice
from .sources import KERNEL_FILES, kernel_names, kernel_source

ATTN_THREADS = 128                 # threads per attention block (4 warps)
DECODE_PARTITION_SIZE = 512        # tokens per decode partition (split-K above this context length)
MAX_DECODE_PARTITIONS = 64         # partitions grow past 512 tokens rather than exceed this
DECODE_HEADS_PER_PASS = (4, 8)     # the decode kernels' heads per pass (attention.cu's h4 / h8 entry points)
PREFILL_ROWS = 64                  # must equal PREFILL_ROWS in attention.cu
PREFILL_BK = {32: 64, 64: 64, 128: 64, 256: 32}  # keys per KV tile of the prefill kernel per head_dim
HEAD_DIMS = tuple(PREFILL_BK)
DEFAULT_SMEM_LIMIT = 48 * 1024     # dynamic shared memory without opting in
SAMPLE_THREADS = 256               # threads per row of the sampling kernel


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """NumPy: uint16 bf16 bit patterns -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """NumPy: float32 -> uint16 bf16 bit patterns, round to nearest even (as the kernels do)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)  # wraps only for NaN
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        r = np.where(nan, ((u >> 16) | np.uint32(0x40)).astype(np.uint16), r)
    return r


def decode_partitioning(max_seq_len: int, partition_size: int = DECODE_PARTITION_SIZE,
                        max_partitions: int = MAX_DECODE_PARTITIONS) -> tuple[int, int]:
    """``(num_partitions, partition_size)`` of a decode step whose longest context is
    ``max_seq_len``: one partition of exactly ``max_seq_len`` tokens when it fits in
    ``partition_size``, else partitions of ``partition_size`` tokens, enlarged (in multiples of
    it) when more than ``max_partitions`` would be needed."""
    if max_seq_len <= partition_size:
        return 1, max(1, int(max_seq_len))
    part = partition_size * math.ceil(math.ceil(max_seq_len / max_partitions) / partition_size)
    return math.ceil(max_seq_len / part), part


class CudaKernels:
    """Kernel table over an array module ``xp`` and a kernel getter (see the module docstring).

    Args:
        xp: ``cupy`` (GPU) or ``numpy`` (the SIMT emulator in tests).
        get_function: ``name -> kernel`` callable as ``kernel(grid, block, args, shared_mem=0)``
            (``shared_mem`` keyword-only, as CuPy's RawKernel takes it).
        gemm: ``(x_bf16 [T, in] uint16, w_bf16 [out, in] uint16, out [T, out] float32)`` writing
            ``x @ w.T`` (cuBLAS on a GPU).
        ptr: optional ``array -> address`` (default: ``a.data.ptr`` for CuPy, ``a.ctypes.data``).
        smem_limit: shared memory one block may use (static + dynamic), bytes.
        device: kernels/cuda/device.py object (default: ``HostDevice`` for NumPy, ``CupyDevice``).
        kernel_names: every kernel to fetch (compile) now, so that a failure surfaces here.
    """

    name = "cuda"
    weight_dtype = "bfloat16"
    stacked_layers = False   # the forward pass calls the operations layer by layer
    device_sampling = True   # steps run through runtime/worker/device_step.py

    def __init__(self, xp, get_function, gemm, ptr=None, smem_limit: int = DEFAULT_SMEM_LIMIT,
                 device=None, kernel_names=()):
        self.xp = xp
        self.kv_cache_dtype = np.dtype(np.uint16)  # bf16 bit patterns
        self.kv_cache_dtypes = {"bfloat16": self.kv_cache_dtype}
        self.act_dtype = np.dtype(np.float32)
        self.matmul_input_dtype = np.dtype(np.uint16)  # what the norms / activations hand to linear
        self.device = device or (HostDevice() if xp is np else CupyDevice(xp))
        self._get = get_function
        self._fns: dict = {}
        self._gemm = gemm
        self._ptr = ptr or (lambda a: a.data.ptr if hasattr(a.data, "ptr") else a.ctypes.data)
        self.smem_limit = smem_limit
        self.decode_partition_size = DECODE_PARTITION_SIZE
        self.max_decode_partitions = MAX_DECODE_PARTITIONS
        self.rope_inv_freq = reference.rope_inv_freq
        self.rope_cos_sin_cache = reference.rope_cos_sin_cache
        self._scratch_bufs: dict = {}
        self.scratch_generation = 0  # bumped when a scratch buffer moves (CUDA graphs hold addresses)
        self._ptr_arrays: dict = {}
        for n in kernel_names:
            self._fn(n)

    # ---- helpers -------------------------------------------------------------------------------
    def _fn(self, name):
        f = self._fns.get(name)
        if f is None:
            f = self._fns[name] = self._get(name)
        return f

    def _launch(self, name, grid, block, args, shared_mem=0):
        f = self._fn(name)
        static = int(getattr(f, "shared_size_bytes", 0) or 0)
        if static + shared_mem > DEFAULT_SMEM_LIMIT:
            if static + shared_mem > self.smem_limit:
                raise ValueError(f"{name} needs {shared_mem} bytes of dynamic + {static} of static shared "
                                 f"memory (limit {self.smem_limit} per block)")
            if shared_mem > DEFAULT_SMEM_LIMIT - static and hasattr(f, "max_dynamic_shared_size_bytes") \
                    and f.max_dynamic_shared_size_bytes < shared_mem:
                f.max_dynamic_shared_size_bytes = shared_mem
        # CuPy's RawKernel.__call__(grid, block, args, **kwargs) takes shared_mem only as a keyword
        self.device.launch(f, tuple(int(g) for g in grid), tuple(int(b) for b in block), args,
                           shared_mem=int(shared_mem))

    def _c(self, a, dtype):
        return self.xp.ascontiguousarray(self.xp.asarray(a), dtype=dtype)

    def _out(self, out, shape, dtype, zero=False):
        if out is None:
            return (self.xp.zeros if zero else self.xp.empty)(shape, dtype=dtype)
        if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
            raise ValueError(f"out must be {np.dtype(dtype)} {tuple(shape)}, got {out.dtype} {tuple(out.shape)}")
        return out

    def _scratch(self, name, shape, dtype):
        """A view of a per-table buffer that only grows (split-K partials): no allocation per layer."""
        n = int(np.prod(shape))
        buf = self._scratch_bufs.get(name)
        if buf is None or buf.size < n:
            buf = self._scratch_bufs[name] = self.xp.empty(max(n, 1), dtype=dtype)
            self.scratch_generation += 1
        return buf[:n].reshape(shape)

    def reserve_decode_scratch(self, max_num_seqs: int, num_heads: int, head_dim: int, max_model_len: int):
        """Allocate the split-K partials for the largest decode step now (fixed addresses for CUDA
        graphs, and counted in the KV sizing's profile)."""
        P, _ = decode_partitioning(max_model_len, self.decode_partition_size)
        P = 1 << max(0, (P - 1).bit_length())  # the graph buckets round partitions up to a power of 2
        if P > 1:
            self._scratch("tmp_out", (max_num_seqs, num_heads, P, head_dim), np.float32)
            self._scratch("max_logits", (max_num_seqs, num_heads, P), np.float32)
            self._scratch("exp_sums", (max_num_seqs, num_heads, P), np.float32)

    def to_numpy(self, a) -> np.ndarray:
        """Device array -> NumPy array."""
        return to_numpy(a)

    def zeros(self, shape, dtype=np.float32):
        """A zeroed device array (the KV cache)."""
        return self.xp.zeros(shape, dtype=dtype)

    # ---- the device, as the model runner sees it -----------------------------------------------
    def activate(self):
        """Context manager under which a step's work goes to the device's stream."""
        return self.device.activate()

    def synchronize(self):
        """Wait for all work on the device, every stream (set-up runs on the legacy default
        stream, steps on their own non-blocking one)."""
        self.device.synchronize_device()

    def empty_cache(self):
        """Hand the blocks CuPy's memory pool holds for reuse back to the driver (best effort; none
        on the host)."""
        pool = getattr(self.xp, "get_default_memory_pool", None)
        if pool is not None:
            try:
                pool().free_all_blocks()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass

    def bf16_to_float32(self, a, out=None):
        """uint16 bf16 array on this backend -> float32 array of the same shape."""
        a = self._c(a, np.uint16)
        out = self._out(out, a.shape, np.float32)
        n = a.size
        if n:
            self._launch("bf16_to_float_kernel", (min(65535, (n + 255) // 256),), (256,), (out, a, np.int64(n)))
        return out

    def float32_to_bf16(self, a, out=None):
        """float32 array on this backend -> uint16 bf16 bit patterns (round to nearest even)."""
        a = self._c(a, np.float32)
        out = self._out(out, a.shape, np.uint16)
        n = a.size
        if n:
            self._launch("float_to_bf16_kernel", (min(65535, (n + 255) // 256),), (256,), (out, a, np.int64(n)))
        return out

    def _bf16_input(self, x):
        """Activations for a bf16 consumer: uint16 bits as they are, float32 rounded (one launch)."""
        if x.dtype == np.uint16:
            return self._c(x, np.uint16)
        return self.float32_to_bf16(x)

    # ---- weights -------------------------------------------------------------------------------
    def prepare_weight(self, w, chunk_elems: int = 1 << 26):
        """Weight -> device bf16 (uint16 bit patterns), same shape.

        Args:
            w: NumPy float32 (float16/float64 are cast) ``[out, in]`` or ``[n]``, converted on the
                device in chunks of ``chunk_elems`` so a large matrix needs only a chunk of float32
                staging memory; or an array already on this backend (float: cast on the device;
                uint16: taken as bf16 bits and returned as is). A uint16 NumPy array is taken as
                bf16 bits too (a bf16 checkpoint is copied as it is, no float32 round trip).
        """
        if not isinstance(w, np.ndarray) and hasattr(w, "dtype"):  # already a device array
            return w if w.dtype == np.uint16 else self.float32_to_bf16(w)
        w = np.asarray(w)
        if w.dtype == np.uint16:
            return self.xp.asarray(np.ascontiguousarray(w))
        flat = np.ascontiguousarray(w, dtype=np.float32).reshape(-1)
        if self.xp is np:  # host "device" (the emulator): the same rounding without a launch per chunk
            return float32_to_bf16_bits(flat).reshape(w.shape)
        out = self.xp.empty(flat.shape, dtype=np.uint16)
        for i in range(0, flat.size, chunk_elems):
            out[i:i + chunk_elems] = self.float32_to_bf16(self.xp.asarray(flat[i:i + chunk_elems]))
        return out.reshape(w.shape)

    def random_weight(self, shape, seed: int = 0, std: float = 0.02, mean: float = 0.0):
        """Random bf16 device weight ``N(mean, std)`` made on the device (``--load-format dummy``):
        no host array, no weight files. Deterministic for a seed on one backend."""
        n = int(np.prod(shape))
        out = self.xp.empty((n,), dtype=np.uint16)
        rs = self.xp.random.RandomState(seed)
        chunk = 1 << 26
        f32 = {} if isinstance(rs, np.random.RandomState) else {"dtype": np.float32}  # NumPy's: float64 only
        for i in range(0, n, chunk):
            m = min(chunk, n - i)
            x = rs.standard_normal(m, **f32).astype(np.float32, copy=False) * np.float32(std) + np.float32(mean)
            out[i:i + m] = float32_to_bf16_bits(x) if isinstance(x, np.ndarray) else self.float32_to_bf16(x)
        return out.reshape(tuple(shape))

    def _weight(self, w):
        return w if w.dtype == np.uint16 and not (isinstance(w, np.ndarray) and self.xp is not np) \
            else self.prepare_weight(w)

    # ---- matrix products -----------------------------------------------------------------------
    def linear(self, x, weight, out=None):
        """``x @ weight.T``: x ``[T, in]`` bf16 (uint16; float32 is rounded first, one extra launch),
        weight bf16 ``[out, in]`` -> ``[T, out]`` float32; products accumulate in float32.

        Raises:
            ValueError: the inner dimensions differ, or ``out`` has the wrong shape / dtype.
        """
        if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
            raise ValueError(f"linear: x {tuple(x.shape)} does not match weight {tuple(weight.shape)} "
                             "(x [T, in] @ weight [out, in].T)")
        xb = self._bf16_input(x)
        T = xb.shape[0]
        out = self._out(out, (T, weight.shape[0]), np.float32)
        if T:
            self.device.launch(self._gemm, xb, weight, out)
        return out

    def embedding(self, ids, table, out=None):
        """Rows of a bf16 table ``[vocab, hidden]`` for ``ids [T]`` int64 -> ``[T, hidden]`` float32.
        Ids must be in range (not checked on the device)."""
        ids = self._c(ids, np.int64)
        hidden = table.shape[1]
        out = self._out(out, (ids.shape[0], hidden), np.float32)
        if ids.shape[0]:
            self._launch("embedding_kernel", (ids.shape[0],), (256,), (out, ids, table, np.int32(hidden)))
        return out

    # ---- per-token layer ops -------------------------------------------------------------------
    def rms_norm(self, x, weight, eps, out=None):
        """Spec: reference.rms_norm, rounded to bf16. x ``[T, hidden]`` float32, weight bf16
        ``[hidden]`` -> ``[T, hidden]`` uint16 (bf16 bits)."""
        x = self._c(x, np.float32)
        hidden = x.shape[-1]
        x2 = x.reshape(-1, hidden)
        out = self._out(out, x2.shape, np.uint16)
        if x2.shape[0]:
            self._launch("rms_norm_kernel", (x2.shape[0],), (256,),
                         (out, x2, self._weight(weight), np.float32(eps), np.int32(hidden)))
        return out

    def fused_add_rms_norm(self, x, residual, weight, eps, out=None, residual_out=None, rows=None):
        """Spec: reference.fused_add_rms_norm -> ``(bf16(rms_norm(x + residual)), x + residual)``.

        ``residual_out`` may be ``residual`` itself (updated in place). With ``rows`` (``[R]`` int64
        row indices) only those rows are normalised (``out [R, hidden]``) and the residual is not
        written: returns ``(out, None)`` (the final norm before ``lm_head``).
        """
        x = self._c(x, np.float32)
        residual = self._c(residual, np.float32)
        hidden = x.shape[-1]
        w = self._weight(weight)
        if rows is not None:
            rows = self._c(rows, np.int64)
            out = self._out(out, (rows.shape[0], hidden), np.uint16)
            if rows.shape[0]:
                self._launch("fused_add_rms_norm_rows_kernel", (rows.shape[0],), (256,),
                             (out, x, residual, rows, w, np.float32(eps), np.int32(hidden)))
            return out, None
        out = self._out(out, x.shape, np.uint16)
        residual_out = self._out(residual_out, x.shape, np.float32)
        if x.shape[0]:
            self._launch("fused_add_rms_norm_kernel", (x.shape[0],), (256,),
                         (out, residual_out, x, residual, w, np.float32(eps), np.int32(hidden)))
        return out, residual_out

    def rope_and_cache(self, positions, qkv, cos_sin_cache, key_cache, value_cache, slot_mapping,
                       num_heads, num_kv_heads, out=None):
        """Spec: reference.rope_and_cache, one launch: RoPE of the q and k parts of the fused
        projection ``qkv [T, (num_heads + 2 num_kv_heads) * head_dim]`` float32 (read in place),
        rotated keys and the values written to their slots of the bf16 caches, and the rotated
        queries returned as ``[T, num_heads, head_dim]`` bf16.

        Raises:
            ValueError: shapes that do not fit one another.
        """
        T = qkv.shape[0]
        D = key_cache.shape[3]
        if qkv.ndim != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * D or key_cache.shape[2] != num_kv_heads \
                or cos_sin_cache.shape[1] != D or key_cache.dtype != np.uint16:
            raise ValueError(f"rope_and_cache: qkv {tuple(qkv.shape)} with {num_heads}+2x{num_kv_heads} heads does "
                             f"not fit caches {key_cache.dtype} {tuple(key_cache.shape)} / cos_sin {tuple(cos_sin_cache.shape)}")
        out = self._out(out, (T, num_heads, D), np.uint16)
        if T:
            qkv = self._c(qkv, np.float32)
            self._launch("rope_and_cache_kernel", (T,), (128,),
                         (out, key_cache, value_cache, qkv, self._c(positions, np.int64),
                          self._c(slot_mapping, np.int64), self._c(cos_sin_cache, np.float32),
                          np.int32(num_heads), np.int32(num_kv_heads), np.int32(D), np.int64(qkv.shape[1])))
        return out

    def silu_and_mul(self, x, out=None):
        """Spec: reference.silu_and_mul, rounded to bf16. x ``[T, 2I]`` float32 -> ``[T, I]`` uint16."""
        x = self._c(x, np.float32)
        T, two_i = x.shape
        out = self._out(out, (T, two_i // 2), np.uint16)
        if T:
            self._launch("silu_and_mul_kernel", (T,), (256,), (out, x, np.int32(two_i // 2)))
        return out

    # ---- KV cache ------------------------------------------------------------------------------
    def copy_blocks(self, key_caches, value_caches, block_mapping):
        """Spec: reference.copy_blocks (every layer, one launch). The per-layer cache addresses are
        uploaded once per set of caches."""
        mapping = self._c(block_mapping, np.int64).reshape(-1, 2)
        if mapping.shape[0] == 0 or not key_caches:
            return
        key = (tuple(self._ptr(c) for c in key_caches), tuple(self._ptr(c) for c in value_caches))
        ptrs = self._ptr_arrays.get(key)
        if ptrs is None:
            ptrs = self._ptr_arrays[key] = tuple(self.xp.asarray(np.array(p, dtype=np.int64)) for p in key)
        numel = int(np.prod(key_caches[0].shape[1:]))
        self._launch("copy_blocks_kernel", (len(key_caches), mapping.shape[0]), (256,),
                     (ptrs[0], ptrs[1], mapping, np.int64(numel)))

    # ---- attention -----------------------------------------------------------------------------
    def paged_attention(self, q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                        *, max_query_len: int | None = None, max_seq_len: int | None = None,
                        partition_size: int | None = None, num_partitions: int | None = None,
                        out=None):
        """Spec: reference.paged_attention with bf16 caches; returns ``[T, H, D]`` bf16 (uint16).

        ``q`` is bf16 (uint16) or float32 (rounded to bf16 first). Extra keywords: ``max_query_len``
        / ``max_seq_len`` (host ints from the attention metadata; computed with a device sync
        when omitted), ``partition_size`` (decode split-K partition, default 512),
        ``num_partitions`` (decode: a fixed partition count >= what ``max_seq_len`` needs, for a
        CUDA graph that serves any context up to ``num_partitions * partition_size``), ``out``
        (rows of tokens outside every sequence are zero only when ``out`` is not given).

        Raises:
            ValueError: head_dim not 32, 64, 128 or 256, a GQA group above 64 heads, or num_heads
                not a multiple of num_kv_heads.
        """
        qb = self._bf16_input(q)
        block_tables = self._c(block_tables, np.int32)
        seq_lens = self._c(seq_lens, np.int32)
        qsl = self._c(query_start_loc, np.int32)
        T, H, D = qb.shape
        _, block_size, Hkv, Dk = key_cache.shape
        if Dk != D or H % Hkv:
            raise ValueError(f"q [.., {H}, {D}] does not fit a cache with {Hkv} KV heads of {Dk}")
        if D not in HEAD_DIMS:
            raise ValueError(f"head_dim {D} unsupported (32, 64, 128 or 256)")
        group = H // Hkv
        if group > PREFILL_ROWS:
            raise ValueError(f"GQA group of {group} query heads per KV head unsupported (at most {PREFILL_ROWS})")
        S = seq_lens.shape[0]
        out = self._out(out, (T, H, D), np.uint16, zero=out is None)
        if S == 0 or T == 0:
            return out
        if max_query_len is None:
            max_query_len = int((qsl[1:] - qsl[:-1]).max())
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        if max_query_len == 0 or max_seq_len == 0:
            return out
        common = (block_tables, seq_lens, qsl, np.float32(scale), np.int32(H), np.int32(Hkv))
        if max_query_len == 1:
            base = int(partition_size or self.decode_partition_size)
            if num_partitions is None:
                P, part = decode_partitioning(max_seq_len, base)
            else:  # fixed grid (CUDA graphs): partitions of `base` tokens
                P, part = int(num_partitions), base
                if P * part < max_seq_len:
                    raise ValueError(f"{P} partitions of {part} tokens cannot hold {max_seq_len} tokens")
            hpp = 4 if group <= 4 else 8  # DECODE_HEADS_PER_PASS
            table_len = (part // block_size + 2 + 3) // 4 * 4
            smem = 4 * (group * D + table_len + (ATTN_THREADS // 32) * hpp * (D + 2))
            if P == 1:
                tmp = ml = es = self._scratch("unused", (1,), np.float32)  # not read when P == 1
            else:
                tmp = self._scratch("tmp_out", (S, H, P, D), np.float32)
                ml = self._scratch("max_logits", (S, H, P), np.float32)
                es = self._scratch("exp_sums", (S, H, P), np.float32)
            self._launch(f"paged_attention_decode_h{hpp}_kernel", (Hkv, S, P), (ATTN_THREADS,),
                         (out, tmp, ml, es, qb, key_cache, value_cache) + common +
                         (np.int32(D), np.int32(block_size), np.int32(block_tables.shape[1]), np.int32(part)),
                         shared_mem=smem)
            if P > 1:
                self._launch("paged_attention_reduce_kernel", (H, S), (min(D, 128),),
                             (out, tmp, ml, es, qsl, np.int32(H), np.int32(D), np.int32(P)))
            return out
        bk = PREFILL_BK[D]
        tpt = PREFILL_ROWS // group
        smem = 2 * (PREFILL_ROWS * (D + 8) + bk * (D + 8) + D * (bk + 8))
        self._launch(f"paged_attention_prefill_d{D}_kernel", (math.ceil(max_query_len / tpt), Hkv, S),
                     (ATTN_THREADS,),
                     (out, qb, key_cache, value_cache) + common +
                     (np.int32(block_size), np.int32(block_tables.shape[1]), np.int32(tpt)),
                     shared_mem=smem)
        return out

    # ---- sampling ------------------------------------------------------------------------------
    def sample(self, logits, params, uniforms, out):
        """One token per row of ``logits [R, V]`` float32, on the device (sampling.cu; semantics of
        runtime/worker/sampler.py: temperature, min_p, top-k, top-p over the top-k renormalised, inverse
        CDF with the row's uniform; greedy rows take the first argmax). A row with temperature only
        (no top-k, top-p or min-p) is sampled in one pass by the Gumbel-max trick with noise keyed
        by its uniform's 64 bits (kernels/reference.py ``sample_gumbel``): a draw from the same
        distribution, reproducible from the row's uniform, though not the inverse CDF's token.

        Args:
            params: ``[R, 4]`` float32 rows ``(temperature, top_k, top_p, min_p)`` (temperature 0 =
                greedy, top_k <= 0 = off, top_p >= 1 = off, min_p 0 = off).
            uniforms: ``[R]`` float64 in (0, 1].
            out: ``[R]`` int64, written.
        """
        R, V = logits.shape
        if R:
            self._launch("sample_kernel", (R,), (SAMPLE_THREADS,),
                         (out, self._c(logits, np.float32), params, uniforms, np.int32(V)))
        return out

    def apply_penalties(self, logits, entries, row_params, num_entries: int):
        """Penalties and min_tokens masks on ``logits [R, V]`` in place (sampling.cu): ``entries
        [N, 3]`` int64 rows ``(row * V + token, output count, flags)`` (flags 1 = mask to -inf,
        2 = seen in prompt or output), unique per (row, token); ``row_params [R, 3]`` float32
        ``(repetition, frequency, presence)``."""
        if num_entries:
            self._launch("apply_penalties_kernel", (math.ceil(num_entries / 256),), (256,),
                         (logits, entries, row_params, np.int64(num_entries), np.int32(logits.shape[1])))
        return logits

    def apply_token_bitmask(self, logits, bitmask):
        """Structured outputs' mask on ``logits [R, V]`` float32 in place (sampling.cu): -inf where
        bit ``t % 32`` of ``bitmask [R, W]`` int32 word ``t // 32`` is clear (``W >= ceil(V / 32)``;
        ``reference.apply_token_bitmask`` is the spec)."""
        R, V = logits.shape
        if R and V:
            self._launch("apply_token_bitmask_kernel", (math.ceil(V / 256), R), (256,),
                         (logits, self._c(bitmask, np.int32), np.int32(V), np.int32(bitmask.shape[1])))
        return logits

    # ---- CUDA graphs ---------------------------------------------------------------------------
    def capture(self):
        """Context manager capturing the launches of its body into a graph (``.replay()``)."""
        return self.device.capture()


_TABLE: CudaKernels | None = None


def get_cuda_kernels() -> CudaKernels:
    """The CUDA kernel table (every kernel compiled once per process when the table is built, so a
    compile failure surfaces here and ``--device auto`` can fall back to the CPU; CuPy caches the
    binaries on disk).

    Works with cupy-cuda12x or cupy-cuda13x. ``$FOLIO_CUDA_TABLE=module:function`` names a factory
    to call instead (perf/gpu_check.sh's dry run: ``simt.table:simt_kernels``, the kernels under the
    SIMT emulator on the CPU).

    Raises:
        RuntimeError: CuPy is not installed, no usable NVIDIA GPU / driver is present, or a kernel
            does not compile or load.
    """
    global _TABLE
    if _TABLE is not None:
        return _TABLE
    factory = os.environ.get("FOLIO_CUDA_TABLE")
    if factory:  # "module:function" returning a table (perf/gpu_check.sh's dry run: the SIMT emulator)
        import importlib

        mod, _, fn = factory.partition(":")
        _TABLE = getattr(importlib.import_module(mod), fn)()
        return _TABLE
    try:
        import cupy
    except Exception as e:  # ImportError, or a broken CUDA install raising at import
        raise RuntimeError(
            "device 'cuda' needs CuPy and an NVIDIA GPU: install cupy-cuda12x or cupy-cuda13x "
            f"(pip install 'folio-serve[cuda]'), or use --device cpu ({type(e).__name__}: {e})") from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        raise RuntimeError(f"device 'cuda': no usable NVIDIA GPU or driver ({e}); use --device cpu") from None
    if count < 1:
        raise RuntimeError("device 'cuda': no NVIDIA GPU found; use --device cpu")
    try:
        dev = cupy.cuda.Device()
        major = int(dev.compute_capability[:-1] or 0)
        if major < 8:
            raise RuntimeError(f"compute capability {dev.compute_capability} < 8.0 (bf16 tensor cores)")
        smem_optin = dev.attributes.get("MaxSharedMemoryPerBlockOptin", DEFAULT_SMEM_LIMIT)
        functions = {}
        for f in KERNEL_FILES:  # compile and load every kernel now
            mod = cupy.RawModule(code=kernel_source(f), options=("-std=c++17",))
            for k in kernel_names(f):
                functions[k] = mod.get_function(k)
        from .cublas import CublasGemm

        table = CudaKernels(cupy, functions.__getitem__, gemm=CublasGemm(cupy), smem_limit=smem_optin,
                            device=CupyDevice(cupy), kernel_names=list(functions))
        table.device.synchronize_device()  # the cuBLAS scalars went on the legacy stream; steps do not
    except Exception as e:  # CompileException, CUDADriverError, CublasError, ...
        raise RuntimeError(f"device 'cuda': kernels failed to build ({type(e).__name__}: {e}); "
                           "use --device cpu") from None
    _TABLE = table
    return _TABLE
