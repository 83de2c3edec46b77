// hkstore CUDA emulation: compile the kernels of runtime/exec/kernels/*.cu, unchanged, with g++.
//
// runtime.exec.emu.module writes a translation unit
//     #include "cuda_emu.h"     (this file)
//     #include "kernel.cu"      (kernel_sources()[name], byte for byte)
//     <generated launch table: one trampoline per extern "C" __global__ kernel>
// and builds it into a shared library that Python launches through ctypes.
//
// Execution model (what the kernels see):
//  * a launch runs its blocks one after another, in forward, reverse or seeded random order;
//    the order also picks the thread schedule inside a block (round robin over all threads;
//    warp by warp with lanes reversed; warp by warp in random warp and lane order), so that a
//    missing barrier between warps changes the result with the order (see run_block_impl);
//  * every CUDA thread of a block is a user-space fiber with its own stack (one makecontext
//    per fiber, once; every switch afterwards is _setjmp/_longjmp);
//  * threadIdx is per fiber; blockIdx, blockDim, gridDim per block / launch (uint3 / dim3,
//    unsigned, as in CUDA);
//  * __syncthreads() is a barrier over the threads of the block still running; threads
//    waiting at different __syncthreads() call sites are reported as barrier divergence;
//  * __shfl_xor_sync goes through a per-warp exchange: every lane named in the mask must
//    reach the same shuffle (else: an error), values are swapped once all have arrived;
//  * __shared__ variables are function-local statics (the only statics CUDA device code can
//    have), located through the library's symbol table and filled with the poison byte 0xFF
//    (NaN as fp32/fp16, -1 as int) before every block, so reads of shared memory no thread
//    of the block wrote show up;
//  * the two PTX conversions of _common.cu (cvt.f32.f16, cvt.rn.f16.f32) run as _Float16
//    conversions; any other inline asm fails the compilation with a static_assert.
// What it does not model: timing, occupancy, warps executing in lock step (threads of a warp
// interleave only at barriers and shuffles), the memory model beyond barriers, FMA
// contraction (built with -ffp-contract=off) and device math-library rounding.

#pragma once

#include <cmath>
#include <cstdarg>
#include <csetjmp>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>
#include <type_traits>
#include <ucontext.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define HK_EMU_ASAN 1
#else
#define HK_EMU_ASAN 0
#endif

#if !defined(__FLT16_MANT_DIG__)
#error "hk emu: this compiler has no _Float16 (g++ >= 12 on x86-64 / aarch64 needed)"
#endif

namespace hk_emu {

struct uint3 { unsigned int x, y, z; };

}  // namespace hk_emu

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
};
typedef hk_emu::uint3 uint3;

namespace hk_emu {

enum State { IDLE = 0, READY, AT_BARRIER, AT_SHUFFLE, DONE };

struct Fiber {
    jmp_buf jb;
    ucontext_t uc;             // only for the first entry
    char* stack;               // usable stack (above the guard page)
    size_t stack_size;
    uint3 tid;
    unsigned int linear;       // linear thread index in the block
    int state;
    int site;                  // __LINE__ of the barrier / shuffle waited at
    unsigned int shfl_mask;
    int shfl_lane_mask;
    unsigned long long shfl_value, shfl_result;
#if HK_EMU_ASAN
    void* fake_stack;
#endif
};

constexpr int kMaxThreads = 1024;
constexpr size_t kStackSize = HK_EMU_ASAN ? (256u << 10) : (64u << 10);

struct Runtime {
    Fiber fibers[kMaxThreads];
    int created = 0;           // fibers [0, created) have a stack and a context
    bool broken = false;       // a block was abandoned mid-way: recreate every fiber
    char* stacks = nullptr;
    size_t page = 4096;
    jmp_buf sched_jb;
    Fiber* cur = nullptr;
    void (*body)(void**) = nullptr;
    void** args = nullptr;
    uint3 block_idx{0, 0, 0};
    dim3 block_dim, grid_dim;
    char* err = nullptr;       // first error of the launch (nullptr: none)
    char errbuf[1024];
#if HK_EMU_ASAN
    const void* main_bottom = nullptr;
    size_t main_size = 0;
#endif
};

inline Runtime g_rt;           // one per shared library (built with -fvisibility=hidden)

inline Runtime& rt() { return g_rt; }

__attribute__((format(printf, 1, 2))) inline void fail(const char* fmt, ...) {
    Runtime& r = rt();
    if (r.err) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r.errbuf, sizeof r.errbuf, fmt, ap);
    va_end(ap);
    r.err = r.errbuf;
}

