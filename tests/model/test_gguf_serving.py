"""Weights served in their stored types on the CPU: GGUF files read in place, 16-bit and quantized
weights through the fused forward, and the errors a bad file gives.

The expectations are independent of the kernels under test: the dense float64 Llama of
``support.llama_forward.dense_llama_logits`` on the *dequantized* weights (``quant_reference.dequantize``, itself
bit-exact with gguf-py, tests/kernels/test_quant_reference.py), and the files' own values as gguf-py reads
them (``support.tiny_gguf.write_tiny_gguf``).
"""

from __future__ import annotations

import copy
import json
import pickle

import gguf
import numpy as np
import pytest

from folio.kernels import get_kernels
from folio.kernels import quant_reference as qr
from folio.model import loader
from folio.model.config import ModelConfig
from folio.model.gguf_weights import gguf_source, load_gguf_weights
from folio.model.llama import LlamaForCausalLM
from folio.model.quantize import quantize_weights
from folio.model.registry import resolve_model
from folio.runtime.common.config import DEFAULT_MODEL, EngineConfig
from folio.model.weights import dummy_weights
from support.quant_cases import random_weight
from support.llama_forward import dense_llama_logits, run_paged, tiny_atol
from support.tiny_gguf import write_tiny_gguf

# every matrix's K (256, 512) a whole number of k-quant super-blocks
SMALL = dict(vocab_size=97, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, rope_theta=10000.0, rms_norm_eps=1e-5,
             max_position_embeddings=256, tie_word_embeddings=False)
# types with a quantizer in quant_reference (values: the float weights rounded to the type)
QUANTIZED = ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K")
# types without one: random blocks with binary16 fields small enough that every value stays under
# ~0.5 (Q5_K: d * sc * q with sc < 64, q < 32; Q6_K: d * sc * (q - 32) with |sc| < 128, |q - 32| <= 32)
RANDOM_BLOCKS = {"Q5_K": 2e-4, "Q6_K": 1e-4}


def _weights_of_type(config, name: str, seed: int = 3):
    """``(stored, dequantized)``: the model's matrices in GGUF type ``name`` (``QuantizedWeight``) and
    the float32 values they hold; norms float32 in both."""
    rng = np.random.default_rng(seed)
    stored, values = {}, {}
    for key, w in dummy_weights(config, seed=seed).items():
        if w.ndim == 1:
            stored[key] = values[key] = w
            continue
        q = qr.quant_type(name)
        if name in RANDOM_BLOCKS:
            data = random_weight(q, w.shape[0], w.shape[1], rng, scale=RANDOM_BLOCKS[name])
        else:   # larger weights than the 0.02 initializer so that attention is not flat (as test_forward)
            data = qr.quantize(w * 10, q.id)
        qw = qr.QuantizedWeight(data, q.id, w.shape)
        stored[key], values[key] = qw, qw.dequantize()
    return stored, values


@pytest.fixture(autouse=True)
def _folio_home(tmp_path, monkeypatch):
    # imports of the test's files go under the test's own folder
    monkeypatch.setenv("FOLIO_HOME", str(tmp_path / "home"))


@pytest.mark.parametrize("name", QUANTIZED + tuple(RANDOM_BLOCKS))
def test_each_type_forward_matches_the_float_reference_on_its_values(name):
    # whole prefill (decoded tiles + sgemm), chunks of 7 (decode-and-dot kernel) and one token at a
    # time, against the float64 forward on the dequantized weights: the same bound as the float32
    # model (llama_forward.tiny_atol), since the weights are exactly those values and only the
    # rounding of the products differs
    config = ModelConfig(**SMALL)
    stored, values = _weights_of_type(config, name)
    model = LlamaForCausalLM(config, stored, get_kernels("cpu"))
    assert model.layer_stacks["qkv_proj"].table.shape == (2, 3, 4)   # q, k, v read in place, not concatenated
    ids = np.random.default_rng(0).integers(0, config.vocab_size, size=40)
    stats = {}
    want = dense_llama_logits(config, values, ids, stats)
    atol = tiny_atol(config, want, stats)
    for chunk in (40, 7, 1):
        got = run_paged(model, config, ids, chunk, shuffle_seed=1)
        np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=f"{name}, chunks of {chunk}")


