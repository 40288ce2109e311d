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
