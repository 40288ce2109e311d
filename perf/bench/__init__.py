"""Benchmarks of folio (``folio bench ...``): offline throughput against peers and the perf report.

Installed with the package so that the ``folio`` command can run them from any install; the
report's output (REPORT.md, plots, JSON, RESULTS.md) lives in the repository's ``perf/`` folder.
Modules: ``common`` (workloads, engine driver), ``throughput``, ``peers`` (transformers,
llama-cpp-python), ``kv_replay`` (section 1), ``sections`` (2, 4-7), ``report``.
"""
