// Fused element-wise work of the upper layers (fp32 math, dtype of x in and out).
//
// bias + GELU (erf form):  y = g(x + bias[c]),  g(v) = 0.5 v (1 + erf(v / sqrt 2)).
//   x (rows, d), bias (d,).  Grid-stride over rows*d elements; block 256,
//   grid min(ceil(total / 256), 65535).
// residual + LayerNorm:    v = x + residual;  y = (v - mean) * rsqrt(var + eps) * gamma + beta
//   with mean/var (biased) over the last dim, accumulated in fp32.  One block (256) per row,
//   grid (rows); three passes over the row (sum, squared deviations, write) re-read it from
//   L1/L2, which avoids both dynamic shared memory and the cancellation of E[v^2] - mean^2.

template <typename T>
__device__ __forceinline__ void hk_bias_gelu(T* y, const T* x,   // y may alias x
                                             const T* __restrict__ bias, long long total, int d) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += stride) {
        const int c = (int)(e % d);
        const float v = hk_to_float(x[e]) + hk_to_float(bias[c]);
        y[e] = hk_from_float<T>(0.5f * v * (1.f + erff(v * 0.70710678118654752f)));
    }
}

template <typename T>
__device__ __forceinline__ void hk_residual_layernorm(T* y, const T* x, const T* residual,
                                                      const T* __restrict__ gamma,
                                                      const T* __restrict__ beta, int rows,
                                                      int d, float eps) {
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
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        const float v = hk_to_float(x[base + c]) + hk_to_float(residual[base + c]);
        y[base + c] = hk_from_float<T>((v - mean) * rstd * hk_to_float(gamma[c]) +
                                       hk_to_float(beta[c]));
    }
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
    hk_residual_layernorm<float>(y, x, residual, gamma, beta, rows, d, eps);
}

extern "C" __global__ void __launch_bounds__(256)
hk_residual_layernorm_f16(hk_half* y, const hk_half* x, const hk_half* residual,
                          const hk_half* gamma, const hk_half* beta, int rows, int d, float eps) {
    hk_residual_layernorm<hk_half>(y, x, residual, gamma, beta, rows, d, eps);
}
