"""Shared pytest fixtures."""

import sys
from pathlib import Path

import pytest

# the benchmark harness (perf/bench, imported as perf.bench) lives beside the package, not in it;
# the tests' shared helpers are the package ``support`` (tests/support) and the emulator ``simt``
ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


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
    """The reference facts and golden outputs of the default model (tests/data/smollm2_135m.json:
    Hugging Face transformers generations from the same GGUF, an independent implementation)."""
    import json

    from support import GOLDEN_PATH
    return json.loads(GOLDEN_PATH.read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def echo_http():
    """A ``folio serve`` with EchoRunner in its worker (next id = last id + 1; 10 ms per step) and both
    doors: ``(proc, zmq_address, http_url)``; the HTTP API needs ``Authorization: Bearer API_KEY``."""
    from folio.cmd_serve import spawn_server, stop_server
    from support.serve_helpers import API_KEY, ECHO, echo_env

    proc, addr = spawn_server(ECHO + ["--api-key", API_KEY, "--served-model-name", "echo", "smollm2-135m-instruct"],
                              env=echo_env(step_s=0.01), startup_timeout=180)
    yield proc, addr, proc.http_url
    assert stop_server(proc) == 0
