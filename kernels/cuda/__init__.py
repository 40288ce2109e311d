"""The CUDA kernels: ``*.cu`` sources compiled with NVRTC and launched as CuPy RawKernels.

``table`` (``CudaKernels``, the ``KernelTable`` for ``"cuda"``, and the ``KERNEL_FILES``),
``device`` (launches, copies, syncs and graphs on a GPU or, for tests, on the CPU through the SIMT
emulator), ``cublas`` (the products through cuBLAS) and ``nvrtc`` (the compiler). Every kernel is
tested against ``kernels/reference.py`` on the emulator (``tests/simt``).
"""
