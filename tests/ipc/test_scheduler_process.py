"""The scheduler process's ``Server`` in this process (its loop on a thread, the engine over the echo
worker in-process): a ZeroMQ client's request is validated once, where it enters.

Counted by wrapping the functions that do the work (``InputProcessor.check_token_ids``,
``SamplingParams`` construction and ``to_dict``): each runs once per request, however many
samples the request has (before: token ids were checked twice in the scheduler, and the
parameters turned into a dict once per sequence sent to the worker).
"""

from __future__ import annotations

import threading

import pytest
from support.ipc_fake_runner import EchoRunner

from folio.ipc.client import Client
from folio.ipc.scheduler_process import Server
from folio.ipc.transport import private_ipc_address
from folio.runtime.common.config import EngineConfig
from folio.runtime.common.sampling_params import SamplingParams
from folio.runtime.inputs.input_processor import InputProcessor
from folio.runtime.scheduler.engine import LLMEngine


@pytest.fixture
def server():
    cfg = EngineConfig(device="cpu", max_model_len=512)
    engine = LLMEngine(cfg, EchoRunner(cfg))
    srv = Server(cfg, private_ipc_address("test-sched"), engine=engine)
    loop = threading.Thread(target=srv.serve_forever, daemon=True)
    loop.start()
    yield srv
    srv.stop()
    loop.join(30)


def test_a_request_is_validated_once_where_it_enters(server, monkeypatch):
    calls = {"check_token_ids": 0, "SamplingParams": 0, "to_dict": 0}

    def counted(name, fn):
        def wrapper(*a, **kw):
            if threading.current_thread().name != "MainThread":   # (the test's own calls do not count)
                calls[name] += 1
            return fn(*a, **kw)
        return wrapper
    monkeypatch.setattr(InputProcessor, "check_token_ids", counted("check_token_ids", InputProcessor.check_token_ids))
    monkeypatch.setattr(SamplingParams, "_validate", counted("SamplingParams", SamplingParams._validate))
    monkeypatch.setattr(SamplingParams, "to_dict", counted("to_dict", SamplingParams.to_dict))
    with Client(server.address, timeout=60) as c:
        sp = {"n": 3, "max_tokens": 4, "temperature": 1.0, "seed": 1}
        out = c.generate({"prompt_token_ids": [5, 6, 7]}, sp)
    assert [o.token_ids for o in out.outputs] == [[8, 9, 10, 11]] * 3      # (the echo worker's answer)
    # the scheduler: the parameters built once from the wire (and made the worker's dict once, not
    # once per sample), the token ids checked once
    assert calls == {"check_token_ids": 1, "SamplingParams": 1, "to_dict": 1}, calls
