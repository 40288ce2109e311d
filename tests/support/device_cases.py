"""The CUDA table run on the CPU: a tiny random Llama's ``ModelRunner`` on the CUDA kernel table
under the SIMT emulator, with a device that counts every launch, host<->device copy and sync.

``make_table(modules, device)`` builds the table over the emulator's compiled modules (the
``modules`` fixture of tests/runtime/worker/conftest.py) with NumPy GEMMs; ``model_dir`` writes the
tiny model's config (``TINY`` with overrides) and ``make_runner`` builds a dummy-weight runner on
that table with blocks of ``BS`` tokens; ``Seq`` and ``plan_for`` build its steps by hand.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np

from folio.kernels.cuda import sources as cuda_sources
from folio.kernels.cuda import table as cuda_ops
from folio.kernels.cuda.device import HostDevice
from folio.runtime.common.config import EngineConfig
from folio.runtime.common.step import NewSequence, StepPlan
from folio.runtime.worker.model_runner import ModelRunner

TINY = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 211, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2}
BS = 8


class CountingDevice(HostDevice):
    """HostDevice that counts launches (kernels and GEMMs), copies and syncs; ``allocs`` counts
    device allocations made through the fake xp (``FakeXP``)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.counts = Counter()
        self.order: list[str] = []  # "launch" / "device_sync", in order

    def launch(self, fn, *args, **kwargs):
        self.counts["launch"] += 1
        self.order.append("launch")
        super().launch(fn, *args, **kwargs)

    def synchronize_device(self):
        self.counts["device_sync"] += 1
        self.order.append("device_sync")

    def h2d(self, dst, src):
        self.counts["h2d"] += 1
        super().h2d(dst, src)

    def d2h(self, dst, src):
        self.counts["d2h"] += 1
        super().d2h(dst, src)

    def synchronize(self):
        self.counts["sync"] += 1

    def take(self):
        c, self.counts = self.counts, Counter()
        return c


def make_table(modules, device, xp=np):
    from simt.table import numpy_gemm

    return cuda_ops.CudaKernels(xp, lambda n: modules[n].get_function(n), gemm=numpy_gemm,
                                smem_limit=227 * 1024, device=device, kernel_names=cuda_sources.all_kernel_names())


def model_dir(tmp_path, **overrides):
    d = tmp_path / ("m" + "_".join(f"{k}{v}" for k, v in overrides.items()))
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({**TINY, **overrides}))
    return str(d)


def make_runner(monkeypatch, table, path, **kw):
    monkeypatch.setattr(cuda_ops, "_TABLE", table)
    args = dict(model=path, device="cuda", load_format="dummy", block_size=BS, max_num_seqs=8,
                max_num_batched_tokens=64, max_model_len=128, num_kv_blocks_override=64, seed=5)
    args.update(kw)
    return ModelRunner(EngineConfig(**args))


class Seq:
    """A sequence on fixed blocks; ``done`` counts its computed tokens."""

    def __init__(self, seq_id, prompt, blocks, params, seed=None):
        self.seq_id, self.tokens, self.blocks = seq_id, list(prompt), list(blocks)
        self.done = 0
        self.new = NewSequence(seq_id, list(prompt), [], params.to_dict(), seed, [2])


def plan_for(step_id, seqs, new=(), copies=None, chunk=None):
    """Each seq computes its pending tokens (at most ``chunk``) and samples when it reaches the end."""
    ids, pos, slots, qsl, lens, rows, sample_ids = [], [], [], [0], [], [], []
    table = np.zeros((len(seqs), max(len(s.blocks) for s in seqs)), np.int32)
    for i, s in enumerate(seqs):
        end = len(s.tokens) if chunk is None else min(len(s.tokens), s.done + chunk)
        p = np.arange(s.done, end)
        ids += s.tokens[s.done:end]
        pos += p.tolist()
        slots += (np.asarray(s.blocks)[p // BS] * BS + p % BS).tolist()
        qsl.append(qsl[-1] + len(p))
        lens.append(end)
        if end == len(s.tokens):
            rows.append(qsl[-1] - 1)
            sample_ids.append(s.seq_id)
        table[i, :len(s.blocks)] = s.blocks
        s.done = end
    return StepPlan(step_id=step_id, input_ids=np.array(ids, np.int64), positions=np.array(pos, np.int64),
                    slot_mapping=np.array(slots, np.int64), query_start_loc=np.array(qsl, np.int32),
                    seq_lens=np.array(lens, np.int32), block_tables=table,
                    seq_ids=np.array([s.seq_id for s in seqs], np.int64), logits_indices=np.array(rows, np.int64),
                    sample_seq_ids=np.array(sample_ids, np.int64), new_seqs=[s.new for s in new],
                    block_copies=np.zeros((0, 2), np.int64) if copies is None else np.array(copies, np.int64))
