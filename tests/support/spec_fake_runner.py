"""A fake worker for speculative decoding: a simulated KV cache of token ids and a target "model"
whose next token is a fixed function of the history, verifying drafts as the real worker does.

``SpecFakeExecutor`` (a ``StepRunner``) writes every input token at its slot (drafts included),
performs the plan's block copies, and checks that each sequence reads back through its block
table exactly its history, followed in a verifying step by the drafts it is verifying. For a
sampled row with ``d`` drafts it computes the target after the history and after each draft
prefix (``target_token``), accepts the drafts while they agree, and answers the token after the
accepted ones with ``num_accepted_tokens``. The target mostly repeats the token ``PERIOD`` places
back (so n-gram lookup proposes it) and every few positions departs from it (so some drafts are
rejected): the outputs of any scheduling path must be those of ``expected_tokens``, a plain loop.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from folio.runtime.common.step import PLACEHOLDER_TOKEN_ID, StepResult

V = 50
EOS = 0
PERIOD = 7


def target_token(history) -> int:
    """The target's greedy next token after ``history`` (never EOS): the token ``PERIOD``
    places back, except at positions where a hash of the length says to depart from it."""
    n = len(history)
    if n >= PERIOD and (n * 2654435761) % 13 > 2:
        return int(history[n - PERIOD])
    return (sum(history) * 31 + n) % (V - 1) + 1


def expected_tokens(prompt, max_tokens) -> list[int]:
    """What greedy decoding of ``prompt`` gives, one token at a time."""
    h = list(prompt)
    for _ in range(max_tokens):
        h.append(target_token(h))
    return h[len(prompt):]


class FakeTokenizer:
    """Letters: token ``t`` is ``chr(ord('a') + t - 1)``; 0 is EOS."""

    eos_token_ids = [EOS]
    all_special_ids = {EOS}

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - ord("a") + 1 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + int(t) - 1) for t in ids if not (skip_special_tokens and t == EOS))


class SpecFakeExecutor:
    """See the module docstring.

    Attributes:
        cache: ``[num_blocks, block_size]`` int64, the token id written at each slot (-1: none).
        plans: every plan run; accepted: for each, the drafts accepted per sampled row.
        fail_step: the first step with drafts from this step id on answers an error (then
            this is cleared).
        target: the next-token function (``target_token`` by default).
    """

    def __init__(self, num_blocks: int, block_size: int, max_len: int = 512, target=target_token):
        self.target = target
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model_config = SimpleNamespace(vocab_size=V, max_position_embeddings=max_len, eos_token_ids=[EOS])
        self.cache = np.full((num_blocks, block_size), -1, dtype=np.int64)
        self.history: dict[int, list[int]] = {}
        self.plans = []
        self.accepted = []   # per plan: the drafts accepted per sampled row
        self.fail_step: int | None = None

    def execute(self, plan):
        self.plans.append(plan)
        if self.fail_step is not None and plan.step_id >= self.fail_step and len(plan.num_draft_tokens):
            self.fail_step = None
            self.accepted.append([])
            return StepResult(plan.step_id, np.zeros(0, np.int64), error="RuntimeError: injected")
        bs = self.block_size
        for sid in plan.finished_seq_ids:
            self.history.pop(int(sid), None)
        for ns in plan.new_seqs:
            self.history[ns.seq_id] = list(ns.prompt_token_ids) + list(ns.output_token_ids)
        for src, dst in plan.block_copies:
            self.cache[dst] = self.cache[src]
        slots = np.asarray(plan.slot_mapping)
        assert slots.min() >= 0 and len(set(slots.tolist())) == len(slots), "a slot written twice"
        nd = np.asarray(plan.num_draft_tokens, dtype=np.int64)
        drafts_of = {}
        sampled = [int(s) for s in plan.sample_seq_ids]
        for r, sid in enumerate(sampled):
            if len(nd) and nd[r]:
                li = int(plan.logits_indices[r])
                drafts_of[sid] = [int(t) for t in plan.input_ids[li - nd[r] + 1:li + 1]]
        ids = np.array(plan.input_ids)
        for i, sid in enumerate(plan.seq_ids.tolist()):
            hist = self.history[sid]
            a, b = int(plan.query_start_loc[i]), int(plan.query_start_loc[i + 1])
            drafts = drafts_of.get(sid, [])
            known = b - a - len(drafts)
            for j in range(a, a + known):
                p = int(plan.positions[j])
                if ids[j] == PLACEHOLDER_TOKEN_ID:
                    assert p == len(hist) - 1 and j == b - 1 and not drafts, "a placeholder that is not the last input"
                    ids[j] = hist[p]
                assert ids[j] == hist[p], f"seq {sid} input at {p} is not its token"
            assert int(plan.positions[b - 1]) + 1 == int(plan.seq_lens[i])
            if drafts:
                assert int(plan.positions[a + known - 1]) == len(hist) - 1, "drafts must follow the last token"
        self.cache[slots // bs, slots % bs] = ids
        for i, sid in enumerate(plan.seq_ids.tolist()):
            ctx = np.arange(int(plan.seq_lens[i]))
            read = self.cache[plan.block_tables[i][ctx // bs], ctx % bs].tolist()
            want = (self.history[sid] + drafts_of.get(sid, []))[:len(ctx)]
            assert read == want, f"seq {sid} reads a wrong context"
        out, accepted = [], []
        for sid in sampled:
            hist = self.history[sid]
            drafts = drafts_of.get(sid, [])
            a = 0
            while a < len(drafts) and drafts[a] == self.target(hist + drafts[:a]):
                a += 1
            emitted = drafts[:a] + [self.target(hist + drafts[:a])]
            hist.extend(emitted)
            out.append(emitted[-1])
            accepted.append(a)
        self.accepted.append(accepted)
        result = StepResult(plan.step_id, np.asarray(out, dtype=np.int64))
        if len(nd):
            result.num_accepted_tokens = np.asarray(accepted, dtype=np.int64)
        return result

    def shutdown(self):
        pass
