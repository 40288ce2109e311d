// Shared helpers of folio's CUDA kernels (included by every kernels/cuda/*.cu).
//
// bfloat16 is handled as raw 16-bit patterns (`bf16_t`, uint16 on the CuPy side, which has no
// bfloat16 dtype): the value is the top half of a float32. Conversions round to nearest even, as
// __float2bfloat16 does. No CUDA header is needed, so the same source compiles with NVRTC (no
// include path), with CuPy's RawModule, and with g++ behind the SIMT shim (tests/simt/simt.h).
#pragma once

typedef unsigned short bf16_t;

#define FOLIO_WARP 32
#define FOLIO_NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float bf16_to_float(bf16_t v) {
    return __uint_as_float(((unsigned int)v) << 16);
}

__device__ __forceinline__ bf16_t float_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int m = FOLIO_WARP / 2; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int m = FOLIO_WARP / 2; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
    return v;
}

// Sum over the whole block; every thread gets the result. `scratch` holds >= 32 floats of
// __shared__ memory; blockDim.x must be a multiple of 32. Contains two __syncthreads.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % FOLIO_WARP, warp = threadIdx.x / FOLIO_WARP;
    const int nwarps = blockDim.x / FOLIO_WARP;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nwarps ? scratch[lane] : 0.0f;
    t = warp_sum(t);
    __syncthreads();  // scratch may be reused right after
    return t;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x % FOLIO_WARP, warp = threadIdx.x / FOLIO_WARP;
    const int nwarps = blockDim.x / FOLIO_WARP;
    v = warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nwarps ? scratch[lane] : FOLIO_NEG_INF;
    t = warp_max(t);
    __syncthreads();
    return t;
}

// ---- packed bf16 pairs and 16-byte vectors ----------------------------------------------------
// A 32-bit word holds two consecutive bf16 values of memory: the first in the low half.
__device__ __forceinline__ float bf16_lo(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ unsigned int pack_bf16(float lo, float hi) {
    return (unsigned int)float_to_bf16(lo) | ((unsigned int)float_to_bf16(hi) << 16);
}

// 8 consecutive bf16 values (16 bytes, one vector load; p must be 16-byte aligned) -> float.
__device__ __forceinline__ void load_bf16x8(const bf16_t* p, float (&f)[8]) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    f[0] = bf16_lo(v.x); f[1] = bf16_hi(v.x); f[2] = bf16_lo(v.y); f[3] = bf16_hi(v.y);
    f[4] = bf16_lo(v.z); f[5] = bf16_hi(v.z); f[6] = bf16_lo(v.w); f[7] = bf16_hi(v.w);
}

// ---- tensor cores: mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 ------------------------
// d (16x8 float) += a (16x16 bf16, row major) @ b (16x8 bf16, column major), by the whole warp.
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), with
// g = lane >> 2 and t = lane % 4, each register holding two bf16 (low half first):
//   a[0] = A[g][2t..2t+1]     a[1] = A[g+8][2t..2t+1]   a[2] = A[g][2t+8..]   a[3] = A[g+8][2t+8..]
//   b[0] = B[2t..2t+1][g]     b[1] = B[2t+8..2t+9][g]
//   d[0..1] = D[g][2t..2t+1]  d[2..3] = D[g+8][2t..2t+1]
// Needs sm_80 or newer. Under the SIMT emulator (tests/simt) the same operation runs on the CPU.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const unsigned int (&a)[4],
                                               const unsigned int (&b)[2]) {
#if defined(SIMT_EMULATOR)
    ::simt::mma_m16n8k16_bf16(d, a, b);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}
