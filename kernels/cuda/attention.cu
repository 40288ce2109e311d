// Paged attention over a bf16 KV cache [num_blocks, block_size, num_kv_heads, head_dim], reading
// keys/values through each sequence's block table; float32 scores, softmax and accumulation, the
// output rounded to bf16 in the kernel (it is the o_proj matmul's input).
// Spec: kernels/reference.py (paged_attention). Ideas: PagedAttention (Kwon et al., SOSP 2023) and
// vLLM's split-K "v2" decode (partitions + a reduce kernel); FlashAttention-2's online softmax and
// register-resident probabilities for the P @ V product on tensor cores (Dao, 2023).
//
// Shared arguments: q [T, num_heads, head_dim] bf16; block_tables [S, max_blocks] int32;
// seq_lens [S] int32 (context length after this step); query_start_loc [S+1] int32; out
// [T, num_heads, head_dim] bf16 (rows of tokens that belong to no sequence are not written).
// Query head h reads KV head h / (num_heads / num_kv_heads). head_dim is 32, 64, 128 or 256.
#include "common.cuh"

#define DECODE_KEYS_PER_LANE 2  // keys whose K and V rows a lane loads before it uses them

// Decode, FlashDecoding-style (Dao et al., "Flash-Decoding for long-context inference", 2023):
// every sequence has exactly one new token (row query_start_loc[s]); sequences with no token are
// skipped. One block per (KV head, sequence, partition) serves the whole GQA group, HPP query
// heads per pass over the partition's keys (one pass when group <= HPP), so each K and V row is
// read once per pass for all of them. The partition's block-table entries are staged in shared
// memory first. A key row is split over head_dim / 8 lanes (16 bytes, 8 dims each); a lane loads
// the K and V rows of DECODE_KEYS_PER_LANE keys (64 bytes in flight) before it computes, then
// folds them into its own running (max m, sum l, 8 dims of P @ V) per head: one online-softmax pass
// (Milakov and Gimelshein, "Online normalizer calculation for softmax", 2018), no score buffer.
// The lanes of a warp, then the warps (through shared memory), merge their (m, l, acc) at the end.
// grid = (num_kv_heads, S, num_partitions); block = 128 threads; dynamic shared memory =
// 4 * (group * head_dim + table_len + 4 * HPP * (head_dim + 2)) bytes, table_len =
// partition_size / block_size + 2 rounded up to a multiple of 4.
// num_partitions == 1: writes out (bf16) directly (partition_size >= every seq_len).
// num_partitions > 1: writes tmp_out [S, num_heads, P, head_dim] (float32, normalised per
// partition), max_logits / exp_sums [S, num_heads, P]; paged_attention_reduce_kernel combines them.
__device__ __forceinline__ void online_merge(float& m, float& l, float* acc, float m2, float l2, const float* acc2) {
    const float mn = fmaxf(m, m2);
    const float c1 = m == FOLIO_NEG_INF ? 0.0f : expf(m - mn), c2 = m2 == FOLIO_NEG_INF ? 0.0f : expf(m2 - mn);
    l = l * c1 + l2 * c2;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = acc[e] * c1 + acc2[e] * c2;
    m = mn;
}

