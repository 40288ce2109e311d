// SIMT launcher: the fiber scheduler behind simt.h and the C entry points runner.py calls through
// ctypes. Compiled in one translation unit after the kernel source (see runner.py), which also
// registers every __global__ function with simt::Registrar.
#include <memory>
#include <mutex>
#include <new>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace simt {

// ---- context switch ---------------------------------------------------------------------------
#if defined(__x86_64__)
// simt_switch(save, to): push callee-saved registers, MXCSR and the x87 control word, store the
// stack pointer in *save, load `to`, pop the same and return into the other context.
extern "C" void simt_switch(void** save, void* to);
asm(R"(
    .text
    .globl simt_switch
    .hidden simt_switch
    .type simt_switch, @function
simt_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size simt_switch, .-simt_switch
)");
#endif

constexpr size_t kStack = 256 * 1024;
constexpr unsigned long long kCanary = 0x5afe5afe5afe5afeULL;

struct Kernel {
    const char* name;
    std::string signature;
    void (*invoke)(void* fn, void** args);
    void* fn;
};

inline std::vector<Kernel>& kernels() { static std::vector<Kernel> k; return k; }
// Dynamic shared arrays are thread_local: each is registered by a function that returns the
// *calling* thread's copy (an address taken at load time would be the copy of whichever thread
// loaded the library, freed when that thread exits).
using SmemGetter = void* (*)();
inline std::vector<std::pair<SmemGetter, size_t>>& dyn_smem() { static std::vector<std::pair<SmemGetter, size_t>> d; return d; }

template <class T> std::string type_code() {
    using U = std::remove_cv_t<T>;
    if constexpr (std::is_pointer_v<U>) return "ptr:" + type_code<std::remove_pointer_t<U>>();
    else if constexpr (std::is_same_v<U, float>) return "f32";
    else if constexpr (std::is_same_v<U, double>) return "f64";
    else if constexpr (std::is_same_v<U, __nv_bfloat16>) return "bf16";
    else if constexpr (std::is_same_v<U, __half>) return "f16";
    else if constexpr (std::is_same_v<U, bool>) return "bool";
    else if constexpr (std::is_same_v<U, void>) return "void";
    else if constexpr (std::is_integral_v<U>) return (std::is_signed_v<U> ? "i" : "u") + std::to_string(8 * sizeof(U));
    else return "?";
}

