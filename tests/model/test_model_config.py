"""config.json parsing and safetensors weight loading (single, sharded, bf16/fp16/fp32)."""

import json

import numpy as np
import pytest
import safetensors
from safetensors.numpy import save_file

from folio.model.config import ModelConfig
from folio.model.weights import dummy_weights, load_weights, weight_shapes

LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}

# a tiny Llama 3-style config: GQA 4:2, head_dim != hidden/heads, llama3 rope scaling, untied lm_head
TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 48, "intermediate_size": 80,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 100, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 256,
    "bos_token_id": 1, "eos_token_id": [2, 3],
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 64},
}


def test_llama31_8b_config():
    cfg = ModelConfig.from_dict(LLAMA31_8B)
    assert cfg.kv_bytes_per_token(2) == 131072
    assert cfg.kv_bytes_per_token(4) == 2 * 131072
    assert cfg.eos_token_ids == [128001, 128008, 128009]
    assert cfg.rope_scaling == LLAMA31_8B["rope_scaling"]
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.tie_word_embeddings) == (128, 8, False)
    assert cfg.num_parameters == 8_030_261_248  # Llama 3.1 8B's published parameter count
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_defaults_and_int_eos():
    d = {k: v for k, v in LLAMA31_8B.items() if k not in ("head_dim", "tie_word_embeddings", "rope_scaling")}
    d["eos_token_id"] = 7
    cfg = ModelConfig.from_dict(d)
    assert cfg.head_dim == 4096 // 32
    assert cfg.tie_word_embeddings is False  # HF LlamaConfig default
    assert cfg.rope_scaling is None
    assert cfg.eos_token_ids == [7]


