/* formats._probe: the compiled fast path of PLOT segment lookups (FORMAT.md sections 3 and 4).
 *
 * Plain C and the buffer protocol: no NumPy headers, so building needs only a C compiler and the
 * Python headers. Every function takes NumPy arrays (or any C-contiguous buffer), checks their
 * sizes, and releases the GIL while it works. The NumPy code in formats/segment.py and
 * hkstore/lookup.py is the reference; tests/test_accel.py checks that this module agrees with it.
 *
 *   xxh64(data, seed=0) -> int                     XXH64 of one buffer (written from the spec)
 *   hash_keys(keys, n, out)                        key hash of each (m, n) uint32 row into out (m,) uint64
 *   probe(index, keys, n, max_probe, queries, out_entries, hashes, compute_hashes)
 *                                                  Segment.probe: entry number of each query or -1
 *   resolve(windows, n, segs, seg_version, seg_group, center, drop, pad,
 *           out_seg, out_entry, out_hash, out_version, out_order) -> (need, misses, used)
 *                                                  the whole lookup rule of FORMAT.md section 4
 *   gather(values, count, n, entries, out, out_rows, scales, rowsums, row_ok, hashes) -> int
 *                                                  Segment.read_values / _check_rows
 *   verify_rows(values, keys, n, rowsums, row_ok, scales, populate) -> int
 *                                                  Segment.warm: check every unchecked row now
 *
 * On-disk arrays (index, keys, flags, rowsums, scales) are little-endian; queries, windows and
 * the output arrays are native (NumPy's uint32/int64/... on this machine).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#define HK_API_VERSION 2

/* Tuning knobs, all optional -D flags: HK_NO_PREFETCH (measure without software prefetch),
 * PF_INDEX / PF_KEYS / PF_CANDS (probe pipeline distances, key rows prefetched a probe),
 * GATHER_AHEAD / GATHER_LINES / GATHER_LOCALITY. */
#if defined(__GNUC__) || defined(__clang__)
#define HK_INLINE static inline __attribute__((always_inline))
#else
#define HK_INLINE static inline
#endif
#if (defined(__GNUC__) || defined(__clang__)) && !defined(HK_NO_PREFETCH)
#define HK_PREFETCH(p) __builtin_prefetch((const void *)(p), 0, 3)
#else
#define HK_PREFETCH(p) ((void)(p))
#endif

#if defined(__BYTE_ORDER__) && defined(__ORDER_BIG_ENDIAN__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define HK_BIG_ENDIAN 1
#else
#define HK_BIG_ENDIAN 0
#endif

static PyObject *CorruptIndex; /* (segment position, slot value - 1, entry count) */

/* ---- little-endian reads ------------------------------------------------------------------ */

HK_INLINE uint32_t bswap32(uint32_t x) {
    return (x >> 24) | ((x >> 8) & 0xff00u) | ((x << 8) & 0xff0000u) | (x << 24);
}

HK_INLINE uint64_t bswap64(uint64_t x) {
    return ((uint64_t)bswap32((uint32_t)x) << 32) | bswap32((uint32_t)(x >> 32));
}

HK_INLINE uint32_t le32(uint32_t x) { return HK_BIG_ENDIAN ? bswap32(x) : x; }
HK_INLINE uint64_t le64(uint64_t x) { return HK_BIG_ENDIAN ? bswap64(x) : x; }

HK_INLINE uint64_t read64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return le64(v);
}

HK_INLINE uint32_t read32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return le32(v);
}

/* ---- XXH64 --------------------------------------------------------------------------------- */

static const uint64_t P1 = 11400714785074694791ULL;
static const uint64_t P2 = 14029467366897019727ULL;
static const uint64_t P3 = 1609587929392839161ULL;
static const uint64_t P4 = 9650029242287828579ULL;
static const uint64_t P5 = 2870177450012600261ULL;

HK_INLINE uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

HK_INLINE uint64_t xround(uint64_t acc, uint64_t lane) {
    acc += lane * P2;
    acc = rotl64(acc, 31);
    return acc * P1;
}

HK_INLINE uint64_t xmerge(uint64_t h, uint64_t v) {
    h ^= xround(0, v);
    return h * P1 + P4;
}

/* XXH64 of `len` bytes at `p`. Inlined into the key hash, where len is small. */
HK_INLINE uint64_t xxh64_bytes(const uint8_t *p, size_t len, uint64_t seed) {
    const uint8_t *end = p + len;
    uint64_t h;
    if (len >= 32) {
        const uint8_t *limit = end - 32;
        uint64_t v1 = seed + P1 + P2, v2 = seed + P2, v3 = seed, v4 = seed - P1;
        do {
            v1 = xround(v1, read64(p));
            v2 = xround(v2, read64(p + 8));
            v3 = xround(v3, read64(p + 16));
            v4 = xround(v4, read64(p + 24));
            p += 32;
        } while (p <= limit);
        h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
        h = xmerge(h, v1);
        h = xmerge(h, v2);
        h = xmerge(h, v3);
        h = xmerge(h, v4);
    } else {
        h = seed + P5;
    }
    h += (uint64_t)len;
    while (p + 8 <= end) {
        h ^= xround(0, read64(p));
        h = rotl64(h, 27) * P1 + P4;
        p += 8;
    }
    if (p + 4 <= end) {
        h ^= (uint64_t)read32(p) * P1;
        h = rotl64(h, 23) * P2 + P3;
        p += 4;
    }
    while (p < end) {
        h ^= (uint64_t)(*p) * P5;
        h = rotl64(h, 11) * P1;
        p++;
    }
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}

static uint64_t xxh64_any(const uint8_t *p, size_t len, uint64_t seed) { return xxh64_bytes(p, len, seed); }

/* The key hash: XXH64 (seed 0) of the key's n ids as 4n little-endian bytes (n <= HK_MAX_N).
 * Always inlined: callers pass a compile-time n where speed matters (see the n dispatch below),
 * which unrolls the hash into straight-line code. */
#define HK_MAX_N 64

HK_INLINE uint64_t key_hash(const uint32_t *key, const int n) {
#if HK_BIG_ENDIAN
    uint32_t buf[HK_MAX_N];
    for (int j = 0; j < n; j++) buf[j] = bswap32(key[j]);
    return xxh64_bytes((const uint8_t *)buf, 4 * (size_t)n, 0);
#else
    return xxh64_bytes((const uint8_t *)key, 4 * (size_t)n, 0);
#endif
}

/* ---- buffers ------------------------------------------------------------------------------- */

