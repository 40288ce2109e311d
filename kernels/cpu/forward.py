"""Every decoder layer of a step in one compiled call: the CPU table's ``decoder_layers``.

``decoder_layers`` runs the kernels of ``model/llama.py``'s layer loop (the bodies of ``rows.py``,
``linear.py`` and ``attention.py``, unchanged) in the same order from one ``@njit`` function that
loops over the layers, so a step makes one call from Python instead of nine per layer (each of
which pays the dispatcher with caches the weight stream has just evicted). Everything that depends
only on the step's shapes is planned once per step in Python: the tasks and tiles
(``linear_plan``) of the four matrix products, the tasks of the row kernels, and the attention
work items (the same for every layer). The layers' weights are stacked per kind (``[num_layers,
...]``, ``LlamaForCausalLM.layer_stacks``) and the KV caches passed per layer (tuples; in the
region, addresses), so the compiled loop can index them by layer.

**One parallel region per step** (``ONE_REGION``, with two threads or more): ``_layers_region``
opens one ``prange`` region whose tasks all walk the same phases of every layer (norm, QKV
product, RoPE and cache append, attention items, their merge, o_proj, norm, gate/up product,
SwiGLU, down product) instead of one region per kernel call, each of which wakes the pool's
sleeping threads (``kernels/cpu/threads.py``). A phase's work items (``linear.linear_items``: the
weight-row blocks, streamed tiles or sgemm tiles of ``linear_into``'s own region, row blocks of
``_ROWS_PER_ITEM``, attention items) are claimed from the phase's counter; each finished item is
counted (``atomic_add``, acquire-release), and a task that finds no item left waits until the
phase's count is complete before it starts the next phase (``atomic_load``, acquire). It never
waits for an item nobody has claimed, so the region cannot deadlock when its tasks run one after
another (a pool smaller than the plan, a nested call); the wait spins, then gives the core away
each turn (``sched_yield``), so other work on the machine and the engine's scheduling thread still
run. Same items, same arithmetic: bit-identical to the per-call path and the per-kernel loop
(tests/model/test_forward.py).

**Work items through a pointer.** Numba links the LLVM module of every callee into its caller and
optimizes it again there, and a parallel region is four such libraries (the loop body, two gufunc
wrappers, the function itself). The regions therefore call their work item function at its
address (``_call_item``: Numba's calling convention through a pointer, after a check that the
function was compiled for the call's argument types): ``_phase_item`` is compiled once, as any
function, and each region's libraries carry only the region's own code. Likewise the products'
entry leaves the int8 kernels out where no weight asked for them (``product_item``).

The compiled call releases the GIL (``nogil``): in-process engines run the forward on a background
thread (``ThreadedExecutor``) while the calling thread schedules the next step.

Sources: llama.cpp's CPU thread pool (``ggml_graph_compute``: threads stay in one region for the
whole graph and meet at a barrier after each node) for the shape, the CPU counterpart of replaying
a captured CUDA graph (one launch per step); the counters are this module's.
"""

from __future__ import annotations

import weakref
import zlib

import numpy as np
from llvmlite import ir
from numba import carray, njit, prange, typeof, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .attention import attention_item, attention_scratch, attention_into, finish_attention, plan
from .compile_jobs import QUANTIZED, NumbaJob
from .kv_dtype import KV_CACHE_DTYPES
from .linear import linear_into, linear_item, linear_items, linear_plan
from .math import LOG2E
from .quant_linear import (INT8_ACTIVATIONS, _check_weight, kernel_layout, kernel_row_bytes, quant_item_rows,
                           quant_kernel_type, quant_linear, quant_linear_into, quant_linear_tasks, quant_scratch,
                           quant_task_rows, quant_task_rows_f32)
from ..quant_reference import QuantizedWeight
from . import rows
from .rows import (_fused_add_rms_norm_rows, _rms_norm_rows, _rope_and_cache_rows, _silu_and_mul_rows,
                   fused_add_rms_norm_into, rms_norm_into, rope_and_cache_into, row_tasks, silu_and_mul_into)
from .threads import atomic_add, atomic_load, num_threads, region_guard, sched_yield

__all__ = ["decoder_layers", "quantized_linear", "LAYER_WEIGHTS", "QuantizedStack", "stack_quantized"]

LAYER_WEIGHTS = ("input_layernorm", "qkv_proj", "o_proj", "post_attention_layernorm", "gate_up_proj", "down_proj")
"""The per-layer weights ``decoder_layers`` takes, each stacked ``[num_layers, ...]``."""


