"""The GPU side of one step: one upload, the forward pass, device sampling, one download, one sync.

Per step on the CUDA table (counted by tests/runtime/worker/test_device_step.py with a counting device):

* **one host-to-device copy**: every input of the step (token ids, positions, slot mapping,
  query_start_loc, seq_lens, block tables, logits rows, copy-on-write pairs, the sampling
  parameters, each random row's uniform, the sparse penalty work) is packed into one pinned host
  buffer and copied in one asynchronous transfer; the kernels read views of the device copy;
* the forward pass (model/llama.py over preallocated buffers) and the sampler's kernels
  (kernels/cuda/sampling.cu), all on one stream, no host sync in between;
* **one device-to-host copy** of the sampled tokens with their logprobs (packed the same way) and
  **one synchronisation**: waiting for that copy.

Decode steps (every sequence has one new token, and each samples it) replay a **CUDA graph**
captured per (batch bucket, partition bucket): the batch is padded to the next bucket
(``graph_batch_sizes``: 1, 2, 4, then every multiple of 8 below ``max_num_seqs``, then
``max_num_seqs`` itself, vLLM's capture sizes) with rows that belong to no sequence (slot -1, empty
query range), so the matrix products run at most 7 padding rows (powers of two would run up to
2x the real rows); the context is padded to a power-of-two count of 512-token decode partitions.
One graph serves every step of that shape. The graph reads its inputs from fixed offsets of the
upload buffer and writes the logits to a fixed buffer; the sampler runs after it as usual. Capture goes through
``kernels.capture()`` (kernels/cuda/device.py; on a GPU CuPy's stream capture, with cuBLAS called as
kernels/cuda/cublas.py explains); a capture that fails turns graphs off for the engine
(``enforce_eager`` turns them off from the start).
"""

from __future__ import annotations

import numpy as np

from ...kernels.table import CudaKernelTable
from ...model.attention_metadata import AttentionMetadata
from .sampler import max_logprobs, penalty_entries, sample_on_device, sampling_arrays

_ALIGN = 16