/* A C-contiguous buffer with the given item size, or an error. `what` names it in messages. */
static int get_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, int writable, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous%s buffer", what, writable ? " writable" : "");
        return -1;
    }
    if (view->itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s must have %zd-byte items, got %zd", what, itemsize, view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* ---- one segment's index --------------------------------------------------------------------- */

typedef struct {
    const uint32_t *index; /* capacity slots, little-endian: 0 empty, else entry + 1 */
    const uint32_t *keys;  /* count x n ids, little-endian */
    const uint8_t *flags;  /* count flags, or NULL when the segment has no tombstones */
    uint64_t mask;         /* capacity - 1 */
    uint64_t nprobe;       /* slots a probe may visit: min(max_probe + 1, capacity) */
    uint64_t count;
} seg_t;

#define ST_OK 0
#define ST_CORRUPT 1

/* Linear probing of FORMAT.md section 3: at most nprobe slots from h & mask, an empty slot ends
 * the probe, a hit needs all n ids equal. Returns the entry, -1 if absent, -2 if the index names
 * an entry beyond count (the entry goes to *bad). */
HK_INLINE int64_t probe_one(const seg_t *s, const uint32_t *q, const int n, uint64_t h, uint64_t *bad) {
    uint64_t slot = h & s->mask;
    for (uint64_t i = 0; i < s->nprobe; i++) {
        uint32_t v = le32(s->index[slot]);
        if (v == 0) return -1;
        uint64_t e = (uint64_t)v - 1;
        if (e >= s->count) {
            *bad = e;
            return -2;
        }
        const uint32_t *k = s->keys + e * (uint64_t)n;
        int j = 0;
        while (j < n && le32(k[j]) == q[j]) j++;
        if (j == n) return (int64_t)e;
        slot = (slot + 1) & s->mask;
    }
    return -1;
}

#ifndef PF_INDEX
#define PF_INDEX 32 /* queries ahead whose home slot is prefetched */
#endif
#ifndef PF_KEYS
#define PF_KEYS 16 /* queries ahead whose candidate key rows are prefetched */
#endif
#ifndef PF_CANDS
#define PF_CANDS 3 /* occupied slots from the home slot whose key rows are prefetched (1, 2, 3 measured: 3 best) */
#endif
#ifndef GATHER_LOCALITY
#define GATHER_LOCALITY 3 /* __builtin_prefetch locality of the value rows */
#endif
#if (defined(__GNUC__) || defined(__clang__)) && !defined(HK_NO_PREFETCH)
#define GATHER_PREFETCH(p) __builtin_prefetch((const void *)(p), 0, GATHER_LOCALITY)
#else
#define GATHER_PREFETCH(p) ((void)(p))
#endif
#ifndef GATHER_LINES
#define GATHER_LINES 64 /* cache lines prefetched of each row (from its start) */
#endif
#ifndef GATHER_AHEAD
#define GATHER_AHEAD 8 /* entries ahead whose value row is prefetched (2, 4 and 8 measured: 8 best) */
#endif

/* Prefetch the key rows a probe from hash h will compare: the entries of the occupied slots from
 * the home slot on, up to PF_CANDS and within the home slot's cache line. At the index's load of
 * about 1/2 a third of the keys sit past their home slot, and their own key row would otherwise
 * be a dependent miss in probe_one. */
HK_INLINE void prefetch_candidates(const seg_t *s, const int n, uint64_t h) {
    uint64_t slot = h & s->mask;
    for (int k = 0; k < PF_CANDS; k++) {
        const uint32_t v = le32(s->index[slot]);
        if (v == 0 || (uint64_t)v - 1 >= s->count) return;
        HK_PREFETCH(s->keys + ((uint64_t)v - 1) * (uint64_t)n);
        slot = (slot + 1) & s->mask;
        if (((uintptr_t)(s->index + slot) & 63) == 0) return; /* the next slot's line is not loaded yet */
    }
}

/* Probe the queries list[0..cnt) (query w: ids qkeys[w*n..], hash hashes[w]; list NULL means
 * 0..cnt), writing res[j] for list position j. A software pipeline: the home slot of query
 * j+PF_INDEX and the key rows its probe will compare for query j+PF_KEYS are prefetched while
 * query j is probed, so the cache misses of a big index overlap instead of adding up. */
HK_INLINE int probe_list(const seg_t *s, const uint32_t *qkeys, const int n, const uint64_t *hashes,
                         const Py_ssize_t *list, Py_ssize_t cnt, int64_t *res, uint64_t *bad) {
    const uint64_t mask = s->mask;
    for (Py_ssize_t j = 0; j < cnt; j++) {
        if (j + PF_INDEX < cnt) {
            Py_ssize_t w = list ? list[j + PF_INDEX] : j + PF_INDEX;
            HK_PREFETCH(s->index + (hashes[w] & mask));
        }
        if (j + PF_KEYS < cnt) {
            Py_ssize_t w = list ? list[j + PF_KEYS] : j + PF_KEYS;
            prefetch_candidates(s, n, hashes[w]);
        }
        Py_ssize_t w = list ? list[j] : j;
        int64_t e = probe_one(s, qkeys + (uint64_t)w * (uint64_t)n, n, hashes[w], bad);
        if (e == -2) return ST_CORRUPT;
        res[j] = e;
    }
    return ST_OK;
}

/* Fill a seg_t from (index, keys, flags or None, max_probe) buffers; views are released by the
 * caller. Returns 0 or -1 with an exception set. */
static int seg_from(seg_t *s, Py_buffer *index, Py_buffer *keys, Py_buffer *flags, unsigned long long max_probe, int n) {
    uint64_t capacity = (uint64_t)(index->len / 4);
    if (capacity == 0 || (capacity & (capacity - 1)) != 0) {
        PyErr_Format(PyExc_ValueError, "index capacity %llu is not a power of two", (unsigned long long)capacity);
        return -1;
    }
    if (keys->len % (4 * (Py_ssize_t)n) != 0) {
        PyErr_Format(PyExc_ValueError, "keys buffer of %zd bytes is not a whole number of %d-id keys", keys->len, n);
        return -1;
    }
    s->index = (const uint32_t *)index->buf;
    s->keys = (const uint32_t *)keys->buf;
    s->count = (uint64_t)(keys->len / (4 * (Py_ssize_t)n));
    s->mask = capacity - 1;
    s->nprobe = max_probe >= capacity ? capacity : (uint64_t)max_probe + 1;
    s->flags = NULL;
    if (flags) {
        if ((uint64_t)flags->len < s->count) {
            PyErr_SetString(PyExc_ValueError, "flags buffer is shorter than the entry count");
            return -1;
        }
        s->flags = (const uint8_t *)flags->buf;
    }
    return 0;
}

/* Segment.probe's loop: hash (when asked) then probe every query. */
HK_INLINE int probe_core(const seg_t *s, const uint32_t *q, const int n, uint64_t *h, int compute, Py_ssize_t m,
                         int64_t *res, uint64_t *bad) {
    if (compute)
        for (Py_ssize_t i = 0; i < m; i++) h[i] = key_hash(q + i * n, n);
    if (s->count == 0) {
        for (Py_ssize_t i = 0; i < m; i++) res[i] = -1;
        return ST_OK;
    }
    return probe_list(s, q, n, h, NULL, m, res, bad);
}

/* One copy per common n (a compile-time n unrolls the hash and the key compare), one for any. */
static int probe_run(const seg_t *s, const uint32_t *q, const int n, uint64_t *h, int compute, Py_ssize_t m,
                     int64_t *res, uint64_t *bad) {
    switch (n) {
    case 2: return probe_core(s, q, 2, h, compute, m, res, bad);
    case 3: return probe_core(s, q, 3, h, compute, m, res, bad);
    case 4: return probe_core(s, q, 4, h, compute, m, res, bad);
    case 5: return probe_core(s, q, 5, h, compute, m, res, bad);
    default: return probe_core(s, q, n, h, compute, m, res, bad);
    }
}

/* ---- Python functions ---------------------------------------------------------------------- */

static PyObject *py_xxh64(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"data", "seed", NULL};
    Py_buffer b;
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*|K", kwlist, &b, &seed)) return NULL;
    uint64_t h;
    Py_BEGIN_ALLOW_THREADS
    h = xxh64_any((const uint8_t *)b.buf, (size_t)b.len, (uint64_t)seed);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *py_hash_keys(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *keys_o, *out_o;
    int n;
    Py_buffer keys, out;
    if (!PyArg_ParseTuple(args, "OiO", &keys_o, &n, &out_o)) return NULL;
    if (n <= 0 || n > HK_MAX_N) return PyErr_Format(PyExc_ValueError, "n must be in 1..%d, got %d", HK_MAX_N, n);
    if (get_buffer(keys_o, &keys, 4, 0, "keys") < 0) return NULL;
    if (get_buffer(out_o, &out, 8, 1, "out") < 0) {
        PyBuffer_Release(&keys);
        return NULL;
    }
    Py_ssize_t m = keys.len / (4 * (Py_ssize_t)n);
    if (keys.len != m * 4 * n || out.len != m * 8) {
        PyErr_SetString(PyExc_ValueError, "keys must be (m, n) and out (m,)");
    } else {
        const uint32_t *k = (const uint32_t *)keys.buf;
        uint64_t *h = (uint64_t *)out.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < m; i++) h[i] = key_hash(k + i * n, n);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&keys);
    PyBuffer_Release(&out);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* probe(index, keys, n, max_probe, queries, out_entries, hashes, compute_hashes)
 * index: (capacity,) uint32; keys: (count, n) uint32; queries: (m, n) uint32; out_entries: (m,)
 * int64, written; hashes: (m,) uint64, written when compute_hashes else read. */
static PyObject *py_probe(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *index_o, *keys_o, *queries_o, *out_o, *hashes_o;
    unsigned long long max_probe;
    int n, compute;
    if (!PyArg_ParseTuple(args, "OOiKOOOp", &index_o, &keys_o, &n, &max_probe, &queries_o, &out_o, &hashes_o, &compute))
        return NULL;
    if (n <= 0 || n > HK_MAX_N) return PyErr_Format(PyExc_ValueError, "n must be in 1..%d, got %d", HK_MAX_N, n);
    Py_buffer index = {0}, keys = {0}, queries = {0}, out = {0}, hashes = {0};
    int got = 0;
    if (get_buffer(index_o, &index, 4, 0, "index") < 0) goto done;
    got = 1;
    if (get_buffer(keys_o, &keys, 4, 0, "keys") < 0) goto done;
    got = 2;
    if (get_buffer(queries_o, &queries, 4, 0, "queries") < 0) goto done;
    got = 3;
    if (get_buffer(out_o, &out, 8, 1, "out_entries") < 0) goto done;
    got = 4;
    if (get_buffer(hashes_o, &hashes, 8, compute, "hashes") < 0) goto done;
    got = 5;
    Py_ssize_t m = queries.len / (4 * (Py_ssize_t)n);
    if (queries.len != m * 4 * n || out.len != m * 8 || hashes.len != m * 8) {
        PyErr_SetString(PyExc_ValueError, "queries must be (m, n), out_entries and hashes (m,)");
        goto done;
    }
    seg_t s;
    if (seg_from(&s, &index, &keys, NULL, max_probe, n) < 0) goto done;
    {
        const uint32_t *q = (const uint32_t *)queries.buf;
        uint64_t *h = (uint64_t *)hashes.buf;
        int64_t *res = (int64_t *)out.buf;
        uint64_t bad = 0;
        int st = ST_OK;
        Py_BEGIN_ALLOW_THREADS
        st = probe_run(&s, q, n, h, compute, m, res, &bad);
        Py_END_ALLOW_THREADS
        if (st == ST_CORRUPT)
            PyErr_SetObject(CorruptIndex, Py_BuildValue("(iKK)", 0, (unsigned long long)bad, (unsigned long long)s.count));
    }
done:
    if (got >= 1) PyBuffer_Release(&index);
    if (got >= 2) PyBuffer_Release(&keys);
    if (got >= 3) PyBuffer_Release(&queries);
    if (got >= 4) PyBuffer_Release(&out);
    if (got >= 5) PyBuffer_Release(&hashes);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* A slot of the dedupe table: the high half of a key's dedupe_hash and its first window + 1
 * (0: empty; resolve takes fewer than 2^32 - 1 windows). */
typedef struct {
    uint32_t tag;
    uint32_t w1;
} hslot;

/* The dedupe table's hash of a key: cheaper than XXH64 (one multiply an id), good enough to
 * spread the keys of one batch; equal tags are confirmed by comparing the ids. */
HK_INLINE uint64_t dedupe_hash(const uint32_t *k, const int n) {
    uint64_t g = 0;
    for (int j = 0; j < n; j++) g = (g + k[j] + 1) * 0x9E3779B97F4A7C15ULL;
    g ^= g >> 29;
    g *= 0xBF58476D1CE4E5B9ULL;
    return g ^ (g >> 32);
}

/* The state of one resolve call, shared by its GIL-free core. */
typedef struct {
    Py_ssize_t m, S;
    int center, ndrop;
    uint32_t pad;
    const int *drop;
    const seg_t *sg;
    const int *checked;
    const int16_t *versions;
    const Py_ssize_t *groups;
    const uint32_t *w_in;
    int64_t *o_seg, *o_ent;
    uint64_t *o_hash;
    int16_t *o_ver;
    int8_t *o_ord;
    Py_ssize_t *lists; /* 3 x m */
    uint32_t *cur;     /* m x n: each window's current key */
    uint64_t *hash;
    int8_t *order;
    int64_t *res;
    char *used;
    Py_ssize_t *rep;   /* m: the first window with the same key (dedupe) */
    hslot *table;      /* tsize slots */
    Py_ssize_t tsize;  /* a power of two >= 2m */
    Py_ssize_t need, misses, bad_seg; /* results */
    uint64_t bad;
} rctx;

/* Rounds of the lookup rule: all windows at their own order, then those no version served
 * backed off by one, until every window is served or a uni-gram missed. Each round searches
 * version after version, each version's segments newest first, with the pipelined probe. */
HK_INLINE void resolve_core(rctx *c, const int n) {
    const Py_ssize_t m = c->m, S = c->S;
    const int center = c->center, ndrop = c->ndrop;
    const uint32_t pad = c->pad;
    const int *drop = c->drop;
    const seg_t *sg = c->sg;
    const int *checked = c->checked;
    const int16_t *versions = c->versions;
    const Py_ssize_t *groups = c->groups;
    const uint32_t *w_in = c->w_in;
    int64_t *o_seg = c->o_seg, *o_ent = c->o_ent;
    uint64_t *o_hash = c->o_hash;
    int16_t *o_ver = c->o_ver;
    int8_t *o_ord = c->o_ord;
    Py_ssize_t *pending = c->lists, *rem = c->lists + m, *cand = c->lists + 2 * m;
    uint32_t *cur = c->cur;
    uint64_t *hash = c->hash;
    int8_t *order = c->order;
    int64_t *res = c->res;
    char *used = c->used;
    Py_ssize_t need = -1, misses = 0, bad_seg = -1;
    uint64_t bad = 0;
    Py_ssize_t L = m;
    Py_ssize_t *rep = c->rep;
    hslot *table = c->table;
    const uint64_t tmask = (uint64_t)c->tsize - 1;
    memcpy(cur, w_in, sizeof(uint32_t) * (size_t)m * (size_t)n);
    memset(table, 0, sizeof(hslot) * (size_t)c->tsize);
    /* Dedupe: a batch repeats keys (a Zipf draw: half the windows or more), and equal windows
     * get equal answers, so only the first window of each key is searched (and XXH64-hashed);
     * the others copy its answer at the end. A small open-addressing table (2m slots of 8 bytes,
     * fits L2) on a cheap multiplicative hash keeps a 32-bit tag of it beside the window, so a
     * probe of the table reads one slot until the tags match, then compares the ids. */
    L = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        const uint32_t *k = cur + i * n;
        const uint64_t g = dedupe_hash(k, n);
        const uint32_t tag = (uint32_t)(g >> 32);
        uint64_t t = g & tmask;
        for (;;) {
            const uint32_t w1 = table[t].w1;
            if (w1 == 0) {
                table[t].tag = tag;
                table[t].w1 = (uint32_t)i + 1;
                break;
            }
            if (table[t].tag == tag && memcmp(cur + (Py_ssize_t)(w1 - 1) * n, k, sizeof(uint32_t) * (size_t)n) == 0) break;
            t = (t + 1) & tmask;
        }
        const Py_ssize_t j = (Py_ssize_t)table[t].w1 - 1;
        rep[i] = j;
        if (j != i) continue;
        hash[i] = key_hash(k, n);
        int o = 1;
        for (int s = 0; s < n; s++) o += (s != center) && (k[s] != pad);
        order[i] = (int8_t)o;
        o_seg[i] = -1;
        o_ent[i] = -1;
        o_hash[i] = 0;
        o_ver[i] = -1;
        o_ord[i] = 0;
        pending[L++] = i;
    }
    int first = 1; /* the first round's hashes are computed above */
    while (L > 0 && need < 0 && bad_seg < 0) {
        if (!first) {
            for (Py_ssize_t i = 0; i < L; i++) {
                Py_ssize_t w = pending[i];
                hash[w] = key_hash(cur + w * n, n);
            }
        }
        first = 0;
        /* rem: the windows of this round not served yet, version after version */
        memcpy(rem, pending, sizeof(Py_ssize_t) * (size_t)L);
        Py_ssize_t R = L;
        Py_ssize_t s = 0;
        while (s < S && R > 0 && need < 0 && bad_seg < 0) {
            Py_ssize_t g_end = s;
            while (g_end < S && groups[g_end] == groups[s]) g_end++;
            /* cand: windows still undecided in this version; rem is rebuilt as the windows
             * that this version does not serve (absent, or tombstoned: next version) */
            memcpy(cand, rem, sizeof(Py_ssize_t) * (size_t)R);
            Py_ssize_t C = R, R2 = 0;
            for (; s < g_end && C > 0; s++) {
                if (!checked[s]) {
                    need = s;
                    break;
                }
                if (sg[s].count == 0) continue;
                if (probe_list(&sg[s], cur, n, hash, cand, C, res, &bad) != ST_OK) {
                    bad_seg = s;
                    break;
                }
                Py_ssize_t C2 = 0;
                const uint8_t *flags = sg[s].flags;
                for (Py_ssize_t j = 0; j < C; j++) {
                    Py_ssize_t w = cand[j];
                    int64_t e = res[j];
                    if (e < 0) {
                        cand[C2++] = w;
                    } else if (flags && (flags[e] & 1)) {
                        rem[R2++] = w; /* a tombstone ends the search in this version */
                    } else {
                        o_seg[w] = s;
                        o_ent[w] = e;
                        o_hash[w] = hash[w];
                        o_ver[w] = versions[s];
                        o_ord[w] = order[w];
                        used[s] = 1;
                    }
                }
                C = C2;
            }
            s = g_end;
            memcpy(rem + R2, cand, sizeof(Py_ssize_t) * (size_t)C);
            R = R2 + C;
        }
        /* back off what no version served; uni-grams stay misses */
        Py_ssize_t L2 = 0;
        for (Py_ssize_t i = 0; i < R; i++) {
            Py_ssize_t w = rem[i];
            if (order[w] > 1) {
                uint32_t *k = cur + w * n;
                for (int j = 0; j < ndrop; j++) {
                    if (drop[j] != center && k[drop[j]] != pad) {
                        k[drop[j]] = pad;
                        break;
                    }
                }
                order[w]--;
                pending[L2++] = w;
            } else {
                misses++;
            }
        }
        L = L2;
    }
    if (need < 0 && bad_seg < 0) {
        for (Py_ssize_t i = 0; i < m; i++) {
            const Py_ssize_t j = rep[i];
            if (j == i) continue;
            o_seg[i] = o_seg[j];
            o_ent[i] = o_ent[j];
            o_hash[i] = o_hash[j];
            o_ver[i] = o_ver[j];
            o_ord[i] = o_ord[j];
            misses += o_ord[j] == 0;
        }
    }
    c->need = need;
    c->misses = misses;
    c->bad_seg = bad_seg;
    c->bad = bad;
}

static void resolve_run(rctx *c, const int n) {
    switch (n) {
    case 2: resolve_core(c, 2); break;
    case 3: resolve_core(c, 3); break;
    case 4: resolve_core(c, 4); break;
    case 5: resolve_core(c, 5); break;
    default: resolve_core(c, n); break;
    }
}

/* resolve(windows, n, segs, seg_version, seg_group, center, drop, pad,
 *         out_seg, out_entry, out_hash, out_version, out_order) -> (need, misses, used)
 *
 * The lookup rule of FORMAT.md section 4 for every window. segs: the segments of the version
 * chain in search order (version v's newest first, then its parent's newest first, ...), each
 * (index, keys, flags or None, max_probe), flags None when the segment holds no tombstone, or
 * None for a segment whose sections have not been checked yet; seg_version[s]: the version index
 * reported for segment s; seg_group[s]: its chain position (equal for the segments of one
 * version, consecutive in segs); center: the center slot; drop: the slots in the order the
 * backoff replaces them with pad (FORMAT.md: the lowest-ranked non-pad, non-center slot first);
 * pad: pad_id.
 * Outputs (m,): out_seg int64 (position in segs, -1 on a miss), out_entry int64, out_hash uint64
 * (the served key's hash, 0 on a miss), out_version int16 (-1 on a miss), out_order int8 (0 on a
 * miss). Returns need = -1 when done, or the position of an unchecked segment that the search
 * reached (the caller checks it and calls again: outputs are then rewritten from scratch); misses
 * = windows no key of whose chain was found; used = positions in segs that served some window.
 */
static PyObject *py_resolve(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *windows_o, *segs_o, *ver_o, *grp_o, *drop_o, *oseg_o, *oent_o, *ohash_o, *over_o, *oord_o;
    int n, center;
    unsigned int pad;
    if (!PyArg_ParseTuple(args, "OiOOOiOIOOOOO", &windows_o, &n, &segs_o, &ver_o, &grp_o, &center, &drop_o, &pad,
                          &oseg_o, &oent_o, &ohash_o, &over_o, &oord_o))
        return NULL;
    if (n <= 0 || center < 0 || center >= n) return PyErr_Format(PyExc_ValueError, "bad n %d / center %d", n, center);
    PyObject *segs = PySequence_Fast(segs_o, "segs must be a sequence");
    if (!segs) return NULL;
    Py_ssize_t S = PySequence_Fast_GET_SIZE(segs);
    Py_buffer win = {0}, oseg = {0}, oent = {0}, ohash = {0}, over = {0}, oord = {0};
    Py_buffer *sb = NULL; /* 3 views per segment */
    char *sb_got = NULL;
    seg_t *sg = NULL;
    int *checked = NULL;
    int16_t *versions = NULL;
    Py_ssize_t *groups = NULL;
    int drop[HK_MAX_N];
    int ndrop = 0, got = 0;
    PyObject *result = NULL;
    Py_ssize_t *lists = NULL;
    uint32_t *cur = NULL;
    uint64_t *hash = NULL;
    int8_t *order = NULL;
    int64_t *res = NULL;
    char *used = NULL;
    Py_ssize_t *rep = NULL;
    hslot *table = NULL;

    if (n > HK_MAX_N) {
        PyErr_Format(PyExc_ValueError, "n > %d is not supported", HK_MAX_N);
        goto done;
    }
    {
        PyObject *d = PySequence_Fast(drop_o, "drop must be a sequence");
        if (!d) goto done;
        ndrop = (int)PySequence_Fast_GET_SIZE(d);
        if (ndrop > n) ndrop = -1;
        for (int i = 0; i >= 0 && i < ndrop; i++) {
            long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(d, i));
            if (v < 0 || v >= n) ndrop = -1;
            else drop[i] = (int)v;
        }
        Py_DECREF(d);
        if (PyErr_Occurred()) goto done;
        if (ndrop < 0) {
            PyErr_SetString(PyExc_ValueError, "drop must list at most n slots in 0..n-1");
            goto done;
        }
    }
    if (PySequence_Size(ver_o) != S || PySequence_Size(grp_o) != S) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "seg_version and seg_group must have one item per segment");
        goto done;
    }
    sb = (Py_buffer *)PyMem_Calloc((size_t)(3 * S + 1), sizeof(Py_buffer));
    sb_got = (char *)PyMem_Calloc((size_t)(3 * S + 1), 1);
    sg = (seg_t *)PyMem_Calloc((size_t)(S + 1), sizeof(seg_t));
    checked = (int *)PyMem_Calloc((size_t)(S + 1), sizeof(int));
    versions = (int16_t *)PyMem_Calloc((size_t)(S + 1), sizeof(int16_t));
    groups = (Py_ssize_t *)PyMem_Calloc((size_t)(S + 1), sizeof(Py_ssize_t));
    used = (char *)PyMem_Calloc((size_t)(S + 1), 1);
    if (!sb || !sb_got || !sg || !checked || !versions || !groups || !used) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t s = 0; s < S; s++) {
        PyObject *v = PySequence_GetItem(ver_o, s), *g = PySequence_GetItem(grp_o, s);
        long vv = v ? PyLong_AsLong(v) : -1, gg = g ? PyLong_AsLong(g) : -1;
        Py_XDECREF(v);
        Py_XDECREF(g);
        if (PyErr_Occurred()) goto done;
        if (vv < 0 || vv > INT16_MAX || gg < 0 || (s > 0 && gg < groups[s - 1])) {
            PyErr_SetString(PyExc_ValueError, "bad seg_version / seg_group (versions 0..32767, groups non-decreasing)");
            goto done;
        }
        versions[s] = (int16_t)vv;
        groups[s] = gg;
        PyObject *item = PySequence_Fast_GET_ITEM(segs, s);
        if (item == Py_None) continue;
        PyObject *index_o, *keys_o, *flags_o;
        unsigned long long max_probe;
        if (!PyArg_ParseTuple(item, "OOOK", &index_o, &keys_o, &flags_o, &max_probe)) goto done;
        if (get_buffer(index_o, &sb[3 * s], 4, 0, "index") < 0) goto done;
        sb_got[3 * s] = 1;
        if (get_buffer(keys_o, &sb[3 * s + 1], 4, 0, "keys") < 0) goto done;
        sb_got[3 * s + 1] = 1;
        if (flags_o != Py_None) {
            if (get_buffer(flags_o, &sb[3 * s + 2], 1, 0, "flags") < 0) goto done;
            sb_got[3 * s + 2] = 1;
        }
        if (seg_from(&sg[s], &sb[3 * s], &sb[3 * s + 1], sb_got[3 * s + 2] ? &sb[3 * s + 2] : NULL, max_probe, n) < 0)
            goto done;
        checked[s] = 1;
    }
    if (get_buffer(windows_o, &win, 4, 0, "windows") < 0) goto done;
    got = 1;
    if (get_buffer(oseg_o, &oseg, 8, 1, "out_seg") < 0) goto done;
    got = 2;
    if (get_buffer(oent_o, &oent, 8, 1, "out_entry") < 0) goto done;
    got = 3;
    if (get_buffer(ohash_o, &ohash, 8, 1, "out_hash") < 0) goto done;
    got = 4;
    if (get_buffer(over_o, &over, 2, 1, "out_version") < 0) goto done;
    got = 5;
    if (get_buffer(oord_o, &oord, 1, 1, "out_order") < 0) goto done;
    got = 6;
    Py_ssize_t m = win.len / (4 * (Py_ssize_t)n);
    if (win.len != m * 4 * n || oseg.len != 8 * m || oent.len != 8 * m || ohash.len != 8 * m || over.len != 2 * m ||
        oord.len != m) {
        PyErr_SetString(PyExc_ValueError, "windows must be (m, n); outputs (m,)");
        goto done;
    }
    if ((uint64_t)m >= UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "resolve takes fewer than 2^32 - 1 windows a call");
        goto done;
    }
    lists = (Py_ssize_t *)PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(3 * m + 1));
    cur = (uint32_t *)PyMem_Malloc(sizeof(uint32_t) * (size_t)(m * n + 1));
    hash = (uint64_t *)PyMem_Malloc(sizeof(uint64_t) * (size_t)(m + 1));
    order = (int8_t *)PyMem_Malloc((size_t)(m + 1));
    res = (int64_t *)PyMem_Malloc(sizeof(int64_t) * (size_t)(m + 1));
    Py_ssize_t tsize = 16;
    while (tsize < 2 * m) tsize *= 2;
    rep = (Py_ssize_t *)PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(m + 1));
    table = (hslot *)PyMem_Malloc(sizeof(hslot) * (size_t)tsize);
    if (!lists || !cur || !hash || !order || !res || !rep || !table) {
        PyErr_NoMemory();
        goto done;
    }

    rctx c = {0};
    c.m = m;
    c.S = S;
    c.center = center;
    c.ndrop = ndrop;
    c.pad = pad;
    c.drop = drop;
    c.sg = sg;
    c.checked = checked;
    c.versions = versions;
    c.groups = groups;
    c.w_in = (const uint32_t *)win.buf;
    c.o_seg = (int64_t *)oseg.buf;
    c.o_ent = (int64_t *)oent.buf;
    c.o_hash = (uint64_t *)ohash.buf;
    c.o_ver = (int16_t *)over.buf;
    c.o_ord = (int8_t *)oord.buf;
    c.lists = lists;
    c.cur = cur;
    c.hash = hash;
    c.order = order;
    c.res = res;
    c.used = used;
    c.rep = rep;
    c.table = table;
    c.tsize = tsize;
    Py_BEGIN_ALLOW_THREADS
    resolve_run(&c, n);
    Py_END_ALLOW_THREADS
    Py_ssize_t need = c.need, misses = c.misses, bad_seg = c.bad_seg;
    uint64_t bad = c.bad;
    if (bad_seg >= 0) {
        PyErr_SetObject(CorruptIndex, Py_BuildValue("(nKK)", bad_seg, (unsigned long long)bad,
                                                    (unsigned long long)sg[bad_seg].count));
        goto done;
    }
    {
        PyObject *u = PyList_New(0);
        if (!u) goto done;
        for (Py_ssize_t s = 0; s < S; s++) {
            if (used[s]) {
                PyObject *v = PyLong_FromSsize_t(s);
                if (!v || PyList_Append(u, v) < 0) {
                    Py_XDECREF(v);
                    Py_DECREF(u);
                    goto done;
                }
                Py_DECREF(v);
            }
        }
        result = Py_BuildValue("(nnN)", need, need < 0 ? misses : (Py_ssize_t)0, u);
    }