// -- fiber switching ------------------------------------------------------------------------

__attribute__((noinline)) inline void to_scheduler(Fiber* self) {
    Runtime& r = rt();
#if HK_EMU_ASAN
    __sanitizer_start_switch_fiber(&self->fake_stack, r.main_bottom, r.main_size);
#endif
    if (!_setjmp(self->jb)) _longjmp(r.sched_jb, 1);
#if HK_EMU_ASAN
    // Resumed, possibly from another OS thread than last time: note the scheduler's stack.
    __sanitizer_finish_switch_fiber(self->fake_stack, &r.main_bottom, &r.main_size);
#endif
}

inline void fiber_main() {
    Runtime& r = rt();
    Fiber* self = r.cur;
#if HK_EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &r.main_bottom, &r.main_size);
#endif
    self->state = IDLE;
    for (;;) {
        to_scheduler(self);       // resumed with state READY for a new block
        r.body(r.args);
        self->state = DONE;       // stays here until the next block resumes it
    }
}

__attribute__((noinline)) inline void resume(Fiber* f) {
    Runtime& r = rt();
    r.cur = f;
#if HK_EMU_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, f->stack, f->stack_size);
#endif
    if (!_setjmp(r.sched_jb)) _longjmp(f->jb, 1);
#if HK_EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
    r.cur = nullptr;
}

// Stacks: one mapping, each stack below an inaccessible guard page (overflow faults).
inline bool ensure_fibers(int n) {
    Runtime& r = rt();
    if (r.broken) {            // contexts of abandoned fibers are mid-kernel: start afresh
        r.created = 0;
        r.broken = false;
    }
    if (!r.stacks) {
        r.page = (size_t)sysconf(_SC_PAGESIZE);
        const size_t per = kStackSize + r.page;
        void* p = mmap(nullptr, per * kMaxThreads, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
        if (p == MAP_FAILED) {
            fail("mmap of %d fiber stacks failed", kMaxThreads);
            return false;
        }
        r.stacks = (char*)p;
        for (int i = 0; i < kMaxThreads; ++i) mprotect(r.stacks + i * per, r.page, PROT_NONE);
    }
    const size_t per = kStackSize + r.page;
    for (int i = r.created; i < n; ++i) {
        Fiber* f = &r.fibers[i];
        f->stack = r.stacks + i * per + r.page;
        f->stack_size = kStackSize;
#if HK_EMU_ASAN
        __asan_unpoison_memory_region(f->stack, f->stack_size);   // frames of an abandoned block
#endif
        if (getcontext(&f->uc) != 0) {
            fail("getcontext failed");
            return false;
        }
        f->uc.uc_stack.ss_sp = f->stack;
        f->uc.uc_stack.ss_size = f->stack_size;
        f->uc.uc_link = nullptr;
        makecontext(&f->uc, (void (*)())fiber_main, 0);
        r.cur = f;
        ucontext_t here;
#if HK_EMU_ASAN
        void* fake = nullptr;
        __sanitizer_start_switch_fiber(&fake, f->stack, f->stack_size);
#endif
        if (!_setjmp(r.sched_jb)) swapcontext(&here, &f->uc);   // runs to the first yield
#if HK_EMU_ASAN
        __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
        r.cur = nullptr;
        r.created = i + 1;
    }
    return true;
}

// -- what the kernels call ----------------------------------------------------------------

inline Fiber* self_or_die(const char* what) {
    Fiber* f = rt().cur;
    if (!f) {
        fprintf(stderr, "hk emu: %s called outside a kernel\n", what);
        abort();
    }
    return f;
}

inline void syncthreads(int site) {
    Fiber* f = self_or_die("__syncthreads");
    f->state = AT_BARRIER;
    f->site = site;
    to_scheduler(f);
}

template <typename T>
inline T shfl_xor_sync(int site, unsigned int mask, T var, int lane_mask, int width = 32) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "hk emu: __shfl_xor_sync of a 4- or 8-byte type only");
    static_assert(std::is_trivially_copyable<T>::value, "hk emu: __shfl_xor_sync of a trivially copyable type only");
    Fiber* f = self_or_die("__shfl_xor_sync");
    if (width != 32) fail("__shfl_xor_sync with width %d: only the default width 32 is emulated (line %d)", width, site);
    f->state = AT_SHUFFLE;
    f->site = site;
    f->shfl_mask = mask;
    f->shfl_lane_mask = lane_mask;
    f->shfl_value = 0;
    memcpy(&f->shfl_value, &var, sizeof(T));
    to_scheduler(f);
    T out;
    memcpy(&out, &f->shfl_result, sizeof(T));
    return out;
}