@njit(cache=True, nogil=True)
def _layers(residual, hidden, x, qkv, q, attn, gate_up, act, ln1, qkv_w, o_w, ln2, gate_up_w, down_w, key_caches,
            value_caches, positions, cos_sin_cache, slot_mapping, block_tables, seq_lens, query_start_loc, H, Hkv,
            eps, qscale, lin, norm_tasks, rope_tasks, silu_tasks, rows_per_item, items, n_parts, attn_tasks):
    T = residual.shape[0]
    attn2 = attn.reshape(T, attn.shape[1] * attn.shape[2])
    for layer in range(ln1.shape[0]):
        if layer == 0:
            rms_norm_into(residual, ln1[0], eps, x, norm_tasks, rows_per_item)
        else:
            fused_add_rms_norm_into(hidden, residual, ln1[layer], eps, x, residual, norm_tasks, rows_per_item)
        linear_into(x, qkv_w[layer], qkv, lin[0, 0], lin[0, 1], lin[0, 2])
        key_cache = key_caches[layer]
        value_cache = value_caches[layer]
        rope_and_cache_into(positions, qkv, cos_sin_cache, key_cache, value_cache, slot_mapping, H, Hkv, q,
                            rope_tasks, rows_per_item)
        attention_into(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, qscale, attn, items,
                       n_parts, attn_tasks)
        linear_into(attn2, o_w[layer], hidden, lin[1, 0], lin[1, 1], lin[1, 2])
        fused_add_rms_norm_into(hidden, residual, ln2[layer], eps, x, residual, norm_tasks, rows_per_item)
        linear_into(x, gate_up_w[layer], gate_up, lin[2, 0], lin[2, 1], lin[2, 2])
        silu_and_mul_into(gate_up, act, silu_tasks, rows_per_item)
        linear_into(act, down_w[layer], hidden, lin[3, 0], lin[3, 1], lin[3, 2])


# The phases of one layer in the one-region step (_layers_region), in order
_P_NORM1, _P_QKV, _P_ROPE, _P_ATTN, _P_MERGE, _P_O, _P_NORM2, _P_GATE_UP, _P_SILU, _P_DOWN = range(10)
_PHASES = 10
_SPINS_BEFORE_YIELD = 200   # atomic reads of a phase's count before each further one yields the core
ONE_REGION = True   # with 2+ threads, one region per step (_layers_region); False: a region per kernel call


@njit(cache=True)
def wait_items_done(done, k, n):
    """Wait until phase ``k`` of a fused region has ``n`` finished items (``done[k]``, int64 counters
    bumped with ``threads.atomic_add``): the barrier between the phases of one parallel region."""
    # until phase k's n items are all finished (each was claimed by a running task); spinning,
    # then giving the core away each turn when the partner is slow (a busy machine)
    spins = 0
    while atomic_load(done, k) < n:
        spins += 1
        if spins > _SPINS_BEFORE_YIELD:
            sched_yield()


# The matrix products of a layer take either float32 weight stacks ([num_layers, N, K]: the
# kernels of linear.py) or a QuantizedStack's table (int64 [num_layers, S, 4]: each layer's
# product is S weight segments in GGUF types, written side by side into the output, e.g. q, k
# and v into qkv). The three functions below are resolved by the weights' type when a region is
# compiled, so a float32 model's regions compile only the float32 kernels. With a table, ``int8`` (an
# argument of the regions) picks the products' entry: None where no weight was asked for int8
# activations (``quant_task_rows_f32``: the integer kernels stay out of the region's call tree and
# are never compiled), True where some were (``quant_task_rows``, which takes either kind of id).

def product_items(T, w, plan):
    """Work items of one layer's product of ``T`` tokens (``linear_items`` or the quantized
    segments' row blocks); compiled code only."""
    raise NotImplementedError("compiled code only")


def product_item(x, w, layer, out, plan, i, qscratch, task, int8):
    """Item ``i`` of ``product_items`` for layer ``layer``; compiled code only."""
    raise NotImplementedError("compiled code only")


def product_scratch(w, n_tasks, T, K):
    """The per-task scratch of the products (``quant_scratch``; a placeholder for float32 weights)."""
    raise NotImplementedError("compiled code only")


def _quantized(w):
    return isinstance(w, types.Array) and w.dtype == types.int64 and w.ndim == 3


@overload(product_items)
def _product_items(T, w, plan):
    if _quantized(w):
        def impl(T, w, plan):
            n = 0   # plan: the product's K, whether interleaved, the region's tasks
            for s in range(w.shape[1]):
                N = w[0, s, _S_ROWS]
                rows = quant_item_rows(T, plan[0], N, plan[1] != 0, plan[2])
                n += (N + rows - 1) // rows
            return n if T > 0 else 0
        return impl
    return lambda T, w, plan: linear_items(T, w.shape[1], plan[0], plan[1], plan[2])