done:
    if (sb) {
        for (Py_ssize_t i = 0; i < 3 * S; i++)
            if (sb_got[i]) PyBuffer_Release(&sb[i]);
    }
    if (got >= 1) PyBuffer_Release(&win);
    if (got >= 2) PyBuffer_Release(&oseg);
    if (got >= 3) PyBuffer_Release(&oent);
    if (got >= 4) PyBuffer_Release(&ohash);
    if (got >= 5) PyBuffer_Release(&over);
    if (got >= 6) PyBuffer_Release(&oord);
    PyMem_Free(sb);
    PyMem_Free(sb_got);
    PyMem_Free(sg);
    PyMem_Free(checked);
    PyMem_Free(versions);
    PyMem_Free(groups);
    PyMem_Free(used);
    PyMem_Free(lists);
    PyMem_Free(cur);
    PyMem_Free(hash);
    PyMem_Free(order);
    PyMem_Free(res);
    PyMem_Free(rep);
    PyMem_Free(table);
    Py_DECREF(segs);
    return result;
}

/* One int8 entry dequantized: o[v, j] = q[v, j] * scale[v] in float32, the same single
 * multiplication NumPy does. Where GCC can dispatch at load time (x86-64 glibc: ifunc), an AVX2
 * clone is picked on CPUs that have it: the int8 -> float conversion is most of the gather's
 * compute. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__GLIBC__) && !defined(HK_NO_CLONES)
#define HK_DEQUANT_ATTR __attribute__((target_clones("avx2", "default")))
#else
#define HK_DEQUANT_ATTR
#endif

HK_DEQUANT_ATTR static void dequant_row(float *o, const int8_t *q, const uint8_t *scales, int n, size_t d) {
    for (int v = 0; v < n; v++) {
        uint32_t bits = read32(scales + 4 * (size_t)v);
        float sc;
        memcpy(&sc, &bits, 4);
        float *ov = o + (size_t)v * d;
        const int8_t *qv = q + (size_t)v * d;
        for (size_t j = 0; j < d; j++) ov[j] = (float)qv[j] * sc;
    }
}

/* gather(values, count, n, entries, out, out_rows, scales, rowsums, row_ok, hashes) -> int
 *
 * values: (count, n, d) fp16 or int8 (any item type: rows are count equal byte slices);
 * entries: (k,) int64 entry numbers; out: (m, n, d) float16 for fp16 (scales None: rows copied)
 * or float32 for int8 (rows dequantized: value * the vector's scale), or None to check only;
 * out_rows: (k,) int64 destination rows in out, or None for 0..k-1; scales: (count, n) float32 or
 * None; rowsums (count,) uint64, row_ok (count,) bool and hashes (k,) uint64 (each entry's key
 * hash), or all None: then every entry whose row_ok is 0 has its row checked (XXH64 of the value
 * bytes seeded with the key hash, then of the scale bytes seeded with that) against its rowsum
 * before it is copied, and is marked on success.
 * Returns -1, or the position in entries of the first row that fails its checksum (nothing from
 * it on is copied). Rows are prefetched a few entries ahead. */
