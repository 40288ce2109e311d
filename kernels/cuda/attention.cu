// Paged attention over a bf16 KV cache [num_blocks, block_size, num_kv_heads, head_dim], reading
// keys/values through each sequence's block table; float32 scores, softmax and accumulation.
// Spec: kernels/reference.py (paged_attention). Ideas: PagedAttention (Kwon et al., SOSP 2023) and
// vLLM's split-K "v2" decode (partitions + a reduce kernel); FlashAttention's online softmax
// (Dao et al., NeurIPS 2022) for prefill tiles.
//
// Shared arguments: q [T, num_heads, head_dim] float32; block_tables [S, max_blocks] int32;
// seq_lens [S] int32 (context length after this step); query_start_loc [S+1] int32.
// Query head h reads KV head h / (num_heads / num_kv_heads).
#include "common.cuh"

#define DECODE_MAX_DIM_PER_LANE 8  // head_dim <= 256 (and a multiple of 32)

// Decode: every sequence has exactly one new token (row query_start_loc[s]); sequences with no
// token are skipped. One block per (KV head, sequence, partition) serves the whole GQA group.
// grid = (num_kv_heads, S, num_partitions); block = 32k threads;
// dynamic shared memory = (group * head_dim + group * partition_size + 2 * group) floats.
// num_partitions == 1: writes out directly (partition_size >= every seq_len).
// num_partitions > 1: writes tmp_out [S, num_heads, P, head_dim] (normalised per partition),
// max_logits / exp_sums [S, num_heads, P]; paged_attention_reduce_kernel combines them.
extern "C" __global__ void paged_attention_decode_kernel(
    float* __restrict__ out, float* __restrict__ tmp_out, float* __restrict__ max_logits,
    float* __restrict__ exp_sums, const float* __restrict__ q, const bf16_t* __restrict__ key_cache,
    const bf16_t* __restrict__ value_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc, float scale,
    int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
    int partition_size) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int kvh = blockIdx.x, s = blockIdx.y, part = blockIdx.z, P = gridDim.z;
    const int group = num_heads / num_kv_heads;
    const int row = query_start_loc[s];
    if (query_start_loc[s + 1] == row) return;  // no token of this sequence in the step
    const int ctx = seq_lens[s];
    const int tok_begin = part * partition_size;
    const int tok_end = min(ctx, tok_begin + partition_size);
    const int tid = threadIdx.x, lane = tid % FOLIO_WARP, warp = tid / FOLIO_WARP;
    const int nwarps = blockDim.x / FOLIO_WARP;

    if (tok_begin >= ctx) {  // empty partition: contributes nothing to the reduce
        for (int g = tid; g < group; g += blockDim.x) {
            const long long idx = ((long long)s * num_heads + kvh * group + g) * P + part;
            max_logits[idx] = FOLIO_NEG_INF;
            exp_sums[idx] = 0.0f;
        }
        return;
    }

    float* q_s = reinterpret_cast<float*>(smem_raw);        // [group, head_dim], pre-scaled
    float* logits = q_s + group * head_dim;                 // [group, partition_size]
    float* stats = logits + group * partition_size;         // [group] max, [group] sum
    __shared__ float scratch[32];

    const float* q_row = q + ((long long)row * num_heads + kvh * group) * head_dim;
    for (int i = tid; i < group * head_dim; i += blockDim.x) q_s[i] = q_row[i] * scale;
    __syncthreads();

    // scores: one warp per key, lanes over head_dim, every head of the group from one K load
    const int per_lane = head_dim / FOLIO_WARP;
    const int* table = block_tables + (long long)s * max_blocks;
    for (int j = tok_begin + warp; j < tok_end; j += nwarps) {
        const long long blk = table[j / block_size];
        const bf16_t* k = key_cache + ((blk * block_size + j % block_size) * num_kv_heads + kvh) * head_dim;
        float kr[DECODE_MAX_DIM_PER_LANE];
#pragma unroll
        for (int c = 0; c < DECODE_MAX_DIM_PER_LANE; ++c)
            kr[c] = c < per_lane ? bf16_to_float(k[c * FOLIO_WARP + lane]) : 0.0f;
        for (int g = 0; g < group; ++g) {
            float acc = 0.0f;
#pragma unroll
            for (int c = 0; c < DECODE_MAX_DIM_PER_LANE; ++c)
                if (c < per_lane) acc += kr[c] * q_s[g * head_dim + c * FOLIO_WARP + lane];
            acc = warp_sum(acc);
            if (lane == 0) logits[g * partition_size + (j - tok_begin)] = acc;
        }
    }
    __syncthreads();

    // softmax over this partition, per head
    const int n = tok_end - tok_begin;
    for (int g = 0; g < group; ++g) {
        float* lg = logits + g * partition_size;
        float m = FOLIO_NEG_INF;
        for (int i = tid; i < n; i += blockDim.x) m = fmaxf(m, lg[i]);
        m = block_max(m, scratch);
        float sum = 0.0f;
        for (int i = tid; i < n; i += blockDim.x) {
            const float p = expf(lg[i] - m);
            lg[i] = p;
            sum += p;
        }
        sum = block_sum(sum, scratch);
        if (tid == 0) {
            stats[g] = m;
            stats[group + g] = sum;
        }
    }
    __syncthreads();

    // out = P @ V: one (head, dim) pair per thread, consecutive threads on consecutive dims
    for (int i = tid; i < group * head_dim; i += blockDim.x) {
        const int g = i / head_dim, d = i % head_dim;
        const float* p = logits + g * partition_size;
        float acc = 0.0f;
        for (int j = tok_begin; j < tok_end; ++j) {
            const long long blk = table[j / block_size];
            acc += p[j - tok_begin] *
                   bf16_to_float(value_cache[((blk * block_size + j % block_size) * num_kv_heads + kvh) *
                                             head_dim + d]);
        }
        const int h = kvh * group + g;
        const float inv = 1.0f / stats[group + g];
        if (P == 1) {
            out[((long long)row * num_heads + h) * head_dim + d] = acc * inv;
        } else {
            const long long idx = ((long long)s * num_heads + h) * P + part;
            tmp_out[idx * head_dim + d] = acc * inv;
            if (d == 0) {
                max_logits[idx] = stats[g];
                exp_sums[idx] = stats[group + g];
            }
        }
    }
}