@overload(product_item)
def _product_item(x, w, layer, out, plan, i, qscratch, task, int8):
    if _quantized(w):
        task_rows = quant_task_rows_f32 if isinstance(int8, types.NoneType) else quant_task_rows

        def impl(x, w, layer, out, plan, i, qscratch, task, int8):
            K = x.shape[1]
            for s in range(w.shape[1]):
                N = w[layer, s, _S_ROWS]
                rows = quant_item_rows(x.shape[0], K, N, plan[1] != 0, plan[2])
                n = (N + rows - 1) // rows
                if i < n:
                    qtype = w[layer, s, _S_TYPE]
                    data = carray(_u8_at(w[layer, s, _S_ADDRESS]), (N, _row_bytes(qtype, K)))
                    task_rows(x, data, qtype, out, w[layer, s, _S_COLUMN], qscratch, task, i * rows,
                              min(N, (i + 1) * rows))
                    return
                i -= n
        return impl
    return lambda x, w, layer, out, plan, i, qscratch, task, int8: linear_item(x, w[layer], out, plan[0], plan[1],
                                                                               plan[2], i)


@overload(product_scratch)
def _product_scratch(w, n_tasks, T, K):
    if _quantized(w):
        return lambda w, n_tasks, T, K: quant_scratch(n_tasks, T, K)
    return lambda w, n_tasks, T, K: np.empty((1, 1), np.float32)


# a QuantizedStack table's columns
_S_ADDRESS, _S_TYPE, _S_ROWS, _S_COLUMN = range(4)


@njit(cache=True)
def _row_bytes(qtype, K):
    # qtype: a kernel type id (a GGML id, plus INT8_ACTIVATIONS for the integer path, or kernel_layout's *_X8)
    return kernel_row_bytes(qtype, K)