static PyObject *py_gather(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *values_o, *entries_o, *out_o, *orows_o, *scales_o, *rowsums_o, *rowok_o, *hashes_o;
    unsigned long long count;
    int n;
    if (!PyArg_ParseTuple(args, "OKiOOOOOOO", &values_o, &count, &n, &entries_o, &out_o, &orows_o, &scales_o,
                          &rowsums_o, &rowok_o, &hashes_o))
        return NULL;
    if (n <= 0) return PyErr_Format(PyExc_ValueError, "n must be positive, got %d", n);
    Py_buffer values = {0}, entries = {0}, out = {0}, orows = {0}, scales = {0}, rowsums = {0}, rowok = {0}, hashes = {0};
    int g_values = 0, g_entries = 0, g_out = 0, g_orows = 0, g_scales = 0, g_rowsums = 0, g_rowok = 0, g_hashes = 0;
    const int int8 = scales_o != Py_None;
    const int check = rowok_o != Py_None;
    Py_ssize_t bad = -1;

    if (PyObject_GetBuffer(values_o, &values, PyBUF_C_CONTIGUOUS) < 0) goto done;
    g_values = 1;
    if (get_buffer(entries_o, &entries, 8, 0, "entries") < 0) goto done;
    g_entries = 1;
    if (out_o != Py_None) {
        if (get_buffer(out_o, &out, int8 ? 4 : 2, 1, "out") < 0) goto done;
        g_out = 1;
    }
    if (orows_o != Py_None) {
        if (get_buffer(orows_o, &orows, 8, 0, "out_rows") < 0) goto done;
        g_orows = 1;
    }
    if (int8) {
        if (get_buffer(scales_o, &scales, 4, 0, "scales") < 0) goto done;
        g_scales = 1;
    }
    if (check) {
        if (get_buffer(rowsums_o, &rowsums, 8, 0, "rowsums") < 0) goto done;
        g_rowsums = 1;
        if (get_buffer(rowok_o, &rowok, 1, 1, "row_ok") < 0) goto done;
        g_rowok = 1;
        if (get_buffer(hashes_o, &hashes, 8, 0, "hashes") < 0) goto done;
        g_hashes = 1;
    }
    const Py_ssize_t k = entries.len / 8;
    if (count == 0 || values.len % (Py_ssize_t)count) {
        if (k) PyErr_SetString(PyExc_ValueError, "values must hold count equal rows");
        goto done;
    }
    const size_t rb = (size_t)(values.len / (Py_ssize_t)count); /* stored bytes per entry */
    const size_t vals = int8 ? rb : rb / 2;                       /* values per entry: n * d */
    if (vals % (size_t)n || (!int8 && rb % 2) || (int8 && (uint64_t)scales.len != count * 4 * (uint64_t)n)) {
        PyErr_SetString(PyExc_ValueError, "values must be (count, n, d) and scales (count, n)");
        goto done;
    }
    if (check && ((uint64_t)rowsums.len != 8 * count || (uint64_t)rowok.len != count || hashes.len != 8 * k)) {
        PyErr_SetString(PyExc_ValueError, "rowsums and row_ok must be (count,), hashes (k,)");
        goto done;
    }
    const size_t ob = vals * (int8 ? 4 : 2); /* output bytes per row */
    Py_ssize_t m_out = 0;
    if (g_out) {
        if ((size_t)out.len % ob) {
            PyErr_SetString(PyExc_ValueError, "out's rows must be (n, d) like the values'");
            goto done;
        }
        m_out = (Py_ssize_t)((size_t)out.len / ob);
        if (!g_orows && m_out != k) {
            PyErr_SetString(PyExc_ValueError, "out must have one row per entry (or pass out_rows)");
            goto done;
        }
    }
    if (g_orows && orows.len != entries.len) {
        PyErr_SetString(PyExc_ValueError, "out_rows must have one item per entry");
        goto done;
    }
    {
        const int64_t *ent = (const int64_t *)entries.buf;
        const int64_t *dst = g_orows ? (const int64_t *)orows.buf : NULL;
        for (Py_ssize_t i = 0; i < k; i++) {
            if (ent[i] < 0 || (uint64_t)ent[i] >= count || (dst && (dst[i] < 0 || dst[i] >= m_out))) {
                PyErr_Format(PyExc_IndexError, "entry %lld (to row %lld) out of range", (long long)ent[i],
                             (long long)(dst ? dst[i] : i));
                goto done;
            }
        }
        const uint8_t *vbase = (const uint8_t *)values.buf;
        const uint8_t *sbase = int8 ? (const uint8_t *)scales.buf : NULL;
        const uint8_t *rsum = check ? (const uint8_t *)rowsums.buf : NULL;
        uint8_t *ok = check ? (uint8_t *)rowok.buf : NULL;
        const uint64_t *hh = check ? (const uint64_t *)hashes.buf : NULL;
        uint8_t *obase = g_out ? (uint8_t *)out.buf : NULL;
        const size_t d = vals / (size_t)n;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < k; i++) {
            if (i + GATHER_AHEAD < k) {
                const uint8_t *nx = vbase + (size_t)ent[i + GATHER_AHEAD] * rb;
                for (size_t l = 0; l < GATHER_LINES * 64 && l < rb; l += 64) GATHER_PREFETCH(nx + l);
                if (sbase) HK_PREFETCH(sbase + (size_t)ent[i + GATHER_AHEAD] * 4 * (size_t)n);
                if (ok) {
                    HK_PREFETCH(ok + ent[i + GATHER_AHEAD]);
                    /* a row's first return reads its rowsum: a random miss otherwise */
                    HK_PREFETCH(rsum + 8 * (size_t)ent[i + GATHER_AHEAD]);
                }
            }
            const uint64_t e = (uint64_t)ent[i];
            const uint8_t *src = vbase + e * rb;
            if (ok && !ok[e]) {
                uint64_t digest = xxh64_any(src, rb, hh[i]);
                if (sbase) digest = xxh64_any(sbase + e * 4 * (uint64_t)n, 4 * (size_t)n, digest);
                if (digest != read64(rsum + 8 * e)) {
                    bad = i;
                    break;
                }
                ok[e] = 1;
            }
            if (!obase) continue;
            const size_t r = dst ? (size_t)dst[i] : (size_t)i;
            if (!sbase) {
                memcpy(obase + r * ob, src, rb);
            } else {
                dequant_row((float *)(obase + r * ob), (const int8_t *)src, sbase + e * 4 * (uint64_t)n, n, d);
            }
        }
        Py_END_ALLOW_THREADS
    }
