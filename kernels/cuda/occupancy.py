"""Occupancy of a kernel on an SM, from its compile-time resources (no GPU needed).

``blocks_per_sm`` is the CUDA Occupancy Calculator's rule: the resident blocks of one kernel on an
SM are limited by warps, registers (allocated per warp in units of 256), shared memory (static +
dynamic + the 1 KB the runtime reserves per block, in units of 128 bytes) and the block limit. The
limits per architecture are the CUDA C++ Programming Guide's ("Technical Specifications per
Compute Capability"; "Shared Memory" for 8.0 and 9.0). Registers and static shared memory come from
ptxas's report (``nvrtc.compile_cubin`` and ``nvrtc.ptxas_resources``).

The kernels state the occupancy they need in their doc comments, one line per kernel::

    // Occupancy of NAME: >= N blocks of T threads per SM [with S bytes of dynamic shared memory]

(the words may run on over several comment lines)
``occupancy_claims`` reads those lines; tests/kernels/test_nvrtc.py holds each kernel to its claim
on sm_80 and sm_90.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class SmLimits:
    regs: int = 65536            # 32-bit registers per SM
    reg_unit: int = 256          # registers are allocated per warp in this unit
    max_warps: int = 64
    max_blocks: int = 32
    smem: int = 0                # shared memory per SM for blocks, bytes
    smem_unit: int = 128
    smem_reserved: int = 1024    # per block, by the CUDA runtime (compute capability 8.0+)


SM_LIMITS = {"sm_80": SmLimits(smem=164 * 1024), "sm_90": SmLimits(smem=228 * 1024)}


def blocks_per_sm(arch: str, registers: int, threads: int, smem_bytes: int = 0) -> int:
    """Resident blocks of ``threads`` threads using ``registers`` per thread and ``smem_bytes`` of
    shared memory (static + dynamic) per block, on one SM of ``arch`` (``sm_80``, ``sm_90``)."""
    lim = SM_LIMITS[arch]
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // lim.reg_unit) * lim.reg_unit
    by_regs = (lim.regs // per_warp) // warps if per_warp else lim.max_blocks
    smem = -(-(smem_bytes + lim.smem_reserved) // lim.smem_unit) * lim.smem_unit
    return min(lim.max_blocks, lim.max_warps // warps, by_regs, lim.smem // smem)


_W = r"(?:\s|//)+"  # the words of a claim may run on over comment lines
_CLAIM_RE = re.compile(rf"//\s*Occupancy{_W}of{_W}(\w+):{_W}>={_W}(\d+){_W}blocks{_W}of{_W}(\d+){_W}threads{_W}per"
                       rf"{_W}SM(?:{_W}with{_W}(\d+){_W}bytes{_W}of{_W}dynamic{_W}shared{_W}memory)?")


def occupancy_claims(source: str) -> dict[str, tuple[int, int, int]]:
    """``kernel -> (blocks, threads, dynamic shared memory bytes)`` from a source's claim lines."""
    return {m.group(1): (int(m.group(2)), int(m.group(3)), int(m.group(4) or 0))
            for m in _CLAIM_RE.finditer(source)}
