"""The CUDA kernel table: folio's kernels in ``kernels/cuda/*.cu`` launched through CuPy.

``get_cuda_kernels()`` returns a ``CudaKernels`` whose operations have the signatures of
``kernels/reference.py`` (the spec) plus ``linear``, ``embedding``, ``prepare_weight`` and
``random_weight``. Storage is bfloat16 (weights and the KV cache), held as ``uint16`` bit patterns
because CuPy has no bfloat16 dtype; activations are float32 and every kernel accumulates in float32.

``CudaKernels`` only needs an array module and a way to fetch a kernel by name with CuPy's calling
convention ``kernel(grid, block, args, shared_mem=0)``. On a GPU those are ``cupy`` and
``cupy.RawModule``; the tests pass ``numpy`` and the SIMT emulator (``tests/simt``), so this launch
code is exercised without a GPU too.

Attention dispatch (documented rule): a step whose sequences all have one new token
(``max_query_len == 1``) uses the decode kernel, one block per (KV head, sequence) serving the whole
GQA group; when the longest context exceeds ``decode_partition_size`` (512 tokens) the context is
split into partitions of that size, one block each, and a reduce kernel combines them (split-K,
vLLM's "v2"). Any other step uses the prefill kernel (query tiles x KV tiles with an online
softmax, FlashAttention style), which also handles the decode rows of a mixed step.

Matrix products use cuBLAS ``gemmEx`` with bf16 inputs, float32 output and float32 compute: the
float32 activations are rounded to bf16 by a small kernel first (as a bf16 model in PyTorch would
hold them).
"""

from __future__ import annotations

import math
import pathlib
import re

import numpy as np

from . import reference, to_numpy

CUDA_DIR = pathlib.Path(__file__).resolve().parent / "cuda"
KERNEL_FILES = ("layer.cu", "cache.cu", "attention.cu")

ATTN_THREADS = 128                 # threads per attention block
DECODE_PARTITION_SIZE = 512        # tokens per decode partition (split-K above this context length)
PREFILL_ROWS = 16                  # target (token, head) rows per prefill tile
PREFILL_MAX_PAIRS = 16             # must equal PREFILL_MAX_PAIRS in attention.cu
PREFILL_BK = 32                    # must equal PREFILL_BK in attention.cu
DEFAULT_SMEM_LIMIT = 48 * 1024     # dynamic shared memory without opting in

# cuBLAS / CUDA enum values (cublas_api.h, library_types.h)
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
_CUDA_R_32F, _CUDA_R_16BF = 0, 14
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1

_INCLUDE_RE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.M)


def kernel_source(filename: str) -> str:
    """The source of ``kernels/cuda/<filename>`` with its local ``#include "..."`` files inlined
    (once each), as one translation unit for NVRTC / ``cupy.RawModule``."""
    seen: set[str] = set()

    def expand(path: pathlib.Path) -> str:
        def sub(m):
            dep = path.parent / m.group(1)
            if not dep.exists():
                return m.group(0)
            if dep.name in seen:
                return ""
            seen.add(dep.name)
            return expand(dep)

        return _INCLUDE_RE.sub(sub, path.read_text().replace("#pragma once", ""))

    return expand(CUDA_DIR / filename)


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """NumPy: uint16 bf16 bit patterns -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """NumPy: float32 -> uint16 bf16 bit patterns, round to nearest even (as the kernels do)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), r)


