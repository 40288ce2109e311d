"""folio's RoPE inverse frequencies (``kernels/reference.rope_inv_freq``: the model's cos/sin table,
the dense reference of the kernel tests and the GGUF import's ``rope_freqs`` matching all use it)
against Hugging Face transformers' own, stored in ``tests/data/rope_inv_freq.json`` by
``perf/make_rope_reference.py`` (transformers' ``ROPE_INIT_FUNCTIONS`` and
``compute_default_rope_parameters``; this file needs neither torch nor transformers).

transformers computes in float32 and folio in float64, so they differ by transformers' rounding.
Its bound, per frequency ``f_i = 1 / theta^(e_i)``, ``e_i = 2 i / d`` (u = 2^-24):

* ``f_i``: the exponent ``e_i`` rounded (relative ``u``, which moves ``theta^e`` by ``ln(theta) e u``),
  torch's float32 ``pow`` (within 1 ulp, 2u: Sleef's ``powf`` u10 and glibc's ``powf`` both), the
  reciprocal (u): ``eps_f = (ln(theta) e_i + 3) u``, relative.
* ``llama3``, per band: kept, ``eps_f``; divided by the factor, ``eps_f + u``; smoothed,
  ``(1 - s) f / k + s f`` with ``s = (L / w - a) / (b - a)``, ``w = 2 pi / f``: the ratio
  ``r = L / w`` carries ``eps_f + 3u`` (2 pi as float32, two divisions), ``s`` then
  ``|ds| <= (r (eps_f + 3u) + u |r - a|) / (b - a) + u |s|``, and the result
  ``f [|ds| (1 - 1/k) + (eps_f + 4u) |1 - s| / k + (eps_f + 2u) |s|]`` (``ds`` enters both terms
  with the same sign: its weight is ``1 - 1/k``; then the roundings of ``1 - s``, the two products,
  the division and the sum).

Each first-order sum is composed (``rel / (1 - rel)``, Higham lemma 3.1), and folio's float64
evaluation adds ``gamma64(8)``. The bands are decided alike on both sides: the test checks that no
frequency's wavelength lies within a relative 1e-4 of a band's edge (where float32 and float64
could fall on different sides), far more than either side's error.

The types folio does not implement (``linear``, ``dynamic``, ``yarn``, ``longrope``) are stored for
the model-families work; until then folio must refuse them, not compute unscaled frequencies.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from support import DATA_DIR
from support.cuda_bounds import U, compose, gamma64

from folio.kernels import reference
from folio.model.config import ModelConfig

REF = json.loads((DATA_DIR / "rope_inv_freq.json").read_text())
SUPPORTED = ("default", "llama3")
CASES = {name: c for name, c in REF["cases"].items() if c["rope_parameters"]["rope_type"] in SUPPORTED}
OTHERS = {name: c for name, c in REF["cases"].items() if name not in CASES}


def _folio_scaling(params: dict) -> dict | None:
    # the config.json form folio reads (transformers 4's rope_scaling; rope_theta beside it)
    if params["rope_type"] == "default":
        return None
    return {k: v for k, v in params.items() if k != "rope_theta"}


def hf_float32_bound(case: dict, f64: np.ndarray) -> np.ndarray:
    """Per frequency, the bound on |transformers' float32 value - the exact one| (module docstring),
    plus folio's float64 evaluation."""
    p = case["rope_parameters"]
    d, theta = case["head_dim"], float(p["rope_theta"])
    e = np.arange(0, d, 2, dtype=np.float64) / d
    eps_f = (math.log(theta) * e + 3) * U
    rel = eps_f.copy()
    if p["rope_type"] == "llama3":
        k, a, b = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
        L = float(p["original_max_position_embeddings"])
        w = 2 * math.pi / reference.rope_inv_freq(d, theta, None)
        low, high = w > L / a, w < L / b
        rel[low] = eps_f[low] + U
        mid = ~(low | high)
        r = L / w[mid]
        s = (r - a) / (b - a)
        ds = (r * (eps_f[mid] + 3 * U) + U * np.abs(r - a)) / (b - a) + U * np.abs(s)
        f = 1.0 / theta ** e[mid]   # the unscaled frequency the smoothing starts from
        err = f * (ds * (1 - 1 / k) + (eps_f[mid] + 4 * U) * np.abs(1 - s) / k + (eps_f[mid] + 2 * U) * np.abs(s))
        rel[mid] = err / f64[mid]
    return (compose(rel) + gamma64(8)) * np.abs(f64)


