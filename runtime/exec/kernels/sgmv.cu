// SGMV (Punica): segmented gather matrix-vector/matrix-matrix for LoRA.
//
//   shrink:  v[rows of s]  = x[rows of s] @ A[t].T           A stacked (T, r, d_in), v fp32
//   expand:  y[rows of s] += scale[t] * v[rows of s] @ B[t].T B stacked (T, d_out, r)
// with t = seg_ids[s].  Segments must not overlap (each output element has one writer, so
// the expand read-modify-write needs no atomics).  Rows no valid segment covers are not
// touched.  x, A, B, y share one dtype (fp32 or fp16); scales is fp32 (T,).
//
// Both are one tiled GEMM per segment (hk_seg_gemm in the prelude): block (16, 16),
// grid (ceil(N / 16), G, S) where N = r (shrink) or d_out (expand), G = row-tile groups
// (the block with blockIdx.y = g handles the segment's row tiles g, g + G, ...), and
// S <= 65535 segments (the launcher splits longer lists).

struct HkShrinkEpi {
    float* v;
    int r;
    __device__ __forceinline__ void operator()(int row, int col, float acc) {
        v[(size_t)row * r + col] = acc;
    }
};

template <typename T>
struct HkExpandEpi {
    T* y;
    int d_out;
    float scale;
    __device__ __forceinline__ void operator()(int row, int col, float acc) {
        const size_t o = (size_t)row * d_out + col;
        y[o] = hk_from_float<T>(hk_to_float(y[o]) + scale * acc);
    }
};

template <typename T>
__device__ __forceinline__ void hk_sgmv_shrink(float* __restrict__ v, const T* __restrict__ x,
                                               const T* __restrict__ A,
                                               const int* __restrict__ seg_starts,
                                               const int* __restrict__ seg_ids, int S, int rows,
                                               int num_tenants, int d_in, int r) {
    const int s = blockIdx.z;
    int start, end, t;
    if (s >= S || !hk_segment(seg_starts, seg_ids, s, rows, num_tenants, start, end, t)) return;
    if ((int)blockIdx.x * HK_TILE >= r) return;
    HkShrinkEpi epi;
    epi.v = v;
    epi.r = r;
    hk_seg_gemm(x, A + (size_t)t * r * d_in, start, end, r, d_in, epi);
}

template <typename T>
__device__ __forceinline__ void hk_sgmv_expand(T* __restrict__ y, const float* __restrict__ v,
                                               const T* __restrict__ Bw,
                                               const float* __restrict__ scales,
                                               const int* __restrict__ seg_starts,
                                               const int* __restrict__ seg_ids, int S, int rows,
                                               int num_tenants, int r, int d_out) {
    const int s = blockIdx.z;
    int start, end, t;
    if (s >= S || !hk_segment(seg_starts, seg_ids, s, rows, num_tenants, start, end, t)) return;
    if ((int)blockIdx.x * HK_TILE >= d_out) return;
    HkExpandEpi<T> epi;
    epi.y = y;
    epi.d_out = d_out;
    epi.scale = scales[t];
    hk_seg_gemm(v, Bw + (size_t)t * d_out * r, start, end, d_out, r, epi);
}

extern "C" __global__ void __launch_bounds__(HK_TILE * HK_TILE)
hk_sgmv_shrink_f32(float* v, const float* x, const float* A, const int* seg_starts,
                   const int* seg_ids, int S, int rows, int num_tenants, int d_in, int r) {
    hk_sgmv_shrink<float>(v, x, A, seg_starts, seg_ids, S, rows, num_tenants, d_in, r);
}

extern "C" __global__ void __launch_bounds__(HK_TILE * HK_TILE)
hk_sgmv_shrink_f16(float* v, const hk_half* x, const hk_half* A, const int* seg_starts,
                   const int* seg_ids, int S, int rows, int num_tenants, int d_in, int r) {
    hk_sgmv_shrink<hk_half>(v, x, A, seg_starts, seg_ids, S, rows, num_tenants, d_in, r);
}

extern "C" __global__ void __launch_bounds__(HK_TILE * HK_TILE)
hk_sgmv_expand_f32(float* y, const float* v, const float* Bw, const float* scales,
                   const int* seg_starts, const int* seg_ids, int S, int rows, int num_tenants,
                   int r, int d_out) {
    hk_sgmv_expand<float>(y, v, Bw, scales, seg_starts, seg_ids, S, rows, num_tenants, r, d_out);
}

extern "C" __global__ void __launch_bounds__(HK_TILE * HK_TILE)
hk_sgmv_expand_f16(hk_half* y, const float* v, const hk_half* Bw, const float* scales,
                   const int* seg_starts, const int* seg_ids, int S, int rows, int num_tenants,
                   int r, int d_out) {
    hk_sgmv_expand<hk_half>(y, v, Bw, scales, seg_starts, seg_ids, S, rows, num_tenants, r,
                            d_out);
}