@njit(cache=True)
def _phase_item(phase, i, layer, w, residual, hidden, x, qkv, q, attn, attn2, gate_up, act, ln1, qkv_w, o_w, ln2,
                gate_up_w, down_w, key_cache, value_cache, positions, cos_sin_cache, slot_mapping, block_tables,
                seq_lens, query_start_loc, H, Hkv, eps, qscale, lin, rows_per_item, items, n_parts, qs, kb, vb, ko, sc,
                acc, m, l, bm, pm, pl, pacc, qscratch, int8):
    # item i of one phase of one layer, on task w's scratch (_layers_region calls it at its address)
    T = residual.shape[0]
    t0, t1 = i * rows_per_item, min(T, (i + 1) * rows_per_item)
    if phase == _P_NORM1:
        if layer == 0:
            _rms_norm_rows(residual, ln1[0], eps, x, t0, t1)
        else:
            _fused_add_rms_norm_rows(hidden, residual, ln1[layer], eps, x, residual, t0, t1)
    elif phase == _P_QKV:
        product_item(x, qkv_w, layer, qkv, lin[0], i, qscratch, w, int8)
    elif phase == _P_ROPE:
        _rope_and_cache_rows(positions, qkv, cos_sin_cache, key_cache, value_cache, slot_mapping, H, Hkv, q, t0, t1)
    elif phase == _P_ATTN:
        attention_item(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, qscale, attn, items, i,
                       qs[w], kb[w], vb[w], ko[w], sc[w], acc[w], m[w], l[w], bm[w], pm, pl, pacc)
    elif phase == _P_MERGE:
        finish_attention(items, H // Hkv, n_parts, pm, pl, pacc, query_start_loc, attn)
    elif phase == _P_O:
        product_item(attn2, o_w, layer, hidden, lin[1], i, qscratch, w, int8)
    elif phase == _P_NORM2:
        _fused_add_rms_norm_rows(hidden, residual, ln2[layer], eps, x, residual, t0, t1)
    elif phase == _P_GATE_UP:
        product_item(x, gate_up_w, layer, gate_up, lin[2], i, qscratch, w, int8)
    elif phase == _P_SILU:
        _silu_and_mul_rows(gate_up, act, t0, t1)
    else:
        product_item(act, down_w, layer, hidden, lin[3], i, qscratch, w, int8)


# The types of _phase_item's arguments that _layers_region makes itself (the rest are the
# region's own arguments, or views of them): the task's index, the attention scratch
# (attention_scratch: qs kb vb ko sc acc m l bm pm pl pacc), the products' scratch
_F1, _F2, _F3 = (types.Array(types.float32, n, "C") for n in (1, 2, 3))
_SCRATCH_TYPES = (_F3, _F3, _F3, types.Array(types.int64, 2, "C"), _F3, _F3, _F2, _F2, _F2, _F2, _F2, _F3, _F2)


def _signature_key(argtypes) -> int:
    # a check that a function address and a call site agree on the argument types (crc32 of their names)
    return zlib.crc32(repr(tuple(argtypes)).encode())


@intrinsic
def _call_item(typingctx, address, key, *args):
    # call the function compiled at int64 ``address`` with ``args`` (Numba's own calling convention,
    # no result) if ``key`` is _signature_key of the args' types, and return True; else return False
    # without calling. A call by address links nothing: the region's module does not carry the
    # callee's call tree (below)
    argtys = tuple(types.unliteral(a) for a in args)
    expected = _signature_key(argtys)
    star = types.StarArgTuple.from_types(args)   # how Numba passes *args

    def codegen(context, builder, sig, llargs):
        values = [context.cast(builder, v, t, u)
                  for v, t, u in zip(cgutils.unpack_tuple(builder, llargs[2], len(args)), args, argtys)]
        fnty = context.call_conv.get_function_type(types.none, argtys)
        ok = builder.icmp_unsigned("==", llargs[1], ir.Constant(ir.IntType(64), expected))
        with builder.if_then(ok):
            fn = builder.inttoptr(llargs[0], fnty.as_pointer())
            status, _ = context.call_conv.call_function(builder, fn, types.none, argtys, values)
            with cgutils.if_unlikely(builder, status.is_error):
                context.call_conv.return_status_propagate(builder, status)
        return ok

    return types.boolean(types.int64, types.int64, star), codegen


def _prange_only():
    # Numba's parallel options with only prange loops made parallel: no array expression or
    # np.zeros of a region becomes a parallel loop of its own (each one more function compiled,
    # wrapped and linked; the counters and item counts are a few dozen values)
    return dict(comprehension=False, reduction=False, inplace_binop=False, setitem=False, numpy=False,
                stencil=False, fusion=False, prange=True)


@njit(parallel=_prange_only(), cache=True, nogil=True)
def _layers_region(residual, hidden, x, qkv, q, attn, gate_up, act, ln1, qkv_w, o_w, ln2, gate_up_w, down_w,
                   cache_addrs, cache_like, positions, cos_sin_cache, slot_mapping, block_tables, seq_lens,
                   query_start_loc, H, Hkv, eps, qscale, lin, rows_per_item, items, n_parts, n_tasks, int8, item,
                   key):
    # _layers in one parallel region: every task walks the same phases of every layer, takes
    # the items of each phase from its claim counter, and waits at the phase's end until all of
    # its items are done (never for an item nobody took: no deadlock if tasks run one by one).
    # The KV caches come as addresses (cache_addrs [L, 2]: layer's key, value) of arrays shaped
    # like cache_like, not as tuples (LLVM's SROA pass is quadratic in a tuple's size, here 2 x
    # num_layers arrays), while the views made here have the type the tuple's items had (the same
    # callees)
    T = residual.shape[0]
    L = ln1.shape[0]
    attn2 = attn.reshape(T, attn.shape[1] * attn.shape[2])
    n_row = (T + rows_per_item - 1) // rows_per_item
    n_items = np.empty(_PHASES, np.int64)   # items per phase, in _P_* order
    n_items[:] = n_row
    n_items[_P_QKV] = product_items(T, qkv_w, lin[0])
    n_items[_P_ATTN] = items.shape[0]
    n_items[_P_MERGE] = 1
    n_items[_P_O] = product_items(T, o_w, lin[1])
    n_items[_P_GATE_UP] = product_items(T, gate_up_w, lin[2])
    n_items[_P_DOWN] = product_items(T, down_w, lin[3])
    claims = np.zeros(L * _PHASES, np.int64)
    done = np.zeros(L * _PHASES, np.int64)
    failed = np.zeros(1, np.int64)
    shape = cache_like.shape
    qs, kb, vb, ko, sc, acc, m, l, bm, pm, pl, pacc = attention_scratch(n_tasks, H, Hkv, cos_sin_cache.shape[1], shape[1],
                                                                n_parts)
    qscratch = product_scratch(qkv_w, n_tasks, T, max(x.shape[1], attn2.shape[1], act.shape[1]))
    for w in prange(n_tasks):
        # w as the prange index is typed in the region's body (uint64): the same type for the
        # callees, so that typing the loop does not compile an int64 twin of them
        wt = np.uint64(w)
        for layer in range(L):
            key_cache = carray(_ptr_at(cache_addrs[layer, 0], cache_like), shape)
            value_cache = carray(_ptr_at(cache_addrs[layer, 1], cache_like), shape)
            for phase in range(_PHASES):
                k = layer * _PHASES + phase
                while True:
                    i = atomic_add(claims, k, 1)
                    if i >= n_items[phase]:
                        break
                    # item i of this phase on task wt's scratch (_phase_item, called at its address)
                    if not _call_item(item, key, phase, i, layer, wt, residual, hidden, x, qkv, q, attn, attn2,
                                      gate_up, act, ln1, qkv_w, o_w, ln2, gate_up_w, down_w, key_cache, value_cache,
                                      positions, cos_sin_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                                      H, Hkv, eps, qscale, lin, rows_per_item, items, n_parts, qs, kb, vb, ko, sc, acc,
                                      m, l, bm, pm, pl, pacc, qscratch, int8):
                        failed[0] = 1
                    atomic_add(done, k, 1)
                wait_items_done(done, k, n_items[phase])
    if failed[0]:
        raise RuntimeError("decoder_layers: the layer item function does not take the region's argument types")


@njit(parallel=_prange_only(), cache=True, nogil=True)
def _product_region(x, address, qtype, out, n_tasks, entry, key):
    # out = x @ W.T, W the out.shape[1] rows of GGUF blocks (kernel type qtype) at address, in one
    # region: items of quant_item_rows(T, K, N, interleaved, n_tasks) rows claimed from a counter, each computed
    # by the products' entry (quant_task_rows_f32, or quant_task_rows: called at its address, as
    # _layers_region calls _phase_item), as quant_linear_into's items: its rows bit for bit
    T, K = x.shape
    N = out.shape[1]
    rows = quant_item_rows(T, K, N, qtype >= 2 * INT8_ACTIVATIONS, n_tasks)
    n = (N + rows - 1) // rows
    data = carray(_u8_at(address), (N, _row_bytes(qtype, K)))
    claims = np.zeros(1, np.int64)
    failed = np.zeros(1, np.int64)
    qscratch = quant_scratch(n_tasks, T, K)
    for task in prange(n_tasks):
        wt = np.uint64(task)   # the prange index's type in the region's body, as in _layers_region
        while True:
            i = atomic_add(claims, 0, 1)
            if i >= n:
                break
            if not _call_item(entry, key, x, data, qtype, out, 0, qscratch, wt, i * rows, min(N, (i + 1) * rows)):
                failed[0] = 1
    if failed[0]:
        raise RuntimeError("quantized_linear: the products' entry does not take the region's argument types")


def quantized_linear(x, weight: QuantizedWeight, out=None):
    """``x [T, K]`` float32 @ ``dequantize(weight)``.T -> ``[T, N]`` float32 for a ``QuantizedWeight``
    (the CPU table's ``linear``; ``lm_head``): ``quant_linear``'s result, bit for bit. With two
    tasks or more (``quant_linear_tasks``) it runs as a phase of the layer loop does
    (``_product_region``: the same work items and entry, ``product_item``), so a server compiles the
    products' kernels once, in the signature the layers call them with, and not again in
    ``quant_linear_into``'s (a read-only mapped table, literal arguments: ~10 CPU s of a cold start);
    otherwise, and for arguments it does not take as they are, ``quant_linear``, which checks them.

    Raises:
        what ``quant_linear`` raises (``UnsupportedQuantType``, ``ValueError``).
    """
    data, (N, K) = weight.data, weight.shape
    x = np.ascontiguousarray(x, dtype=np.float32)
    if weight.packed is not None:   # the rows as the kernels read them (prepare_weight): checked there
        data, kind = weight.packed
        if x.ndim != 2 or x.shape[1] != K:
            raise ValueError(f"x must be [T, {K}], got shape {x.shape}")
        if out is None:
            out = np.empty((x.shape[0], N), np.float32)
        elif out.shape != (x.shape[0], N) or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous float32 {(x.shape[0], N)}, got {out.dtype} {out.shape}")
        if x.shape[0] == 0:
            return out
        tasks = quant_linear_tasks(N, K, num_threads())
        with region_guard():
            if tasks < 2:
                quant_linear_into(x, data, kind, out, quant_scratch(1, x.shape[0], K), 1)
            else:
                _product_region(x, data.ctypes.data, kind, out, num_threads(),
                                *_function_at(quant_task_rows, _ITEM_SIG))
        return out
    if x.ndim != 2 or x.shape[1] != K or x.shape[0] == 0 or quant_linear_tasks(N, K, num_threads()) < 2 or \
            not (data.flags.c_contiguous and data.dtype == np.uint8 and data.shape[0] == N) or \
            not (out is None or out.shape == (x.shape[0], N) and out.dtype == np.float32 and out.flags.c_contiguous):
        return quant_linear(x, data, weight.qtype, out, activations=weight.activations)
    _check_weight(data, weight.qtype, K)   # the rows' size in bytes
    if out is None:
        out = np.empty((x.shape[0], N), np.float32)
    entry = quant_task_rows if weight.activations == "int8" else quant_task_rows_f32   # see product_item
    with region_guard():
        _product_region(x, data.ctypes.data, quant_kernel_type(weight.qtype, weight.activations), out, num_threads(),
                        *_function_at(entry, _ITEM_SIG))
    return out


_F2 = types.Array(types.float32, 2, "C")
_ITEM_SIG = (_F2, types.Array(types.uint8, 2, "C"), types.int64, _F2, types.int64, _F2, types.uint64, types.int64,
             types.int64)   # the products' entries (quant_task_rows, quant_task_rows_f32) as the regions call them


@intrinsic
def _u8_at(typingctx, address):
    # an int64 address as a uint8 pointer (a quantized weight's bytes)
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))
    return types.CPointer(types.uint8)(types.int64), codegen