// Combines the partitions of paged_attention_decode_kernel: partition p's normalised output is
// weighted by exp_sums[p] * exp(max_logits[p] - max) / sum over partitions of the same.
// grid = (num_heads, S); block = any.
extern "C" __global__ void paged_attention_reduce_kernel(
    float* __restrict__ out, const float* __restrict__ tmp_out, const float* __restrict__ max_logits,
    const float* __restrict__ exp_sums, const int* __restrict__ query_start_loc, int num_heads,
    int head_dim, int num_partitions) {
    const int h = blockIdx.x, s = blockIdx.y, P = num_partitions;
    const int row = query_start_loc[s];
    if (query_start_loc[s + 1] == row) return;
    const long long base = ((long long)s * num_heads + h) * P;
    float m = FOLIO_NEG_INF;
    for (int p = 0; p < P; ++p) m = fmaxf(m, max_logits[base + p]);
    float denom = 0.0f;
    for (int p = 0; p < P; ++p)
        if (exp_sums[base + p] > 0.0f) denom += exp_sums[base + p] * expf(max_logits[base + p] - m);
    const float inv = 1.0f / denom;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int p = 0; p < P; ++p)
            if (exp_sums[base + p] > 0.0f)
                acc += tmp_out[(base + p) * head_dim + d] * exp_sums[base + p] * expf(max_logits[base + p] - m);
        out[((long long)row * num_heads + h) * head_dim + d] = acc * inv;
    }
}

#define PREFILL_BK 32        // keys per tile: one per lane in the softmax step
#define PREFILL_MAX_PAIRS 16 // (row, dim) accumulator pairs per thread, kept in registers