template <int HPP>
__device__ __forceinline__ void paged_attention_decode(
    unsigned char* smem_raw, bf16_t* __restrict__ out, float* __restrict__ tmp_out, float* __restrict__ max_logits,
    float* __restrict__ exp_sums, const bf16_t* __restrict__ q, const bf16_t* __restrict__ key_cache,
    const bf16_t* __restrict__ value_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc, float scale,
    int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks, int partition_size) {
    constexpr int U = DECODE_KEYS_PER_LANE;
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

    const int first_blk = tok_begin / block_size;
    const int nblk = (tok_end - 1) / block_size - first_blk + 1;
    const int table_len = ((partition_size / block_size + 2) + 3) / 4 * 4;
    float* q_s = reinterpret_cast<float*>(smem_raw);         // [group, head_dim], pre-scaled
    int* tbl = reinterpret_cast<int*>(q_s + group * head_dim);  // [nblk] physical blocks
    float* red = reinterpret_cast<float*>(tbl + table_len);    // [nwarps, HPP, head_dim + 2]: acc, m, l

    const bf16_t* q_row = q + ((long long)row * num_heads + kvh * group) * head_dim;
    for (int i = tid; i < group * head_dim; i += blockDim.x) q_s[i] = bf16_to_float(q_row[i]) * scale;
    const int* table = block_tables + (long long)s * max_blocks + first_blk;
    for (int i = tid; i < nblk; i += blockDim.x) tbl[i] = table[i];
    __syncthreads();

    const int lpk = head_dim / 8;            // lanes per key, a power of two 4..32
    const int kpw = FOLIO_WARP / lpk;        // keys per warp and load slot
    const int sub = lane % lpk, kslot = lane / lpk;
    const int n = tok_end - tok_begin;
    const long long head_off = (long long)kvh * head_dim + sub * 8;
    for (int g0 = 0; g0 < group; g0 += HPP) {
        const int gn = min(HPP, group - g0);
        float m[HPP], l[HPP], acc[HPP][8];
#pragma unroll
        for (int gi = 0; gi < HPP; ++gi) {
            m[gi] = FOLIO_NEG_INF;
            l[gi] = 0.0f;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[gi][e] = 0.0f;
        }
        for (int base = warp * kpw * U; base < n; base += nwarps * kpw * U) {  // warp-uniform bound
            uint4 kr[U], vr[U];
            bool valid[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {  // every load first: 2 U 16-byte loads in flight
                const int jj = base + u * kpw + kslot;
                valid[u] = jj < n;
                kr[u] = vr[u] = make_uint4(0u, 0u, 0u, 0u);
                if (valid[u]) {
                    const int j = tok_begin + jj;
                    const long long off = ((long long)tbl[j / block_size - first_blk] * block_size + j % block_size) *
                                              num_kv_heads * head_dim + head_off;
                    kr[u] = *reinterpret_cast<const uint4*>(key_cache + off);
                    vr[u] = *reinterpret_cast<const uint4*>(value_cache + off);
                }
            }
#pragma unroll
            for (int gi = 0; gi < HPP; ++gi) {
                if (gi < gn) {  // uniform over the block
                    const float* qg = q_s + (g0 + gi) * head_dim + sub * 8;
                    float sc[U];
                    float mn = m[gi];
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        const unsigned int w[4] = {kr[u].x, kr[u].y, kr[u].z, kr[u].w};
                        float a = 0.0f;
#pragma unroll
                        for (int e = 0; e < 4; ++e) a += bf16_lo(w[e]) * qg[2 * e] + bf16_hi(w[e]) * qg[2 * e + 1];
                        for (int mm = lpk / 2; mm > 0; mm >>= 1) a += __shfl_xor_sync(0xffffffffu, a, mm);
                        sc[u] = valid[u] ? a : FOLIO_NEG_INF;
                        mn = fmaxf(mn, sc[u]);
                    }
                    if (mn == FOLIO_NEG_INF) continue;  // this lane has no key yet
                    const float c = expf(m[gi] - mn);   // 0 while m is -inf: one rescale per U keys
                    l[gi] *= c;
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[gi][e] *= c;
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        const float pr = expf(sc[u] - mn);  // 0 for a key past the end
                        l[gi] += pr;
                        const unsigned int w[4] = {vr[u].x, vr[u].y, vr[u].z, vr[u].w};
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            acc[gi][2 * e] += pr * bf16_lo(w[e]);
                            acc[gi][2 * e + 1] += pr * bf16_hi(w[e]);
                        }
                    }
                    m[gi] = mn;
                }
            }
        }
        // lanes sub, sub + lpk, ... of a warp hold the same dims of other keys: merge them
