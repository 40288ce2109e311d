// SIMT emulation shim: compiles CUDA kernel sources with g++ (C++20) and runs them on the CPU.
//
// Execution model emulated (CUDA C++ Programming Guide, "Programming Model" / "Hardware
// Implementation"): a launch runs its blocks one after another; the threads of a block run as
// user-space fibers on one OS thread, switched only at synchronisation points, so a run is
// deterministic. threadIdx/blockIdx/blockDim/gridDim are globals the scheduler sets before it
// resumes a fiber. `__shared__` becomes `thread_local` (a block-scope thread_local is static: one
// copy, reused block after block, which is CUDA's per-block shared memory when blocks run in turn);
// `extern __shared__` arrays are defined by the generated launcher TU (see runner.py) with room for
// SIMT_DYN_SMEM_BYTES and filled with 0xff (NaN for floats) before each block. __syncthreads is a
// block barrier; a barrier reached while some threads of the block have exited, or threads waiting
// at different __syncthreads call sites, is reported as an error instead of hanging. Warp
// shuffles and votes go through per-warp exchange slots with two warp barriers per operation.
// bf16/half are 16-bit structs converting through float. Warp-level matrix multiply-accumulate
// (mma.sync m16n8k16 bf16, reached through kernels/cuda/common.cuh's mma_bf16_16816 when
// SIMT_EMULATOR is defined) gathers every lane's fragments and computes the 16x8 product exactly
// as the PTX ISA's fragment layouts place the elements (products exact, sums in double, one
// rounding to float).
#pragma once
#define SIMT_EMULATOR 1
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __shared__ thread_local
#define __constant__ static
#define __align__(n)
#define __launch_bounds__(...)
#define __syncthreads() ::simt::block_barrier(__FILE__, __LINE__)

#ifndef SIMT_DYN_SMEM_BYTES
#define SIMT_DYN_SMEM_BYTES (228 * 1024)
#endif

