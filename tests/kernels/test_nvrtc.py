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


# ---- static gates: the machine code ptxas makes for sm_80 (A100) and sm_90 (H100/H200) ---------
# NVRTC compiles to SASS itself (--gpu-architecture=sm_XX, --ptxas-options=-v), as CuPy does on a
# GPU, so registers and spills are compile-time facts checked here without one.
from folio.kernels.cuda import occupancy  # noqa: E402

SM_ARCHS = ("sm_80", "sm_90")
# every kernel a prefill or decode step launches: each must state the occupancy it needs
HOT = ("rms_norm_kernel", "fused_add_rms_norm_kernel", "fused_add_rms_norm_rows_kernel", "rope_and_cache_kernel",
       "silu_and_mul_kernel", "embedding_kernel", "paged_attention_decode_h4_kernel", "paged_attention_decode_h8_kernel",
       "paged_attention_reduce_kernel",
       "paged_attention_prefill_d32_kernel", "paged_attention_prefill_d64_kernel",
       "paged_attention_prefill_d128_kernel", "paged_attention_prefill_d256_kernel", "sample_kernel")


@pytest.fixture(scope="module")
def resources():
    """``(arch, kernel) -> ptxas resources`` of every kernel file, each compiled once per arch."""
    out = {}
    for filename in cuda_sources.KERNEL_FILES:
        src = cuda_sources.kernel_source(filename)
        for arch in SM_ARCHS:
            _, log = nvrtc.compile_cubin(src, filename, arch)
            found = nvrtc.ptxas_resources(log)
            assert set(found) == set(cuda_sources.kernel_names(filename)), (filename, arch, sorted(found))
            out.update({(arch, k): r for k, r in found.items()})
    return out


def claims():
    out = {}
    for filename in cuda_sources.KERNEL_FILES:
        out.update(occupancy.occupancy_claims(cuda_sources.kernel_source(filename)))
    return out


def test_no_kernel_spills_or_uses_local_memory(resources):
    bad = {k: r for k, r in resources.items() if r["spill_stores"] or r["spill_loads"] or r["stack"]}
    assert not bad, bad


@pytest.mark.parametrize("arch", SM_ARCHS)
def test_hot_kernels_reach_the_occupancy_their_comments_claim(resources, arch):
    c = claims()
    assert set(HOT) <= set(c), sorted(set(HOT) - set(c))
    short = {}
    for kernel, (blocks, threads, dyn_smem) in c.items():
        r = resources[(arch, kernel)]
        got = occupancy.blocks_per_sm(arch, r["registers"], threads, r["smem"] + dyn_smem)
        if got < blocks:
            short[kernel] = f"{got} blocks < {blocks} claimed ({r['registers']} registers, {r['smem']} + {dyn_smem} smem)"
    assert not short, short


def test_ptxas_report_parsing():
    log = ("ptxas info    : 0 bytes gmem\n"
           "ptxas info    : Compiling entry function 'k1' for 'sm_90'\n"
           "ptxas info    : Function properties for k1\n"
           "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 92 registers, used 1 barriers, 128 bytes smem\n"
           "ptxas info    : Compiling entry function 'k2' for 'sm_90'\n"
           "ptxas info    : Function properties for k2\n"
           "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 32 registers, used 0 barriers, 376 bytes cmem[0]\n")
    assert nvrtc.ptxas_resources(log) == {
        "k1": {"arch": "sm_90", "registers": 92, "spill_stores": 4, "spill_loads": 4, "stack": 8, "smem": 128},
        "k2": {"arch": "sm_90", "registers": 32, "spill_stores": 0, "spill_loads": 0, "stack": 0, "smem": 0}}


def test_occupancy_rule_worked_by_hand():
    # 92 registers x 32 lanes = 2944, rounded up to 3072 per warp: 65536 // 3072 = 21 warps, 5 blocks
    # of 4 warps; 255 registers: 8192 per warp, 8 warps, 2 blocks
    assert occupancy.blocks_per_sm("sm_90", 92, 128) == 5
    assert occupancy.blocks_per_sm("sm_90", 255, 128) == 2
    # 32 registers: 64 warps, the warp limit (8 blocks of 256)
    assert occupancy.blocks_per_sm("sm_80", 32, 256) == 8
    # shared memory: 100 KB + 1 KB reserved per block: 1 block in A100's 164 KB, 2 in H100's 228 KB
    assert occupancy.blocks_per_sm("sm_80", 32, 128, 100 * 1024) == 1
    assert occupancy.blocks_per_sm("sm_90", 32, 128, 100 * 1024) == 2
    # a claim may run on over comment lines
    assert occupancy.occupancy_claims("// Occupancy of k: >= 3 blocks of 64 threads per SM with 512 bytes of\n"
                                      "// dynamic shared memory\n// Occupancy of j: >= 1 blocks of 32 threads per SM") \
        == {"k": (3, 64, 512), "j": (1, 32, 0)}