@intrinsic
def _ptr_at(typingctx, address, like):
    # an int64 address as a pointer to like's dtype (float32, or uint16 for a bfloat16 cache;
    # numba.carray makes it an array view)
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))
    return types.CPointer(like.dtype)(types.int64, like), codegen


def _int64(a):
    return np.ascontiguousarray(a, dtype=np.int64)


_items = {}   # (weights' types, cache dtype, int8) -> (_phase_item's address, its _signature_key)


def _item_function(step, int8):
    # (address, key) of _phase_item compiled (or loaded from Numba's cache) for the argument types
    # _layers_region calls it with, for a step's region arguments (step: decoder_layers' tuple);
    # the types the region makes itself are _SCRATCH_TYPES, the caches' views are C arrays of the
    # cache's dtype. Kept per weights' types, cache dtype and int8: the buffers are C-contiguous
    # float32 and the metadata int64 for every step (a mismatch raises in the region, never calls)
    (residual, hidden, x, qkv, q, attn, gate_up, act, ln1, qkv_w, o_w, ln2, gate_up_w, down_w, _, cache_like,
     positions, cos_sin_cache, slot_mapping, block_tables, seq_lens, query_start_loc, H, Hkv, eps, qscale, lin) = step
    k = (typeof(qkv_w), typeof(ln1), cache_like.dtype, int8 is None)
    found = _items.get(k)
    if found is None:
        cache = types.Array(typeof(cache_like).dtype, 4, "C")
        attn2 = types.Array(types.float32, 2, "C")
        sig = ((types.int64, types.int64, types.int64, types.uint64)
               + tuple(typeof(a) for a in (residual, hidden, x, qkv, q, attn)) + (attn2,)
               + tuple(typeof(a) for a in (gate_up, act, ln1, qkv_w, o_w, ln2, gate_up_w, down_w))
               + (cache, cache)
               + tuple(typeof(a) for a in (positions, cos_sin_cache, slot_mapping, block_tables, seq_lens,
                                           query_start_loc, H, Hkv, eps, qscale, lin))
               + (types.int64, types.Array(types.int64, 2, "C"), types.int64) + _SCRATCH_TYPES + (typeof(int8),))
        found = _items[k] = _function_at(_phase_item, sig)
    return found