struct uint3 { unsigned int x, y, z; };
struct alignas(8) uint2 { unsigned int x, y; };
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
inline uint2 make_uint2(unsigned a, unsigned b) { return uint2{a, b}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
inline float2 make_float2(float a, float b) { return float2{a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
    dim3() = default;
    dim3(unsigned int a, unsigned int b = 1, unsigned int c = 1) : x(a), y(b), z(c) {}
};
inline uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
constexpr int warpSize = 32;

using std::max;
using std::min;

inline float __int_as_float(int v) { return std::bit_cast<float>(v); }
inline float __uint_as_float(unsigned int v) { return std::bit_cast<float>(v); }
inline int __float_as_int(float v) { return std::bit_cast<int>(v); }
inline unsigned int __float_as_uint(float v) { return std::bit_cast<unsigned int>(v); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
template <class T> inline T __ldg(const T* p) { return *p; }

// 16-bit float types: storage only, arithmetic through float.
struct __nv_bfloat16 {
    unsigned short x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) {
        unsigned int u = std::bit_cast<unsigned int>(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) { x = (unsigned short)((u >> 16) | 0x40u); return; }
        u += 0x7fffu + ((u >> 16) & 1u);
        x = (unsigned short)(u >> 16);
    }
    operator float() const { return std::bit_cast<float>((unsigned int)x << 16); }
};
struct __half {
    unsigned short x;
    __half() = default;
    __half(float f) : x(std::bit_cast<unsigned short>((_Float16)f)) {}
    operator float() const { return (float)std::bit_cast<_Float16>(x); }
};
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 h) { return (float)h; }
inline __half __float2half(float f) { return __half(f); }
inline float __half2float(__half h) { return (float)h; }

namespace simt {

enum FiberState { READY, WAIT_BLOCK, WAIT_WARP, DONE };

struct Fiber {
    void* sp;
    FiberState state;
    uint3 tid;
    unsigned warp_ops;  // warp-synchronous ops done: picks the exchange buffer (parity)
};

struct Warp {
    int lanes = 0;    // threads of the block in this warp
    int live = 0;     // of which not exited
    int arrived = 0;  // waiting at the current warp barrier
    unsigned long long slot[2][32];  // double-buffered: one warp barrier per exchange
    alignas(16) unsigned char big[2][32][64];  // the same for up to 64 bytes per lane (mma fragments)
    float mma_out[2][32][4];                    // an mma's D fragments, computed once per warp
    unsigned mma_op[2] = {~0u, ~0u};            // which warp op filled mma_out[parity]
};

struct Block {
    std::vector<Fiber> fibers;
    std::vector<Warp> warps;
    int n = 0, cur = 0, done = 0;
    int arrived = 0;
    const char* bar_file = nullptr;
    int bar_line = 0;
    void* sched_sp = nullptr;
    std::string error;
};

Block& block();
void yield_to_scheduler();
void fail(const std::string& msg);

inline int lane_id() { return block().cur % 32; }

inline void block_barrier(const char* file, int line) {
    Block& b = block();
    if (b.done > 0) {
        fail("__syncthreads at " + std::string(file) + ":" + std::to_string(line) + " reached while " +
             std::to_string(b.done) + " of " + std::to_string(b.n) + " threads of the block have exited");
        return;
    }
    if (b.arrived == 0) {
        b.bar_file = file;
        b.bar_line = line;
    } else if (b.bar_line != line || std::strcmp(b.bar_file, file) != 0) {
        fail("threads wait at different __syncthreads: " + std::string(b.bar_file) + ":" +
             std::to_string(b.bar_line) + " and " + file + ":" + std::to_string(line));
        return;
    }
    if (++b.arrived == b.n) {  // last one in: release everybody, keep running
        b.arrived = 0;
        for (auto& f : b.fibers)
            if (f.state == WAIT_BLOCK) f.state = READY;
        return;
    }
    b.fibers[b.cur].state = WAIT_BLOCK;
    yield_to_scheduler();
}

inline void warp_barrier(const char* what) {
    Block& b = block();
    Warp& w = b.warps[b.cur / 32];
    if (w.live != w.lanes) {
        fail(std::string(what) + " in warp " + std::to_string(b.cur / 32) + " after " +
             std::to_string(w.lanes - w.live) + " of its lanes exited");
        return;
    }
    if (++w.arrived == w.live) {
        w.arrived = 0;
        const int base = (b.cur / 32) * 32;
        for (int i = 0; i < w.lanes; ++i)
            if (b.fibers[base + i].state == WAIT_WARP) b.fibers[base + i].state = READY;
        return;
    }
    b.fibers[b.cur].state = WAIT_WARP;
    yield_to_scheduler();
}

// Exchange through the warp's slots: write, one warp barrier, read. Two buffers alternate, so a
// lane can write the next exchange while slower lanes still read this one: it cannot get two
// exchanges ahead, since the next barrier waits for every lane.
inline unsigned long long* exchange(unsigned long long bits, const char* what) {
    Block& b = block();
    Fiber& f = b.fibers[b.cur];
    unsigned long long* slots = b.warps[b.cur / 32].slot[f.warp_ops++ & 1];
    slots[lane_id()] = bits;
    warp_barrier(what);
    return slots;
}

template <class T>
inline T shuffle_from(T v, int src_of_lane(int lane, int arg, int width), int arg, int width, const char* what) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    const unsigned long long* slots = exchange(bits, what);
    Block& b = block();
    const int lane = lane_id();
    int src = src_of_lane(lane, arg, width);
    const int seg = lane - lane % width;
    if (src < seg || src >= seg + width || src >= b.warps[b.cur / 32].lanes) src = lane;
    T r;
    std::memcpy(&r, &slots[src], sizeof(T));
    return r;
}

// Every lane's `bytes` (<= 64) bytes, gathered: row i of the result is lane i's data. Same double
// buffering as exchange(); all 32 lanes of a full warp must take part (mma needs them all).
inline const unsigned char (*gather(const void* mine, size_t bytes, const char* what))[64] {
    Block& b = block();
    Fiber& f = b.fibers[b.cur];
    Warp& w = b.warps[b.cur / 32];
    if (w.lanes != 32) fail(std::string(what) + " needs a full warp of 32 threads");
    auto& buf = w.big[f.warp_ops++ & 1];
    std::memcpy(buf[lane_id()], mine, bytes);
    warp_barrier(what);
    return buf;
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 with D = A B + C in place (d = C on entry).
// Element placement per the PTX ISA ("Matrix Fragments for mma.m16n8k16 with floating point
// type"): g = lane >> 2, t = lane % 4; A element a_i (i = 0..7, two per 32-bit register, low half
// first) sits at row g + 8 * ((i >> 1) & 1), column 2t + (i & 1) + 8 * (i >> 2); B element b_i
// (i = 0..3) at row 2t + (i & 1) + 8 * (i >> 1), column g; C/D element c_i at row g + 8 * (i >> 1),
// column 2t + (i & 1).
inline void mma_m16n8k16_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&bfrag)[2]) {
    struct Frag { unsigned a[4]; unsigned b[2]; float c[4]; } mine;
    static_assert(sizeof(Frag) <= 64);
    std::memcpy(mine.a, a, sizeof mine.a);
    std::memcpy(mine.b, bfrag, sizeof mine.b);
    std::memcpy(mine.c, d, sizeof mine.c);
    Block& blk = block();
    const unsigned parity = blk.fibers[blk.cur].warp_ops & 1;
    const unsigned char (*all)[64] = gather(&mine, sizeof mine, "mma.sync");
    Warp& w = block().warps[block().cur / 32];
    const unsigned op = block().fibers[block().cur].warp_ops;  // the same for every lane of this op
    if (w.mma_op[parity] != op) {  // the first lane to resume computes the whole 16x8 result
        auto half = [](unsigned reg, int i) { return std::bit_cast<float>((i & 1 ? reg >> 16 : reg & 0xffffu) << 16); };
        float A[16][16], B[16][8], C[16][8];
        for (int lane = 0; lane < 32; ++lane) {
            Frag fr;
            std::memcpy(&fr, all[lane], sizeof fr);
            const int g = lane >> 2, t = lane % 4;
            for (int i = 0; i < 8; ++i) A[g + 8 * ((i >> 1) & 1)][2 * t + (i & 1) + 8 * (i >> 2)] = half(fr.a[i >> 1], i);
            for (int i = 0; i < 4; ++i) B[2 * t + (i & 1) + 8 * (i >> 1)][g] = half(fr.b[i >> 1], i);
            for (int i = 0; i < 4; ++i) C[g + 8 * (i >> 1)][2 * t + (i & 1)] = fr.c[i];
        }
        for (int lane = 0; lane < 32; ++lane) {
            const int g = lane >> 2, t = lane % 4;
            for (int i = 0; i < 4; ++i) {
                const int r = g + 8 * (i >> 1), c = 2 * t + (i & 1);
                double acc = C[r][c];
                for (int k = 0; k < 16; ++k) acc += (double)A[r][k] * (double)B[k][c];
                w.mma_out[parity][lane][i] = (float)acc;
            }
        }
        w.mma_op[parity] = op;
    }
    std::memcpy(d, w.mma_out[parity][lane_id()], sizeof d);
}

