"""The HTTP process of ``folio serve``: an OpenAI-compatible API (FastAPI + uvicorn) in a process of
its own that reaches the scheduler process through ``folio.ipc.client.AsyncClient``, exactly as any
other client does (so HTTP adds no engine code path).

Files: ``protocol.py`` (request bodies as pydantic models, with vLLM's extensions), ``serving.py``
(requests -> engine requests, engine deltas -> OpenAI responses and SSE chunks), ``metrics.py``
(Prometheus exposition of the scheduler's counters), ``app.py`` (routes, auth, errors),
``http_process.py`` (the process: uvicorn on a socket bound by ``folio serve``), ``chat.html`` (the page
served at ``/``).
"""
