// Fused element-wise work of the upper layers (fp32 math, dtype of x in and out).
//
// bias + GELU (erf form):  y = g(x + bias[c]),  g(v) = 0.5 v (1 + erf(v / sqrt 2)), computed as
// 0.5 v erfc(-v / sqrt 2): 1 + erf cancels in fp32 for v below about -4.
//   x (rows, d), bias (d,).  Grid-stride over rows*d elements; block 256,
//   grid min(ceil(total / 256), 65535).
// residual + LayerNorm:    v = x + residual;  y = (v - mean) * rsqrt(var + eps) * gamma + beta
//   with mean/var (biased) over the last dim, accumulated in fp32.  One block (256) per row,
//   grid (rows); three passes over the row (sum, squared deviations, write) re-read it from
//   L1/L2, which avoids both dynamic shared memory and the cancellation of E[v^2] - mean^2.
// segmented residual + LayerNorm: the same, with the row's tenant's gain and shift deltas
//   (PET LayerNorm edits) added: gamma[c] + gamma_delta[t, c], beta[c] + beta_delta[t, c],
//   t = seg_ids[segment of the row]; rows outside every segment, or of t outside [0, T), use
//   gamma and beta alone.  gamma_delta, beta_delta (T, d).

template <typename T>
__device__ __forceinline__ void hk_bias_gelu(T* y, const T* x,   // y may alias x
                                             const T* __restrict__ bias, long long total, int d) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += stride) {
        const int c = (int)(e % d);
        const float v = hk_to_float(x[e]) + hk_to_float(bias[c]);
        y[e] = hk_from_float<T>(0.5f * v * erfcf(-v * 0.70710678118654752f));
    }
}

// t < 0: no deltas (gamma_delta / beta_delta are not read).
template <typename T>
__device__ __forceinline__ void hk_residual_layernorm(T* y, const T* x, const T* residual,
                                                      const T* __restrict__ gamma,
                                                      const T* __restrict__ beta,
                                                      const T* __restrict__ gamma_delta,
                                                      const T* __restrict__ beta_delta, int t,
                                                      int rows, int d, float eps) {
    __shared__ float shm[32];
    const int row = blockIdx.x;
    if (row >= rows || d <= 0) return;                 // uniform per block
    const size_t base = (size_t)row * d;
    float s = 0.f;
    for (int c = threadIdx.x; c < d; c += blockDim.x)
        s += hk_to_float(x[base + c]) + hk_to_float(residual[base + c]);
    const float mean = hk_block_sum(s, shm) / (float)d;
    float q = 0.f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        const float v = hk_to_float(x[base + c]) + hk_to_float(residual[base + c]) - mean;
        q += v * v;
    }
    const float var = hk_block_sum(q, shm) / (float)d;
    const float rstd = rsqrtf(var + eps);
    // All reads of this row by this block are done (hk_block_sum ends in __syncthreads),
    // so y may alias x or residual.
    const size_t tenant = (size_t)(t < 0 ? 0 : t) * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        const float v = hk_to_float(x[base + c]) + hk_to_float(residual[base + c]);
        float g = hk_to_float(gamma[c]), b = hk_to_float(beta[c]);
        if (t >= 0) {
            g += hk_to_float(gamma_delta[tenant + c]);
            b += hk_to_float(beta_delta[tenant + c]);
        }
        y[base + c] = hk_from_float<T>((v - mean) * rstd * g + b);
    }
}

template <typename T>
__device__ __forceinline__ void hk_segmented_layernorm(
    T* y, const T* x, const T* residual, const T* __restrict__ gamma, const T* __restrict__ beta,
    const T* __restrict__ gamma_delta, const T* __restrict__ beta_delta,
    const int* __restrict__ seg_starts, const int* __restrict__ seg_ids, int S, int num_tenants,
    int rows, int d, float eps) {
    if ((int)blockIdx.x >= rows) return;               // uniform per block
    const int s = hk_find_segment(seg_starts, S, blockIdx.x);
    int t = s < 0 ? -1 : seg_ids[s];
    if (t >= num_tenants) t = -1;
    hk_residual_layernorm<T>(y, x, residual, gamma, beta, gamma_delta, beta_delta, t, rows, d, eps);
}

extern "C" __global__ void __launch_bounds__(256)
hk_bias_gelu_f32(float* y, const float* x, const float* bias, long long total, int d) {
    hk_bias_gelu<float>(y, x, bias, total, d);
}

extern "C" __global__ void __launch_bounds__(256)
hk_bias_gelu_f16(hk_half* y, const hk_half* x, const hk_half* bias, long long total, int d) {
    hk_bias_gelu<hk_half>(y, x, bias, total, d);
}

extern "C" __global__ void __launch_bounds__(256)
hk_residual_layernorm_f32(float* y, const float* x, const float* residual, const float* gamma,
                          const float* beta, int rows, int d, float eps) {
    hk_residual_layernorm<float>(y, x, residual, gamma, beta, gamma, beta, -1, rows, d, eps);
}

extern "C" __global__ void __launch_bounds__(256)
hk_residual_layernorm_f16(hk_half* y, const hk_half* x, const hk_half* residual,
                          const hk_half* gamma, const hk_half* beta, int rows, int d, float eps) {
    hk_residual_layernorm<hk_half>(y, x, residual, gamma, beta, gamma, beta, -1, rows, d, eps);
}

extern "C" __global__ void __launch_bounds__(256)
hk_segmented_layernorm_f32(float* y, const float* x, const float* residual, const float* gamma,
                           const float* beta, const float* gamma_delta, const float* beta_delta,
                           const int* seg_starts, const int* seg_ids, int S, int num_tenants,
                           int rows, int d, float eps) {
    hk_segmented_layernorm<float>(y, x, residual, gamma, beta, gamma_delta, beta_delta, seg_starts,
                                  seg_ids, S, num_tenants, rows, d, eps);
}

extern "C" __global__ void __launch_bounds__(256)
hk_segmented_layernorm_f16(hk_half* y, const hk_half* x, const hk_half* residual,
                           const hk_half* gamma, const hk_half* beta, const hk_half* gamma_delta,
                           const hk_half* beta_delta, const int* seg_starts, const int* seg_ids,
                           int S, int num_tenants, int rows, int d, float eps) {
    hk_segmented_layernorm<hk_half>(y, x, residual, gamma, beta, gamma_delta, beta_delta,
                                    seg_starts, seg_ids, S, num_tenants, rows, d, eps);
}