def test_the_file_is_transformers_and_covers_every_type():
    assert REF["command"] == "python perf/make_rope_reference.py" and REF["transformers"], REF.keys()
    types = {c["rope_parameters"]["rope_type"] for c in REF["cases"].values()}
    assert types == {"default", "llama3", "linear", "dynamic", "yarn", "longrope"}, types
    for c in REF["cases"].values():
        assert len(c["inv_freq"]) == c["head_dim"] // 2
        assert all(np.float32(v) == v for v in c["inv_freq"]), "stored values are float32"


@pytest.mark.parametrize("name", sorted(CASES))
def test_inv_freq_matches_transformers(name):
    c = CASES[name]
    p = c["rope_parameters"]
    got = reference.rope_inv_freq(c["head_dim"], p["rope_theta"], _folio_scaling(p))
    want = np.asarray(c["inv_freq"], np.float64)
    assert got.shape == want.shape
    bound = hf_float32_bound(c, got)
    err = np.abs(got - want)
    assert np.all(err <= bound), (name, int(np.argmax(err / bound)), float((err / bound).max()))
    assert c["attention_factor"] == 1.0   # neither type scales cos and sin (folio does not either)
    if p["rope_type"] == "llama3":
        # the bands are decided alike (module docstring): no wavelength near an edge
        w = 2 * math.pi / reference.rope_inv_freq(c["head_dim"], p["rope_theta"], None)
        L = p["original_max_position_embeddings"]
        for edge in (L / p["low_freq_factor"], L / p["high_freq_factor"]):
            assert np.all(np.abs(w / edge - 1) > 1e-4), (name, edge)
        # and all three bands occur, so each branch is held to transformers
        assert (w > L / p["low_freq_factor"]).any() and (w < L / p["high_freq_factor"]).any()
        assert ((w <= L / p["low_freq_factor"]) & (w >= L / p["high_freq_factor"])).any()


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_model_config_gives_the_same_frequencies(name):
    # config.json -> ModelConfig -> the frequencies the model builds its cos/sin table from
    # (model/llama.py _init_rope): the same rope_theta and rope_scaling arrive
    c = CASES[name]
    p = c["rope_parameters"]
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 64,
                                 "hidden_size": c["hidden_size"], "intermediate_size": 64, "num_hidden_layers": 1,
                                 "num_attention_heads": c["num_attention_heads"], "head_dim": c["head_dim"],
                                 "max_position_embeddings": c["max_position_embeddings"],
                                 "rope_theta": p["rope_theta"], "rope_scaling": _folio_scaling(p)})
    got = reference.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert np.all(np.abs(got - np.asarray(c["inv_freq"])) <= hf_float32_bound(c, got)), name


@pytest.mark.parametrize("name", sorted(OTHERS))
def test_types_folio_does_not_implement_are_refused(name):
    c = OTHERS[name]
    p = c["rope_parameters"]
    with pytest.raises(ValueError, match=p["rope_type"]):
        reference.rope_inv_freq(c["head_dim"], p["rope_theta"], _folio_scaling(p))
    with pytest.raises(ValueError, match=f"unsupported rope_scaling type '{p['rope_type']}'"):
        ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": c["hidden_size"],
                               "intermediate_size": 64, "num_hidden_layers": 1,
                               "num_attention_heads": c["num_attention_heads"], "head_dim": c["head_dim"],
                               "rope_theta": p["rope_theta"], "rope_scaling": _folio_scaling(p)})