done:
    if (g_values) PyBuffer_Release(&values);
    if (g_entries) PyBuffer_Release(&entries);
    if (g_out) PyBuffer_Release(&out);
    if (g_orows) PyBuffer_Release(&orows);
    if (g_scales) PyBuffer_Release(&scales);
    if (g_rowsums) PyBuffer_Release(&rowsums);
    if (g_rowok) PyBuffer_Release(&rowok);
    if (g_hashes) PyBuffer_Release(&hashes);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromSsize_t(bad);
}

/* Map the pages of [p, p + len) into this process now, so the reads that follow take no page
 * faults: MADV_POPULATE_READ (Linux 5.14+) maps them in one call; elsewhere, or where the kernel
 * refuses it, a read of one byte a page does the same one fault (and fault-around) at a time. */
static void populate_range(const uint8_t *p, size_t len) {
    if (!len) return;
#if defined(__unix__) || defined(__APPLE__)
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0) page = 4096;
    uintptr_t start = (uintptr_t)p & ~((uintptr_t)page - 1);
#ifdef MADV_POPULATE_READ
    if (madvise((void *)start, (size_t)((uintptr_t)p + len - start), MADV_POPULATE_READ) == 0) return;
#endif
#else
    long page = 4096;
#endif
    volatile uint8_t sink = 0;
    for (size_t o = 0; o < len; o += (size_t)page) sink ^= p[o];
    sink ^= p[len - 1];
    (void)sink;
}

