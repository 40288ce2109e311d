// Device sampler: one token per row of the logits, so a step needs no host round trip between the
// forward pass and the copy of its sampled tokens. Semantics are runtime/worker/sampler.py's (vLLM V1's
// order): penalties and min_tokens masks (apply_penalties_kernel), then per row: greedy = first
// argmax; plain temperature (no top-k, top-p or min-p) = one pass, the Gumbel-max trick (argmax of
// x / T + G with G standard Gumbel noise, a draw from softmax(x / T): Gumbel 1954; Maddison, Tarlow
// and Minka, "A* Sampling", NeurIPS 2014), the noise a counter-based stream keyed by the row's
// uniform (spec: kernels/reference.py sample_gumbel); else temperature, min_p (Nguyen et al. 2024),
// top-k, top-p over the top-k renormalised distribution (Holtzman et al. 2020), and inverse-CDF
// sampling with the row's uniform.
//
// Top-k and top-p thresholds are found without sorting: float32 values map monotonically onto
// 32-bit keys, and a bisection over the keys (32 block-wide passes over the row) finds the exact
// k-th largest value, and the exact smallest kept value of top-p: the least value v such that the
// probability mass of values strictly greater than v is below top_p. Ties with the threshold are
// kept, as in runtime/worker/sampler.py.
#include "common.cuh"

// order-preserving float32 -> uint32 (for finite values and +-inf)
__device__ __forceinline__ unsigned int float_key(float f) {
    const unsigned int u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
#define KEY_NEG_INF 0x007fffffu  // float_key(-inf)
#define KEY_POS_INF 0xff800000u  // float_key(+inf)
__device__ __forceinline__ float key_float(unsigned int k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ int block_sum_int(int v, int* scratch) {
    const int lane = threadIdx.x % FOLIO_WARP, warp = threadIdx.x / FOLIO_WARP;
    const int nwarps = blockDim.x / FOLIO_WARP;
    for (int m = FOLIO_WARP / 2; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int t = lane < nwarps ? scratch[lane] : 0;
    for (int m = FOLIO_WARP / 2; m > 0; m >>= 1) t += __shfl_xor_sync(0xffffffffu, t, m);
    __syncthreads();
    return t;
}

// SplitMix64's output function (Steele, Lea and Flood, "Fast splittable pseudorandom number
// generators", OOPSLA 2014).
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Standard Gumbel noise for token i of a row whose stream is seeded with `seed` (= mix64(key)):
// output i + 1 of SplitMix64 from state `seed`, its top 23 bits as u = (k + 0.5) / 2^23 in (0, 1)
// (exact in float32), then -log(-log(u)).
__device__ __forceinline__ float gumbel_noise(unsigned long long seed, int i) {
    const unsigned long long z = mix64(seed + (unsigned long long)(i + 1) * 0x9E3779B97F4A7C15ull);
    const float u = ((float)(unsigned int)(z >> 41) + 0.5f) * 1.1920928955078125e-7f;  // 2^-23
    return -logf(-logf(u));
}

// (value, index) of the largest value, the smallest index among equal values.
__device__ __forceinline__ void block_argmax(float& v, int& idx, float* fscratch, int* iscratch) {
    const int lane = threadIdx.x % FOLIO_WARP, warp = threadIdx.x / FOLIO_WARP;
    const int nwarps = blockDim.x / FOLIO_WARP;
    for (int m = FOLIO_WARP / 2; m > 0; m >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, m);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, m);
        if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
    }
    if (lane == 0) { fscratch[warp] = v; iscratch[warp] = idx; }
    __syncthreads();
    v = lane < nwarps ? fscratch[lane] : FOLIO_NEG_INF;
    idx = lane < nwarps ? iscratch[lane] : 0x7fffffff;
    for (int m = FOLIO_WARP / 2; m > 0; m >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, m);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, m);
        if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
    }
    __syncthreads();
}