_addresses = {}   # (dispatcher, signature) -> _function_at's answer


def _function_at(fn, sig):
    # (address, _signature_key) of the compiled function ``fn`` (a Numba dispatcher) for the
    # argument types ``sig``, compiled or loaded from Numba's cache the first time (_call_item's
    # arguments)
    found = _addresses.get((fn, sig))
    if found is None:
        fn.compile(sig)
        cres = fn.overloads[sig]
        found = _addresses[(fn, sig)] = (cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name),
                                         _signature_key(sig))
    return found


_cache_table = ((), None)   # (weak references to the KV cache arrays, their addresses [L, 2]) of the last step


def _cache_addresses(kv_caches):
    # [L, 2] int64 data addresses of the layers' (key, value) caches for _layers_region, kept
    # while the steps after pass the same arrays (the engine's caches: one table per run; checking
    # them is cheaper than reading the addresses again). Weak references: the table neither keeps
    # a released cache alive nor matches a new array at a freed one's address
    global _cache_table
    arrays = [c for pair in kv_caches for c in pair]
    refs, addrs = _cache_table
    if len(refs) != len(arrays) or any(r() is not a for r, a in zip(refs, arrays)):
        addrs = np.array([a.ctypes.data for a in arrays], dtype=np.int64).reshape(-1, 2)
        _cache_table = (tuple(weakref.ref(a) for a in arrays), addrs)
    return addrs


class QuantizedStack:
    """One kind of layer product (e.g. qkv) for every layer, in GGUF types: what ``decoder_layers``
    takes in place of a float32 ``[num_layers, N, K]`` stack when a model is served in its stored
    types (``stack_quantized``).

    Attributes:
        table: int64 ``[num_layers, S, 4]``: per layer, the ``S`` weight segments written side by
            side into the product's output (q, k, v for qkv; gate, up for gate_up), each as (data
            address, kernel type id: ``quant_kernel_type(qtype, activations)``, or
            ``kernel_layout``'s ``*_X8`` for an interleaved segment, rows, first output column).
        shape: ``(N, K)``: the product's output columns (the segments' rows together) and inputs.
        weights: the ``QuantizedWeight`` segments per layer, kept alive (the table holds only
            their addresses).
        packed: the segments the kernels read in another layout (``quant_linear.kernel_layout``:
            the interleaved types' rows (quant_x8) for int8 activations), kept alive likewise. Their GGUF
            rows are then not read by the layers; where they are pages of a mapped file, those
            pages are handed back (``memory.release_mapped_pages``: peak RSS stays near the file's
            size; a later read maps them again), and rows that are a copy to begin with (the GGUF
            loader's q and k, ``QuantizedWeight.lazy``) are dropped (``release_rows``).
        int8: whether int8 activations were asked for some segment (``QuantizedWeight.activations``).
        interleaved: whether some segment is read interleaved (the product's items are then
            larger: ``quant_item_rows``).
    """

    def __init__(self, layers):
        layers = [tuple(segments) for segments in layers]
        K = layers[0][0].shape[1]
        rows = [w.shape[0] for w in layers[0]]
        table = np.zeros((len(layers), len(rows), 4), np.int64)
        packed = []
        for li, segments in enumerate(layers):
            if [w.shape for w in segments] != [w.shape for w in layers[0]]:
                raise ValueError(f"layer {li}'s weights have shapes {[w.shape for w in segments]}, layer 0's "
                                 f"{[w.shape for w in layers[0]]}")
            column = 0
            for s, w in enumerate(segments):
                data, kind = kernel_layout(w.data, quant_kernel_type(w.qtype, w.activations), release=True)
                if data is not w.data:
                    packed.append(data)
                    w.release_rows()   # rows made in another order (the GGUF loader's q, k): not kept twice
                table[li, s] = data.ctypes.data, kind, w.shape[0], column
                column += w.shape[0]
        self.table, self.shape, self.weights, self.packed = table, (sum(rows), K), layers, packed
        self.int8 = any(w.activations == "int8" for segments in layers for w in segments)
        self.interleaved = bool((table[:, :, 1] >= 2 * INT8_ACTIVATIONS).any())


