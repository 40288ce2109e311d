// Kernels that exercise the SIMT emulator itself (tests/simt/test_harness.py): warp shuffles and
// votes, barriers, dynamic shared memory, and three deliberate mistakes it must report.
#include "../../../kernels/cuda/common.cuh"

// out[blockIdx.x * blockDim.x + t] = results of warp ops on in[] (blockDim multiple of 32)
extern "C" __global__ void warp_ops(float* out, const float* in, int* ballots) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int lane = threadIdx.x % 32;
    const float v = in[i];
    out[4 * i + 0] = warp_sum(v);
    out[4 * i + 1] = __shfl_down_sync(0xffffffffu, v, 1);
    out[4 * i + 2] = __shfl_sync(0xffffffffu, v, 3);
    out[4 * i + 3] = __shfl_xor_sync(0xffffffffu, v, 5, 8);
    const unsigned b = __ballot_sync(0xffffffffu, v > 0.0f);
    if (lane == 0) ballots[i / 32] = (int)b;
}

// out[b] = sum of in over block b (block_sum: warp shuffles + __syncthreads), and a reversed copy
// through dynamic shared memory.
extern "C" __global__ void block_ops(float* out, float* rev, const float* in) {
    extern __shared__ float dyn[];
    __shared__ float scratch[32];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    dyn[threadIdx.x] = in[i];
    const float s = block_sum(in[i], scratch);
    if (threadIdx.x == 0) out[blockIdx.x] = s;
    rev[i] = dyn[blockDim.x - 1 - threadIdx.x];
}

// Bug: threads past n return before a __syncthreads the others reach.
extern "C" __global__ void early_return_before_barrier(float* x, int n) {
    __shared__ float tile[256];
    if ((int)threadIdx.x >= n) return;
    tile[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    x[threadIdx.x] = tile[(threadIdx.x + 1) % n];
}

// Bug: even and odd threads wait at different barriers.
extern "C" __global__ void divergent_barriers(float* x) {
    if (threadIdx.x % 2) {
        __syncthreads();
    } else {
        __syncthreads();
    }
    x[threadIdx.x] = 1.0f;
}

// Bug: lane 0 waits at a block barrier while its warp waits for it in a shuffle.
extern "C" __global__ void barrier_vs_shuffle(float* x) {
    if (threadIdx.x == 0) __syncthreads();
    x[threadIdx.x] = __shfl_xor_sync(0xffffffffu, x[threadIdx.x], 1);
}

extern "C" __global__ void typed_args(double* d, long long n, unsigned short* h) {
    if (threadIdx.x == 0) d[0] = (double)n + h[0];
}