#pragma unroll
        for (int gi = 0; gi < HPP; ++gi)
            for (int mm = lpk; mm < FOLIO_WARP; mm <<= 1) {
                float a2[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) a2[e] = __shfl_xor_sync(0xffffffffu, acc[gi][e], mm);
                const float m2 = __shfl_xor_sync(0xffffffffu, m[gi], mm);
                const float l2 = __shfl_xor_sync(0xffffffffu, l[gi], mm);
                online_merge(m[gi], l[gi], acc[gi], m2, l2, a2);
            }
        if (kslot == 0)
            for (int gi = 0; gi < gn; ++gi) {
                float* r = red + (warp * HPP + gi) * (head_dim + 2);
#pragma unroll
                for (int e = 0; e < 8; ++e) r[sub * 8 + e] = acc[gi][e];
                if (sub == 0) {
                    r[head_dim] = m[gi];
                    r[head_dim + 1] = l[gi];
                }
            }
        __syncthreads();
        // the warps' partial results, merged: out = sum_w c_w acc_w / sum_w c_w l_w
        for (int i = tid; i < gn * head_dim; i += blockDim.x) {
            const int gi = i / head_dim, d = i % head_dim, g = g0 + gi;
            float mx = FOLIO_NEG_INF;
            for (int w = 0; w < nwarps; ++w) mx = fmaxf(mx, red[(w * HPP + gi) * (head_dim + 2) + head_dim]);
            float o = 0.0f, den = 0.0f;
            for (int w = 0; w < nwarps; ++w) {
                const float* r = red + (w * HPP + gi) * (head_dim + 2);
                const float c = r[head_dim] == FOLIO_NEG_INF ? 0.0f : expf(r[head_dim] - mx);
                o += r[d] * c;
                den += r[head_dim + 1] * c;
            }
            o *= 1.0f / den;
            const int h = kvh * group + g;
            if (P == 1) {
                out[((long long)row * num_heads + h) * head_dim + d] = float_to_bf16(o);
            } else {
                const long long idx = ((long long)s * num_heads + h) * P + part;
                tmp_out[idx * head_dim + d] = o;
                if (d == 0) {
                    max_logits[idx] = mx;
                    exp_sums[idx] = den;
                }
            }
        }
        __syncthreads();  // red is reused by the next pass
    }
}

// Entry points by heads per pass: the table takes h4 for GQA groups of up to 4 (fewer registers:
// 4 x 8 accumulators a lane), h8 for larger groups (passes of 8 heads).
// Occupancy of paged_attention_decode_h4_kernel: >= 4 blocks of 128 threads per SM with 10512 bytes of
// dynamic shared memory (Llama-3.1-8B: group 4, head_dim 128, 512-token partitions, 16-token blocks):
// each lane has 2 keys' K and V rows (64 bytes) in flight, so 4 blocks keep 32 KB in flight per SM,
// above the ~25 KB that an H200's bandwidth-latency product (4.8 TB/s x ~0.7 us over 132 SMs) asks.
// Occupancy of paged_attention_decode_h8_kernel: >= 3 blocks of 128 threads per SM with 20880 bytes of
// dynamic shared memory (group 8, head_dim 128): 8 x 8 accumulators a lane; 24 KB in flight per SM.
#define FOLIO_DECODE_PARAMS                                                                          \
    bf16_t *__restrict__ out, float *__restrict__ tmp_out, float *__restrict__ max_logits,             \
        float *__restrict__ exp_sums, const bf16_t *__restrict__ q, const bf16_t *__restrict__ key_cache, \
        const bf16_t *__restrict__ value_cache, const int *__restrict__ block_tables,                  \
        const int *__restrict__ seq_lens, const int *__restrict__ query_start_loc, float scale,       \
        int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks, int partition_size
#define FOLIO_DECODE_BODY(HPP)                                                                       \
    {                                                                                                \
        extern __shared__ __align__(16) unsigned char smem_raw[];                                    \
        paged_attention_decode<HPP>(smem_raw, out, tmp_out, max_logits, exp_sums, q, key_cache,       \
                                    value_cache, block_tables, seq_lens, query_start_loc, scale,     \
                                    num_heads, num_kv_heads, head_dim, block_size, max_blocks,       \
                                    partition_size);                                                 \
    }
extern "C" __global__ void paged_attention_decode_h4_kernel(FOLIO_DECODE_PARAMS) FOLIO_DECODE_BODY(4)
extern "C" __global__ void paged_attention_decode_h8_kernel(FOLIO_DECODE_PARAMS) FOLIO_DECODE_BODY(8)

// Combines the partitions of paged_attention_decode_h*_kernel: partition p's normalised output is
// weighted by exp_sums[p] * exp(max_logits[p] - max) / sum over partitions of the same; the
// result is rounded to bf16. grid = (num_heads, S); block = any.
// Occupancy of paged_attention_reduce_kernel: >= 16 blocks of 128 threads per SM (all 2048 threads:
// a memory-bound pass over the partials)
extern "C" __global__ void paged_attention_reduce_kernel(
    bf16_t* __restrict__ out, const float* __restrict__ tmp_out, const float* __restrict__ max_logits,
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
        out[((long long)row * num_heads + h) * head_dim + d] = float_to_bf16(acc * inv);
    }
}

