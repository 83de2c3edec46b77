// Window aggregation (FORMAT.md section 4, "Values and aggregation").
//
// values: (B*L, n, d) fp16/fp32, row b*L + j = the value of the window at position j of
//         sequence b (its n slot vectors).
// lengths: (B,) int32, clamped to [0, L].
// slot_mask: (B*L, n) uint8, read only when has_mask != 0: a slot with mask 0 does not
//         count (e.g. a slot a backed-off key replaced by pad_id).
// out:    (B, L, d) fp32.  out[b, i] = mean over the in-sequence windows j (0 <= j < len)
//         covering i of values[b*L + j, i - j + l], l = window's left extent; positions
//         i >= len, and tokens no counted slot covers, are written as 0.
//
// Window j covers positions j - l .. j - l + n - 1, so token i sits in slot k = i - j + l
// of the windows j in [i + l - (n - 1), i + l].  The loop runs over j descending
// (= k ascending), the summation order of the CPU reference.
//
// Launch: grid (B*L, ceil(d / blockDim.x)), block (256).  Every output element written.

template <typename T>
__device__ __forceinline__ void hk_aggregate(float* __restrict__ out, const T* __restrict__ values,
                                             const int* __restrict__ lengths,
                                             const unsigned char* __restrict__ slot_mask,
                                             int has_mask, int B, int L, int n, int d, int left) {
    const int tok = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (tok >= B * L || c >= d) return;
    const int b = tok / L;
    const int i = tok - b * L;
    const int len = min(max(lengths[b], 0), L);
    const size_t o = (size_t)tok * d + c;
    if (i >= len) { out[o] = 0.f; return; }
    const int jlo = max(0, i + left - (n - 1));
    const int jhi = min(len - 1, i + left);
    float sum = 0.f;
    int cnt = 0;
    for (int j = jhi; j >= jlo; --j) {
        const int k = i - j + left;                  // in [0, n) by construction of jlo/jhi
        const size_t w = (size_t)b * L + j;          // window row
        if (has_mask && slot_mask[w * n + k] == 0) continue;
        sum += hk_to_float(values[(w * n + k) * d + c]);
        ++cnt;
    }
    out[o] = (cnt > 0) ? sum / (float)cnt : 0.f;
}

extern "C" __global__ void hk_aggregate_f32(float* out, const float* values, const int* lengths,
                                            const unsigned char* slot_mask, int has_mask, int B,
                                            int L, int n, int d, int left) {
    hk_aggregate<float>(out, values, lengths, slot_mask, has_mask, B, L, n, d, left);
}

extern "C" __global__ void hk_aggregate_f16(float* out, const hk_half* values, const int* lengths,
                                            const unsigned char* slot_mask, int has_mask, int B,
                                            int L, int n, int d, int left) {
    hk_aggregate<hk_half>(out, values, lengths, slot_mask, has_mask, B, L, n, d, left);
}
