"""Step plans built by hand for a ``ModelRunner`` (the scheduler's side of the contract).

``Seq`` is a sequence on fixed blocks; ``make_plan`` computes every not-yet-computed token of
each sequence and samples its last one; ``finish_plan`` only ends sequences. Blocks hold ``BS``
tokens (the engine's default block size). ``CASE_A`` is golden case "a" of
tests/data/smollm2_135m.json (the default model's prompt and its greedy tokens).
"""

import json

import numpy as np

from folio.runtime.common.step import NewSequence, StepPlan
from support import GOLDEN_PATH

CASE_A = next(c for c in json.loads(GOLDEN_PATH.read_text(encoding="utf-8"))["greedy_cases"] if c["id"] == "a")
BS = 16


class Seq:
    """A hand-rolled sequence on fixed blocks (what the scheduler would track)."""

    def __init__(self, seq_id, prompt, blocks, params, seed=None):
        self.seq_id, self.tokens, self.blocks = seq_id, list(prompt), list(blocks)
        self.num_computed = 0
        self.new = NewSequence(seq_id, list(prompt), [], params.to_dict(), seed, [2])


def make_plan(step_id, seqs, new=(), finished=(), copies=None):
    """One step: each seq computes all its not-yet-computed tokens and samples its last one."""
    ids, pos, slots, qsl, lens, rows = [], [], [], [0], [], []
    width = max(len(s.blocks) for s in seqs)
    table = np.zeros((len(seqs), width), dtype=np.int32)
    for i, s in enumerate(seqs):
        p = np.arange(s.num_computed, len(s.tokens))
        ids += s.tokens[s.num_computed:]
        pos += p.tolist()
        slots += (np.asarray(s.blocks)[p // BS] * BS + p % BS).tolist()
        qsl.append(qsl[-1] + len(p))
        lens.append(len(s.tokens))
        rows.append(qsl[-1] - 1)
        table[i, :len(s.blocks)] = s.blocks
        s.num_computed = len(s.tokens)
    return StepPlan(step_id=step_id, input_ids=np.array(ids, np.int64), positions=np.array(pos, np.int64),
                    slot_mapping=np.array(slots, np.int64), query_start_loc=np.array(qsl, np.int32),
                    seq_lens=np.array(lens, np.int32), block_tables=table,
                    seq_ids=np.array([s.seq_id for s in seqs], np.int64), logits_indices=np.array(rows, np.int64),
                    sample_seq_ids=np.array([s.seq_id for s in seqs], np.int64), new_seqs=[s.new for s in new],
                    finished_seq_ids=list(finished),
                    block_copies=np.zeros((0, 2), np.int64) if copies is None else np.array(copies, np.int64))


def finish_plan(step_id, seq_ids):
    """A step that computes nothing and ends ``seq_ids``."""
    e64, e32 = np.zeros(0, np.int64), np.zeros(0, np.int32)
    return StepPlan(step_id, e64, e64, e64, np.zeros(1, np.int32), e32, np.zeros((0, 1), np.int32), e64, e64, e64,
                    finished_seq_ids=list(seq_ids))

