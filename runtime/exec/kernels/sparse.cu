// Diff-pruning sparse delta: y[rows of s] += x[rows of s] @ Delta_t.T, t = seg_ids[s].
//
// Delta_t is COO over the flat index f = o * d_in + i of a (d_out, d_in) matrix:
// entries delta_offsets[t] .. delta_offsets[t+1] of delta_idx (int32) / delta_vals.
// Contract: within each tenant the flat indices are nondecreasing (row-major order; a
// repeated index adds up).  Then the entries of output o form one contiguous run,
// [lower_bound(o * d_in), lower_bound((o + 1) * d_in)), and
//     y[row, o] += sum over that run of vals[e] * x[row, f_e - o * d_in]
// is a sparse dot product per (row, o): no densify, no atomics, deterministic.
// Entries outside the run (only possible when the contract is broken) are skipped, so
// every access stays in bounds whatever the input.
//
// One thread per (row, o); grid (rows, ceil(d_out / 128)), block 128.

template <typename T>
__device__ __forceinline__ void hk_sparse_add(T* __restrict__ y, const T* __restrict__ x,
                                              const int* __restrict__ delta_idx,
                                              const T* __restrict__ delta_vals,
                                              const int* __restrict__ delta_offsets,
                                              const int* __restrict__ seg_starts,
                                              const int* __restrict__ seg_ids, int S, int rows,
                                              int num_tenants, int nnz_total, int d_in,
                                              int d_out) {
    const int row = blockIdx.x;
    const int o = blockIdx.y * blockDim.x + threadIdx.x;
    if (row >= rows || o >= d_out) return;
    const int s = hk_find_segment(seg_starts, S, row);
    if (s < 0) return;
    const int t = seg_ids[s];
    if (t < 0 || t >= num_tenants) return;
    const int lo = max(delta_offsets[t], 0);
    const int hi = min(delta_offsets[t + 1], nnz_total);
    if (lo >= hi) return;
    const long long key0 = (long long)o * d_in;
    const long long key1 = key0 + d_in;
    int a = lo, b = hi;                     // lower_bound(key0) in delta_idx[lo:hi]
    while (a < b) {
        const int mid = a + ((b - a) >> 1);
        if ((long long)delta_idx[mid] < key0) a = mid + 1; else b = mid;
    }
    const T* xr = x + (size_t)row * d_in;
    float acc = 0.f;
    for (int e = a; e < hi; ++e) {
        const long long f = delta_idx[e];
        if (f >= key1) break;
        if (f < key0) continue;
        acc += hk_to_float(delta_vals[e]) * hk_to_float(xr[f - key0]);
    }
    const size_t idx = (size_t)row * d_out + o;
    y[idx] = hk_from_float<T>(hk_to_float(y[idx]) + acc);
}

extern "C" __global__ void __launch_bounds__(128)
hk_sparse_add_f32(float* y, const float* x, const int* delta_idx, const float* delta_vals,
                  const int* delta_offsets, const int* seg_starts, const int* seg_ids, int S,
                  int rows, int num_tenants, int nnz_total, int d_in, int d_out) {
    hk_sparse_add<float>(y, x, delta_idx, delta_vals, delta_offsets, seg_starts, seg_ids, S, rows,
                         num_tenants, nnz_total, d_in, d_out);
}

extern "C" __global__ void __launch_bounds__(128)
hk_sparse_add_f16(hk_half* y, const hk_half* x, const int* delta_idx, const hk_half* delta_vals,
                  const int* delta_offsets, const int* seg_starts, const int* seg_ids, int S,
                  int rows, int num_tenants, int nnz_total, int d_in, int d_out) {
    hk_sparse_add<hk_half>(y, x, delta_idx, delta_vals, delta_offsets, seg_starts, seg_ids, S,
                           rows, num_tenants, nnz_total, d_in, d_out);
}
