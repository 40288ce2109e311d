// The KV cache's block copy, used for copy-on-write (this step's keys and values are appended by
// rope_and_cache_kernel, layer.cu). Cache layout [num_blocks, block_size, num_kv_heads, head_dim]
// of bf16 bit patterns. Spec: kernels/reference.py (copy_blocks); the idea is vLLM's copy_blocks
// (PagedAttention, Kwon et al., SOSP 2023).
#include "common.cuh"

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