// ---- prefill / mixed steps on tensor cores ------------------------------------------------------
// One block of 4 warps per (query tile, KV head, sequence). The tile's 64 rows are
// tokens_per_tile new tokens times the GQA group (row r: token r / group, query head
// kvh * group + r % group), so a K/V tile in shared memory serves every head of the group. Each
// warp owns 16 rows: S = Q K^T and O += P V run on mma.sync m16n8k16 (bf16 in, float32
// accumulate); the online softmax (running max m, running sum l) works on the S fragments in
// registers, and P is rounded to bf16 in registers as the A operand of P V (FlashAttention-2).
// Causal over the cached context plus the new tokens; KV tiles of BK keys.
// Shared memory (bf16): Q [64][D + 8], K [BK][D + 8], V transposed [D][BK + 8] (the 8-element pad
// keeps rows 16-byte aligned and spreads the fragment reads over the banks).
#define PREFILL_ROWS 64

template <int D, int BK>
__device__ __forceinline__ void prefill_attention_tile(
    unsigned char* smem, bf16_t* __restrict__ out, const bf16_t* __restrict__ q, const bf16_t* __restrict__ key_cache,
    const bf16_t* __restrict__ value_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc, float scale,
    int num_heads, int num_kv_heads, int block_size, int max_blocks, int tokens_per_tile) {
    constexpr int QS = D + 8, KS = D + 8, VS = BK + 8;
    constexpr int NT_S = BK / 8;   // S n-tiles (8 keys each)
    constexpr int NT_O = D / 8;    // O n-tiles (8 dims each)
    constexpr int KSTEP = D / 16;  // k-steps of Q K^T
    bf16_t* q_s = reinterpret_cast<bf16_t*>(smem);
    bf16_t* k_s = q_s + PREFILL_ROWS * QS;
    bf16_t* vt_s = k_s + BK * KS;

    const int kvh = blockIdx.y, s = blockIdx.z;
    const int group = num_heads / num_kv_heads;
    const int start = query_start_loc[s], q_len = query_start_loc[s + 1] - start;
    const int t0 = blockIdx.x * tokens_per_tile;
    if (t0 >= q_len) return;  // whole block leaves together
    const int nt = min(tokens_per_tile, q_len - t0);
    const int R = nt * group;               // valid rows
    const int ctx = seq_lens[s];
    const int pos0 = ctx - q_len + t0;      // position of the tile's first token
    const int kend = pos0 + nt;             // keys [0, kend) are visible to some row
    const int tid = threadIdx.x, lane = tid % FOLIO_WARP, warp = tid / FOLIO_WARP;
    const int g = lane >> 2, t4 = lane & 3;
    const int* table = block_tables + (long long)s * max_blocks;

    // Q tile, 16 bytes per load; rows past R are zero
    for (int i = tid; i < PREFILL_ROWS * (D / 8); i += blockDim.x) {
        const int r = i / (D / 8), c = (i % (D / 8)) * 8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (r < R) {
            const int h = kvh * group + r % group, tok = start + t0 + r / group;
            v = *reinterpret_cast<const uint4*>(q + ((long long)tok * num_heads + h) * D + c);
        }
        *reinterpret_cast<uint4*>(q_s + r * QS + c) = v;
    }

    // this lane's two rows: r_lo = warp * 16 + g and r_hi = r_lo + 8
    const int r_lo = warp * 16 + g, r_hi = r_lo + 8;
    const int pos_lo = r_lo < R ? pos0 + r_lo / group : -1;  // -1: padding row, sees no key
    const int pos_hi = r_hi < R ? pos0 + r_hi / group : -1;
    float m_lo = FOLIO_NEG_INF, m_hi = FOLIO_NEG_INF, l_lo = 0.0f, l_hi = 0.0f;
    float o[NT_O][4];
#pragma unroll
    for (int j = 0; j < NT_O; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;

    for (int kb = 0; kb < kend; kb += BK) {
        __syncthreads();  // the previous tile's K/V reads are done (and Q is stored, first time)
        for (int i = tid; i < BK * (D / 8); i += blockDim.x) {
            const int c = i / (D / 8), d = (i % (D / 8)) * 8, j = kb + c;
            uint4 kv = make_uint4(0u, 0u, 0u, 0u), vv = make_uint4(0u, 0u, 0u, 0u);
            if (j < kend) {
                const long long off =
                    (((long long)table[j / block_size] * block_size + j % block_size) * num_kv_heads + kvh) * D + d;
                kv = *reinterpret_cast<const uint4*>(key_cache + off);
                vv = *reinterpret_cast<const uint4*>(value_cache + off);
            }
            *reinterpret_cast<uint4*>(k_s + c * KS + d) = kv;
            const unsigned int w[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                vt_s[(d + 2 * e) * VS + c] = (bf16_t)(w[e] & 0xffffu);
                vt_s[(d + 2 * e + 1) * VS + c] = (bf16_t)(w[e] >> 16);
            }
        }
        __syncthreads();

        // S = Q K^T for this warp's 16 rows and the BK keys
        float sc[NT_S][4];
#pragma unroll
        for (int j = 0; j < NT_S; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KSTEP; ++ks) {
            const int k0 = ks * 16 + 2 * t4;
            const unsigned int a[4] = {
                *reinterpret_cast<const unsigned int*>(q_s + r_lo * QS + k0),
                *reinterpret_cast<const unsigned int*>(q_s + r_hi * QS + k0),
                *reinterpret_cast<const unsigned int*>(q_s + r_lo * QS + k0 + 8),
                *reinterpret_cast<const unsigned int*>(q_s + r_hi * QS + k0 + 8)};
#pragma unroll
            for (int j = 0; j < NT_S; ++j) {
                const bf16_t* kr = k_s + (j * 8 + g) * KS + k0;
                const unsigned int b[2] = {*reinterpret_cast<const unsigned int*>(kr),
                                           *reinterpret_cast<const unsigned int*>(kr + 8)};
                mma_bf16_16816(sc[j], a, b);
            }
        }

        // scale, causal mask, online softmax: this lane holds rows r_lo (sc[j][0..1]) and r_hi
        // (sc[j][2..3]) at keys kb + 8j + 2 t4 + {0, 1}; a row's 4 lanes reduce with xor 1, 2
        float mx_lo = FOLIO_NEG_INF, mx_hi = FOLIO_NEG_INF;
#pragma unroll
        for (int j = 0; j < NT_S; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = kb + j * 8 + 2 * t4 + (e & 1);
                const int pos = e < 2 ? pos_lo : pos_hi;
                const float v = key <= pos ? sc[j][e] * scale : FOLIO_NEG_INF;
                sc[j][e] = v;
                if (e < 2) mx_lo = fmaxf(mx_lo, v); else mx_hi = fmaxf(mx_hi, v);
            }
        for (int m = 1; m < 4; m <<= 1) {
            mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, m));
            mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, m));
        }
        const float mn_lo = fmaxf(m_lo, mx_lo), mn_hi = fmaxf(m_hi, mx_hi);
        const float al_lo = mn_lo == FOLIO_NEG_INF ? 1.0f : expf(m_lo - mn_lo);
        const float al_hi = mn_hi == FOLIO_NEG_INF ? 1.0f : expf(m_hi - mn_hi);
        m_lo = mn_lo;
        m_hi = mn_hi;
        float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
        for (int j = 0; j < NT_S; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float mref = e < 2 ? mn_lo : mn_hi;
                const float p = sc[j][e] == FOLIO_NEG_INF ? 0.0f : expf(sc[j][e] - mref);
                sc[j][e] = p;
                if (e < 2) sum_lo += p; else sum_hi += p;
            }
        for (int m = 1; m < 4; m <<= 1) {
            sum_lo += __shfl_xor_sync(0xffffffffu, sum_lo, m);
            sum_hi += __shfl_xor_sync(0xffffffffu, sum_hi, m);
        }
        l_lo = l_lo * al_lo + sum_lo;
        l_hi = l_hi * al_hi + sum_hi;
