"""A stand-in for a CuPy ``RawKernel`` that records the dynamic shared memory of each launch."""


class FakeRawKernel:
    """``static`` bytes of static shared memory (``shared_size_bytes``), CuPy's default 48 KiB
    dynamic limit (``max_dynamic_shared_size_bytes``, which the table raises when it opts in);
    ``calls`` holds each launch's ``shared_mem``."""

    def __init__(self, static=0):
        self.shared_size_bytes = static
        self.max_dynamic_shared_size_bytes = 48 * 1024
        self.calls = []

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None):
        # CuPy's RawKernel signature exactly (tests/kernels/test_cupy_conformance.py): shared_mem keyword-only
        self.calls.append(shared_mem)
