// KV-cache writes: the fused append of this step's keys and values into their paged slots, and the
// block copy used for copy-on-write. Cache layout [num_blocks, block_size, num_kv_heads, head_dim]
// of bf16 bit patterns. Specs: kernels/reference.py (reshape_and_cache, copy_blocks); the idea is
// vLLM's reshape_and_cache / copy_blocks (PagedAttention, Kwon et al., SOSP 2023).
#include "common.cuh"

// key/value: [T, num_kv_heads, head_dim] float32 rows, `key_stride`/`value_stride` elements apart.
// Token t goes to slot slot_mapping[t] (= block * block_size + offset, which is also its row in the
// cache seen as [num_blocks * block_size, num_kv_heads, head_dim]); slot -1 is skipped.
// grid = (T), block = any.
extern "C" __global__ void reshape_and_cache_kernel(const float* __restrict__ key,
                                                    const float* __restrict__ value,
                                                    bf16_t* __restrict__ key_cache,
                                                    bf16_t* __restrict__ value_cache,
                                                    const long long* __restrict__ slot_mapping,
                                                    int num_kv_heads, int head_dim,
                                                    long long key_stride, long long value_stride) {
    const long long t = blockIdx.x;
    const long long slot = slot_mapping[t];
    if (slot < 0) return;  // padding token
    const int n = num_kv_heads * head_dim;
    const long long dst = slot * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        key_cache[dst + i] = float_to_bf16(key[t * key_stride + i]);
        value_cache[dst + i] = float_to_bf16(value[t * value_stride + i]);
    }
}

// For every layer l and pair p: block block_mapping[p, 1] := block block_mapping[p, 0] in that
// layer's key and value caches. key_ptrs/value_ptrs hold each layer's cache base address.
// grid = (num_layers, num_pairs), block = any.
extern "C" __global__ void copy_blocks_kernel(const long long* __restrict__ key_ptrs,
                                              const long long* __restrict__ value_ptrs,
                                              const long long* __restrict__ block_mapping,
                                              long long numel_per_block) {
    bf16_t* kc = reinterpret_cast<bf16_t*>(key_ptrs[blockIdx.x]);
    bf16_t* vc = reinterpret_cast<bf16_t*>(value_ptrs[blockIdx.x]);
    const long long src = block_mapping[2 * blockIdx.y] * numel_per_block;
    const long long dst = block_mapping[2 * blockIdx.y + 1] * numel_per_block;
    for (long long i = threadIdx.x; i < numel_per_block; i += blockDim.x) {
        kc[dst + i] = kc[src + i];
        vc[dst + i] = vc[src + i];
    }
}