#pragma unroll
        for (int j = 0; j < NT_O; ++j) {
            o[j][0] *= al_lo; o[j][1] *= al_lo;
            o[j][2] *= al_hi; o[j][3] *= al_hi;
        }

        // O += P V: the S fragments of key tiles 2kk and 2kk+1 are exactly P's A fragment
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            const unsigned int a[4] = {pack_bf16(sc[2 * kk][0], sc[2 * kk][1]),
                                       pack_bf16(sc[2 * kk][2], sc[2 * kk][3]),
                                       pack_bf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                                       pack_bf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
            for (int j = 0; j < NT_O; ++j) {
                const bf16_t* vr = vt_s + (j * 8 + g) * VS + kk * 16 + 2 * t4;
                const unsigned int b[2] = {*reinterpret_cast<const unsigned int*>(vr),
                                           *reinterpret_cast<const unsigned int*>(vr + 8)};
                mma_bf16_16816(o[j], a, b);
            }
        }
    }

    // normalise, round to bf16 and store this lane's (row, 2 dims) pairs as 32-bit words
    const float inv_lo = r_lo < R ? 1.0f / l_lo : 0.0f, inv_hi = r_hi < R ? 1.0f / l_hi : 0.0f;
#pragma unroll
    for (int j = 0; j < NT_O; ++j) {
        const int d = j * 8 + 2 * t4;
        if (r_lo < R) {
            const int h = kvh * group + r_lo % group, tok = start + t0 + r_lo / group;
            *reinterpret_cast<unsigned int*>(out + ((long long)tok * num_heads + h) * D + d) =
                pack_bf16(o[j][0] * inv_lo, o[j][1] * inv_lo);
        }
        if (r_hi < R) {
            const int h = kvh * group + r_hi % group, tok = start + t0 + r_hi / group;
            *reinterpret_cast<unsigned int*>(out + ((long long)tok * num_heads + h) * D + d) =
                pack_bf16(o[j][2] * inv_hi, o[j][3] * inv_hi);
        }
    }
}

