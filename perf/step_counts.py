"""Launches, host<->device copies and syncs per step of the GPU path, counted on the CPU.

The CUDA kernel table runs under the SIMT emulator (tests/simt) with a device that counts every
kernel launch and cuBLAS call, every copy and every synchronisation (the counting device of
tests/support/device_cases.py). The counts are those of a GPU run: the same Python issues the same
launches; only the kernels' execution differs. A SmolLM2-shaped model (30 layers, GQA 9:3,
head_dim 64) with small widths: counts do not depend on widths.

Usage: python perf/step_counts.py [--layers 30] [--seqs 4]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--seqs", type=int, default=4)
    args = p.parse_args(argv)

    from folio.kernels.cuda import table as cuda_ops
    from folio.runtime.common.config import EngineConfig
    from folio.runtime.worker.model_runner import ModelRunner
    from folio.runtime.common.sampling_params import SamplingParams
    from simt.table import simt_kernels
    from support.device_cases import TINY, CountingDevice, Seq, plan_for

    d = tempfile.mkdtemp(prefix="folio-counts-")
    cfg = dict(TINY, num_hidden_layers=args.layers, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               hidden_size=96, intermediate_size=128)
    (pathlib.Path(d) / "config.json").write_text(json.dumps(cfg))
    rows = {}
    for eager in (True, False):
        dev = CountingDevice()
        cuda_ops._TABLE = simt_kernels(device=dev)
        runner = ModelRunner(EngineConfig(model=d, device="cuda", load_format="dummy", block_size=8,
                                          max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128,
                                          num_kv_blocks_override=64, enforce_eager=eager))
        seqs = [Seq(i, list(range(3, 3 + 9 + i)), list(range(8 * i, 8 * i + 8)),
                    SamplingParams(temperature=0.8, top_p=0.9, seed=i)) for i in range(args.seqs)]
        dev.take()
        res = runner.execute(plan_for(0, seqs, new=seqs))
        prefill = dict(dev.take())
        for s, t in zip(seqs, res.sampled_token_ids.tolist()):
            s.tokens.append(t)
        decodes = []
        for step in range(1, 4):
            res = runner.execute(plan_for(step, seqs))
            decodes.append(dict(dev.take()))
            for s, t in zip(seqs, res.sampled_token_ids.tolist()):
                s.tokens.append(t)
        mode = "eager" if eager else "graphs"
        rows[f"prefill ({mode})"] = prefill
        rows[f"decode ({mode}, first)"] = decodes[0]
        rows[f"decode ({mode}, steady)"] = decodes[-1]
        runner.shutdown()
        cuda_ops._TABLE = None
    print(f"python perf/step_counts.py --layers {args.layers} --seqs {args.seqs}")
    print(f"{'step':32s} {'launches':>9s} {'per layer':>10s} {'h2d':>4s} {'d2h':>4s} {'syncs':>6s}")
    for name, c in rows.items():
        n = c.get("launch", 0)
        print(f"{name:32s} {n:9d} {n / args.layers:10.2f} {c.get('h2d', 0):4d} {c.get('d2h', 0):4d} {c.get('sync', 0):6d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