// Prefill / mixed step: any number of new tokens per sequence, causal over the cached context plus
// the new tokens. One block per (query tile, KV head, sequence); a tile holds tokens_per_tile new
// tokens times the GQA group = R rows (row r: token r / group, head kvh * group + r % group).
// Keys are visited in tiles of 32 with an online softmax (running max m, running sum l).
// grid = (ceil(max_query_len / tokens_per_tile), num_kv_heads, S); block = NT (32k) threads with
// R * head_dim <= PREFILL_MAX_PAIRS * NT; dynamic shared memory =
// (32 * (head_dim + 1) + 32 * head_dim + R * head_dim + R * 32 + 3 * R) floats.
extern "C" __global__ void paged_attention_prefill_kernel(
    float* __restrict__ out, const float* __restrict__ q, const bf16_t* __restrict__ key_cache,
    const bf16_t* __restrict__ value_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc, float scale,
    int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
    int tokens_per_tile) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int kvh = blockIdx.y, s = blockIdx.z;
    const int group = num_heads / num_kv_heads;
    const int start = query_start_loc[s], q_len = query_start_loc[s + 1] - start;
    const int t0 = blockIdx.x * tokens_per_tile;
    if (t0 >= q_len) return;  // whole block leaves together
    const int nt = min(tokens_per_tile, q_len - t0);
    const int R = nt * group;
    const int ctx = seq_lens[s];
    const int pos0 = ctx - q_len + t0;  // position of the tile's first token
    const int kend = pos0 + nt;         // keys [0, kend) are visible to some row
    const int tid = threadIdx.x, lane = tid % FOLIO_WARP, warp = tid / FOLIO_WARP;
    const int nwarps = blockDim.x / FOLIO_WARP;
    const int ks = head_dim + 1;  // padded K row: no bank conflicts when lanes walk keys

    float* k_s = reinterpret_cast<float*>(smem_raw);  // [32, head_dim + 1]
    float* v_s = k_s + PREFILL_BK * ks;               // [32, head_dim]
    float* q_s = v_s + PREFILL_BK * head_dim;         // [R, head_dim], pre-scaled
    float* p_s = q_s + R * head_dim;                  // [R, 32] scores, then probabilities
    float* m_s = p_s + R * PREFILL_BK;                // [R] running max
    float* l_s = m_s + R;                             // [R] running sum
    float* a_s = l_s + R;                             // [R] rescale factor of this tile

    for (int i = tid; i < R * head_dim; i += blockDim.x) {
        const int r = i / head_dim, d = i % head_dim;
        const int h = kvh * group + r % group, tok = start + t0 + r / group;
        q_s[i] = q[((long long)tok * num_heads + h) * head_dim + d] * scale;
    }
    for (int r = tid; r < R; r += blockDim.x) {
        m_s[r] = FOLIO_NEG_INF;
        l_s[r] = 0.0f;
    }
    float o[PREFILL_MAX_PAIRS];
#pragma unroll
    for (int k = 0; k < PREFILL_MAX_PAIRS; ++k) o[k] = 0.0f;
    const int* table = block_tables + (long long)s * max_blocks;
    __syncthreads();

    for (int kb = 0; kb < kend; kb += PREFILL_BK) {
        // K/V tile through the block table
        for (int i = tid; i < PREFILL_BK * head_dim; i += blockDim.x) {
            const int c = i / head_dim, d = i % head_dim, j = kb + c;
            float kv = 0.0f, vv = 0.0f;
            if (j < kend) {
                const long long off =
                    (((long long)table[j / block_size] * block_size + j % block_size) * num_kv_heads + kvh) *
                        head_dim + d;
                kv = bf16_to_float(key_cache[off]);
                vv = bf16_to_float(value_cache[off]);
            }
            k_s[c * ks + d] = kv;
            v_s[c * head_dim + d] = vv;
        }
        __syncthreads();
        // scores, causal mask
        for (int i = tid; i < R * PREFILL_BK; i += blockDim.x) {
            const int r = i / PREFILL_BK, c = i % PREFILL_BK, j = kb + c;
            float sc = FOLIO_NEG_INF;
            if (j <= pos0 + r / group) {
                sc = 0.0f;
                for (int d = 0; d < head_dim; ++d) sc += q_s[r * head_dim + d] * k_s[c * ks + d];
            }
            p_s[i] = sc;
        }
        __syncthreads();
        // online softmax: one warp per row, one key per lane
        for (int r = warp; r < R; r += nwarps) {
            const float x = p_s[r * PREFILL_BK + lane];
            const float m_old = m_s[r];
            const float m_new = fmaxf(m_old, warp_max(x));
            const float p = m_new == FOLIO_NEG_INF ? 0.0f : expf(x - m_new);
            const float sum = warp_sum(p);
            p_s[r * PREFILL_BK + lane] = p;
            if (lane == 0) {
                const float alpha = m_new == FOLIO_NEG_INF ? 1.0f : expf(m_old - m_new);
                a_s[r] = alpha;
                l_s[r] = l_s[r] * alpha + sum;
                m_s[r] = m_new;
            }
        }
        __syncthreads();
        // o = o * alpha + P @ V
#pragma unroll
        for (int k = 0; k < PREFILL_MAX_PAIRS; ++k) {
            const int i = tid + k * blockDim.x;
            if (i < R * head_dim) {
                const int r = i / head_dim, d = i % head_dim;
                float acc = o[k] * a_s[r];
                for (int c = 0; c < PREFILL_BK; ++c) acc += p_s[r * PREFILL_BK + c] * v_s[c * head_dim + d];
                o[k] = acc;
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int k = 0; k < PREFILL_MAX_PAIRS; ++k) {
        const int i = tid + k * blockDim.x;
        if (i < R * head_dim) {
            const int r = i / head_dim, d = i % head_dim;
            const int h = kvh * group + r % group, tok = start + t0 + r / group;
            out[((long long)tok * num_heads + h) * head_dim + d] = o[k] / l_s[r];
        }
    }
}
