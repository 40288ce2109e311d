"""Where a request enters: the code that turns what a user sends (text, token ids, chat messages)
into a validated prompt. It runs in whichever process takes the user's request: the scheduler
process (``folio.LLM``, ``LLMEngine.add_request``, the ZeroMQ server's ``ipc/scheduler_process.py``)
and the HTTP process (``folio/api/``), never in the worker. It sits on the tokenizer and
the shared types only, so every one of those may import it (vLLM V1's ``Processor``, which runs in
the HTTP process of ``AsyncLLM`` and in ``LLMEngine``, has the same place)."""