// Entry points, one per head_dim (the fragment arrays are sized at compile time).
// grid = (ceil(max_query_len / tokens_per_tile), num_kv_heads, S); block = 128 threads;
// tokens_per_tile = 64 / group; dynamic shared memory = 2 * (64 * (D + 8) + BK * (D + 8) +
// D * (BK + 8)) bytes with BK = 64 (32 for head_dim 256).
// Occupancy of paged_attention_prefill_d32_kernel: >= 2 blocks of 128 threads per SM with 14848 bytes
// of dynamic shared memory
// Occupancy of paged_attention_prefill_d64_kernel: >= 2 blocks of 128 threads per SM with 27648 bytes
// of dynamic shared memory
// Occupancy of paged_attention_prefill_d128_kernel: >= 2 blocks of 128 threads per SM with 53248 bytes
// of dynamic shared memory
// Occupancy of paged_attention_prefill_d256_kernel: >= 2 blocks of 128 threads per SM with 71168 bytes
// of dynamic shared memory
// (two blocks: the K/V tile loads are synchronous, so while one block loads the other's mma.sync
// keep the tensor cores busy; the S and O fragments take 110-250 registers per thread)
#define FOLIO_PREFILL_PARAMS                                                                        \
    bf16_t *__restrict__ out, const bf16_t *__restrict__ q, const bf16_t *__restrict__ key_cache,    \
        const bf16_t *__restrict__ value_cache, const int *__restrict__ block_tables,                \
        const int *__restrict__ seq_lens, const int *__restrict__ query_start_loc, float scale,     \
        int num_heads, int num_kv_heads, int block_size, int max_blocks, int tokens_per_tile
#define FOLIO_PREFILL_BODY(D, BK)                                                                   \
    {                                                                                               \
        extern __shared__ __align__(16) unsigned char smem_raw[];                                   \
        prefill_attention_tile<D, BK>(smem_raw, out, q, key_cache, value_cache, block_tables,        \
                                      seq_lens, query_start_loc, scale, num_heads, num_kv_heads,    \
                                      block_size, max_blocks, tokens_per_tile);                     \
    }
extern "C" __global__ void paged_attention_prefill_d32_kernel(FOLIO_PREFILL_PARAMS) FOLIO_PREFILL_BODY(32, 64)
extern "C" __global__ void paged_attention_prefill_d64_kernel(FOLIO_PREFILL_PARAMS) FOLIO_PREFILL_BODY(64, 64)
extern "C" __global__ void paged_attention_prefill_d128_kernel(FOLIO_PREFILL_PARAMS) FOLIO_PREFILL_BODY(128, 64)
extern "C" __global__ void paged_attention_prefill_d256_kernel(FOLIO_PREFILL_PARAMS) FOLIO_PREFILL_BODY(256, 32)