def stack_quantized(layers) -> QuantizedStack:
    """The ``QuantizedStack`` of one kind of layer product: ``layers[i]`` is layer ``i``'s tuple of
    ``QuantizedWeight`` segments (e.g. ``(q_proj, k_proj, v_proj)``), each of any supported GGUF type
    (types may differ between segments and layers, as in llama.cpp's Q4_K_M mixes).

    Raises:
        ValueError: layers whose segment shapes differ, or segments of different ``K``.
    """
    layers = list(layers)
    for segments in layers:
        for w in segments:
            if not isinstance(w, QuantizedWeight):
                raise ValueError(f"stack_quantized takes QuantizedWeight segments, got {type(w).__name__}")
            if w.shape[1] != segments[0].shape[1]:
                raise ValueError(f"segments of one product must share K, got {[v.shape for v in segments]}")
    return QuantizedStack(layers)


def decoder_layers(weights: dict, buffers: dict, positions, attn_metadata, kv_caches, cos_sin_cache, scale: float,
                   num_heads: int, num_kv_heads: int, eps: float):
    """Run every decoder layer of a step on the CPU, in place in ``buffers``; returns ``(hidden,
    residual)``, the last layer's output and residual stream (``[T, hidden]`` float32 each).

    Same arithmetic, in the same order, as the per-kernel loop of ``LlamaForCausalLM.forward``
    (RMSNorm, fused QKV product, RoPE and cache append, paged attention, o_proj, residual add and
    RMSNorm, gate/up product, SwiGLU, down product), one compiled call for all layers.

    Args:
        weights: ``LAYER_WEIGHTS`` names -> C-contiguous float32 ``[num_layers, ...]`` stacks, or for
            the four products (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) all
            ``QuantizedStack`` (weights in GGUF types, ``stack_quantized``; the norms stay float32).
        buffers: the workspace's ``[T, ...]`` views (``model.llama.Workspace.view``); ``residual``
            holds the embeddings on entry.
        positions: ``[T]`` int positions; ``attn_metadata``: the step's ``AttentionMetadata``.
        kv_caches: per layer ``(key_cache, value_cache)``, C-contiguous ``[num_blocks, block_size,
            num_kv_heads, head_dim]``, float32 or bfloat16 bits as uint16 (``kv_dtype.py``), all of
            one dtype; this step's keys and values are appended.
        cos_sin_cache: ``[max_position, head_dim]`` float32 RoPE table; ``scale``: softmax scale.
    Raises:
        ValueError: a KV cache that is not C-contiguous float32 / uint16, or caches of different shapes or dtypes
            (the kernels address blocks directly; the one-region loop gets the layers' caches as
            addresses of arrays of one shape).
    """
    shape0, dtype0 = kv_caches[0][0].shape, kv_caches[0][0].dtype
    if dtype0 not in KV_CACHE_DTYPES.values() or \
            not all(c.flags.c_contiguous and c.dtype == dtype0 and c.shape == shape0 for pair in kv_caches for c in pair):
        raise ValueError("decoder_layers needs C-contiguous KV caches (float32, or bfloat16 bits as uint16), all of "
                         "one shape and dtype")
    b, md = buffers, attn_metadata
    residual = b["residual"]
    T, hid = residual.shape
    if T == 0:
        return b["hidden"], residual
    D = cos_sin_cache.shape[1]
    threads = num_threads()
    seq_lens, query_start_loc = _int64(md.seq_lens), _int64(md.query_start_loc)
    products = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    quantized = isinstance(weights["qkv_proj"], QuantizedStack)
    if quantized:   # every product's plan is its segments' row blocks (product_items) of rows of K values
        lin = np.zeros((4, 3), np.int64)
        lin[:, 0] = hid, b["attn"].shape[1] * b["attn"].shape[2], hid, b["act"].shape[1]
        lin[:, 1] = [weights[name].interleaved for name in products]
        lin[:, 2] = threads
        int8 = True if any(weights[name].int8 for name in products) else None   # see product_item
    else:
        lin = np.array([linear_plan(T, weights[name].shape[1:], threads) for name in products], dtype=np.int64)
        int8 = None
    key_cache = kv_caches[0][0]
    items, n_parts, attn_tasks = plan(seq_lens, query_start_loc, num_heads, num_kv_heads, D, key_cache.shape[1],
                                      threads)
    # quantized weights: always the one region (on one thread too: a region of one task)
    region = (quantized or ONE_REGION and threads > 1) and T > 0
    caches = (_cache_addresses(kv_caches), key_cache) if region else \
        (tuple(k for k, _ in kv_caches), tuple(v for _, v in kv_caches))
    step = (residual, b["hidden"], b["x"], b["qkv"], b["q"], b["attn"], b["gate_up"], b["act"],
            *(weights[name].table if isinstance(weights[name], QuantizedStack) else weights[name]
              for name in LAYER_WEIGHTS), *caches,
            _int64(positions), cos_sin_cache, _int64(md.slot_mapping), _int64(md.block_tables), seq_lens,
            query_start_loc, num_heads, num_kv_heads, float(eps), np.float32(scale * LOG2E), lin)
    with region_guard():   # the layers run without the GIL: see region_guard
        if region:
            _layers_region(*step, rows._ROWS_PER_ITEM, items, n_parts, threads, int8, *_item_function(step, int8))
        else:
            _layers(*step, row_tasks(T * hid, T, threads), row_tasks(b["qkv"].size, T, threads),
                    row_tasks(b["gate_up"].size, T, threads), rows._ROWS_PER_ITEM, items, n_parts, attn_tasks)
    return b["hidden"], residual

