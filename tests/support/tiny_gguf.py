"""Tiny synthetic GGUF files: a 2-layer Llama with mixed tensor types and a small byte-level BPE
vocabulary, written with gguf-py, and the Hugging Face float32 weights they must import to.

``write_tiny_gguf`` writes the file and returns those weights; the dimensions (``H``, ``HEADS``,
``KV``, ``D``, ``FF``, ``LAYERS``) and ``tiny_vocab`` are what the file declares.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from tokenizers import pre_tokenizers

from folio.kernels.reference import rope_inv_freq

H, HEADS, KV, D, FF, LAYERS = 64, 4, 2, 16, 256, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "1 2", "Ġ 1"]


def tiny_vocab():
    """``(tokens, token types)``: the specials, the byte-level alphabet and the merged pieces."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merged = [m.replace(" ", "") for m in MERGES]
    tokens = SPECIALS + alphabet + merged
    types = [3] * len(SPECIALS) + [1] * (len(alphabet) + len(merged))
    return tokens, types


def _permute(w, n_heads):
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (HF rotate_half -> adjacent pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def _q4_k_bytes(rng, rows, cols):
    """Random but valid Q4_K blocks (gguf-py has no Q4_K quantizer): f16 d/dmin, random scales/nibbles."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[Q.Q4_K]
    raw = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    raw[:, :, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    raw[:, :, 2:4] = np.frombuffer(np.float16(0.005).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def write_tiny_gguf(path, *, pre="smollm", tok_model="gpt2", tied=True, rope_scaling=None, add_bos=False, seed=0,
                    qk_type=None):
    """A 2-layer Llama GGUF with mixed tensor types (q F32 and k F16, or both ``qk_type``).
    Returns (expected HF float32 weights, config)."""
    rng = np.random.default_rng(seed)
    tokens, types = tiny_vocab()
    vocab = len(tokens)
    theta = 500000.0
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_rope_dimension_count(D)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model(tok_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")
    expect = {}

    def put(gname, hfname, arr, qtype=Q.F32):
        if qtype == Q.F32:
            w.add_tensor(gname, arr.astype(np.float32))
            expect[hfname] = arr.astype(np.float32)
        elif qtype == Q.F16:
            w.add_tensor(gname, arr.astype(np.float16))
            expect[hfname] = arr.astype(np.float16).astype(np.float32)
        else:
            data = gguf.quants.quantize(arr.astype(np.float32), qtype)
            w.add_tensor(gname, data, raw_dtype=qtype)
            expect[hfname] = gguf.quants.dequantize(data, qtype).reshape(arr.shape)

    put("token_embd.weight", "model.embed_tokens.weight", rng.standard_normal((vocab, H)), Q.Q8_0)
    if rope_scaling:
        freqs = rope_inv_freq(D, theta, None) / rope_inv_freq(D, theta, rope_scaling)
        w.add_tensor("rope_freqs.weight", freqs.astype(np.float32))
    for i in range(LAYERS):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        put(b + "attn_norm.weight", p + "input_layernorm.weight", 1 + 0.1 * rng.standard_normal(H))
        q = rng.standard_normal((HEADS * D, H)).astype(np.float32)
        k = rng.standard_normal((KV * D, H)).astype(np.float32)
        if qk_type is None:
            w.add_tensor(b + "attn_q.weight", _permute(q, HEADS))  # F32: the permutation is checked exactly
            w.add_tensor(b + "attn_k.weight", _permute(k, KV).astype(np.float16))
            expect[p + "self_attn.q_proj.weight"] = q
            expect[p + "self_attn.k_proj.weight"] = k.astype(np.float16).astype(np.float32)
        else:   # blocks lie within rows: quantizing the permuted rows permutes the quantized ones
            for gname, hfname, m, n in (("attn_q", "q_proj", q, HEADS), ("attn_k", "k_proj", k, KV)):
                w.add_tensor(b + gname + ".weight", gguf.quants.quantize(_permute(m, n), qk_type), raw_dtype=qk_type)
                expect[p + f"self_attn.{hfname}.weight"] = \
                    gguf.quants.dequantize(gguf.quants.quantize(m, qk_type), qk_type).reshape(m.shape)
        put(b + "attn_v.weight", p + "self_attn.v_proj.weight", rng.standard_normal((KV * D, H)), Q.Q4_0)
        put(b + "attn_output.weight", p + "self_attn.o_proj.weight", rng.standard_normal((H, HEADS * D)), Q.Q4_1)
        put(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", 1 + 0.1 * rng.standard_normal(H))
        put(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", rng.standard_normal((FF, H)), Q.BF16)
        put(b + "ffn_up.weight", p + "mlp.up_proj.weight", rng.standard_normal((FF, H)), Q.F16)
        raw = _q4_k_bytes(rng, H, FF)
        w.add_tensor(b + "ffn_down.weight", raw, raw_dtype=Q.Q4_K)
        expect[p + "mlp.down_proj.weight"] = gguf.quants.dequantize(raw, Q.Q4_K).reshape(H, FF)
    put("output_norm.weight", "model.norm.weight", 1 + 0.1 * rng.standard_normal(H))
    if not tied:
        put("output.weight", "lm_head.weight", rng.standard_normal((vocab, H)), Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expect
