"""A fake executor over a token-id function (no model), its tokenizer, and an engine that records.

``FakeExecutor`` keeps a simulated KV cache of token ids: it performs the plan's block copies,
writes every input token at its slot, and checks that each sequence's context read back through
its block table is exactly the tokens it has seen for that sequence (prompt + sampled). The token
it "samples" is ``next_token`` of that whole history (and the seed), so any scheduling path -
batched, chunked, preempted, forked, prefix-cached - must produce the tokens of a plain loop
(``expected``). Token ids are 1..V-1 (``prompt``); ``EOS`` is 0 and never sampled.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from folio.runtime.common.outputs import RequestOutput
from folio.runtime.common.step import PLACEHOLDER_TOKEN_ID, StepResult
from folio.runtime.scheduler.engine import LLMEngine

V = 50
EOS = 0


def next_token(history, seed):
    return (sum(history) * 31 + len(history) + (seed or 0)) % (V - 1) + 1  # never EOS


def expected(prompt, max_tokens, seed=None):
    h = list(prompt)
    for _ in range(max_tokens):
        h.append(next_token(h, seed))
    return h[len(prompt):]


class FakeTokenizer:
    eos_token_ids = [EOS]
    all_special_ids = {EOS}

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - ord("a") + 1 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + int(t) - 1) for t in ids if not (skip_special_tokens and t == EOS))


class FakeExecutor:
    def __init__(self, num_blocks, block_size, max_len=256):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model_config = SimpleNamespace(vocab_size=V, max_position_embeddings=max_len, eos_token_ids=[EOS])
        self.cache = np.full((num_blocks, block_size), -1, dtype=np.int64)
        self.history: dict[int, list[int]] = {}
        self.seeds: dict[int, int | None] = {}
        self.plans = []

    def execute(self, plan):
        self.plans.append(plan)
        bs = self.block_size
        for ns in plan.new_seqs:
            assert ns.seq_id not in self.history
            self.history[ns.seq_id] = list(ns.prompt_token_ids) + list(ns.output_token_ids)
            self.seeds[ns.seq_id] = ns.seed
        for src, dst in plan.block_copies:
            self.cache[dst] = self.cache[src]
        assert plan.slot_mapping.min() >= 0
        assert len(set(plan.slot_mapping.tolist())) == len(plan.slot_mapping), "two tokens, one slot"
        input_ids = np.array(plan.input_ids)
        for i, sid in enumerate(plan.seq_ids):
            hist = self.history[int(sid)]
            a, b = plan.query_start_loc[i], plan.query_start_loc[i + 1]
            pos = plan.positions[a:b]
            assert pos[-1] + 1 == plan.seq_lens[i]
            for j, p in zip(range(a, b), pos):
                if input_ids[j] == PLACEHOLDER_TOKEN_ID:
                    # overlap scheduling: the token this sequence sampled in the previous step
                    assert p == len(hist) - 1 and j == b - 1, "a placeholder that is not the last sample"
                    input_ids[j] = hist[p]
            assert list(input_ids[a:b]) == [hist[p] for p in pos]
        self.cache[plan.slot_mapping // bs, plan.slot_mapping % bs] = input_ids
        for i, sid in enumerate(plan.seq_ids):
            hist = self.history[int(sid)]
            ctx = np.arange(plan.seq_lens[i])
            read = self.cache[plan.block_tables[i][ctx // bs], ctx % bs]
            assert list(read) == hist[:plan.seq_lens[i]], f"seq {sid} reads a wrong context"
        out = []
        for row, sid in zip(plan.logits_indices, plan.sample_seq_ids):
            sid = int(sid)
            i = list(plan.seq_ids).index(sid)
            assert row == plan.query_start_loc[i + 1] - 1
            assert plan.seq_lens[i] == len(self.history[sid])
            t = next_token(self.history[sid], self.seeds[sid])
            self.history[sid].append(t)
            out.append(t)
        for sid in plan.finished_seq_ids:
            del self.history[sid]
        return StepResult(step_id=plan.step_id, sampled_token_ids=np.asarray(out, dtype=np.int64))

    def shutdown(self):
        pass


class RecordingEngine(LLMEngine):
    """An ``LLMEngine`` that keeps every delta it returned (``deltas[request_id]``)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.deltas: dict[str, list] = {}

    def step(self, block=True):
        out = super().step(block)
        for d in out:
            self.deltas.setdefault(d.request_id, []).append(d)
        return out

    def final(self, request_id):
        """The cumulative output of a finished request."""
        out = RequestOutput.from_deltas(self.deltas[request_id])
        assert out.finished
        return out


def prompt(n, salt=0):
    return [(i * 7 + salt) % (V - 1) + 1 for i in range(n)]

