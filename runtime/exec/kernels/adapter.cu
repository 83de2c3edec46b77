// Segmented bottleneck adapter (HMI section 6.3: one batched matmul pair per segment).
//
//   down:  h[rows of s] = relu(x @ down[t].T + down_bias[t])   down (T, b, d), h fp32 (rows, b)
//   up:    y[rows of s] = x + h @ up[t].T + up_bias[t]         up (T, d, b), y (rows, d)
// t = seg_ids[s].  x, y, weights and biases share one dtype; h is fp32.  Rows no valid
// segment covers are not written by either kernel: the launcher first copies x into y.
// Same tiled GEMM and launch shape as SGMV: block (16, 16), grid (ceil(N / 16), G, S),
// N = b for down, d for up.

template <typename T>
struct HkDownEpi {
    float* h;
    const T* bias;   // down_bias[t], (b,)
    int b;
    __device__ __forceinline__ void operator()(int row, int col, float acc) {
        h[(size_t)row * b + col] = fmaxf(acc + hk_to_float(bias[col]), 0.f);
    }
};

template <typename T>
struct HkUpEpi {
    T* y;
    const T* x;
    const T* bias;   // up_bias[t], (d,)
    int d;
    __device__ __forceinline__ void operator()(int row, int col, float acc) {
        const size_t o = (size_t)row * d + col;
        y[o] = hk_from_float<T>(hk_to_float(x[o]) + acc + hk_to_float(bias[col]));
    }
};

template <typename T>
__device__ __forceinline__ void hk_adapter_down(float* __restrict__ h, const T* __restrict__ x,
                                                const T* __restrict__ down,
                                                const T* __restrict__ down_bias,
                                                const int* __restrict__ seg_starts,
                                                const int* __restrict__ seg_ids, int S, int rows,
                                                int num_tenants, int d, int b) {
    const int s = blockIdx.z;
    int start, end, t;
    if (s >= S || !hk_segment(seg_starts, seg_ids, s, rows, num_tenants, start, end, t)) return;
    if ((int)blockIdx.x * HK_TILE >= b) return;
    HkDownEpi<T> epi;
    epi.h = h;
    epi.bias = down_bias + (size_t)t * b;
    epi.b = b;
    hk_seg_gemm(x, down + (size_t)t * b * d, start, end, b, d, epi);
}

template <typename T>
__device__ __forceinline__ void hk_adapter_up(T* y, const T* x,   // may alias (in place)
                                              const float* __restrict__ h,
                                              const T* __restrict__ up,
                                              const T* __restrict__ up_bias,
                                              const int* __restrict__ seg_starts,
                                              const int* __restrict__ seg_ids, int S, int rows,
                                              int num_tenants, int d, int b) {
    const int s = blockIdx.z;
    int start, end, t;
    if (s >= S || !hk_segment(seg_starts, seg_ids, s, rows, num_tenants, start, end, t)) return;
    if ((int)blockIdx.x * HK_TILE >= d) return;
    HkUpEpi<T> epi;
    epi.y = y;
    epi.x = x;
    epi.bias = up_bias + (size_t)t * d;
    epi.d = d;
    hk_seg_gemm(h, up + (size_t)t * d * b, start, end, d, b, epi);
}

extern "C" __global__ void __launch_bounds__(HK_TILE * HK_TILE)
hk_adapter_down_f32(float* h, const float* x, const float* down, const float* down_bias,
                    const int* seg_starts, const int* seg_ids, int S, int rows, int num_tenants,
                    int d, int b) {
    hk_adapter_down<float>(h, x, down, down_bias, seg_starts, seg_ids, S, rows, num_tenants, d, b);
}

extern "C" __global__ void __launch_bounds__(HK_TILE * HK_TILE)
hk_adapter_down_f16(float* h, const hk_half* x, const hk_half* down, const hk_half* down_bias,
                    const int* seg_starts, const int* seg_ids, int S, int rows, int num_tenants,
                    int d, int b) {
    hk_adapter_down<hk_half>(h, x, down, down_bias, seg_starts, seg_ids, S, rows, num_tenants, d,
                             b);
}

extern "C" __global__ void __launch_bounds__(HK_TILE * HK_TILE)
hk_adapter_up_f32(float* y, const float* x, const float* h, const float* up, const float* up_bias,
                  const int* seg_starts, const int* seg_ids, int S, int rows, int num_tenants,
                  int d, int b) {
    hk_adapter_up<float>(y, x, h, up, up_bias, seg_starts, seg_ids, S, rows, num_tenants, d, b);
}

extern "C" __global__ void __launch_bounds__(HK_TILE * HK_TILE)
hk_adapter_up_f16(hk_half* y, const hk_half* x, const float* h, const hk_half* up,
                  const hk_half* up_bias, const int* seg_starts, const int* seg_ids, int S,
                  int rows, int num_tenants, int d, int b) {
    hk_adapter_up<hk_half>(y, x, h, up, up_bias, seg_starts, seg_ids, S, rows, num_tenants, d, b);
}
