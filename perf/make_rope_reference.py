"""RoPE inverse frequencies computed by Hugging Face transformers, stored for the tests.

Writes ``tests/data/rope_inv_freq.json``: for each case, the config fields transformers reads
(``head_dim``, ``hidden_size``, ``num_attention_heads``, ``max_position_embeddings`` and
``rope_parameters``: ``rope_type``, ``rope_theta`` and the type's own keys), the sequence length
passed (``dynamic`` and ``longrope`` depend on it), and what transformers returns for them: the
``[head_dim // 2]`` float32 inverse frequencies and the attention factor (the scale of cos and
sin: YaRN's and LongRoPE's ``mscale``, 1 for the others).

The functions are transformers' own: ``ROPE_INIT_FUNCTIONS[rope_type]`` from
``transformers.modeling_rope_utils`` for the scaled types, and
``LlamaRotaryEmbedding.compute_default_rope_parameters`` for ``default`` (the unscaled RoPE
every Llama without ``rope_scaling`` uses). They compute in float32 (torch's default dtype); the
stored numbers are those float32 values, written as the shortest decimals that read back to the
same float32.

The cases: Llama 3.1 (8B) and 3.2 (1B) ``llama3`` scaling, one with another smoothing band; the
default model's and Llama 2's unscaled RoPE; and, for model families folio does not serve yet,
``linear``, ``dynamic`` (at and past ``max_position_embeddings``), ``yarn`` (Qwen2.5's and
DeepSeek-V3's parameters) and ``longrope`` (Phi-3-mini-128k's shape, both factor lists; the lists
themselves are made up here: smooth, increasing, with the real ones' ranges). The test
(``tests/kernels/test_rope_reference.py``) reads the file only: it needs neither torch nor
transformers.

Needs torch and transformers (the ``perf`` extra, or ``pip install torch transformers``). Run it
from the repository root, as a script (so that folio's ``kernels/`` folder does not shadow
transformers' ``kernels`` dependency)::

    python perf/make_rope_reference.py [--out tests/data/rope_inv_freq.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "rope_inv_freq.json"


def _longrope_factors(n: int, top: float) -> list[float]:
    """``n`` smooth increasing factors from 1 to ``top`` (float32 values, as a list)."""
    t = np.linspace(0.0, 1.0, n)
    return [float(np.float32(v)) for v in 1.0 + (top - 1.0) * t ** 2]


# name -> (head_dim, hidden_size, num_attention_heads, max_position_embeddings, rope_parameters, seq_len)
CASES = {
    "default_smollm2_135m": (64, 576, 9, 8192, {"rope_type": "default", "rope_theta": 100000.0}, None),
    "default_llama2_7b": (128, 4096, 32, 4096, {"rope_type": "default", "rope_theta": 10000.0}, None),
    "llama3_llama3.1_8b": (128, 4096, 32, 131072, {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, None),
    "llama3_llama3.2_1b": (64, 2048, 32, 131072, {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, None),
    "llama3_other_band": (128, 4096, 32, 32768, {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0, "low_freq_factor": 2.0,
        "high_freq_factor": 8.0, "original_max_position_embeddings": 4096}, None),
    "linear_factor4": (128, 4096, 32, 16384, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, None),
    "dynamic_at_max": (128, 4096, 32, 4096, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, None),
    "dynamic_past_max": (128, 4096, 32, 4096, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, 16384),
    "yarn_qwen2.5": (128, 5120, 40, 131072, {
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
        "original_max_position_embeddings": 32768}, None),
    "yarn_deepseek_v3": (64, 7168, 128, 163840, {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}, None),
    "longrope_short": (96, 3072, 32, 131072, {
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 4096,
        "short_factor": _longrope_factors(48, 1.2), "long_factor": _longrope_factors(48, 60.0)}, None),
    "longrope_long": (96, 3072, 32, 131072, {
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 4096,
        "short_factor": _longrope_factors(48, 1.2), "long_factor": _longrope_factors(48, 60.0)}, 131072),
}


def compute(case):
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    head_dim, hidden, heads, max_pos, params, seq_len = case
    config = LlamaConfig(head_dim=head_dim, hidden_size=hidden, num_attention_heads=heads,
                         max_position_embeddings=max_pos, rope_parameters=dict(params))
    if params["rope_type"] == "default":
        inv_freq, attention_factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu", seq_len=seq_len)
    assert inv_freq.dtype == torch.float32 and tuple(inv_freq.shape) == (head_dim // 2,), inv_freq
    return {"head_dim": head_dim, "hidden_size": hidden, "num_attention_heads": heads,
            "max_position_embeddings": max_pos, "rope_parameters": params, "seq_len": seq_len,
            "inv_freq": [float(v) for v in inv_freq.numpy()], "attention_factor": float(attention_factor)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    import torch
    import transformers

    out = {"about": "RoPE inverse frequencies (float32) and attention factors computed by Hugging Face "
                    "transformers (ROPE_INIT_FUNCTIONS; default: LlamaRotaryEmbedding."
                    "compute_default_rope_parameters); made by perf/make_rope_reference.py",
           "command": "python perf/make_rope_reference.py",
           "transformers": transformers.__version__, "torch": torch.__version__,
           "cases": {name: compute(case) for name, case in CASES.items()}}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}: {len(out['cases'])} cases (transformers {transformers.__version__}, "
          f"torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
