"""folio's benchmarks: ``perf.bench`` is the harness behind ``folio bench`` (run from a source checkout)."""
