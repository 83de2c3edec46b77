// BitFit bias gather: y[row, c] += bias_delta[seg_ids[s], c] for the rows of segment s.
//
// y (rows, d_out) and bias_delta (T, d_out) share one dtype.  One thread per element;
// grid (rows, ceil(d_out / 256)), block 256.  The row's segment is found by binary search
// over seg_starts (block-uniform, O(log S) cached reads), so the kernel needs no host-side
// row -> tenant map and no host synchronisation.

template <typename T>
__device__ __forceinline__ void hk_bias_gather(T* __restrict__ y, const T* __restrict__ bias,
                                               const int* __restrict__ seg_starts,
                                               const int* __restrict__ seg_ids, int S, int rows,
                                               int num_tenants, int d_out) {
    const int row = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (row >= rows || c >= d_out) return;
    const int s = hk_find_segment(seg_starts, S, row);
    if (s < 0) return;
    const int t = seg_ids[s];
    if (t < 0 || t >= num_tenants) return;
    const size_t o = (size_t)row * d_out + c;
    y[o] = hk_from_float<T>(hk_to_float(y[o]) + hk_to_float(bias[(size_t)t * d_out + c]));
}

extern "C" __global__ void __launch_bounds__(256)
hk_bias_gather_f32(float* y, const float* bias, const int* seg_starts, const int* seg_ids, int S,
                   int rows, int num_tenants, int d_out) {
    hk_bias_gather<float>(y, bias, seg_starts, seg_ids, S, rows, num_tenants, d_out);
}

extern "C" __global__ void __launch_bounds__(256)
hk_bias_gather_f16(hk_half* y, const hk_half* bias, const int* seg_starts, const int* seg_ids,
                   int S, int rows, int num_tenants, int d_out) {
    hk_bias_gather<hk_half>(y, bias, seg_starts, seg_ids, S, rows, num_tenants, d_out);
}