// -- the PTX conversions --------------------------------------------------------------------
// The asm text is stringized by the asm() macro below and matched here at compile time.
// GCC cannot bind PTX operands, so the operands are bound by name: the statement must read
// exactly  "cvt.f32.f16 %0, %1;" : "=f"(OUT) : "h"(IN)   or
//          "cvt.rn.f16.f32 %0, %1;" : "=h"(OUT) : "f"(IN)
// with OUT and IN among the names f, h, v (the ones _common.cu uses); anything else is a
// compile-time error.

constexpr bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// Compare `text` to `pattern` ignoring whitespace; '@' in the pattern matches one operand name
// (an identifier), whose index among {f, h, v} is stored in order into names[].
constexpr bool match(const char* text, const char* pattern, int* names) {
    int k = 0;
    while (true) {
        while (is_space(*text)) ++text;
        while (is_space(*pattern)) ++pattern;
        if (!*pattern) return !*text;
        if (*pattern == '@') {
            const char* s = text;
            while ((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') || *s == '_') ++s;
            if (s - text != 1) return false;
            const char c = *text;
            names[k++] = c == 'f' ? 0 : c == 'h' ? 1 : c == 'v' ? 2 : -1;
            if (names[k - 1] < 0) return false;
            text = s;
            ++pattern;
            continue;
        }
        if (*text != *pattern) return false;
        ++text;
        ++pattern;
    }
}

// 0: unsupported; 1: cvt.f32.f16; 2: cvt.rn.f16.f32.  Result = op + 4 * out + 16 * in.
constexpr int classify(const char* text) {
    int n[2] = {-1, -1};
    if (match(text, "\"cvt.f32.f16 %0, %1;\" : \"=f\"(@) : \"h\"(@)", n) && n[0] != n[1]) return 1 + 4 * n[0] + 16 * n[1];
    n[0] = n[1] = -1;
    if (match(text, "\"cvt.rn.f16.f32 %0, %1;\" : \"=h\"(@) : \"f\"(@)", n) && n[0] != n[1]) return 2 + 4 * n[0] + 16 * n[1];
    return 0;
}

struct Unbound {};             // an operand name the enclosing scope does not declare

template <int I, typename A, typename B, typename C>
inline auto& pick(A& a, B& b, C& c) {
    if constexpr (I == 0) return a; else if constexpr (I == 1) return b; else return c;
}

template <int Code, typename A, typename B, typename C>
inline void ptx(A& f, B& h, C& v) {
    static_assert(Code != 0, "hk emu: unsupported inline asm (only cvt.f32.f16 and cvt.rn.f16.f32 are emulated)");
    constexpr int op = Code & 3, out = (Code >> 2) & 3, in = (Code >> 4) & 3;
    auto& o = pick<out>(f, h, v);
    auto& i = pick<in>(f, h, v);
    using O = std::remove_reference_t<decltype(o)>;
    using I = std::remove_cv_t<std::remove_reference_t<decltype(i)>>;
    if constexpr (op == 1) {   // half bits -> float
        static_assert(std::is_same<O, float>::value && std::is_same<I, unsigned short>::value,
                      "hk emu: cvt.f32.f16 needs a float output and an unsigned short input");
        _Float16 hv;
        memcpy(&hv, &i, 2);
        o = (float)hv;
    } else {                   // float -> half bits, round to nearest even
        static_assert(std::is_same<O, unsigned short>::value && std::is_same<I, float>::value,
                      "hk emu: cvt.rn.f16.f32 needs an unsigned short output and a float input");
        const _Float16 hv = (_Float16)i;
        memcpy(&o, &hv, 2);
    }
}

namespace operand_fallback {
inline Unbound f, h, v;
}

}  // namespace hk_emu

// -- CUDA built-ins -----------------------------------------------------------------------------

#define threadIdx (static_cast<const uint3&>(::hk_emu::rt().cur->tid))
#define blockIdx (static_cast<const uint3&>(::hk_emu::rt().block_idx))
#define blockDim (static_cast<const dim3&>(::hk_emu::rt().block_dim))
#define gridDim (static_cast<const dim3&>(::hk_emu::rt().grid_dim))
#define warpSize 32

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ static
#define __syncthreads() ::hk_emu::syncthreads(__LINE__)
#define __shfl_xor_sync(...) ::hk_emu::shfl_xor_sync(__LINE__, __VA_ARGS__)

#define HK_EMU_ASM(text)                                                             \
    do {                                                                             \
        using namespace ::hk_emu::operand_fallback;                                  \
        ::hk_emu::ptx<::hk_emu::classify(text)>(f, h, v);                            \
    } while (0)
#define asm(...) HK_EMU_ASM(#__VA_ARGS__)
#define __asm__(...) HK_EMU_ASM(#__VA_ARGS__)
#define __asm(...) HK_EMU_ASM(#__VA_ARGS__)

__device__ inline int max(int a, int b) { return a > b ? a : b; }
__device__ inline int min(int a, int b) { return a < b ? a : b; }
__device__ inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
__device__ inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
__device__ inline long long max(long long a, long long b) { return a > b ? a : b; }
__device__ inline long long min(long long a, long long b) { return a < b ? a : b; }
__device__ inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
__device__ inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
__device__ inline float max(float a, float b) { return fmaxf(a, b); }
__device__ inline float min(float a, float b) { return fminf(a, b); }
__device__ inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }

// -- the block scheduler (called by the generated launch functions) ------------------------------

namespace hk_emu {

constexpr unsigned char kPoison = 0xFF;

// The __shared__ variables of the module (function-local statics: CUDA device code has no
// other kind), found by runtime.exec.emu.module in the library's symbol table and handed over
// with hkemu_set_shared() before the first launch.
struct SharedVar { unsigned char* p; unsigned long long n; };
inline SharedVar* g_shared = nullptr;
inline int g_shared_count = 0;

inline void poison_shared() {
    for (int i = 0; i < g_shared_count; ++i) memset(g_shared[i].p, kPoison, g_shared[i].n);
}

inline unsigned long long splitmix(unsigned long long& s) {
    unsigned long long z = (s += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// Run fiber f until it waits or exits.  False on an error.
inline bool step(Fiber& f, int& alive) {
    Runtime& r = rt();
    resume(&f);
    if (f.state == DONE) --alive;
    else if (f.state != AT_BARRIER && f.state != AT_SHUFFLE) fail("internal: a thread yielded in state %d", f.state);
    return !r.err;
}

// Warp w exchanges its shuffle values if every lane named in the mask waits at the same
// shuffle; `done` tells whether it did.  False on an error (mismatched or incomplete shuffle).
inline bool resolve_warp(int w, int n, bool& done) {
    Runtime& r = rt();
    Fiber* fb = r.fibers;
    done = false;
    const int base = 32 * w;
    const int lanes = (n - base) < 32 ? (n - base) : 32;
    int site = -1;
    unsigned int mask = 0;
    bool any = false, ok = true;
    for (int l = 0; l < lanes; ++l) {
        Fiber& f = fb[base + l];
        if (f.state != AT_SHUFFLE) continue;
        if (!any) {
            any = true;
            site = f.site;
            mask = f.shfl_mask;
        } else if (f.site != site || f.shfl_mask != mask) {
            fail("warp %d of block (%u,%u,%u): lanes wait at different shuffles (lines %d and %d)", w,
                 r.block_idx.x, r.block_idx.y, r.block_idx.z, site, f.site);
            return false;
        }
    }
    if (!any) return true;
    for (int l = 0; l < 32 && ok; ++l)
        if ((mask >> l & 1u) && (l >= lanes || fb[base + l].state != AT_SHUFFLE)) ok = false;
    for (int l = 0; l < lanes && ok; ++l)
        if (fb[base + l].state == AT_SHUFFLE && !(mask >> l & 1u)) ok = false;
    if (!ok) {
        // Lanes still running (READY) may yet arrive: only a lane that exited or waits at a
        // barrier makes the shuffle impossible.
        int missing = -1;
        for (int l = 0; l < 32; ++l)
            if ((mask >> l & 1u) && (l >= lanes || fb[base + l].state != AT_SHUFFLE)) { missing = l; break; }
        if (missing >= 0 && missing < lanes && fb[base + missing].state == READY) return true;
        fail("warp %d of block (%u,%u,%u): __shfl_xor_sync (line %d, mask 0x%08x) while lane %d %s", w,
             r.block_idx.x, r.block_idx.y, r.block_idx.z, site, mask, missing,
             missing < 0 ? "is not in the mask" :
             missing >= lanes ? "does not exist" :
             fb[base + missing].state == DONE ? "has exited" : "waits at a __syncthreads");
        return false;
    }
    for (int l = 0; l < lanes; ++l) {
        Fiber& f = fb[base + l];
        if (f.state != AT_SHUFFLE) continue;
        const int src = l ^ f.shfl_lane_mask;
        // A source lane outside the warp returns the caller's own value (CUDA).
        f.shfl_result = (src >= 0 && src < 32 && (mask >> src & 1u)) ? fb[base + src].shfl_value : f.shfl_value;
    }
    for (int l = 0; l < lanes; ++l)
        if (fb[base + l].state == AT_SHUFFLE) fb[base + l].state = READY;
    done = true;
    return true;
}

// One block to completion.  Returns false on an error (rt().err set).
// Thread schedule, from the launch's order:
//  0 (forward): round robin over all threads in index order, each running until it waits;
//  1 (reverse): warp by warp from warp 0, each warp running as far as it can (shuffles
//     resolved at once) before the next starts, its lanes in reverse order;
//  2 (random):  warp by warp as in 1, warps and lanes in a fresh random order per phase.
// Race-free kernels give identical results under all three; a missing barrier between
// warps shows as a difference.
inline bool run_block_impl(int n, int order, unsigned long long& rng) {
    Runtime& r = rt();
    Fiber* fb = r.fibers;
    const dim3 bd = r.block_dim;
    for (int i = 0; i < n; ++i) {
        Fiber& f = fb[i];
        f.linear = (unsigned)i;
        f.tid.x = (unsigned)i % bd.x;
        f.tid.y = ((unsigned)i / bd.x) % bd.y;
        f.tid.z = (unsigned)i / (bd.x * bd.y);
        f.state = READY;
        f.site = 0;
    }
    poison_shared();
    int alive = n;
    const int warps = (n + 31) / 32;
    int worder[kMaxThreads / 32];
    int lorder[32];
    while (alive > 0) {
        if (order == 0) {
            bool progressed = true;
            while (progressed && alive > 0) {
                for (int i = 0; i < n; ++i)
                    if (fb[i].state == READY && !step(fb[i], alive)) return false;
                progressed = false;
                for (int w = 0; w < warps; ++w) {
                    bool done;
                    if (!resolve_warp(w, n, done)) return false;
                    progressed |= done;
                }
            }
        } else {
            for (int k = 0; k < warps; ++k) worder[k] = k;
            if (order == 2)
                for (int k = warps - 1; k > 0; --k) {
                    const int j = (int)(splitmix(rng) % (unsigned long long)(k + 1));
                    const int t = worder[k]; worder[k] = worder[j]; worder[j] = t;
                }
            for (int k = 0; k < warps; ++k) {
                const int w = worder[k];
                const int base = 32 * w;
                const int lanes = (n - base) < 32 ? (n - base) : 32;
                for (bool done = true; done;) {
                    for (int l = 0; l < lanes; ++l) lorder[l] = order == 1 ? lanes - 1 - l : l;
                    if (order == 2)
                        for (int l = lanes - 1; l > 0; --l) {
                            const int j = (int)(splitmix(rng) % (unsigned long long)(l + 1));
                            const int t = lorder[l]; lorder[l] = lorder[j]; lorder[j] = t;
                        }
                    for (int l = 0; l < lanes; ++l)
                        if (fb[base + lorder[l]].state == READY && !step(fb[base + lorder[l]], alive)) return false;
                    if (!resolve_warp(w, n, done)) return false;
                }
            }
        }
        if (alive == 0) break;
        // No thread can run and no shuffle complete: every live thread must wait at the same
        // __syncthreads().
        int site = -1;
        for (int i = 0; i < n; ++i) {
            Fiber& f = fb[i];
            if (f.state == DONE) continue;
            if (f.state == AT_SHUFFLE) {
                fail("block (%u,%u,%u): thread %d waits at a shuffle (line %d) that cannot complete",
                     r.block_idx.x, r.block_idx.y, r.block_idx.z, i, f.site);
                return false;
            }
            if (site < 0) site = f.site;
            else if (f.site != site) {
                fail("block (%u,%u,%u): barrier divergence: threads wait at __syncthreads() of lines %d and %d",
                     r.block_idx.x, r.block_idx.y, r.block_idx.z, site, f.site);
                return false;
            }
        }
        for (int i = 0; i < n; ++i)
            if (fb[i].state == AT_BARRIER) fb[i].state = READY;
    }
    return true;
}

inline bool run_block(int n, int order, unsigned long long& rng) {
    if (run_block_impl(n, order, rng)) return true;
    rt().broken = true;        // fibers were abandoned mid-kernel: recreate them next launch
    return false;
}

// order: 0 forward, 1 reverse, 2 random (seeded).  Returns 0, or 1 with the message in err.
inline int launch(void (*body)(void**), void** args, const unsigned* grid, const unsigned* block, int order,
                  unsigned long long seed, char* err, int errlen) {
    Runtime& r = rt();
    r.err = nullptr;
    r.body = body;
    r.args = args;
    r.grid_dim = dim3(grid[0], grid[1], grid[2]);
    r.block_dim = dim3(block[0], block[1], block[2]);
    const unsigned long long nthreads = (unsigned long long)block[0] * block[1] * block[2];
    const unsigned long long nblocks = (unsigned long long)grid[0] * grid[1] * grid[2];
    int rc = 0;
    if (nthreads == 0 || nthreads > (unsigned long long)kMaxThreads || nblocks == 0) {
        fail("invalid launch configuration");
    } else if (ensure_fibers((int)nthreads)) {
        unsigned long long* perm = nullptr;
        if (order == 2) {
            perm = (unsigned long long*)malloc(nblocks * sizeof *perm);
            if (!perm) fail("out of memory for a random order of %llu blocks", nblocks);
            else {
                for (unsigned long long i = 0; i < nblocks; ++i) perm[i] = i;
                unsigned long long s = seed;
                for (unsigned long long i = nblocks - 1; i > 0; --i) {
                    const unsigned long long j = splitmix(s) % (i + 1);
                    const unsigned long long t = perm[i];
                    perm[i] = perm[j];
                    perm[j] = t;
                }
            }
        }
        unsigned long long s = seed ^ 0xD1B54A32D192ED03ULL;   // thread schedules (order 2)
        for (unsigned long long k = 0; k < nblocks && !r.err; ++k) {
            const unsigned long long b = order == 0 ? k : order == 1 ? nblocks - 1 - k : perm[k];
            r.block_idx.x = (unsigned)(b % grid[0]);
            r.block_idx.y = (unsigned)((b / grid[0]) % grid[1]);
            r.block_idx.z = (unsigned)(b / ((unsigned long long)grid[0] * grid[1]));
            run_block((int)nthreads, order, s);
        }
        free(perm);
    }
    if (r.err) {
        snprintf(err, (size_t)errlen, "%s", r.err);
        rc = 1;
    }
    r.body = nullptr;
    r.args = nullptr;
    return rc;
}

}  // namespace hk_emu