template <class... A, size_t... I>
void invoke_impl(void* fn, void** args, std::index_sequence<I...>) {
    reinterpret_cast<void (*)(A...)>(fn)(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}

struct Registrar {
    template <class... A> Registrar(const char* name, void (*fn)(A...)) {
        std::string sig;
        ((sig += (sig.empty() ? "" : ",") + type_code<A>()), ...);
        kernels().push_back({name, sig, [](void* f, void** a) { invoke_impl<A...>(f, a, std::index_sequence_for<A...>{}); },
                             reinterpret_cast<void*>(fn)});
    }
    Registrar(SmemGetter smem, size_t bytes) { dyn_smem().push_back({smem, bytes}); }
};

// ---- per-launch state -------------------------------------------------------------------------
struct Launch {
    Block b;
    const Kernel* k = nullptr;
    void** args = nullptr;
    long long switches = 0;
#if !defined(__x86_64__)
    std::vector<ucontext_t> ctx;
    ucontext_t sched_ctx;
#endif
};
inline Launch* g_launch = nullptr;
inline std::string g_error;
inline long long g_switches = 0;
inline std::mutex g_mutex;
inline std::unique_ptr<char[]> g_stacks;  // fiber stacks, grown on demand, never zeroed
inline size_t g_stack_threads = 0;

Block& block() { return g_launch->b; }

// jump(from, to): save the running context as `from` and resume `to` (-1 = the scheduler).
static void jump(int from, int to) {
    Launch& L = *g_launch;
    Block& b = L.b;
    if (to >= 0) {
        b.cur = to;
        threadIdx = b.fibers[to].tid;
        ++L.switches;
    }
#if defined(__x86_64__)
    simt_switch(from < 0 ? &b.sched_sp : &b.fibers[from].sp, to < 0 ? b.sched_sp : b.fibers[to].sp);
#else
    swapcontext(from < 0 ? &L.sched_ctx : &L.ctx[from], to < 0 ? &L.sched_ctx : &L.ctx[to]);
#endif
}

// The running fiber waits (or has exited): resume the next ready fiber directly, round robin, or
// hand back to the scheduler when none is ready (block finished, deadlock or error).
void yield_to_scheduler() {
    Block& b = block();
    const int me = b.cur;
    int next = -1;
    if (b.error.empty())
        for (int k = 1; k <= b.n; ++k) {
            const int i = (me + k) % b.n;
            if (b.fibers[i].state == READY) { next = i; break; }
        }
    jump(me, next);
}

void fail(const std::string& msg) {
    Block& b = block();
    if (b.error.empty()) b.error = msg;
    yield_to_scheduler();  // the scheduler abandons the block; this fiber never resumes
}

static void fiber_exit() {
    Block& b = block();
    b.fibers[b.cur].state = DONE;
    ++b.done;
    Warp& w = b.warps[b.cur / 32];
    --w.live;
    if (b.arrived > 0)
        b.error = "thread " + std::to_string(b.cur) + " exited while " + std::to_string(b.arrived) +
                  " threads wait at __syncthreads " + b.bar_file + ":" + std::to_string(b.bar_line);
    else if (w.arrived > 0)
        b.error = "thread " + std::to_string(b.cur) + " exited while lanes of its warp wait in a warp-synchronous op";
    yield_to_scheduler();
}

static void fiber_main() {
    g_launch->k->invoke(g_launch->k->fn, g_launch->args);
    fiber_exit();
    __builtin_trap();  // never resumed after exit
}

#if defined(__x86_64__)
static void fiber_trampoline() { fiber_main(); }
#else
static void fiber_trampoline_uc() { fiber_main(); }
#endif

static std::string describe_deadlock(const Block& b) {
    int wb = 0, ww = 0;
    for (auto& f : b.fibers) { wb += f.state == WAIT_BLOCK; ww += f.state == WAIT_WARP; }
    return "deadlock: " + std::to_string(wb) + " threads at a __syncthreads, " + std::to_string(ww) +
           " in a warp op, " + std::to_string(b.done) + " exited";
}

static bool run_block(Launch& L, int nthreads) {
    Block& b = L.b;
    b.n = nthreads;
    b.cur = 0;
    b.done = 0;
    b.arrived = 0;
    b.error.clear();
    for (auto [get, n] : dyn_smem()) std::memset(get(), 0xff, n);
    for (size_t w = 0; w < b.warps.size(); ++w) {
        b.warps[w].lanes = std::min(32, nthreads - (int)w * 32);
        b.warps[w].live = b.warps[w].lanes;
        b.warps[w].arrived = 0;
        b.warps[w].mma_op[0] = b.warps[w].mma_op[1] = ~0u;  // op counters restart with the block
    }
    for (int i = 0; i < nthreads; ++i) {
        char* lo = g_stacks.get() + (size_t)i * kStack;
        std::memcpy(lo, &kCanary, sizeof kCanary);
#if defined(__x86_64__)
        auto top = reinterpret_cast<uintptr_t>(lo + kStack) & ~uintptr_t(15);
        auto* sp = reinterpret_cast<uint64_t*>(top);
        *--sp = 0;                                                  // fake return address
        *--sp = reinterpret_cast<uint64_t>(&fiber_trampoline);      // popped by ret
        for (int r = 0; r < 6; ++r) *--sp = 0;                      // rbp rbx r12..r15
        *--sp = 0x037F00001F80ULL;                                  // mxcsr | fpu cw << 32
        b.fibers[i].sp = sp;
#else
        getcontext(&L.ctx[i]);
        L.ctx[i].uc_stack.ss_sp = lo + 64;
        L.ctx[i].uc_stack.ss_size = kStack - 64;
        L.ctx[i].uc_link = nullptr;
        makecontext(&L.ctx[i], fiber_trampoline_uc, 0);
#endif
        b.fibers[i].state = READY;
        b.fibers[i].warp_ops = 0;
    }
    jump(-1, 0);  // fibers switch among themselves; back here when none is ready
    if (!b.error.empty()) return false;
    if (b.done < nthreads) {
        b.error = describe_deadlock(b);
        return false;
    }
    for (int i = 0; i < nthreads; ++i) {
        unsigned long long c;
        std::memcpy(&c, g_stacks.get() + (size_t)i * kStack, sizeof c);
        if (c != kCanary) { b.error = "fiber stack overflow (thread " + std::to_string(i) + ")"; return false; }
    }
    return true;
}

}  // namespace simt

