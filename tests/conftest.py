"""Shared pytest fixtures."""

import sys
from pathlib import Path

import pytest

# the benchmark harness (perf/bench, imported as perf.bench) lives beside the package, not in it
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def default_model_dir():
    """The default model's Hugging Face folder (imported from its GGUF on first use, then cached)."""
    from folio.model.registry import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def default_model(default_model_dir):
    """``(LlamaForCausalLM, ModelConfig, model_dir)`` of the default model on CPU, float32, loaded once."""
    from folio.model.loader import load_model

    return load_model(str(default_model_dir), device="cpu")


@pytest.fixture(scope="session")
def golden():
    """The reference facts and golden outputs of the default model (tests/data/smollm2_135m.json, a copy of
    shared/reference/smollm2_135m.json: Hugging Face transformers generations from the same GGUF)."""
    import json
    from pathlib import Path

    return json.loads((Path(__file__).parent / "data" / "smollm2_135m.json").read_text(encoding="utf-8"))


API_KEY = "sk-folio-test"


@pytest.fixture(scope="session")
def echo_http():
    """A ``folio serve`` with EchoRunner in its worker (next id = last id + 1; 10 ms per step) and both
    doors: ``(proc, zmq_address, http_url)``; the HTTP API needs ``Authorization: Bearer API_KEY``."""
    from folio.cmd_serve import spawn_server, stop_server
    from serve_helpers import ECHO, echo_env

    proc, addr = spawn_server(ECHO + ["--api-key", API_KEY, "--served-model-name", "echo", "smollm2-135m-instruct"],
                              env=echo_env(step_s=0.01), startup_timeout=180)
    yield proc, addr, proc.http_url
    assert stop_server(proc) == 0


def force_parallel_kernels(monkeypatch):
    """Every CPU kernel on its parallel driver whatever the size (several row items per call),
    decode attention split into key ranges from 32 keys on 2 threads too: the paths a 2-core
    machine would otherwise only take for large steps."""
    from folio.kernels.cpu import attention as cpu_attention
    from folio.kernels.cpu import linear as cpu_linear
    from folio.kernels.cpu import rows as cpu_rows
    monkeypatch.setattr(cpu_rows, "_PARALLEL_MIN_ELEMENTS", 0)
    monkeypatch.setattr(cpu_rows, "_ROWS_PER_ITEM", 2)  # several work items per call
    monkeypatch.setattr(cpu_attention, "_PARALLEL_MIN_WORK", 0)
    monkeypatch.setattr(cpu_attention, "SPLIT_MIN_KEYS", 16)  # decodes of 32+ keys split into key ranges
    monkeypatch.setattr(cpu_attention, "SPLIT_MIN_THREADS", 2)  # ... on 2 threads too
    monkeypatch.setattr(cpu_linear, "_PARALLEL_MIN_WEIGHTS", 0)