/* verify_rows(values, keys, n, rowsums, row_ok, scales, populate) -> int
 *
 * Check, now, every row whose row_ok is 0, the check gather does on a row's first return:
 * XXH64 of the row's value bytes seeded with its key's hash (computed here from keys), then of
 * its scale bytes seeded with that, against its rowsum; a row that passes is marked. values:
 * (k, slots, d) any item type; keys: (k, n) uint32; rowsums (k,) uint64; row_ok (k,) bool;
 * scales (k, slots) float32 or None. populate: map the value pages first (populate_range).
 * Returns how many rows failed (left unmarked, so a lookup that returns one raises). */
static PyObject *py_verify_rows(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *values_o, *keys_o, *rowsums_o, *rowok_o, *scales_o;
    int n, populate;
    if (!PyArg_ParseTuple(args, "OOiOOOp", &values_o, &keys_o, &n, &rowsums_o, &rowok_o, &scales_o, &populate))
        return NULL;
    if (n <= 0 || n > HK_MAX_N) return PyErr_Format(PyExc_ValueError, "n must be in 1..%d, got %d", HK_MAX_N, n);
    Py_buffer values = {0}, keys = {0}, rowsums = {0}, rowok = {0}, scales = {0};
    int got = 0;
    Py_ssize_t failed = 0;
    if (PyObject_GetBuffer(values_o, &values, PyBUF_C_CONTIGUOUS) < 0) goto done;
    got = 1;
    if (get_buffer(keys_o, &keys, 4, 0, "keys") < 0) goto done;
    got = 2;
    if (get_buffer(rowsums_o, &rowsums, 8, 0, "rowsums") < 0) goto done;
    got = 3;
    if (get_buffer(rowok_o, &rowok, 1, 1, "row_ok") < 0) goto done;
    got = 4;
    if (scales_o != Py_None) {
        if (get_buffer(scales_o, &scales, 4, 0, "scales") < 0) goto done;
        got = 5;
    }
    {
        const Py_ssize_t k = rowok.len;
        if (keys.len != k * 4 * (Py_ssize_t)n || rowsums.len != 8 * k || (k && values.len % k) ||
            (got == 5 && k && scales.len % k)) {
            PyErr_SetString(PyExc_ValueError, "values (k, ...), keys (k, n), rowsums (k,), row_ok (k,), scales (k, ...)");
            goto done;
        }
        const size_t rb = k ? (size_t)(values.len / k) : 0, sb = (got == 5 && k) ? (size_t)(scales.len / k) : 0;
        const uint8_t *v = (const uint8_t *)values.buf, *sc = got == 5 ? (const uint8_t *)scales.buf : NULL;
        const uint8_t *rs = (const uint8_t *)rowsums.buf;
        const uint32_t *kk = (const uint32_t *)keys.buf;
        uint8_t *ok = (uint8_t *)rowok.buf;
        Py_BEGIN_ALLOW_THREADS
        if (populate) populate_range(v, (size_t)values.len);
        for (Py_ssize_t i = 0; i < k; i++) {
            if (ok[i]) continue;
            uint64_t digest = xxh64_any(v + (size_t)i * rb, rb, key_hash(kk + (size_t)i * (size_t)n, n));
            if (sc) digest = xxh64_any(sc + (size_t)i * sb, sb, digest);
            if (digest == read64(rs + 8 * (size_t)i)) ok[i] = 1;
            else failed++;
        }
        Py_END_ALLOW_THREADS
    }
done:
    if (got >= 1) PyBuffer_Release(&values);
    if (got >= 2) PyBuffer_Release(&keys);
    if (got >= 3) PyBuffer_Release(&rowsums);
    if (got >= 4) PyBuffer_Release(&rowok);
    if (got >= 5) PyBuffer_Release(&scales);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromSsize_t(failed);
}