def _bucket(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode graphs' batch buckets: 1, 2, 4, every multiple of 8 below ``max_num_seqs``, and
    ``max_num_seqs`` (vLLM's CUDA-graph capture sizes, capped at the engine's batch)."""
    m = int(max_num_seqs)
    return sorted({b for b in (1, 2, 4) if b < m} | set(range(8, m, 8)) | {m})


def graph_batch_bucket(n: int, max_num_seqs: int) -> int:
    """The smallest of ``graph_batch_sizes(max_num_seqs)`` holding ``n`` rows (``n <= max_num_seqs``)."""
    n = int(n)
    if n <= 4:
        return min(_bucket(n), int(max_num_seqs))
    return min(-(-n // 8) * 8, int(max_num_seqs))


class Staging:
    """A pinned host buffer and a device buffer of the same size; ``ensure`` grows both (doubling)
    and bumps ``generation`` (graphs captured on the old buffers are then dropped)."""

    def __init__(self, device, nbytes: int = 1 << 16):
        self.device = device
        self.generation = 0
        self._alloc(nbytes)

    def _alloc(self, nbytes):
        self.nbytes = int(nbytes)
        self.host = self.device.pinned_empty(self.nbytes)
        self.dev = self.device.empty((self.nbytes,), np.uint8)

    def ensure(self, nbytes: int):
        if nbytes > self.nbytes:
            self._alloc(max(int(nbytes), 2 * self.nbytes))
            self.generation += 1


def layout(sections: list[tuple[str, np.ndarray]]) -> tuple[list[tuple[str, int, np.ndarray]], int]:
    """Offsets (16-byte aligned, in order) of named host arrays in a packed buffer, and its size."""
    out, off = [], 0
    for name, a in sections:
        a = np.ascontiguousarray(a)
        out.append((name, off, a))
        off += -(-a.nbytes // _ALIGN) * _ALIGN
    return out, off


def upload(staging: Staging, sections) -> dict:
    """Pack ``sections`` into the pinned buffer, copy it to the device in one transfer, and return
    ``name -> device view``."""
    spec, total = layout(sections)
    staging.ensure(total)
    host = staging.host
    for _, off, a in spec:
        host[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
    if total:
        staging.device.h2d(staging.dev[:total], host[:total])
    dev = staging.dev
    return {name: dev[off:off + a.nbytes].view(a.dtype).reshape(a.shape) for name, off, a in spec}


class DeviceStep:
    """Runs steps on the CUDA table (see the module docstring).

    Args:
        kernels: a ``CudaKernelTable`` (its ``device`` does the copies, syncs and graphs).
        model: the ``LlamaForCausalLM`` on that table.
        max_num_seqs, max_num_batched_tokens, max_model_len, block_size: the engine's limits.
        enforce_eager: never capture CUDA graphs.
        extra_logits_rows: logits rows a step may sample beyond one per sequence (the verified
            drafts of speculative decoding).
    """

    def __init__(self, kernels: CudaKernelTable, model, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 block_size: int, enforce_eager: bool = False, extra_logits_rows: int = 0):
        self.k = kernels
        self.dev = kernels.device
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.max_num_seqs = int(max_num_seqs)
        self.max_model_len = int(max_model_len)
        self.max_blocks = -(-self.max_model_len // block_size)
        self.inp = Staging(self.dev)
        self.out = Staging(self.dev)
        self.logits = self.dev.empty((self.max_num_seqs + int(extra_logits_rows), self.vocab_size), np.float32)
        self.use_graphs = not enforce_eager
        self.graphs: dict = {}
        self._graph_state = None
        self._graph_caches: list = []
        self.graph_error: str | None = None
        self.partition_size = int(kernels.decode_partition_size)
        self.max_graph_partitions = min(int(kernels.max_decode_partitions),
                                        _bucket(-(-self.max_model_len // self.partition_size)))

    # ---- one step ------------------------------------------------------------------------------
    def run(self, plan, states, kv_caches):
        """Forward + sample ``plan`` (a ``StepPlan``) for ``states`` (one per sampled row).

        Returns:
            ``(tokens [R] int64, logprobs [R, 1+K] float32 | None, logprob ids | None,
            forward_seconds, sample_seconds)`` as host arrays.
        """
        with self.dev.activate():
            return self._run(plan, states, kv_caches)

    def _decode_graph_key(self, plan, R):
        T = plan.num_tokens
        S = len(plan.seq_lens)
        if not self.use_graphs or T == 0 or T != S or R != S or S > self.max_num_seqs:
            return None
        if not np.array_equal(np.asarray(plan.query_start_loc), np.arange(S + 1)) or \
                not np.array_equal(np.asarray(plan.logits_indices), np.arange(S)):
            return None
        need = -(-int(np.max(plan.seq_lens)) // self.partition_size)
        P = _bucket(need)
        if P > self.max_graph_partitions or np.asarray(plan.block_tables).shape[1] > self.max_blocks:
            return None
        return graph_batch_bucket(S, self.max_num_seqs), P

    def _forward_sections(self, plan, key):
        """Host arrays of the forward pass; for a graph step padded to the bucket's fixed shapes."""
        ids = np.asarray(plan.input_ids, dtype=np.int64)
        pos = np.asarray(plan.positions, dtype=np.int64)
        slots = np.asarray(plan.slot_mapping, dtype=np.int64)
        qsl = np.asarray(plan.query_start_loc, dtype=np.int32)
        lens = np.asarray(plan.seq_lens, dtype=np.int32)
        table = np.asarray(plan.block_tables, dtype=np.int32)
        rows = np.asarray(plan.logits_indices, dtype=np.int64)
        if key is not None:
            B, _ = key
            S = len(lens)
            pad = B - S
            ids = np.concatenate([ids, np.zeros(pad, np.int64)])
            pos = np.concatenate([pos, np.zeros(pad, np.int64)])
            slots = np.concatenate([slots, np.full(pad, -1, np.int64)])
            qsl = np.concatenate([qsl, np.full(pad, S, np.int32)])
            lens = np.concatenate([lens, np.zeros(pad, np.int32)])
            full = np.zeros((B, self.max_blocks), np.int32)
            full[:S, :table.shape[1]] = table
            table = full
            rows = np.arange(B, dtype=np.int64)
        return [("input_ids", ids), ("positions", pos), ("slot_mapping", slots), ("logits_indices", rows),
                ("query_start_loc", qsl), ("seq_lens", lens), ("block_tables", table)]

    def _forward(self, v, kv_caches, R_rows, max_query_len, max_seq_len):
        md = AttentionMetadata(slot_mapping=v["slot_mapping"], query_start_loc=v["query_start_loc"],
                               seq_lens=v["seq_lens"], block_tables=v["block_tables"],
                               max_query_len=max_query_len, max_seq_len=max_seq_len)
        return self.model.forward(v["input_ids"], v["positions"], md, kv_caches, v["logits_indices"],
                                  out=self.logits[:R_rows])

    def _graph(self, key, v, kv_caches):
        """The captured forward of ``key`` (captured now if new; None if capture is off/failed)."""
        # generation counters, not id(): a freed buffer's id can be reused by its replacement. The
        # caches have no counter: the state holds them (`_graph_caches`), so their ids stay unique
        state = (self.inp.generation, self.model.workspace_generation, self.k.scratch_generation,
                 tuple(id(c) for pair in kv_caches for c in pair))
        if state != self._graph_state:
            self.graphs.clear()
            self._graph_state = state
            self._graph_caches = [c for pair in kv_caches for c in pair]
        g = self.graphs.get(key)
        if g is None:
            B, P = key
            try:
                # warm-up: grows the workspace / scratch if this shape needs more (never while
                # capturing), and lets cuBLAS pick its algorithm outside the graph
                self._forward(v, kv_caches, B, 1, P * self.partition_size)
                state = (self.inp.generation, self.model.workspace_generation, self.k.scratch_generation, state[3])
                if state != self._graph_state:  # buffers moved: graphs captured before are stale
                    self.graphs.clear()
                    self._graph_state = state
                with self.k.capture() as g:
                    self._forward(v, kv_caches, B, 1, P * self.partition_size)
            except Exception as e:  # noqa: BLE001 - a capture the driver refuses: run eagerly from now on
                self.use_graphs = False
                self.graph_error = f"{type(e).__name__}: {e}"
                self.graphs.clear()
                return None
            self.graphs[key] = g
        return g

    def _run(self, plan, states, kv_caches):
        k = self.k
        R = len(states)
        T = plan.num_tokens
        if not T and not R and not len(plan.block_copies):  # nothing for the device this step
            return np.zeros(0, np.int64), None, None, 0.0, 0.0
        key = self._decode_graph_key(plan, R)
        sections = self._forward_sections(plan, key)
        copies = np.asarray(plan.block_copies, dtype=np.int64).reshape(-1, 2)
        sections.append(("block_copies", copies))
        params, uniforms = sampling_arrays(states)
        pen = penalty_entries(states, self.vocab_size) if R else None
        sections += [("params", params), ("uniforms", uniforms)]
        if pen is not None:
            sections += [("pen_entries", pen[0]), ("pen_rows", pen[1])]
        v = upload(self.inp, sections)  # the step's one host-to-device copy

        mark, elapsed = self.dev.timer()
        t0 = mark()
        if len(copies):
            k.copy_blocks([kc for kc, _ in kv_caches], [vc for _, vc in kv_caches], v["block_copies"])
        logits = None
        if T:
            g = self._graph(key, v, kv_caches) if key is not None else None
            if g is not None:
                g.replay()
                logits = self.logits[:R]
            else:
                qsl = np.asarray(plan.query_start_loc)
                mql = int(np.diff(qsl).max()) if len(qsl) > 1 else 0
                msl = int(np.max(plan.seq_lens)) if len(plan.seq_lens) else 0
                if key is not None:  # graphs were turned off while this step was being prepared
                    mql, msl = 1, key[1] * self.partition_size
                logits = self._forward(v, kv_caches, len(v["logits_indices"]), mql, msl)[:R]
        t1 = mark()
        K = max_logprobs(states) if R else None
        spec, total = layout([("tokens", np.zeros(R, np.int64))] + (
            [("lp", np.zeros((R, 1 + K), np.float32)), ("lp_ids", np.zeros((R, 1 + K), np.int64))] if K is not None else []))
        self.out.ensure(total)
        o = {name: self.out.dev[off:off + a.nbytes].view(a.dtype).reshape(a.shape) for name, off, a in spec}
        if R:
            pens = (v["pen_entries"], v["pen_rows"], len(pen[0])) if pen is not None else None
            sample_on_device(k, logits, v["params"], v["uniforms"], pens, K, o["tokens"], o.get("lp"), o.get("lp_ids"))
        t2 = mark()
        if total:
            self.dev.d2h(self.out.host[:total], self.out.dev[:total])  # the step's one device-to-host copy
        self.dev.synchronize()  # ... and its one sync
        host = {name: self.out.host[off:off + a.nbytes].view(a.dtype).reshape(a.shape).copy() for name, off, a in spec}
        return (host.get("tokens", np.zeros(0, np.int64)), host.get("lp"), host.get("lp_ids"),
                elapsed(t0, t1), elapsed(t1, t2))
