"""Every CUDA kernel source compiles with NVRTC for compute_80 (A100) and compute_90 (H100/H200)
with no GPU or driver (pip's nvidia-cuda-nvrtc-cu12), and the PTX holds every kernel entry."""

from __future__ import annotations

import re

import pytest

from folio.kernels.cuda import sources as cuda_sources
from folio.kernels.cuda import table as cuda_ops
from folio.kernels.cuda import nvrtc

ARCHS = ("compute_80", "compute_90")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("filename", cuda_sources.KERNEL_FILES)
def test_kernel_compiles(filename, arch):
    src = cuda_sources.kernel_source(filename)
    ptx, log = nvrtc.compile_ptx(src, filename, arch)
    target = arch.replace("compute_", "sm_")
    assert re.search(rf"\.target\s+{target}\b", ptx)
    kernels = re.findall(r"__global__\s+void\s+(\w+)", src)
    assert kernels
    for k in kernels:  # extern "C": unmangled entry names
        assert re.search(rf"\.entry\s+{k}\s*\(", ptx), f"{k} missing from the PTX"
    assert "warning" not in log.lower(), log


def test_kernel_files_list_is_complete():
    on_disk = sorted(p.name for p in cuda_sources.CUDA_DIR.glob("*.cu"))
    assert on_disk == sorted(cuda_sources.KERNEL_FILES)


def test_compile_error_is_reported_with_log():
    with pytest.raises(nvrtc.NvrtcError, match="undefined_thing"):
        nvrtc.compile_ptx('extern "C" __global__ void k() { undefined_thing(); }', "bad.cu")