// out[r] = the token of row r. logits [R, V] float32 (penalties already applied); params [R, 4]
// float32 rows (temperature, top_k, top_p, min_p): temperature 0 = greedy, top_k <= 0 or >= V =
// off, top_p >= 1 = off, min_p <= 0 = off; uniforms [R] float64 in (0, 1] (a plain-temperature
// row's 64 bits are its Gumbel stream's key). A row whose every logit is -inf gets V - 1 (the
// greedy path: 0). grid = (R), block = 256 threads.
// Occupancy of sample_kernel: >= 4 blocks of 256 threads per SM (memory-bound passes over a row:
// half the SM's threads, and a batch of up to 4 x 132 rows in one wave on an H100)
extern "C" __global__ void sample_kernel(long long* __restrict__ out, const float* __restrict__ logits,
                                         const float* __restrict__ params, const double* __restrict__ uniforms,
                                         int V) {
    __shared__ float fscratch[32];
    __shared__ int iscratch[32];
    __shared__ float tscratch[32];
    __shared__ int lscratch[32];
    const int r = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    const float* x = logits + (long long)r * V;
    const float temp = params[4 * r], top_p = params[4 * r + 2], min_p = params[4 * r + 3];
    const int top_k = (int)params[4 * r + 1];

    if (!(temp > 0.0f)) {  // greedy: first argmax of the logits
        float v = FOLIO_NEG_INF;
        int idx = 0x7fffffff;
        for (int i = tid; i < V; i += nt)
            if (x[i] > v || (x[i] == v && i < idx)) { v = x[i]; idx = i; }
        block_argmax(v, idx, fscratch, iscratch);
        if (tid == 0) out[r] = idx == 0x7fffffff ? 0 : idx;
        return;
    }

    if ((top_k <= 0 || top_k >= V) && !(top_p < 1.0f) && !(min_p > 0.0f)) {
        // plain temperature: one pass, argmax of x / T + Gumbel noise (masked tokens stay -inf)
        const unsigned long long seed = mix64(reinterpret_cast<const unsigned long long*>(uniforms)[r]);
        float v = FOLIO_NEG_INF;
        int idx = 0x7fffffff;
        for (int i = tid; i < V; i += nt) {
            const float s = x[i] / temp + gumbel_noise(seed, i);
            if (s > FOLIO_NEG_INF && (s > v || (s == v && i < idx))) { v = s; idx = i; }
        }
        block_argmax(v, idx, fscratch, iscratch);
        if (tid == 0) out[r] = idx == 0x7fffffff ? V - 1 : idx;
        return;
    }

    // values after temperature; m = their max
    float m = FOLIO_NEG_INF;
    for (int i = tid; i < V; i += nt) m = fmaxf(m, x[i] / temp);
    m = block_max(m, fscratch);

    // w(i): the value if min_p keeps it, else -inf
#define FOLIO_W(i) ((min_p > 0.0f && expf(x[i] / temp - m) < min_p) ? FOLIO_NEG_INF : x[i] / temp)

    // top-k: the k-th largest w (largest key K with count(w >= K) >= k)
    float tk = FOLIO_NEG_INF;
    if (top_k > 0 && top_k < V) {
        unsigned int lo = KEY_NEG_INF, hi = KEY_POS_INF;  // count(w >= -inf) = V >= top_k
        while (lo < hi) {
            const unsigned int mid = lo + (hi - lo) / 2u + 1u;
            int c = 0;
            for (int i = tid; i < V; i += nt) c += float_key(FOLIO_W(i)) >= mid;
            if (block_sum_int(c, iscratch) >= top_k) lo = mid; else hi = mid - 1u;
        }
        tk = key_float(lo);
    }

    // top-p over the kept set W = {w >= tk} (finite values only carry mass)
    float tp = FOLIO_NEG_INF;
    if (top_p < 1.0f) {
        float z = 0.0f;
        for (int i = tid; i < V; i += nt) {
            const float w = FOLIO_W(i);
            if (w >= tk && w > FOLIO_NEG_INF) z += expf(w - m);
        }
        z = block_sum(z, fscratch);
        const float target = top_p * z;
        // least K with mass(w > K) < target: false at -inf (mass z), true at +inf (mass 0)
        unsigned int lo = KEY_NEG_INF, hi = KEY_POS_INF;
        while (lo < hi) {
            const unsigned int mid = lo + (hi - lo) / 2u;
            const float vmid = key_float(mid);
            float mass = 0.0f;
            for (int i = tid; i < V; i += nt) {
                const float w = FOLIO_W(i);
                if (w >= tk && w > vmid && w > FOLIO_NEG_INF) mass += expf(w - m);
            }
            if (block_sum(mass, fscratch) < target) hi = mid; else lo = mid + 1u;
        }
        tp = key_float(lo);
    }
    const float thresh = fmaxf(tk, tp);

    // inverse CDF over the kept values, in index order: first i with cumsum(e)[i] >= u * sum(e).
    // The scan adds in another order than the block sum of `total`, so with u near 1 the running
    // sum can end just below u * total: then the last kept token is taken. Only kept tokens are
    // ever picked.
    float total = 0.0f;
    for (int i = tid; i < V; i += nt) {
        const float w = FOLIO_W(i);
        if (w >= thresh && w > FOLIO_NEG_INF) total += expf(w - m);
    }
    total = block_sum(total, fscratch);
    const double target = uniforms[r] * (double)total;
    const int lane = tid % FOLIO_WARP, warp = tid / FOLIO_WARP, nwarps = nt / FOLIO_WARP;
    float base = 0.0f;
    int picked = -1, last_kept = -1;
    for (int c0 = 0; c0 < V; c0 += nt) {
        const int i = c0 + tid;
        float e = 0.0f;
        bool is_kept = false;
        if (i < V) {
            const float w = FOLIO_W(i);
            if (w >= thresh && w > FOLIO_NEG_INF) { e = expf(w - m); is_kept = true; }
        }
        int kept = is_kept ? i : -1;
        for (int mm = FOLIO_WARP / 2; mm > 0; mm >>= 1) kept = max(kept, __shfl_xor_sync(0xffffffffu, kept, mm));
        if (lane == 0) lscratch[warp] = kept;
        // inclusive block scan: within the warp, then warp totals
        float s = e;
        for (int d = 1; d < FOLIO_WARP; d <<= 1) {
            const float o = __shfl_up_sync(0xffffffffu, s, d);
            if (lane >= d) s += o;
        }
        if (lane == FOLIO_WARP - 1) tscratch[warp] = s;
        __syncthreads();
        float before = 0.0f;
        for (int w = 0; w < warp; ++w) before += tscratch[w];
        float chunk = 0.0f;
        for (int w = 0; w < nwarps; ++w) chunk += tscratch[w];
        const float cum = base + before + s;
        // (only a kept token: the scan's sums are grouped by warp, so the running sum is not
        // monotone in float32 and can first reach the target on a masked token after a kept one)
        int hit = (is_kept && (double)cum >= target) ? i : 0x7fffffff;
        // smallest index that reaches the target
        for (int mm = FOLIO_WARP / 2; mm > 0; mm >>= 1) hit = min(hit, __shfl_xor_sync(0xffffffffu, hit, mm));
        if (lane == 0) iscratch[warp] = hit;
        __syncthreads();
        int best = 0x7fffffff;
        for (int w = 0; w < nwarps; ++w) { best = min(best, iscratch[w]); last_kept = max(last_kept, lscratch[w]); }
        __syncthreads();
        if (best != 0x7fffffff) {
            picked = best;
            break;
        }
        base += chunk;
    }
#undef FOLIO_W
    if (picked < 0) picked = last_kept >= 0 ? last_kept : V - 1;  // (no kept token: only if every value is -inf)
    if (tid == 0) out[r] = picked;
}