inline int src_xor(int lane, int m, int) { return lane ^ m; }
inline int src_down(int lane, int d, int) { return lane + d; }
inline int src_up(int lane, int d, int width) { return lane % width >= d ? lane - d : lane; }
inline int src_idx(int lane, int s, int width) { return lane - lane % width + s % width; }

inline unsigned vote_ballot(bool pred) {
    const unsigned long long* slots = exchange(pred ? 1 : 0, "__ballot_sync");
    Block& b = block();
    unsigned r = 0;
    for (int i = 0; i < b.warps[b.cur / 32].lanes; ++i)
        if (slots[i]) r |= 1u << i;
    return r;
}

}  // namespace simt

template <class T> inline T __shfl_xor_sync(unsigned, T v, int m, int width = 32) {
    return simt::shuffle_from(v, simt::src_xor, m, width, "__shfl_xor_sync");
}
template <class T> inline T __shfl_down_sync(unsigned, T v, unsigned d, int width = 32) {
    return simt::shuffle_from(v, simt::src_down, (int)d, width, "__shfl_down_sync");
}
template <class T> inline T __shfl_up_sync(unsigned, T v, unsigned d, int width = 32) {
    return simt::shuffle_from(v, simt::src_up, (int)d, width, "__shfl_up_sync");
}
template <class T> inline T __shfl_sync(unsigned, T v, int s, int width = 32) {
    return simt::shuffle_from(v, simt::src_idx, s, width, "__shfl_sync");
}
inline unsigned __ballot_sync(unsigned, int pred) { return simt::vote_ballot(pred != 0); }
inline int __any_sync(unsigned, int pred) { return simt::vote_ballot(pred != 0) != 0; }
inline int __all_sync(unsigned m, int pred) {
    const unsigned all = simt::vote_ballot(true);
    return simt::vote_ballot(pred != 0) == all;
    (void)m;
}
inline void __syncwarp(unsigned = 0xffffffffu) { simt::warp_barrier("__syncwarp"); }
