"""A CUDA kernel table whose every result is checked against the float64 spec on the same inputs.

``SpecCheckedKernels(table)`` forwards each operation to ``table`` and, before returning its
result, evaluates the spec of kernels/reference.py (in tests/support/cuda_bounds.py, with its bound) on host copies of the very inputs the kernel got
(bf16 values where the table holds bf16) and asserts the difference is within the derived bound
of tests/support/cuda_bounds.py. Run under the model's forward pass, this checks every kernel launch of a
real step (the strided views, the fused operations, prefill and decode paths) without comparing
two chaotic forward passes: an end-to-end comparison of two float32 forwards that round to bf16
at many points is not bounded by anything useful, because a rounding that lands on the other
side of a bf16 boundary in one of them is amplified by every later layer (see
tests/kernels/test_cuda_kernels.py, test_llama_forward_on_the_cuda_table_matches_the_spec_op_by_op).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from support import cuda_bounds as B
from folio.kernels.cuda.table import bf16_bits_to_float32


def _host(kt, a):
    return np.array(kt.to_numpy(a), copy=True)


def _val(kt, a):
    """Host float64 values of a device array (bf16 bits decoded)."""
    h = _host(kt, a)
    return (bf16_bits_to_float32(h) if h.dtype == np.uint16 else h).astype(np.float64)


class SpecCheckedKernels:
    """See the module docstring. ``checked`` counts the operations checked, by name (attention
    by ``paged_attention/prefill`` and ``paged_attention/decode``)."""

    def __init__(self, table):
        self.kt = table
        self.checked: Counter = Counter()

    def __getattr__(self, name):
        return getattr(self.kt, name)

    def embedding(self, ids, table, out=None):
        kt = self.kt
        r = kt.embedding(ids, table, out=out)
        np.testing.assert_array_equal(_val(kt, r), _val(kt, table)[_host(kt, ids)])
        self.checked["embedding"] += 1
        return r

    def rms_norm(self, x, weight, eps, out=None):
        kt = self.kt
        xh, wh = _val(kt, x), _val(kt, weight)
        r = kt.rms_norm(x, weight, eps, out=out)
        y, b = B.rms_norm(xh, wh, eps)
        B.check(_val(kt, r), y, b, "rms_norm")
        self.checked["rms_norm"] += 1
        return r

    def fused_add_rms_norm(self, x, residual, weight, eps, out=None, residual_out=None, rows=None):
        kt = self.kt
        xh, rh, wh = _host(kt, x), _host(kt, residual), _val(kt, weight)  # before: residual may be updated
        r, res = kt.fused_add_rms_norm(x, residual, weight, eps, out=out, residual_out=residual_out, rows=rows)
        s = (xh.astype(np.float64) + rh).astype(np.float32)  # one float32 addition: exact rounding
        if rows is not None:
            s = s[_host(kt, rows)]
            assert res is None
        else:
            np.testing.assert_array_equal(_host(kt, res), s)
        y, b = B.rms_norm(s, wh, eps)
        B.check(_val(kt, r), y, b, "fused_add_rms_norm")
        self.checked["fused_add_rms_norm"] += 1
        return r, res

    def linear(self, x, weight, out=None):
        kt = self.kt
        xh = _val(kt, x) if x.dtype == np.uint16 else B.bf16(_host(kt, x)).astype(np.float64)
        y, b = B.linear(xh, _val(kt, weight))
        r = kt.linear(x, weight, out=out)
        B.check(_val(kt, r), y, b, "linear")
        self.checked["linear"] += 1
        return r

    def silu_and_mul(self, x, out=None):
        kt = self.kt
        y, b = B.silu_and_mul(_val(kt, x))
        r = kt.silu_and_mul(x, out=out)
        B.check(_val(kt, r), y, b, "silu_and_mul")
        self.checked["silu_and_mul"] += 1
        return r

    def rope_and_cache(self, positions, qkv, cos_sin_cache, key_cache, value_cache, slot_mapping, num_heads,
                       num_kv_heads, out=None):
        kt = self.kt
        pos, qkvh, cs = _host(kt, positions), _val(kt, qkv), _host(kt, cos_sin_cache)
        kc0, vc0, slots = _host(kt, key_cache), _host(kt, value_cache), _host(kt, slot_mapping)
        r = kt.rope_and_cache(positions, qkv, cos_sin_cache, key_cache, value_cache, slot_mapping, num_heads,
                              num_kv_heads, out=out)
        T, D = qkvh.shape[0], cs.shape[1]
        qd, kvd = num_heads * D, num_kv_heads * D
        yq, bq = B.rope(pos, qkvh[:, :qd].reshape(T, num_heads, D), cs)
        B.check(_val(kt, r), yq, bq, "rope_and_cache q")
        yk, bk = B.rope(pos, qkvh[:, qd:qd + kvd].reshape(T, num_kv_heads, D), cs)
        kc, vc = _host(kt, key_cache), _host(kt, value_cache)
        bs = kc.shape[1]
        written = np.zeros(kc.shape[:2], bool)
        for t, slot in enumerate(slots):
            if slot < 0:
                continue
            blk, off = slot // bs, slot % bs
            written[blk, off] = True
            B.check(bf16_bits_to_float32(kc[blk, off]), yk[t], bk[t], "rope_and_cache key")
            np.testing.assert_array_equal(bf16_bits_to_float32(vc[blk, off]),
                                          B.bf16(qkvh[t, qd + kvd:qd + 2 * kvd].reshape(num_kv_heads, D)))
        np.testing.assert_array_equal(kc[~written], kc0[~written])  # nothing else written
        np.testing.assert_array_equal(vc[~written], vc0[~written])
        self.checked["rope_and_cache"] += 1
        return r

    def paged_attention(self, q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, **kw):
        kt = self.kt
        qh, kc, vc = _val(kt, q), _val(kt, key_cache), _val(kt, value_cache)
        bt, sl, qsl = _host(kt, block_tables), _host(kt, seq_lens), _host(kt, query_start_loc)
        r = kt.paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, **kw)
        want, bound = B.paged_attention(qh, kc, vc, bt, sl, qsl, scale)
        n = int(qsl[-1])
        B.check(_val(kt, r)[:n], want[:n], bound[:n], "paged_attention")
        decode = int(np.diff(qsl).max()) == 1
        self.checked["paged_attention/" + ("decode" if decode else "prefill")] += 1
        return r