#define SIMT_API __attribute__((visibility("default")))
extern "C" {

SIMT_API int simt_num_kernels() { return (int)simt::kernels().size(); }
SIMT_API const char* simt_kernel_name(int i) { return simt::kernels()[i].name; }
SIMT_API const char* simt_kernel_signature(int i) { return simt::kernels()[i].signature.c_str(); }
SIMT_API const char* simt_last_error() { return simt::g_error.c_str(); }
SIMT_API long long simt_switch_count() { return simt::g_switches; }
SIMT_API long long simt_dyn_smem_bytes() { return SIMT_DYN_SMEM_BYTES; }

// Runs kernel i over grid x block; args[j] points at the value of parameter j (as CUDA's
// kernelParams). Returns 0, or -1 with simt_last_error() set.
SIMT_API int simt_launch(int i, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                unsigned long long shared_bytes, void** args) {
    std::lock_guard<std::mutex> lock(simt::g_mutex);
    simt::g_error.clear();
    const unsigned long long nthreads = (unsigned long long)bx * by * bz;
    if (i < 0 || i >= simt_num_kernels()) { simt::g_error = "no such kernel"; return -1; }
    if (nthreads == 0 || nthreads > 1024) { simt::g_error = "block of " + std::to_string(nthreads) + " threads (1..1024 allowed)"; return -1; }
    if (gx == 0 || gy == 0 || gz == 0 || gy > 65535 || gz > 65535) { simt::g_error = "invalid grid"; return -1; }
    size_t dyn_room = 0;
    for (auto [p, n] : simt::dyn_smem()) dyn_room = std::max(dyn_room, n);
    if (shared_bytes > dyn_room && shared_bytes > 0) {
        simt::g_error = "dynamic shared memory of " + std::to_string(shared_bytes) + " bytes requested, kernel file provides " + std::to_string(dyn_room);
        return -1;
    }
    simt::Launch L;
    L.k = &simt::kernels()[i];
    L.args = args;
    if (simt::g_stack_threads < nthreads) {
        simt::g_stacks.reset(new char[nthreads * simt::kStack]);
        simt::g_stack_threads = nthreads;
    }
    L.b.fibers.resize(nthreads);
    L.b.warps.resize((nthreads + 31) / 32);
#if !defined(__x86_64__)
    L.ctx.resize(nthreads);
#endif
    for (unsigned t = 0; t < nthreads; ++t) L.b.fibers[t].tid = uint3{t % bx, (t / bx) % by, t / (bx * by)};
    simt::g_launch = &L;
    blockDim = dim3(bx, by, bz);
    gridDim = dim3(gx, gy, gz);
    int rc = 0;
    for (unsigned z = 0; z < gz && rc == 0; ++z)
        for (unsigned y = 0; y < gy && rc == 0; ++y)
            for (unsigned x = 0; x < gx && rc == 0; ++x) {
                blockIdx = uint3{x, y, z};
                if (!simt::run_block(L, (int)nthreads)) {
                    simt::g_error = "block (" + std::to_string(x) + "," + std::to_string(y) + "," + std::to_string(z) + "): " + L.b.error;
                    rc = -1;
                }
            }
    simt::g_switches += L.switches;
    simt::g_launch = nullptr;
    return rc;
}

}  // extern "C"
