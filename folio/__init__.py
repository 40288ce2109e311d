"""folio: a small LLM serving engine for Llama-architecture models.

Offline: ``folio.LLM(model).generate(prompts, SamplingParams(...))``. Online: ``folio serve`` and
``folio.Client`` / ``folio.AsyncClient``.
"""

__version__ = "0.1.0"

from .llm import LLM
from .runtime.scheduler.beam_search import BeamSearchOutput, BeamSearchSequence
from .runtime.common.config import EngineConfig
from .runtime.common.outputs import CompletionOutput, RequestOutput
from .runtime.common.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

__all__ = ["__version__", "LLM", "SamplingParams", "StructuredOutputsParams", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence",
           "RequestOutput", "CompletionOutput", "EngineConfig", "Client", "AsyncClient"]


def __getattr__(name):
    # the clients pull in ZeroMQ; load them only when asked for
    if name in ("Client", "AsyncClient"):
        from .ipc import client
        return getattr(client, name)
    raise AttributeError(f"module 'folio' has no attribute {name!r}")