class CudaKernels:
    """Kernel table over an array module ``xp`` and a kernel getter (see the module docstring).

    Args:
        xp: ``cupy`` (GPU) or ``numpy`` (the SIMT emulator in tests).
        get_function: ``name -> kernel`` callable as ``kernel(grid, block, args, shared_mem=0)``.
        gemm: optional ``(x_bf16 [T, in] uint16, w_bf16 [out, in] uint16, out [T, out] float32)``
            writing ``x @ w.T``; default cuBLAS gemmEx (needs CuPy).
        ptr: optional ``array -> address`` (default: ``a.data.ptr`` for CuPy, ``a.ctypes.data``).
        smem_limit: dynamic shared memory one block may use, bytes.
    """

    name = "cuda"

    def __init__(self, xp, get_function, gemm=None, ptr=None, smem_limit: int = DEFAULT_SMEM_LIMIT):
        self.xp = xp
        self.kv_cache_dtype = np.dtype(np.uint16)  # bf16 bit patterns
        self.act_dtype = np.dtype(np.float32)
        self._get = get_function
        self._fns: dict = {}
        self._gemm = gemm or self._gemm_cublas
        self._ptr = ptr or (lambda a: a.data.ptr if hasattr(a.data, "ptr") else a.ctypes.data)
        self.smem_limit = smem_limit
        self.decode_partition_size = DECODE_PARTITION_SIZE
        self.rope_inv_freq = reference.rope_inv_freq
        self.rope_cos_sin_cache = reference.rope_cos_sin_cache

    # ---- helpers -------------------------------------------------------------------------------
    def _fn(self, name):
        f = self._fns.get(name)
        if f is None:
            f = self._fns[name] = self._get(name)
        return f

    def _launch(self, name, grid, block, args, shared_mem=0):
        f = self._fn(name)
        if shared_mem > DEFAULT_SMEM_LIMIT:
            if shared_mem > self.smem_limit:
                raise ValueError(f"{name} needs {shared_mem} bytes of shared memory (limit {self.smem_limit})")
            if hasattr(f, "max_dynamic_shared_size_bytes") and f.max_dynamic_shared_size_bytes < shared_mem:
                f.max_dynamic_shared_size_bytes = shared_mem
        f(tuple(int(g) for g in grid), tuple(int(b) for b in block), args, shared_mem=int(shared_mem))

    def _c(self, a, dtype):
        return self.xp.ascontiguousarray(self.xp.asarray(a), dtype=dtype)

    def to_numpy(self, a) -> np.ndarray:
        """Device array -> NumPy array."""
        return to_numpy(a)

    def bf16_to_float32(self, a):
        """uint16 bf16 array on this backend -> float32 array of the same shape."""
        a = self._c(a, np.uint16)
        out = self.xp.empty(a.shape, dtype=np.float32)
        n = a.size
        if n:
            self._launch("bf16_to_float_kernel", (min(65535, (n + 255) // 256),), (256,), (out, a, np.int64(n)))
        return out

    def float32_to_bf16(self, a):
        """float32 array on this backend -> uint16 bf16 bit patterns (round to nearest even)."""
        a = self._c(a, np.float32)
        out = self.xp.empty(a.shape, dtype=np.uint16)
        n = a.size
        if n:
            self._launch("float_to_bf16_kernel", (min(65535, (n + 255) // 256),), (256,), (out, a, np.int64(n)))
        return out

    # ---- weights -------------------------------------------------------------------------------
    def prepare_weight(self, w, chunk_elems: int = 1 << 26):
        """Weight -> device bf16 (uint16 bit patterns), same shape.

        Args:
            w: NumPy float32 (float16/float64 are cast) ``[out, in]`` or ``[n]``, converted on the
                device in chunks of ``chunk_elems`` so a large matrix needs only a chunk of float32
                staging memory; or an array already on this backend (float: cast on the device;
                uint16: taken as bf16 bits and returned as is). A uint16 NumPy array is taken as
                bf16 bits too.
        """
        if not isinstance(w, np.ndarray) and hasattr(w, "dtype"):  # already a device array
            return w if w.dtype == np.uint16 else self.float32_to_bf16(w)
        w = np.asarray(w)
        if w.dtype == np.uint16:
            return self.xp.asarray(np.ascontiguousarray(w))
        flat = np.ascontiguousarray(w, dtype=np.float32).reshape(-1)
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
        f32 = {} if self.xp is np else {"dtype": np.float32}  # NumPy's RandomState makes float64 only
        for i in range(0, n, chunk):
            m = min(chunk, n - i)
            x = rs.standard_normal(m, **f32).astype(np.float32, copy=False) * np.float32(std) + np.float32(mean)
            out[i:i + m] = self.float32_to_bf16(x)
        return out.reshape(tuple(shape))

    # ---- matrix products -----------------------------------------------------------------------
    def _gemm_cublas(self, xb, w, out):
        from cupy.cuda import device
        from cupy_backends.cuda.libs import cublas

        T, K = xb.shape
        N = w.shape[0]
        one = np.ones(1, np.float32)
        zero = np.zeros(1, np.float32)
        # row-major out[T, N] = x[T, K] @ w[N, K]^T  <=>  column-major out^T = w^T(op T) x^T
        cublas.gemmEx(device.get_cublas_handle(), _CUBLAS_OP_T, _CUBLAS_OP_N, N, T, K,
                      one.ctypes.data, w.data.ptr, _CUDA_R_16BF, K, xb.data.ptr, _CUDA_R_16BF, K,
                      zero.ctypes.data, out.data.ptr, _CUDA_R_32F, N, _CUBLAS_COMPUTE_32F,
                      _CUBLAS_GEMM_DEFAULT)

    def linear(self, x, weight):
        """``x @ weight.T``: x ``[T, in]`` float32, weight bf16 ``[out, in]`` -> ``[T, out]`` float32.
        x is rounded to bf16; products accumulate in float32 (cuBLAS gemmEx)."""
        x = self._c(x, np.float32)
        T = x.shape[0]
        out = self.xp.empty((T, weight.shape[0]), dtype=np.float32)
        if T:
            self._gemm(self.float32_to_bf16(x), weight, out)
        return out

    def embedding(self, ids, table):
        """Rows of a bf16 table ``[vocab, hidden]`` for ``ids [T]`` int64 -> ``[T, hidden]`` float32.
        Ids must be in range (not checked on the device)."""
        ids = self._c(ids, np.int64)
        hidden = table.shape[1]
        out = self.xp.empty((ids.shape[0], hidden), dtype=np.float32)
        if ids.shape[0]:
            self._launch("embedding_kernel", (ids.shape[0],), (256,), (out, ids, table, np.int32(hidden)))
        return out

    # ---- per-token layer ops -------------------------------------------------------------------
    def _weight(self, w):
        return w if w.dtype == np.uint16 and not (isinstance(w, np.ndarray) and self.xp is not np) \
            else self.prepare_weight(w)

    def rms_norm(self, x, weight, eps):
        """Spec: reference.rms_norm. x ``[T, hidden]`` float32, weight bf16 ``[hidden]``."""
        x = self._c(x, np.float32)
        hidden = x.shape[-1]
        x2 = x.reshape(-1, hidden)
        out = self.xp.empty_like(x2)
        if x2.shape[0]:
            self._launch("rms_norm_kernel", (x2.shape[0],), (256,),
                         (out, x2, self._weight(weight), np.float32(eps), np.int32(hidden)))
        return out.reshape(x.shape)

    def fused_add_rms_norm(self, x, residual, weight, eps):
        """Spec: reference.fused_add_rms_norm -> ``(rms_norm(x + residual), x + residual)``."""
        x = self._c(x, np.float32)
        residual = self._c(residual, np.float32)
        hidden = x.shape[-1]
        x2, r2 = x.reshape(-1, hidden), residual.reshape(-1, hidden)
        out, new_res = self.xp.empty_like(x2), self.xp.empty_like(r2)
        if x2.shape[0]:
            self._launch("fused_add_rms_norm_kernel", (x2.shape[0],), (256,),
                         (out, new_res, x2, r2, self._weight(weight), np.float32(eps), np.int32(hidden)))
        return out.reshape(x.shape), new_res.reshape(x.shape)

    def rotary_embedding(self, positions, q, k, cos_sin_cache):
        """Spec: reference.rotary_embedding (rotate-half). Returns new ``(q, k)`` float32 arrays.

        Raises:
            ValueError: the cache's row width differs from head_dim (partial rotary unsupported).
        """
        positions = self._c(positions, np.int64)
        q = self._c(q, np.float32)
        k = self._c(k, np.float32)
        cache = self._c(cos_sin_cache, np.float32)
        T, H, D = q.shape
        if cache.shape[1] != D:
            raise ValueError(f"cos_sin_cache rows of {cache.shape[1]} != head_dim {D}")
        q_out, k_out = self.xp.empty_like(q), self.xp.empty_like(k)
        if T:
            self._launch("rotary_embedding_kernel", (T,), (128,),
                         (q_out, k_out, q, k, positions, cache, np.int32(H), np.int32(k.shape[1]), np.int32(D)))
        return q_out, k_out

    def silu_and_mul(self, x):
        """Spec: reference.silu_and_mul. x ``[T, 2I]`` float32 -> ``[T, I]``."""
        x = self._c(x, np.float32)
        T, two_i = x.shape
        out = self.xp.empty((T, two_i // 2), dtype=np.float32)
        if T:
            self._launch("silu_and_mul_kernel", (T,), (256,), (out, x, np.int32(two_i // 2)))
        return out

    # ---- KV cache ------------------------------------------------------------------------------
    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping):
        """Spec: reference.reshape_and_cache; caches are bf16 (uint16) and written in place."""
        key = self._c(key, np.float32)
        value = self._c(value, np.float32)
        slot_mapping = self._c(slot_mapping, np.int64)
        T, Hkv, D = key.shape
        if key_cache.dtype != np.uint16 or key_cache.shape[2:] != (Hkv, D):
            raise ValueError(f"key_cache must be uint16 [blocks, block_size, {Hkv}, {D}], got "
                             f"{key_cache.dtype} {tuple(key_cache.shape)}")
        if T:
            self._launch("reshape_and_cache_kernel", (T,), (128,),
                         (key, value, key_cache, value_cache, slot_mapping, np.int32(Hkv), np.int32(D),
                          np.int64(Hkv * D), np.int64(Hkv * D)))

    def copy_blocks(self, key_caches, value_caches, block_mapping):
        """Spec: reference.copy_blocks (every layer, one launch)."""
        mapping = self._c(block_mapping, np.int64).reshape(-1, 2)
        if mapping.shape[0] == 0 or not key_caches:
            return
        kp = self.xp.asarray(np.array([self._ptr(c) for c in key_caches], dtype=np.int64))
        vp = self.xp.asarray(np.array([self._ptr(c) for c in value_caches], dtype=np.int64))
        numel = int(np.prod(key_caches[0].shape[1:]))
        self._launch("copy_blocks_kernel", (len(key_caches), mapping.shape[0]), (256,),
                     (kp, vp, mapping, np.int64(numel)))

    # ---- attention -----------------------------------------------------------------------------
    def paged_attention(self, q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                        *, max_query_len: int | None = None, max_seq_len: int | None = None,
                        partition_size: int | None = None, force_prefill_kernel: bool = False):
        """Spec: reference.paged_attention (bf16 caches). Extra keywords: ``max_query_len`` /
        ``max_seq_len`` (host ints from the attention metadata; computed with a device sync when
        omitted), ``partition_size`` (decode split-K partition, default 512),
        ``force_prefill_kernel`` (tests).

        Raises:
            ValueError: head_dim not a multiple of 32 or above 256 (decode) / above what one
                prefill tile holds, or num_heads not a multiple of num_kv_heads.
        """
        xp = self.xp
        q = self._c(q, np.float32)
        block_tables = self._c(block_tables, np.int32)
        seq_lens = self._c(seq_lens, np.int32)
        qsl = self._c(query_start_loc, np.int32)
        T, H, D = q.shape
        _, block_size, Hkv, Dk = key_cache.shape
        if Dk != D or H % Hkv:
            raise ValueError(f"q [.., {H}, {D}] does not fit a cache with {Hkv} KV heads of {Dk}")
        if D % 32 or D > 256:
            raise ValueError(f"head_dim {D} unsupported (multiple of 32, at most 256)")
        group = H // Hkv
        S = seq_lens.shape[0]
        out = xp.zeros((T, H, D), dtype=np.float32)
        if S == 0 or T == 0:
            return out
        if max_query_len is None:
            max_query_len = int((qsl[1:] - qsl[:-1]).max())
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        if max_query_len == 0 or max_seq_len == 0:
            return out
        common = (block_tables, seq_lens, qsl, np.float32(scale), np.int32(H), np.int32(Hkv), np.int32(D),
                  np.int32(block_size), np.int32(block_tables.shape[1]))
        if max_query_len == 1 and not force_prefill_kernel:
            part = int(partition_size or self.decode_partition_size)
            if max_seq_len <= part:
                P, part = 1, max_seq_len
            else:
                P = math.ceil(max_seq_len / part)
            smem = 4 * (group * D + group * part + 2 * group)
            if P == 1:
                tmp = ml = es = out  # unused by the kernel when P == 1
            else:
                tmp = xp.empty((S, H, P, D), dtype=np.float32)
                ml = xp.empty((S, H, P), dtype=np.float32)
                es = xp.empty((S, H, P), dtype=np.float32)
            self._launch("paged_attention_decode_kernel", (Hkv, S, P), (ATTN_THREADS,),
                         (out, tmp, ml, es, q, key_cache, value_cache) + common + (np.int32(part),),
                         shared_mem=smem)
            if P > 1:
                self._launch("paged_attention_reduce_kernel", (H, S), (min(D, 128),),
                             (out, tmp, ml, es, qsl, np.int32(H), np.int32(D), np.int32(P)))
            return out
        max_rows = PREFILL_MAX_PAIRS * ATTN_THREADS // D
        if group > max_rows:
            raise ValueError(f"GQA group of {group} heads x head_dim {D} does not fit one prefill tile")
        tokens_per_tile = max(1, min(PREFILL_ROWS, max_rows) // group)
        R = tokens_per_tile * group
        smem = 4 * (PREFILL_BK * (D + 1) + PREFILL_BK * D + R * D + R * PREFILL_BK + 3 * R)
        self._launch("paged_attention_prefill_kernel",
                     (math.ceil(max_query_len / tokens_per_tile), Hkv, S), (ATTN_THREADS,),
                     (out, q, key_cache, value_cache) + common + (np.int32(tokens_per_tile),),
                     shared_mem=smem)
        return out


_TABLE: CudaKernels | None = None


def get_cuda_kernels() -> CudaKernels:
    """The CUDA kernel table (compiled once per process; CuPy caches the binaries on disk).

    Works with cupy-cuda12x or cupy-cuda13x.

    Raises:
        RuntimeError: CuPy is not installed, or no usable NVIDIA GPU / driver is present.
    """
    global _TABLE
    if _TABLE is not None:
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
    dev = cupy.cuda.Device()
    smem_optin = dev.attributes.get("MaxSharedMemoryPerBlockOptin", DEFAULT_SMEM_LIMIT)
    modules = [cupy.RawModule(code=kernel_source(f), options=("-std=c++17",)) for f in KERNEL_FILES]
    names = {}
    for f, mod in zip(KERNEL_FILES, modules):
        for k in re.findall(r"__global__\s+void\s+(\w+)", (CUDA_DIR / f).read_text()):
            names[k] = mod

    def get_function(name):
        return names[name].get_function(name)

    _TABLE = CudaKernels(cupy, get_function, smem_limit=smem_optin)
    return _TABLE
