// hkstore kernels: shared prelude.
//
// runtime.exec.kernels.kernel_sources() prepends this file to every other .cu file of the
// package, so each entry of that dict is one self-contained translation unit.
//
// No #include at all: the NVRTC shipped in the nvidia-cuda-nvrtc wheels carries no CUDA
// headers (cuda_fp16.h is not there), and CuPy's RawModule must compile the very same
// text.  fp16 is therefore carried as its raw 16-bit pattern (unsigned short) and
// converted with the PTX cvt instructions (the ones cuda_fp16.hpp itself emits).
// The code sticks to C++11 so that any -std an embedding compiler passes works.
//
// Conventions shared by all kernels:
//  * every index array is int32; tensor extents are passed as int and checked on the host
//    to be < 2^31; products that address memory are formed in size_t;
//  * every global access is bounds-checked against the extents passed in, so a malformed
//    segment table or tenant id is skipped instead of reading out of bounds;
//  * accumulation is always fp32.

typedef unsigned short hk_half;        // IEEE binary16 bit pattern
typedef unsigned long long hk_u64;

__device__ __forceinline__ float hk_to_float(float v) { return v; }

__device__ __forceinline__ float hk_to_float(hk_half v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
}

template <typename T> __device__ __forceinline__ T hk_from_float(float v);

template <> __device__ __forceinline__ float hk_from_float<float>(float v) { return v; }

template <> __device__ __forceinline__ hk_half hk_from_float<hk_half>(float v) {
    hk_half h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));   // round to nearest even
    return h;
}

// ---------------------------------------------------------------------------------------
// Segments: seg_starts (S+1) nondecreasing, seg_ids (S); segment s covers rows
// [seg_starts[s], seg_starts[s+1]) and uses tenant seg_ids[s]; a negative id means
// "no PET on this segment" and the segment is skipped.

// Clamp segment s to [0, rows) and fetch its tenant.  False when there is nothing to do.
__device__ __forceinline__ bool hk_segment(const int* __restrict__ seg_starts,
                                           const int* __restrict__ seg_ids, int s, int rows,
                                           int num_tenants, int& start, int& end, int& t) {
    start = max(seg_starts[s], 0);
    end = min(seg_starts[s + 1], rows);
    t = seg_ids[s];
    return t >= 0 && t < num_tenants && start < end;
}

// The segment containing `row`, or -1.  Binary search for the largest s with
// seg_starts[s] <= row; with nondecreasing starts, row < seg_starts[s+1] then holds.
__device__ __forceinline__ int hk_find_segment(const int* __restrict__ seg_starts, int S,
                                               int row) {
    if (S <= 0 || row < seg_starts[0] || row >= seg_starts[S]) return -1;
    int lo = 0, hi = S - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (seg_starts[mid] <= row) lo = mid; else hi = mid - 1;
    }
    return (row < seg_starts[lo + 1]) ? lo : -1;   // re-checked: unsorted input stays safe
}

// ---------------------------------------------------------------------------------------
// Tiled segmented GEMM main loop (used by SGMV shrink/expand and the adapter kernels).
//
// For the rows [start, end) of one segment and one tile of HK_TILE output columns:
//     acc(row, col) = sum_k X[row, k] * W[col, k]        X: (rows, K), W: (N, K), row-major
// Block = (HK_TILE, HK_TILE) threads, thread (tx, ty) owns output (row tile + ty, col tile + tx).
// Column tile = blockIdx.x; the segment's row tiles are strided over blockIdx.y / gridDim.y.
// K is walked in HK_TILE chunks staged in shared memory (padded +1 against bank
// conflicts); out-of-range elements load as 0, so no extent needs to be a multiple of the
// tile.  The caller returns before this function only under block-uniform conditions,
// so every thread of a block reaches every __syncthreads().
#define HK_TILE 16

template <typename TX, typename TW, typename Epi>
__device__ __forceinline__ void hk_seg_gemm(const TX* __restrict__ X, const TW* __restrict__ W,
                                            int start, int end, int N, int K, Epi& epi) {
    __shared__ float xs[HK_TILE][HK_TILE + 1];
    __shared__ float ws[HK_TILE][HK_TILE + 1];
    const int tx = threadIdx.x;
    const int ty = threadIdx.y;
    const int col = blockIdx.x * HK_TILE + tx;    // output column computed by this thread
    const int wrow = blockIdx.x * HK_TILE + ty;   // row of W this thread stages
    for (int m0 = start + (int)blockIdx.y * HK_TILE; m0 < end; m0 += (int)gridDim.y * HK_TILE) {
        const int row = m0 + ty;
        float acc = 0.f;
        for (int k0 = 0; k0 < K; k0 += HK_TILE) {
            const int k = k0 + tx;
            xs[ty][tx] = (row < end && k < K) ? hk_to_float(X[(size_t)row * K + k]) : 0.f;
            ws[ty][tx] = (wrow < N && k < K) ? hk_to_float(W[(size_t)wrow * K + k]) : 0.f;
            __syncthreads();
#pragma unroll
            for (int kk = 0; kk < HK_TILE; ++kk) acc += xs[ty][kk] * ws[tx][kk];
            __syncthreads();
        }
        if (row < end && col < N) epi(row, col, acc);
    }
}

// ---------------------------------------------------------------------------------------
// Block-wide sum; blockDim.x must be a multiple of 32 (<= 1024), 1-D blocks only.
// Every thread gets the total.  `shm` is a __shared__ float[32] owned by the caller.
__device__ __forceinline__ float hk_warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

__device__ __forceinline__ float hk_block_sum(float v, float* shm) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    v = hk_warp_sum(v);
    if (lane == 0) shm[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = (lane < nwarps) ? shm[lane] : 0.f;
        w = hk_warp_sum(w);
        if (lane == 0) shm[0] = w;
    }
    __syncthreads();
    const float total = shm[0];
    __syncthreads();   // shm may be reused by the next call
    return total;
}