# ----------------------------------------------------------------------------------------------
# compiled ahead (compile_jobs.py; runtime/worker/precompile.py through the table)
# ----------------------------------------------------------------------------------------------

# _phase_item: phase, i, layer, task; buffers (residual, hidden, x, qkv, q, attn, attn2, gate_up, act);
# stacked weights ({W}); one layer's caches; step metadata; attention scratch; product scratch (a
# placeholder with float32 weights); int8 ({A}: none, or b1 where products take int8 activations:
# product_item)
_PHASE_ITEM = ("i64 i64 i64 u64  F2 F2 F2 F2 F3 F3 F2 F2 F2  {W}  F4 F4  I1 F2 I1 I2 I1 I1 i64 i64 f64 f32 "
               "I2 i64 I2 i64  F3 F3 F3 I2 F3 F3 F2 F2 F2 F2 F2 F3 F2 {A}")
# _layers_region: buffers, stacked weights, cache addresses and a cache, step metadata, tasks, int8,
# and _phase_item's address and signature key
_LAYERS_REGION = "F2 F2 F2 F2 F3 F3 F2 F2  {W}  I2 F4  I1 F2 I1 I2 I1 I1 i64 i64 f64 f32 I2 i64 I2 i64 i64 {A} i64 i64"
# the stacked weights (ln1, qkv, o, ln2, gate_up, down): float32 stacks, or QuantizedStack tables
_WEIGHTS = {"float32": "F2 F3 F3 F2 F3 F3", "quantized": "F2 I3 I3 F2 I3 I3", "quantized-int8": "F2 I3 I3 F2 I3 I3"}
_INT8 = {"float32": "none", "quantized": "none", "quantized-int8": "b1"}
_PHASE_SECONDS = {"float32": 10, "quantized": 11, "quantized-int8": 11}
PRECOMPILE = (
    NumbaJob(wait_items_done, "I1 i64 i64", "linear", 0.1, "decoder layers: phase barrier"),
    NumbaJob(_row_bytes, "i64 i64", "linear", 0.1, "GGUF row sizes", QUANTIZED),
    *(NumbaJob(_phase_item, _PHASE_ITEM.format(W=_WEIGHTS[v], A=_INT8[v]), "layers", _PHASE_SECONDS[v],
               "decoder layers: one work item of a phase", (v,)) for v in _WEIGHTS),
    *(NumbaJob(_layers_region, _LAYERS_REGION.format(W=_WEIGHTS[v], A=_INT8[v]), "rest", 6,
               "decoder layers: one parallel region per step", (v,)) for v in _WEIGHTS),
    NumbaJob(_product_region, "F2 i64 i64 F2 i64 i64 i64", "rest", 1,
             "matrix products from GGUF blocks, parallel region (lm_head)", QUANTIZED),
)
