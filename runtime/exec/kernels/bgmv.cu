// BGMV (Punica): one LoRA per row, for decode-like batches where rows of one tenant are
// few and scattered.  t = row_ids[row]; a negative (or out-of-range) id skips the row.
//
//   shrink:  v[row, j]  = sum_k x[row, k] * A[t, j, k]          A (T, r, d_in), v fp32
//            one warp per output (row, j): lanes stride over d_in (coalesced), then a
//            shuffle reduction.  Block = 32 * HK_BGMV_WARPS threads = HK_BGMV_WARPS
//            outputs; grid (rows, ceil(r / HK_BGMV_WARPS)).
//   expand:  y[row, o] += scale[t] * sum_k v[row, k] * B[t, o, k]   B (T, d_out, r)
//            one thread per output (row, o); K = r is small, v[row] is a broadcast read
//            and each thread reads its contiguous B row (the warp's rows share cache
//            lines).  Block 256, grid (rows, ceil(d_out / 256)).
// Rows sit on grid.x (limit 2^31 - 1); grid.y stays far below 65535.

#define HK_BGMV_WARPS 4

template <typename T>
__device__ __forceinline__ void hk_bgmv_shrink(float* __restrict__ v, const T* __restrict__ x,
                                               const T* __restrict__ A,
                                               const int* __restrict__ row_ids, int rows,
                                               int num_tenants, int d_in, int r) {
    const int row = blockIdx.x;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int j = blockIdx.y * HK_BGMV_WARPS + warp;
    if (row >= rows || j >= r) return;                      // uniform per warp
    const int t = row_ids[row];
    if (t < 0 || t >= num_tenants) return;                  // uniform per block
    const T* xr = x + (size_t)row * d_in;
    const T* a = A + ((size_t)t * r + j) * d_in;
    float acc = 0.f;
    for (int k = lane; k < d_in; k += 32) acc += hk_to_float(xr[k]) * hk_to_float(a[k]);
    acc = hk_warp_sum(acc);                                 // all 32 lanes take part
    if (lane == 0) v[(size_t)row * r + j] = acc;
}

template <typename T>
__device__ __forceinline__ void hk_bgmv_expand(T* __restrict__ y, const float* __restrict__ v,
                                               const T* __restrict__ Bw,
                                               const float* __restrict__ scales,
                                               const int* __restrict__ row_ids, int rows,
                                               int num_tenants, int r, int d_out) {
    const int row = blockIdx.x;
    const int o = blockIdx.y * blockDim.x + threadIdx.x;
    if (row >= rows || o >= d_out) return;
    const int t = row_ids[row];
    if (t < 0 || t >= num_tenants) return;
    const float* vr = v + (size_t)row * r;
    const T* b = Bw + ((size_t)t * d_out + o) * r;
    float acc = 0.f;
    for (int k = 0; k < r; ++k) acc += vr[k] * hk_to_float(b[k]);
    const size_t idx = (size_t)row * d_out + o;
    y[idx] = hk_from_float<T>(hk_to_float(y[idx]) + scales[t] * acc);
}

extern "C" __global__ void __launch_bounds__(32 * HK_BGMV_WARPS)
hk_bgmv_shrink_f32(float* v, const float* x, const float* A, const int* row_ids, int rows,
                   int num_tenants, int d_in, int r) {
    hk_bgmv_shrink<float>(v, x, A, row_ids, rows, num_tenants, d_in, r);
}

extern "C" __global__ void __launch_bounds__(32 * HK_BGMV_WARPS)
hk_bgmv_shrink_f16(float* v, const hk_half* x, const hk_half* A, const int* row_ids, int rows,
                   int num_tenants, int d_in, int r) {
    hk_bgmv_shrink<hk_half>(v, x, A, row_ids, rows, num_tenants, d_in, r);
}

extern "C" __global__ void __launch_bounds__(256)
hk_bgmv_expand_f32(float* y, const float* v, const float* Bw, const float* scales,
                   const int* row_ids, int rows, int num_tenants, int r, int d_out) {
    hk_bgmv_expand<float>(y, v, Bw, scales, row_ids, rows, num_tenants, r, d_out);
}

extern "C" __global__ void __launch_bounds__(256)
hk_bgmv_expand_f16(hk_half* y, const float* v, const hk_half* Bw, const float* scales,
                   const int* row_ids, int rows, int num_tenants, int r, int d_out) {
    hk_bgmv_expand<hk_half>(y, v, Bw, scales, row_ids, rows, num_tenants, r, d_out);
}
