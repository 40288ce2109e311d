// Per-token layer kernels of the Llama block: RMSNorm (plain, fused with the residual add, and the
// final norm over gathered rows), RoPE (rotate-half layout) fused with the KV-cache append,
// SiLU-and-mul, the embedding gather and bf16 <-> float32 casts.
// The residual stream is float32; a kernel whose output feeds a matrix product (the norms,
// SiLU-and-mul, the rotated queries) rounds it to bf16 itself, so no separate cast runs.
// Weights are bf16 bit patterns. Specs: kernels/reference.py (rms_norm, fused_add_rms_norm,
// rope_and_cache, silu_and_mul).
#include "common.cuh"

// out[t, :] = bf16(x[t, :] / sqrt(mean(x[t, :]^2) + eps) * weight).  grid = (T), block = 32k threads.
// Occupancy of rms_norm_kernel: >= 8 blocks of 256 threads per SM (every thread the SM holds: a
// memory-bound pass over a row with 4-byte loads needs all its warps' loads in flight)
extern "C" __global__ void rms_norm_kernel(bf16_t* __restrict__ out, const float* __restrict__ x,
                                           const bf16_t* __restrict__ weight, float eps, int hidden) {
    __shared__ float scratch[32];
    const long long row = (long long)blockIdx.x * hidden;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = x[row + i];
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        out[row + i] = float_to_bf16(x[row + i] * inv * bf16_to_float(weight[i]));
}

// residual_out = x + residual (float32); out = bf16(rms_norm(residual_out)). residual_out may
// alias residual (the residual stream updated in place).  grid = (T), block = 32k threads.
// Occupancy of fused_add_rms_norm_kernel: >= 8 blocks of 256 threads per SM (as rms_norm_kernel)
extern "C" __global__ void fused_add_rms_norm_kernel(bf16_t* __restrict__ out, float* residual_out,
                                                     const float* __restrict__ x, const float* residual,
                                                     const bf16_t* __restrict__ weight, float eps,
                                                     int hidden) {
    __shared__ float scratch[32];
    const long long row = (long long)blockIdx.x * hidden;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = x[row + i] + residual[row + i];
        residual_out[row + i] = v;
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)  // each thread re-reads what it wrote
        out[row + i] = float_to_bf16(residual_out[row + i] * inv * bf16_to_float(weight[i]));
}

// The final norm on the rows that are sampled: out[i, :] = bf16(rms_norm(x[rows[i]] +
// residual[rows[i]])); nothing else is written.  grid = (len(rows)), block = 32k threads.
// Occupancy of fused_add_rms_norm_rows_kernel: >= 8 blocks of 256 threads per SM (as rms_norm_kernel)
extern "C" __global__ void fused_add_rms_norm_rows_kernel(bf16_t* __restrict__ out,
                                                          const float* __restrict__ x,
                                                          const float* __restrict__ residual,
                                                          const long long* __restrict__ rows,
                                                          const bf16_t* __restrict__ weight, float eps,
                                                          int hidden) {
    __shared__ float scratch[32];
    const long long src = rows[blockIdx.x] * hidden, dst = (long long)blockIdx.x * hidden;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = x[src + i] + residual[src + i];
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        out[dst + i] = float_to_bf16((x[src + i] + residual[src + i]) * inv * bf16_to_float(weight[i]));
}

// RoPE fused with the KV-cache append, reading q/k/v straight from the fused projection: row t of
// qkv (qkv_stride floats apart) holds q [num_heads * head_dim], then k and v [num_kv_heads *
// head_dim] each. Writes the rotated queries q_out [T, num_heads, head_dim] (bf16, the attention
// kernels' input) and, unless slot_mapping[t] < 0, the rotated key and the value into slot
// slot_mapping[t] of the bf16 caches [num_blocks * block_size, num_kv_heads, head_dim].
// grid = (T), block = any.
// Occupancy of rope_and_cache_kernel: >= 12 blocks of 128 threads per SM (48 of the 64 warps: a
// memory-bound pass over the projection's row; 64-bit index arithmetic takes ~40 registers)
extern "C" __global__ void rope_and_cache_kernel(bf16_t* __restrict__ q_out, bf16_t* __restrict__ key_cache,
                                                 bf16_t* __restrict__ value_cache,
                                                 const float* __restrict__ qkv,
                                                 const long long* __restrict__ positions,
                                                 const long long* __restrict__ slot_mapping,
                                                 const float* __restrict__ cos_sin_cache, int num_heads,
                                                 int num_kv_heads, int head_dim, long long qkv_stride) {
    const long long t = blockIdx.x;
    const int half = head_dim / 2;
    const float* row = qkv + t * qkv_stride;
    const float* cs = cos_sin_cache + positions[t] * (long long)head_dim;
    const long long slot = slot_mapping[t];
    const int kv = num_kv_heads * head_dim;
    const int n = (num_heads + num_kv_heads) * half;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int head = i / half, d = i % half;
        const float c = cs[d], s = cs[half + d];
        const float* src = row + head * head_dim;  // q heads, then k heads
        const float x1 = src[d], x2 = src[half + d];
        const bf16_t y1 = float_to_bf16(x1 * c - x2 * s), y2 = float_to_bf16(x2 * c + x1 * s);
        if (head < num_heads) {
            bf16_t* dst = q_out + (t * num_heads + head) * head_dim;
            dst[d] = y1;
            dst[half + d] = y2;
        } else if (slot >= 0) {
            bf16_t* dst = key_cache + slot * kv + (head - num_heads) * head_dim;
            dst[d] = y1;
            dst[half + d] = y2;
        }
    }
    if (slot >= 0) {
        const float* v = row + (long long)(num_heads * head_dim + kv);
        for (int i = threadIdx.x; i < kv; i += blockDim.x) value_cache[slot * kv + i] = float_to_bf16(v[i]);
    }
}

// out[t, i] = bf16(silu(x[t, i]) * x[t, inter + i]) for x [T, 2 * inter] float32.
// grid = (T), block = any.
// Occupancy of silu_and_mul_kernel: >= 8 blocks of 256 threads per SM (as rms_norm_kernel)
extern "C" __global__ void silu_and_mul_kernel(bf16_t* __restrict__ out, const float* __restrict__ x,
                                               int inter) {
    const long long t = blockIdx.x;
    for (int i = threadIdx.x; i < inter; i += blockDim.x) {
        const float g = x[t * 2 * inter + i], u = x[t * 2 * inter + inter + i];
        out[t * inter + i] = float_to_bf16(g / (1.0f + expf(-g)) * u);
    }
}

// out[t, :] = float(table[ids[t], :]) for a bf16 table [vocab, hidden].  grid = (T).
// Occupancy of embedding_kernel: >= 8 blocks of 256 threads per SM (as rms_norm_kernel)
extern "C" __global__ void embedding_kernel(float* __restrict__ out, const long long* __restrict__ ids,
                                            const bf16_t* __restrict__ table, int hidden) {
    const long long t = blockIdx.x;
    const bf16_t* row = table + ids[t] * (long long)hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[t * hidden + i] = bf16_to_float(row[i]);
}

// Element-wise casts over n elements, grid-stride loops.
extern "C" __global__ void float_to_bf16_kernel(bf16_t* __restrict__ out, const float* __restrict__ x,
                                                long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = float_to_bf16(x[i]);
}

extern "C" __global__ void bf16_to_float_kernel(float* __restrict__ out, const bf16_t* __restrict__ x,
                                                long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = bf16_to_float(x[i]);
}