// Penalties and min_tokens masks, in place on logits [R, V] (vLLM semantics): entries [N, 3] int64
// rows (r * V + token, count of the token in r's output, flags), one per (row, token); flags bit 0:
// mask to -inf (min_tokens: EOS / stop tokens), bit 1: seen in the prompt or output (repetition
// penalty: positive logits divided by it, negative ones multiplied); then frequency * count +
// presence * (count > 0) is subtracted. row_params [R, 3] float32: (repetition, frequency,
// presence). grid = (ceil(N / 256)), block = 256.
extern "C" __global__ void apply_penalties_kernel(float* __restrict__ logits, const long long* __restrict__ entries,
                                                  const float* __restrict__ row_params, long long n, int V) {
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    const long long idx = entries[3 * e], count = entries[3 * e + 1], flags = entries[3 * e + 2];
    const long long r = idx / V;
    float v = logits[idx];
    if (flags & 1) {
        v = FOLIO_NEG_INF;
    } else {
        if (flags & 2) {
            const float rep = row_params[3 * r];
            v = v > 0.0f ? v / rep : v * rep;
        }
        v -= row_params[3 * r + 1] * (float)count + (count > 0 ? row_params[3 * r + 2] : 0.0f);
    }
    logits[idx] = v;
}

// Structured outputs: logits[r, t] = -inf where bit (t % 32) of bitmask[r, t / 32] is clear (the
// grammar forbids token t next; llguidance's / xgrammar's layout). bitmask [R, W] int32, W >=
// ceil(V / 32). One thread per (row, token): grid = (ceil(V / 256), R), block = 256. Semantics of
// runtime/worker/sampler.py apply_token_bitmask; applied before penalties and sample_kernel.
extern "C" __global__ void apply_token_bitmask_kernel(float* __restrict__ logits, const int* __restrict__ bitmask,
                                                      int V, int W) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const long long r = blockIdx.y;
    if (t >= V) return;
    const unsigned int word = (unsigned int)bitmask[r * W + (t >> 5)];
    if (!((word >> (t & 31)) & 1u)) logits[r * V + t] = FOLIO_NEG_INF;
}
