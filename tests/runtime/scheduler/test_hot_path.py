"""The per-step hot path's incremental state equals what it replaces.

* ``KVCacheManager.block_table``: after any sequence of allocate / copy-on-write / fork / free, the
  row of every live sequence is exactly its block ids padded with 0, and rows are not shared.
* The detokenizer's single-token text cache (sliding-window path) and its token byte table
  (byte-level path), shared between sequences as the engine shares them, give the same text as
  private ones and as a full decode.
"""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from folio.model.tokenizer import Tokenizer
from folio.runtime.scheduler.detokenizer import IncrementalDetokenizer
from folio.runtime.common.sampling_params import SamplingParams
from support.kv_cache_harness import OPS, Harness


def assert_rows_match(h: Harness) -> None:
    kv = h.kv
    live = [s for s in h.live if s.seq_id in kv.seq_blocks and kv.seq_blocks[s.seq_id]]
    rows = kv.block_table_rows([s.seq_id for s in live]).tolist()
    assert len(set(rows)) == len(rows), "two sequences share a block-table row"
    for seq, row in zip(live, rows):
        ids = kv.get_block_ids(seq)
        assert kv.block_table[row, :len(ids)].tolist() == ids
        assert not kv.block_table[row, len(ids):].any(), "padding must be 0"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, num_blocks=st.integers(6, 40))
def test_block_table_rows_follow_every_operation(ops, num_blocks):
    h = Harness(num_blocks)
    for kind, a, b in ops:
        h.op(kind, a, b)
        assert_rows_match(h)
    for seq in list(h.live):
        h.kv.free(seq)
    assert not h.kv.block_table.any()


def test_block_table_grows_rows_and_columns():
    h = Harness(400)
    for i in range(40):  # more sequences than the initial 16 rows, longer than the initial 16 columns
        h.op("new", i, 12)
    for _ in range(25):
        for i in range(3):
            h.op("compute", i, 12)
    assert h.kv.block_table.shape[0] >= 40 and h.kv.block_table.shape[1] > 16
    assert_rows_match(h)


def test_shared_single_token_cache_gives_the_same_text(default_model_dir):
    tok = Tokenizer.from_pretrained(default_model_dir)
    texts = ["héllo 😀 世界 ok", "日本語のテキスト 🎉🎉 naïve café", "The answer is: 42."]
    prompt = tok.encode("Say:")
    shared: dict[int, str] = {}
    for skip in (True, False):
        params = SamplingParams(skip_special_tokens=skip)
        for text in texts + texts:  # the second round reads what the first cached
            ids = tok.encode(text)
            a = IncrementalDetokenizer(tok, prompt, params, token_text_cache=shared.setdefault(skip, {}),
                                       byte_level=False)
            b = IncrementalDetokenizer(tok, prompt, params, byte_level=False)
            for t in ids:
                a.update([t])
                b.update([t])
                assert a.output_text == b.output_text
            assert a.finish() == b.finish() == tok.decode(ids, skip_special_tokens=skip)


def test_shared_token_bytes_give_the_same_text(default_model_dir):
    from folio.runtime.scheduler.detokenizer import TokenBytes
    tok = Tokenizer.from_pretrained(default_model_dir)
    prompt = tok.encode("Say:")
    for skip in (True, False):
        shared = TokenBytes(tok.hf, skip)
        params = SamplingParams(skip_special_tokens=skip)
        for text in ["héllo 😀 世界 ok", "日本語のテキスト 🎉🎉 naïve café"] * 2:
            ids = tok.encode(text)
            a = IncrementalDetokenizer(tok, prompt, params, token_bytes=shared)
            b = IncrementalDetokenizer(tok, prompt, params)
            assert "".join(a.add_token(t) for t in ids) == "".join(b.add_token(t) for t in ids) == text
            assert a.finish() == b.finish() == tok.decode(ids, skip_special_tokens=skip)
