"""Fixtures of the worker's tests."""

import pytest


@pytest.fixture(scope="module")
def modules():
    """The CUDA kernels compiled for the SIMT emulator, by name (``simt.table.simt_modules``); the
    tests that take it skip when no C++ compiler is found (fail under ``FOLIO_REQUIRE_SIMT=1``)."""
    from simt.runner import require_compiler
    from simt.table import simt_modules

    require_compiler()
    return simt_modules()
