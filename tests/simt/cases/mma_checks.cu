// Warp-level matrix operations of kernels/cuda/common.cuh, checked against NumPy in
// tests/simt/test_mma.py: on the SIMT emulator by default, on a GPU with FOLIO_TEST_CUDA=1 (which
// checks the emulator's fragment layout against the hardware's).
#include "../../../kernels/cuda/common.cuh"

// One warp; lane L passes its raw fragment registers a_in[4 L .. 4 L + 3] (bf16 pairs),
// b_in[2 L .. 2 L + 1] and c_in[4 L .. 4 L + 3], and gets back d_out[4 L .. 4 L + 3] = its
// fragment of A B + C. The test places the matrix elements per the PTX ISA tables.
extern "C" __global__ void mma_fragments(float* __restrict__ d_out, const unsigned int* __restrict__ a_in,
                                         const unsigned int* __restrict__ b_in, const float* __restrict__ c_in) {
    const int lane = threadIdx.x;
    const unsigned int a[4] = {a_in[4 * lane], a_in[4 * lane + 1], a_in[4 * lane + 2], a_in[4 * lane + 3]};
    const unsigned int b[2] = {b_in[2 * lane], b_in[2 * lane + 1]};
    float d[4] = {c_in[4 * lane], c_in[4 * lane + 1], c_in[4 * lane + 2], c_in[4 * lane + 3]};
    mma_bf16_16816(d, a, b);
    for (int i = 0; i < 4; ++i) d_out[4 * lane + i] = d[i];
}

// out [M, N] float32 = a [M, K] bf16 (row major) @ b [N, K]^T bf16, by warps of 16 x 8 tiles, with
// the fragments read from memory the way the attention kernel reads them (32-bit pairs). M % 16,
// N % 8 and K % 16 must be 0. grid = (M / 16, N / 8), block = 32.
extern "C" __global__ void mma_matmul(float* __restrict__ out, const bf16_t* __restrict__ a,
                                      const bf16_t* __restrict__ b, int K, int N) {
    const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
    const int r0 = blockIdx.x * 16, n0 = blockIdx.y * 8;
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int k0 = 0; k0 < K; k0 += 16) {
        const bf16_t* lo = a + (long long)(r0 + g) * K + k0 + 2 * t;
        const bf16_t* hi = lo + 8LL * K;
        const unsigned int af[4] = {*reinterpret_cast<const unsigned int*>(lo), *reinterpret_cast<const unsigned int*>(hi),
                                    *reinterpret_cast<const unsigned int*>(lo + 8), *reinterpret_cast<const unsigned int*>(hi + 8)};
        const bf16_t* bp = b + (long long)(n0 + g) * K + k0 + 2 * t;
        const unsigned int bf[2] = {*reinterpret_cast<const unsigned int*>(bp), *reinterpret_cast<const unsigned int*>(bp + 8)};
        mma_bf16_16816(d, af, bf);
    }
    out[(long long)(r0 + g) * N + n0 + 2 * t] = d[0];
    out[(long long)(r0 + g) * N + n0 + 2 * t + 1] = d[1];
    out[(long long)(r0 + g + 8) * N + n0 + 2 * t] = d[2];
    out[(long long)(r0 + g + 8) * N + n0 + 2 * t + 1] = d[3];
}