@pytest.mark.parametrize("change, match", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "unsupported architecture"),
    ({"architectures": None, "model_type": "gpt2"}, "unsupported model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),
])
def test_unsupported_configs_are_clear_errors(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict({**LLAMA31_8B, **change})


def test_missing_key_is_named():
    d = dict(LLAMA31_8B)
    del d["intermediate_size"]
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelConfig.from_dict(d)


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even (independent of the loader's widening)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _save_bf16(tensors: dict, path) -> None:
    """Write bf16 safetensors with the ``safetensors`` package (API of 0.4-0.7 and of >= 0.8)."""
    bits = {k: np.ascontiguousarray(_to_bf16_bits(v)) for k, v in tensors.items()}
    if hasattr(safetensors, "TensorSpec"):
        specs = {k: safetensors.TensorSpec(dtype="bfloat16", shape=list(b.shape), data_ptr=b.ctypes.data,
                                           data_len=b.nbytes) for k, b in bits.items()}
    else:
        specs = {k: {"dtype": "BF16", "shape": list(b.shape), "data": b.tobytes()} for k, b in bits.items()}
    safetensors.serialize_file(specs, str(path), metadata={"format": "pt"})


def _write_tiny_sharded(folder, weights, extra=None):
    """Two bf16 shards + index, as Hugging Face writes sharded checkpoints."""
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, part in shards.items():
        _save_bf16({n: weights[n] for n in part}, folder / fname)
    index = {"metadata": {"total_size": 0}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps({**TINY, **(extra or {})}))


def test_tiny_llama3_bf16_sharded_loads_exact_values(tmp_path):
    cfg = ModelConfig.from_dict(TINY)
    rng = np.random.default_rng(0)
    weights = {n: rng.standard_normal(s).astype(np.float32) for n, s in weight_shapes(cfg).items()}
    assert "lm_head.weight" in weights
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)  # extra: ignored
    _write_tiny_sharded(tmp_path, weights)

    cfg2 = ModelConfig.from_pretrained(tmp_path)
    assert cfg2 == cfg and cfg2.rope_scaling["rope_type"] == "llama3" and cfg2.eos_token_ids == [2, 3]
    loaded = load_weights(tmp_path, cfg2)
    assert set(loaded) == set(weight_shapes(cfg))
    for name, arr in loaded.items():
        assert arr.dtype == np.float32 and arr.flags.c_contiguous
        expect = (_to_bf16_bits(weights[name]).astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_array_equal(arr, expect, err_msg=name)
        np.testing.assert_allclose(arr, weights[name], rtol=2 ** -8)
    # for a bf16 device: the stored bits as they are (no float32 round trip on the host)
    raw = load_weights(tmp_path, cfg2, keep_bf16=True)
    for name, arr in raw.items():
        assert arr.dtype == np.uint16 and arr.flags.c_contiguous
        np.testing.assert_array_equal(arr, _to_bf16_bits(weights[name]), err_msg=name)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_single_file_fp32_fp16_and_tied(tmp_path, dtype):
    cfg = ModelConfig.from_dict({**TINY, "tie_word_embeddings": True})
    weights = dummy_weights(cfg, seed=3)
    assert "lm_head.weight" not in weights
    save_file({n: w.astype(dtype) for n, w in weights.items()}, str(tmp_path / "model.safetensors"))
    loaded = load_weights(tmp_path, cfg)
    for name, w in weights.items():
        np.testing.assert_array_equal(loaded[name], w.astype(dtype).astype(np.float32))


def test_missing_tensor_is_named(tmp_path):
    cfg = ModelConfig.from_dict(TINY)
    weights = dummy_weights(cfg, seed=1)
    del weights["model.layers.1.mlp.up_proj.weight"], weights["lm_head.weight"]
    _write_tiny_sharded(tmp_path, weights)
    with pytest.raises(ValueError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight") as e:
        load_weights(tmp_path, cfg)
    assert "lm_head.weight" in str(e.value)


def test_wrong_shape_and_no_weights_are_clear_errors(tmp_path):
    cfg = ModelConfig.from_dict(TINY)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_weights(tmp_path, cfg)
    weights = dummy_weights(cfg, seed=1)
    weights["model.norm.weight"] = np.ones(47, np.float32)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \[47\]"):
        load_weights(tmp_path, cfg)


def test_dummy_weights_shapes_and_determinism():
    cfg = ModelConfig.from_dict(TINY)
    a, b, c = dummy_weights(cfg, 5), dummy_weights(cfg, 5), dummy_weights(cfg, 6)
    assert {n: w.shape for n, w in a.items()} == weight_shapes(cfg)
    assert sum(w.size for w in a.values()) == cfg.num_parameters
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert not np.array_equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert all(w.dtype == np.float32 for w in a.values())


def test_bf16_checkpoint_stays_16_bit_on_cpu(tmp_path):
    # --dtype auto on the CPU: bf16 matrices served as BF16 (half of float32's bytes), the same
    # values as the float32 load; norms float32; --dtype float32 widens everything
    from folio.kernels.quant_reference import QuantizedWeight
    from folio.model.loader import load_model, serves_quantized

    cfg = ModelConfig.from_dict(TINY)
    rng = np.random.default_rng(1)
    weights = {n: rng.standard_normal(s).astype(np.float32) for n, s in weight_shapes(cfg).items()}
    _write_tiny_sharded(tmp_path, weights)
    widened = load_weights(tmp_path, cfg)
    kept = load_weights(tmp_path, cfg, keep_16bit=True)
    for name, w in kept.items():
        if widened[name].ndim == 2:
            assert isinstance(w, QuantizedWeight) and w.type_name == "BF16" and w.nbytes == widened[name].nbytes // 2
            np.testing.assert_array_equal(w.dequantize(), widened[name], err_msg=name)
        else:
            assert w.dtype == np.float32
            np.testing.assert_array_equal(w, widened[name], err_msg=name)
    assert serves_quantized(str(tmp_path)) and not serves_quantized(str(tmp_path), dtype="float32")
    model, _, _ = load_model(str(tmp_path), device="cpu")
    assert isinstance(model.lm_head, QuantizedWeight)
    model32, _, _ = load_model(str(tmp_path), device="cpu", dtype="float32")
    assert model32.weight_bytes() > 1.9 * model.weight_bytes()
