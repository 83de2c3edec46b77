// Hot tier: a device-resident copy of PLOT entries, probed by an open-addressing table
// that follows FORMAT.md section 3:
//   capacity is a power of two; key hash h = XXH64(the 4n little-endian key bytes, seed 0);
//   linear probing from h & (capacity - 1), wrapping; at most max_probe + 1 slots; the
//   first empty slot (table_rows == -1) ends the probe; a slot is a hit only if its key
//   equals the query in all n ids.
// table_keys (capacity, n) uint32, table_rows (capacity,) int32, queries (m, n) uint32.
// n is 1 .. 7 (key length < 32 bytes: XXH64's short-input path; the store uses 2 .. 5).

#define HK_P1 0x9E3779B185EBCA87ULL
#define HK_P2 0xC2B2AE3D27D4EB4FULL
#define HK_P3 0x165667B19E3779F9ULL
#define HK_P4 0x85EBCA77C2B2AE63ULL
#define HK_P5 0x27D4EB2F165667C5ULL

__device__ __forceinline__ hk_u64 hk_rotl64(hk_u64 v, int r) {
    return (v << r) | (v >> (64 - r));
}

// XXH64 (seed 0) of n uint32 ids, n in [1, 7] (4n < 32 bytes).
__device__ __forceinline__ hk_u64 hk_xxh64_u32(const unsigned int* __restrict__ key, int n) {
    hk_u64 h = HK_P5 + (hk_u64)(4 * n);
    int i = 0;
    for (; i + 2 <= n; i += 2) {                      // 8-byte lanes (little endian)
        const hk_u64 lane = (hk_u64)key[i] | ((hk_u64)key[i + 1] << 32);
        const hk_u64 k1 = hk_rotl64(lane * HK_P2, 31) * HK_P1;
        h ^= k1;
        h = hk_rotl64(h, 27) * HK_P1 + HK_P4;
    }
    if (i < n) {                                      // trailing 4 bytes
        h ^= (hk_u64)key[i] * HK_P1;
        h = hk_rotl64(h, 23) * HK_P2 + HK_P3;
    }
    h ^= h >> 33;                                     // avalanche
    h *= HK_P2;
    h ^= h >> 29;
    h *= HK_P3;
    h ^= h >> 32;
    return h;
}

// hashes[i] = XXH64 of query i.  Grid ceil(m / 256), block 256.
extern "C" __global__ void __launch_bounds__(256)
hk_xxh64_keys(hk_u64* hashes, const unsigned int* keys, int m, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= m) return;
    hashes[i] = (n >= 1 && n <= 7) ? hk_xxh64_u32(keys + (size_t)i * n, n) : 0ULL;
}

// out_rows[i] = table row of query i, or -1.  One thread per query; grid ceil(m / 256),
// block 256.  capacity must be a power of two (checked on the host).  With use_hashes != 0
// the home slot comes from the precomputed hashes[i] instead of hashing the query.
extern "C" __global__ void __launch_bounds__(256)
hk_hot_probe(int* out_rows, const unsigned int* queries, const hk_u64* hashes, int use_hashes,
             int m, int n, const unsigned int* table_keys, const int* table_rows, int capacity,
             int max_probe) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= m) return;
    int result = -1;
    if (n >= 1 && n <= 7 && capacity > 0) {
        const unsigned int* q = queries + (size_t)i * n;
        const hk_u64 mask = (hk_u64)(capacity - 1);
        const hk_u64 home = (use_hashes ? hashes[i] : hk_xxh64_u32(q, n)) & mask;
        const int probes = min(max_probe, capacity - 1) + 1;
        for (int p = 0; p < probes; ++p) {
            const size_t slot = (size_t)((home + (hk_u64)p) & mask);
            const int r = table_rows[slot];
            if (r < 0) break;                          // empty slot ends the probe
            const unsigned int* k = table_keys + slot * n;
            bool eq = true;
            for (int c = 0; c < n; ++c) eq = eq && (k[c] == q[c]);
            if (eq) { result = r; break; }
        }
    }
    out_rows[i] = result;
}

// out[i, :] = values[rows[i], :] for hits (0 <= rows[i] < rows_total); misses untouched.
// width = n * d elements per row.  Grid (m, ceil(width / 256)), block 256.
template <typename T>
__device__ __forceinline__ void hk_hot_gather(T* __restrict__ out, const T* __restrict__ values,
                                              const int* __restrict__ rows, int m, int width,
                                              int rows_total) {
    const int i = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= m || c >= width) return;
    const int r = rows[i];
    if (r < 0 || r >= rows_total) return;
    out[(size_t)i * width + c] = values[(size_t)r * width + c];
}

extern "C" __global__ void __launch_bounds__(256)
hk_hot_gather_f16(hk_half* out, const hk_half* values, const int* rows, int m, int width,
                  int rows_total) {
    hk_hot_gather<hk_half>(out, values, rows, m, width, rows_total);
}

extern "C" __global__ void __launch_bounds__(256)
hk_hot_gather_f32(float* out, const float* values, const int* rows, int m, int width,
                  int rows_total) {
    hk_hot_gather<float>(out, values, rows, m, width, rows_total);
}
