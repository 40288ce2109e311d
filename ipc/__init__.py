"""folio's processes and their wire: message schemas (``messages``), ZeroMQ plumbing (``transport``),
the worker process's main (``worker_process``), its scheduler-side ``ZmqExecutor`` (``zmq_executor``),
the scheduler process's main and ``Server`` (``scheduler_process``) and the client library (``client``: ``Client``, ``AsyncClient``)."""

_CLIENT_NAMES = ("Client", "AsyncClient", "ServerError", "ClientTimeoutError", "StreamDelta")


def __getattr__(name):
    # the client pulls in zmq.asyncio; load it only when asked for
    if name in _CLIENT_NAMES:
        from . import client
        return getattr(client, name)
    raise AttributeError(f"module 'folio.ipc' has no attribute {name!r}")