def test_mixed_types_per_layer_and_segment():
    # llama.cpp's Q4_K_M mixes types across layers and between q, k and v: each segment is read
    # in its own type
    config = ModelConfig(**SMALL)
    a, av = _weights_of_type(config, "Q4_K", seed=4)
    b, bv = _weights_of_type(config, "Q6_K", seed=5)
    c, cv = _weights_of_type(config, "Q8_0", seed=6)
    stored, values = dict(a), dict(av)
    for key in ("model.layers.0.self_attn.v_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        stored[key], values[key] = b[key], bv[key]
    for key in ("model.layers.1.self_attn.k_proj.weight", "lm_head.weight", "model.embed_tokens.weight"):
        stored[key], values[key] = c[key], cv[key]
    model = LlamaForCausalLM(config, stored, get_kernels("cpu"))
    ids = np.random.default_rng(1).integers(0, config.vocab_size, size=24)
    stats = {}
    want = dense_llama_logits(config, values, ids, stats)
    for chunk in (24, 5):
        np.testing.assert_allclose(run_paged(model, config, ids, chunk), want, rtol=0,
                                   atol=tiny_atol(config, want, stats))


@pytest.mark.parametrize("name", ["q8_0", "q4_k"])
def test_load_time_quantization(name):
    # --quantization: the float matrices become GGUF blocks of the chosen type (q4_k falls back to
    # q8_0 where rows are not whole super-blocks of 256); the model is the model of those values
    config = ModelConfig(**{**SMALL, "hidden_size": 320})   # K = 320: not whole k-quant super-blocks
    w = quantize_weights(dummy_weights(config, seed=2), name)
    types = {k: v.type_name for k, v in w.items() if isinstance(v, qr.QuantizedWeight)}
    assert len(types) == 2 + 7 * config.num_hidden_layers
    want_k = "Q8_0" if name == "q8_0" else "Q4_K"
    assert types["model.layers.0.mlp.down_proj.weight"] == want_k   # K = 512
    assert types["model.layers.0.mlp.gate_proj.weight"] == "Q8_0"   # K = 320: the fallback
    assert all(w[k].ndim == 1 for k in w if k not in types)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_weights(w, name)


def test_tiny_gguf_served_in_place(tmp_path):
    # every tensor of a mixed-type file (Q8_0 embedding, F32 q, F16 k, Q4_0 v, Q4_1 o, BF16 gate,
    # F16 up, Q4_K down) served as stored: the values are the file's own (gguf-py), q and k put
    # back in Hugging Face row order, the rest views of the mapped file
    path = tmp_path / "tiny.gguf"
    expect = write_tiny_gguf(path, tied=False)
    folder = resolve_model(path)
    assert gguf_source(folder) == path.resolve() and not (folder / "model.safetensors").exists()
    config = ModelConfig.from_pretrained(folder)
    w = load_gguf_weights(path, config)
    for name, want in expect.items():
        got = w[name]
        if got.ndim == 1:
            np.testing.assert_array_equal(got, want, err_msg=name)
            continue
        np.testing.assert_array_equal(got.dequantize(), want, err_msg=name)
        # q and k: copies in Hugging Face row order; the rest views of the mapping
        assert not got.data.flags.writeable
        assert got.data.base.flags.owndata == name.endswith(("q_proj.weight", "k_proj.weight")), name
    types = {n: w[n].type_name for n in w if w[n].ndim == 2}
    assert types["model.layers.0.mlp.down_proj.weight"] == "Q4_K" and types["lm_head.weight"] == "Q8_0"

    stored, _, _ = loader.load_model(str(path), device="cpu", activation_quantization="none")
    f32, _, _ = loader.load_model(str(path), device="cpu", dtype="float32")
    assert isinstance(stored.lm_head, qr.QuantizedWeight) and isinstance(f32.lm_head, np.ndarray)
    ids = np.random.default_rng(2).integers(0, config.vocab_size, size=30)
    stats = {}
    want = dense_llama_logits(config, expect, ids, stats)
    for model in (stored, f32):
        for chunk in (30, 4):
            np.testing.assert_allclose(run_paged(model, config, ids, chunk), want, rtol=0,
                                       atol=tiny_atol(config, want, stats))


# ----------------------------------------------------------------------------------------------
# bad files: a clear error before any model memory is allocated
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def no_allocation(monkeypatch):
    """Fail the test if a model gets as far as being built (its weights placed, buffers sized)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was built: the error came after allocation")
    monkeypatch.setattr(loader, "LlamaForCausalLM", refuse)


def _rewrite(src, dst, mutate):
    # a copy of a tiny GGUF file with its metadata or tensor infos changed by ``mutate(reader, raw)``
    raw = bytearray(src.read_bytes())
    mutate(gguf.GGUFReader(str(src)), raw)
    dst.write_bytes(bytes(raw))
    return dst


def test_truncated_file(tmp_path, no_allocation):
    good = tmp_path / "good.gguf"
    write_tiny_gguf(good)
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(good.read_bytes()[:-3000])   # the last tensors' bytes are missing
    with pytest.raises(ValueError, match="truncated"):
        loader.load_model(str(bad), device="cpu")
    head = tmp_path / "head.gguf"
    head.write_bytes(good.read_bytes()[:200])   # cut inside the metadata
    with pytest.raises(ValueError, match="truncated or corrupt"):
        loader.load_model(str(head), device="cpu")


def test_unsupported_tensor_type(tmp_path, no_allocation):
    # a Q2_K tensor (known to GGUF, not read by folio): named, with the ways out
    good = tmp_path / "good.gguf"
    write_tiny_gguf(good)
    folder = resolve_model(good)   # the import (tokenizer, config) is made from the good file

    def to_q2_k(reader, raw):
        # the tensor info: name, number of dims (u32), dims (u64 each), type id (u32), offset
        name = b"blk.1.ffn_down.weight"
        at = bytes(raw).index(name) + len(name)
        n_dims = int.from_bytes(raw[at:at + 4], "little")
        type_at = at + 4 + 8 * n_dims
        assert int.from_bytes(raw[type_at:type_at + 4], "little") == qr.Q4_K
        raw[type_at:type_at + 4] = (10).to_bytes(4, "little")   # GGML_TYPE_Q2_K

    bad = _rewrite(good, tmp_path / "q2k.gguf", to_q2_k)
    config = ModelConfig.from_pretrained(folder)
    with pytest.raises(qr.UnsupportedQuantType, match=r"blk\.1\.ffn_down\.weight.*Q2_K.*llama-quantize"):
        load_gguf_weights(bad, config)


def test_wrong_architecture(tmp_path, no_allocation):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        loader.load_model(str(path), device="cpu")


def test_cli_reports_a_bad_file_and_exits(tmp_path, capsys):
    # the command line names the problem and exits 1 (no traceback); nothing else is affected
    from folio.cli import main
    good = tmp_path / "good.gguf"
    write_tiny_gguf(good)
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(good.read_bytes()[:-3000])
    assert main(["generate", "--model", str(bad), "--prompt", "hi", "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert "truncated" in err and "Traceback" not in err


def test_tensor_infos_agree_with_gguf_py(tmp_path):
    # the header walk that serving uses, against gguf-py's reader, on the default model's file and
    # a mixed-type one
    from folio.model.gguf_header import read_tensor_infos
    from folio.model.registry import find_packaged_gguf
    write_tiny_gguf(tmp_path / "tiny.gguf", tied=False)
    for path in (find_packaged_gguf("smollm2-135m-instruct"), tmp_path / "tiny.gguf"):
        reader = gguf.GGUFReader(str(path))
        arch, infos = read_tensor_infos(path)
        assert arch == "llama"
        assert infos == {t.name: (tuple(int(n) for n in reversed(t.shape)), int(t.tensor_type), int(t.data_offset))
                         for t in reader.tensors}


def test_marker_names_the_source(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    folder = resolve_model(path)
    info = json.loads((folder / "folio_import.json").read_text())
    assert info["weights"] == "gguf" and info["source"] == str(path.resolve())
    path.rename(tmp_path / "moved.gguf")
    with pytest.raises(FileNotFoundError, match="which is gone"):
        gguf_source(folder)


def test_int8_activations_reach_the_kernels(tmp_path, monkeypatch):
    # --activation-quantization int8: every quantized weight's products take the integer path where
    # the CPU has it (quant_kernel_type), in the fused layers and lm_head alike; its arithmetic is
    # checked product by product against derived bounds in tests/kernels/test_quant_int8.py. Float-typed
    # weights (F16 here) are not quantized weights and keep float32 activations.
    from folio.kernels.cpu.quant_linear import INT8_ACTIVATIONS, Q4_K_X8, quant_kernel_type
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tied=False)
    f32, config, _ = loader.load_model(str(path), device="cpu", activation_quantization="none")
    int8, _, _ = loader.load_model(str(path), device="cpu", activation_quantization="int8")
    integer = loader.on_cpu_integer_products()   # elsewhere every product keeps float32 activations
    assert int8.lm_head.activations == ("int8" if integer else "float32") and f32.lm_head.activations == "float32"
    assert (int8.activation_quantization, f32.activation_quantization) == ("int8" if integer else "none", "none")
    table = int8.layer_stacks["gate_up_proj"].table   # BF16 gate, F16 up: float types
    assert (table[:, :, 1] < INT8_ACTIVATIONS).all()
    down = int8.layer_stacks["down_proj"].table        # Q4_K: its rows interleaved by 8 (quant_x8)
    want = Q4_K_X8 if quant_kernel_type(qr.Q4_K, "int8") >= INT8_ACTIVATIONS else qr.Q4_K
    assert config.hidden_size % 8 == 0 and (down[:, 0, 1] == want).all()
    ids = np.random.default_rng(3).integers(0, config.vocab_size, size=12)
    a, b = run_paged(f32, config, ids, 1), run_paged(int8, config, ids, 1)
    assert np.isfinite(b).all()
    if quant_kernel_type(qr.Q4_K, "int8") >= INT8_ACTIVATIONS:   # the CPU has integer dot products
        assert not np.array_equal(a, b)
    # float weights for sure (--dtype float32): refused before the float32 import is written
    from folio.model import registry
    monkeypatch.setattr(registry, "float32_import", lambda *a, **k: pytest.fail("imported before refusing"))
    with pytest.raises(ValueError, match="activation-quantization int8.*--dtype float32 dequantizes"):
        loader.load_model(str(path), device="cpu", dtype="float32", activation_quantization="int8")


def test_activation_quantization_auto(tmp_path, monkeypatch):
    # "auto" (the default): int8 activations for a GGUF file of quantized types, as llama.cpp
    # computes them; float32 ("none") for float weights and for the weights of a known model's
    # packaged file (the embedded default model, whose golden outputs are float32 products),
    # recognised by content: by name, import folder, the file's path, a copy, or the path an import
    # folder recorded from another virtual environment's install
    from folio.model import registry
    from folio.runtime.worker.precompile import weights_variant
    if not loader.on_cpu_integer_products():
        pytest.skip("no integer dot products on this CPU: every product keeps float32 activations")
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tied=False)
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, tied=False, seed=1)
    assert loader.resolve_activation_quantization("auto", str(path)) == "int8"
    assert loader.resolve_activation_quantization("auto", str(path), dtype="float32") == "none"
    assert loader.resolve_activation_quantization("none", str(path)) == "none"
    assert weights_variant(str(path)) == "quantized-int8"
    assert weights_variant(str(path), activation_quantization="none") == "quantized"
    model, _, folder = loader.load_model(str(path), device="cpu")
    assert model.activation_quantization == "int8" and model.lm_head.activations == "int8"   # Q8_0 lm_head
    with pytest.raises(ValueError, match="auto, int8, none"):
        loader.load_model(str(path), device="cpu", activation_quantization="fp8")
    with pytest.raises(ValueError, match="auto, int8 or none"):
        EngineConfig(activation_quantization=None)

    # the default model's file is recognised by content, wherever it lies
    assert registry.packaged_model_name(registry.find_packaged_gguf(DEFAULT_MODEL)) == DEFAULT_MODEL
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    monkeypatch.setattr(registry, "find_packaged_gguf", lambda name: copy)   # "installed" elsewhere
    for name in (str(path), str(folder), str(copy)):
        assert registry.packaged_model_name(gguf_source(resolve_model(name))) == DEFAULT_MODEL
        assert loader.resolve_activation_quantization("auto", name) == "none"
        assert weights_variant(name) == "quantized"
    assert registry.packaged_model_name(other) is None      # same shapes and types, other weights
    assert loader.resolve_activation_quantization("auto", str(other)) == "int8"
    model, _, _ = loader.load_model(str(path), device="cpu")
    assert model.activation_quantization == "none" and model.lm_head.activations == "float32"
    model, _, _ = loader.load_model(str(path), device="cpu", activation_quantization="int8")
    assert model.activation_quantization == "int8"


@pytest.mark.parametrize("tied", [False, True])
def test_int8_interleaves_lm_head_and_a_tied_table_only(tied):
    # with int8 activations the CPU table gives lm_head an interleaved copy (vocab 96: groups of 8);
    # a tied embedding table is that same weight (looked up from the copy); an untied one is only
    # looked up, so it stays as stored (no copy: a mapped file's rows are read on demand). Either
    # way the lookup is the stored values, bit for bit, and a step runs
    from folio.kernels.cpu.quant_linear import quant_kernel_type
    config = ModelConfig(**dict(SMALL, vocab_size=96, tie_word_embeddings=tied))
    stored, values = _weights_of_type(config, "Q8_0")
    for w in stored.values():
        if isinstance(w, qr.QuantizedWeight):
            w.activations = "int8"
    model = LlamaForCausalLM(config, stored, get_kernels("cpu"))
    integer = quant_kernel_type(qr.Q8_0, "int8") != qr.Q8_0   # the CPU has integer dot products
    assert (model.lm_head.packed is not None) == integer
    if tied:
        assert model.embed_tokens is model.lm_head
    else:
        assert model.embed_tokens is stored["model.embed_tokens.weight"] and model.embed_tokens.packed is None
    ids = np.array([0, 95, 7, 8, 40])
    np.testing.assert_array_equal(get_kernels("cpu").embedding(ids, model.embed_tokens),
                                  values["model.embed_tokens.weight"][ids])
    assert np.isfinite(run_paged(model, config, ids, 1)).all()


def test_q_and_k_are_copies_made_when_read_and_dropped_once_interleaved(tmp_path):
    # q and k are the GGUF loader's one copy (rows back in Hugging Face order): made when first
    # read, and with int8 activations dropped again once the CPU table holds its interleaved rows
    # (they were held twice: +89 MB on the 1B Q8_0 file, +377 MB on the 8B Q4_K_M). Float32
    # activations: the copies are kept and the model is the dense reference's (derived bound);
    # int8: the model computes what one whose copies were never dropped computes, bit for bit, and
    # the rows read again are the file's values
    from folio.kernels.cpu.quant_linear import quant_kernel_type
    path = tmp_path / "qk.gguf"
    expect = write_tiny_gguf(path, tied=False, qk_type=qr.Q8_0)
    config = ModelConfig.from_pretrained(resolve_model(path))
    names = [f"model.layers.{i}.self_attn.{k}_proj.weight" for i in range(config.num_hidden_layers) for k in "qk"]
    assert all(load_gguf_weights(path, config)[n]._data is None for n in names)   # nothing read yet
    ids = np.random.default_rng(3).integers(0, config.vocab_size, size=12)

    def qk(model):
        return [s for layer in model.layers for s in layer.qkv_proj[:2]]

    f32, _, _ = loader.load_model(str(path), device="cpu", activation_quantization="none")
    assert [s.type_name for s in qk(f32)] == ["Q8_0"] * len(names) and all(s._data is not None for s in qk(f32))
    stats = {}
    want = dense_llama_logits(config, expect, ids, stats)
    np.testing.assert_allclose(run_paged(f32, config, ids, 12), want, rtol=0, atol=tiny_atol(config, want, stats))

    int8, _, _ = loader.load_model(str(path), device="cpu", activation_quantization="int8")
    integer = quant_kernel_type(qr.Q8_0, "int8") != qr.Q8_0   # the CPU has integer dot products
    assert all((s._data is None) == integer for s in qk(int8))
    kept = load_gguf_weights(path, config)
    for n, w in kept.items():
        if isinstance(w, qr.QuantizedWeight):
            kept[n] = qr.QuantizedWeight(np.array(w.data), w.qtype, w.shape,
                                         "float32" if w.type_name in ("F32", "F16", "BF16") else "int8")
    reference = LlamaForCausalLM(config, kept, get_kernels("cpu"))
    assert all(s._data is not None for s in qk(reference))
    np.testing.assert_array_equal(run_paged(int8, config, ids, 12), run_paged(reference, config, ids, 12))
    int8.weight_bytes()   # sizes are told without making the rows again
    assert all((s._data is None) == integer for s in qk(int8))
    for s, n in zip(qk(int8), names):
        np.testing.assert_array_equal(s.dequantize(), expect[n], err_msg=n)   # made again where dropped
    # a copy reads the same file; a pickled weight (another process) opens its path again
    s = qk(int8)[0]
    s.release_rows()
    for other in (copy.deepcopy(s), pickle.loads(pickle.dumps(s))):
        np.testing.assert_array_equal(other.dequantize(), expect[names[0]])


def test_a_gguf_of_the_same_name_and_size_serves_its_own_weights(tmp_path, monkeypatch):
    # the import folder was reused by file name and size: a second file of one name and size (two
    # fine-tunes, another imatrix) served the first one's weights, and a file replaced in place kept
    # its old float32 import; the import now records a sampled fingerprint of the file's content
    monkeypatch.setenv("FOLIO_HOME", str(tmp_path / "home"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    want_a = write_tiny_gguf(a, tied=False, seed=0)
    want_b = write_tiny_gguf(b, tied=False, seed=1)
    assert a.stat().st_size == b.stat().st_size
    name = "model.layers.0.mlp.down_proj.weight"
    for path, want in ((a, want_a), (b, want_b), (a, want_a)):
        model, _, _ = loader.load_model(str(path), device="cpu")
        np.testing.assert_array_equal(model.layers[0].down_proj[0].dequantize(), want[name])
    for seed in (2, 3):   # one path, rewritten in place, through the float32 import
        want = write_tiny_gguf(a, tied=False, seed=seed)
        model, _, _ = loader.load_model(str(a), device="cpu", dtype="float32")
        np.testing.assert_array_equal(np.asarray(model.layers[0].down_proj), want[name])
