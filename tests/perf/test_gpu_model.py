"""perf/gpu_model.py's arithmetic on one tiny shape, against figures worked out by hand here.

The shape: hidden 8, intermediate 16, one layer, 2 query heads and 1 KV head of 4 dims, a
32-token vocabulary; bf16 weights and KV (2 bytes), float32 activations (4 bytes)."""

from __future__ import annotations

import pytest

from perf.gpu_model import CARDS, Card, Shape, card_for, ideal_step_seconds, schedule, step_kernels, workload_bound

TINY = Shape(hidden=8, intermediate=16, layers=1, heads=2, kv_heads=1, head_dim=4, vocab=32)
UNIT = Card("unit", "1 B/s, 1 FLOP/s", 1.0, 1.0, 1, "none")


def by_name(kernels):
    return {k.name: k for k in kernels}


def test_weights_and_kv_bytes():
    # q/k/v width (2 + 2) * 4 = 16; products 8x16 + 8x8 + 8x32 + 16x8 = 576 elements, norms 2 x 8;
    # final norm 8, lm_head 32 x 8 = 256: 2 bytes x (592 + 8 + 256)
    assert TINY.qkv == 16
    assert TINY.weight_bytes_per_step() == 2 * 856
    assert TINY.kv_bytes_per_token() == 2 * 1 * 1 * 4 * 2  # K and V, 1 layer, 1 head, 4 dims, bf16


def test_decode_step_kernels():
    # two sequences, one new token each, contexts 3 and 5 after the step
    k = by_name(step_kernels(TINY, [1, 1], [3, 5], 2))
    q = k["qkv_proj"]  # weight 8x16 bf16, 2 rows in (bf16), 2 rows out (float32); 2 * 2 * 8 * 16 FLOPs
    assert (q.bytes, q.flops) == (256 + 32 + 128, 512)
    a = k["paged_attention decode"]
    # K and V of 8 context tokens (1 head x 4 dims x 2 bytes each), one int32 block-table entry per
    # sequence (16-token blocks), q in and out (2 tokens x 2 heads x 4 dims x 2 bytes each)
    assert a.bytes == 2 * 8 * 8 + 2 * 4 + 2 * 32
    assert a.flops == 4 * 2 * 4 * 8           # q.k and p.v: 2 FLOPs a product, 2 heads x 4 dims x 8 keys
    assert k["lm_head"].flops == 2 * 2 * 8 * 32
    assert k["sample"].bytes == 2 * 32 * 4 + 2 * 32  # one pass over 2 x 32 float32 logits
    # FLOPs 512 + 256 (o) + 1024 (gate_up) + 512 (down) + 256 (attention) + 1024 (lm_head) = 3584;
    # bytes 1712 of weights + 16 x (8 read + 2 written) of KV = 1872: on 1 B/s and 1 FLOP/s the
    # FLOPs bound it
    assert ideal_step_seconds(TINY, [1, 1], [3, 5], 2, UNIT) == pytest.approx(3584)
    fast_flops = Card("u", "", 1.0, 1e9, 1, "")
    assert ideal_step_seconds(TINY, [1, 1], [3, 5], 2, fast_flops) == pytest.approx(1872, rel=1e-5)


def test_prefill_attention_is_causal():
    # one sequence: 4 new tokens after 1 cached; token j (position 1 + j) sees 2 + j keys: 14 in
    # all; one tile (64 rows / group 2 = 32 tokens) reads the 5 keys its last token sees
    a = by_name(step_kernels(TINY, [4], [5], 1))["paged_attention prefill"]
    assert a.flops == 4 * 2 * 4 * 14
    assert a.bytes == 2 * 5 * 8 + 2 * 4 * 2 * 4 * 2


def test_schedule_prefills_in_chunks_then_decodes():
    # prompts 3 and 5, outputs 2 and 3, 4 tokens a step: [3 of A, 1 of B], [4 of B], then decode
    # step 1 (both: contexts 3 + 1, 5 + 1) and step 2 (B only: 5 + 2)
    steps = list(schedule([(3, 2), (5, 3)], max_num_batched_tokens=4))
    assert steps == [([3, 1], [3, 1], 1), ([4], [5], 1), ([1, 1], [4, 6], 2), ([1], [7], 1)]
    wb = workload_bound(TINY, [(3, 2), (5, 3)], UNIT, max_num_batched_tokens=4)
    assert (wb["prefill_steps"], wb["decode_steps"], wb["output_tokens"]) == (2, 2, 5)
    assert wb["ideal"]["seconds"] == pytest.approx(sum(ideal_step_seconds(TINY, *s, UNIT) for s in steps))


def test_cards_come_from_the_data_sheets():
    # dense bf16 is half the data sheets' with-sparsity 1,979 TFLOPS; HBM 3.35 and 4.8 TB/s
    assert CARDS["h100-sxm"].bf16_flops == CARDS["h200"].bf16_flops == pytest.approx(989.5e12)
    assert (CARDS["h100-sxm"].hbm_bytes_per_s, CARDS["h200"].hbm_bytes_per_s) == (3.35e12, 4.8e12)
    assert card_for("NVIDIA H200, 143771 MiB, 580.159.04") is CARDS["h200"]
    assert card_for("NVIDIA H100 80GB HBM3, 81559 MiB") is CARDS["h100-sxm"]
    assert card_for("NVIDIA H100 PCIe, 81559 MiB") is None
