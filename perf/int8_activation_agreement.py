"""How far int8 activations move the default model's outputs: greedy agreement with its golden runs.

    python -m perf.int8_activation_agreement [--max-tokens 32]

The golden outputs (tests/data/smollm2_135m.json) were computed from the shipped Q4_1 file's
weights dequantized, with float32 activations. ``quant_linear(..., activations="int8")``
(``kernels/cpu/quant_int8.py``) quantizes each product's activations per 32 values to 8 bits
for products of up to ``int8_max_tokens`` tokens. This script runs the default model's float32
weights (the same dequantized values) through the per-kernel loop of ``LlamaForCausalLM`` with
every projection's and lm_head's input replaced by its int8 rounding (``d = max|x| / 127``, ``x ->
d rint(x / d)`` per 32 values, as the kernel, for products of at most 16 tokens: the decode steps
and short prompts) and reports, per golden case, the number of leading generated tokens that
agree with the golden run, and the top-5 logits of the golden logits case. An emulation: the
kernel sums the same rounded activations in another order (its float32 error is ~1e-3 of the
activation rounding's, see ``tests/kernels/test_quant_int8.py``). Not a test: a figure for the docs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from folio.kernels import get_kernels
from folio.model.config import ModelConfig
from folio.model.llama import LlamaForCausalLM
from folio.model.registry import float32_import, resolve_model
from folio.model.weights import load_weights

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.greedy import greedy_generate  # noqa: E402 - the tests' single-sequence loop

_INT8_MAX_TOKENS = 16   # quant_linear.INT8_MAX_TOKENS (Q4_1 and Q8_0, the default model's types)


def int8_round(x: np.ndarray) -> np.ndarray:
    """``x [T, K]`` float32 with each 32 values replaced by ``d rint(x fl(1 / d))``, ``d = fl(max|x|
    / 127)`` (the kernel's activation codes; the product ``d q`` rounded to float32)."""
    T, K = x.shape
    xb = x.reshape(T, K // 32, 32)
    d = np.abs(xb).max(axis=2, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    return (d * np.rint(xb * inv)).astype(np.float32).reshape(T, K)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-tokens", type=int, default=32)
    a = p.parse_args(argv)
    print("command: python -m perf.int8_activation_agreement " + " ".join(sys.argv[1:]), flush=True)
    golden = json.loads((Path(__file__).resolve().parent.parent / "tests" / "data" / "smollm2_135m.json").read_text())
    model_dir = Path(resolve_model("smollm2-135m-instruct"))
    config = ModelConfig.from_pretrained(model_dir)
    # the import folder serves its weights from the GGUF file: its float32 import has them dequantized
    weights = load_weights(float32_import(model_dir), config)
    cpu = get_kernels("cpu")
    runs = {}
    for act in ("float32", "int8"):
        table = SimpleNamespace(**{**vars(cpu), "stacked_layers": False})   # the kernels one by one
        if act == "int8":
            def linear(x, weight, *, out=None, _linear=cpu.linear):
                if x.shape[0] <= _INT8_MAX_TOKENS:
                    x = int8_round(np.ascontiguousarray(x, np.float32))
                return _linear(x, weight, out=out)
            table.linear = linear
        runs[act] = LlamaForCausalLM(config, weights, table)
    for case in golden["greedy_cases"]:
        want = case["generated_ids_32_ignore_eos"][:a.max_tokens]
        line = [f"case {case['id']} ({len(case['prompt_ids'])} prompt tokens):"]
        for act, model in runs.items():
            got = greedy_generate(model, config, case["prompt_ids"], max_tokens=len(want),
                                  ignore_eos=True)["generated_ids"]
            agree = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), len(want))
            line.append(f"{act} {agree}/{len(want)} tokens agree")
        print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