static PyMethodDef methods[] = {
    {"xxh64", (PyCFunction)(void (*)(void))py_xxh64, METH_VARARGS | METH_KEYWORDS, "xxh64(data, seed=0) -> int"},
    {"hash_keys", py_hash_keys, METH_VARARGS, "hash_keys(keys, n, out): key hash of each (m, n) uint32 row"},
    {"probe", py_probe, METH_VARARGS,
     "probe(index, keys, n, max_probe, queries, out_entries, hashes, compute_hashes): linear probing"},
    {"resolve", py_resolve, METH_VARARGS,
     "resolve(windows, n, segs, seg_version, seg_group, center, drop, pad, out_seg, out_entry, out_hash, "
     "out_version, out_order) -> (need, misses, used): the lookup rule"},
    {"gather", py_gather, METH_VARARGS,
     "gather(values, count, n, entries, out, out_rows, scales, rowsums, row_ok, hashes) -> -1 or first bad position"},
    {"verify_rows", py_verify_rows, METH_VARARGS,
     "verify_rows(values, keys, n, rowsums, row_ok, scales, populate) -> rows that failed: check unchecked rows now"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "formats._probe", "Compiled probe, lookup and gather for hkstore segments.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__probe(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    CorruptIndex = PyErr_NewException("formats._probe.CorruptIndex", PyExc_ValueError, NULL);
    if (!CorruptIndex || PyModule_AddObject(m, "CorruptIndex", CorruptIndex) < 0) {
        Py_XDECREF(CorruptIndex);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(CorruptIndex);
    if (PyModule_AddIntConstant(m, "API_VERSION", HK_API_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
