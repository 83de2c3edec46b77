/* runtime.gen._decode: a decode step's attention straight from the KV pool's pages, every row's
 * LoRA from its adapter's weights (lora_add, below), and the greedy rows' choice from the step's
 * logits (greedy, below; its reference is runtime.gen.sampling.greedy_reference).
 *
 * The reference is runtime/gen/kv_pool.py's KVPool.attend without this module: an index_put of
 * the new keys and values, an index_select gathering every sequence's pages into a padded
 * (B, kv_heads, longest, head_dim) copy, and ATen's fused attention over it with a mask. At a
 * decode step's shapes (one query a sequence, tens of positions) those ops cost far more than
 * their arithmetic; here one pass per sequence reads its pages where they lie (keys, then values).
 * tests/test_gen_decode_kernel.py checks that this module agrees with the reference and that
 * a row's answer is its own. Built with the package (setup.py, optional).
 *
 *   attend(q, k, v, kpool, vpool, pages, lengths, out, B, H, KV, hd, W, P, scale, qs, ks, vs)
 *       for each sequence b < B, with n = lengths[b] (positions it holds before this step):
 *           kpool[pages[b, n]] = k[b];  vpool[pages[b, n]] = v[b]           (this step's)
 *           for each head h (reading kv head g = h / (H / KV)):
 *               s_j = (q[b, h] . kpool[pages[b, j], g]) * scale            j = 0 .. n
 *               out[b, h] = sum_j exp(s_j - max s) vpool[pages[b, j], g] / sum_j exp(s_j - max s)
 *       q (B, H, hd), k and v (B, KV, hd), out (B, H * hd), kpool and vpool (P, KV, hd) one
 *       layer's pool: fp32, row-major, except that sequence b's q, k and v start qs, ks and vs
 *       floats after sequence b - 1's (parts of one GEMM's output); pages int64 (B, W);
 *       lengths int64 (B,). Arguments are addresses (data_ptr()); the Python caller checks
 *       dtypes and shapes, this checks the indices (every page read or written < P, every
 *       length < W).
 *
 * A row's bits depend on its own query, keys and values only: not on B, on the rows beside it,
 * on the CPU's vector width or on addresses (partial sums in 16-lane vectors added in a fixed
 * order, and -ffp-contract=off in setup.py so a vector loop and its scalar tail never fuse
 * different multiply-adds). The weights are e^x by a polynomial (exp_le0), not libm's expf:
 * within 2 ulp of it, so the attention agrees with the reference to fp32 rounding.
 *
 * GCC's vector extension and __builtin_shuffle: another compiler fails the (optional) build
 * and the reference runs.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define HK_DECODE_API_VERSION 2
#define LANES 16 /* partial sums of a dot product: one AVX-512 register */

#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__)) && defined(__linux__)
#define HK_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define HK_CLONES
#endif

/* GCC's vector extension: one AVX-512 register in the avx512f clone, halves or quarters of it in
 * the others, the same lane arithmetic in every clone. */
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
/* (these helpers are inlined into each clone; GCC's note that a 64-byte vector argument would
 * pass differently without AVX-512 concerns calls between objects, of which there are none) */
#pragma GCC diagnostic ignored "-Wpsabi"
#define HK_INLINE static inline __attribute__((always_inline)) /* into each clone: its vector width */
typedef int vi __attribute__((vector_size(LANES * sizeof(int))));

HK_INLINE vf load(const float *p) {
    vf x;
    memcpy(&x, p, sizeof x);
    return x;
}

HK_INLINE void store(float *p, vf x) { memcpy(p, &x, sizeof x); }

/* a . b: the whole vectors' products summed in four vector accumulators (vector i into i % 4:
 * four independent chains, not one as long as a / LANES), those added (0 + 1) + (2 + 3), the
 * lanes in a fixed pairwise tree (in registers), then the tail's products in order */
HK_INLINE float dot(const float *restrict a, const float *restrict b, int64_t n) {
    vf acc0 = {0}, acc1 = {0}, acc2 = {0}, acc3 = {0};
    const int64_t n4 = n - n % (4 * LANES), nv = n - n % LANES;
    int64_t c;
    for (c = 0; c < n4; c += 4 * LANES) {
        acc0 += load(a + c) * load(b + c);
        acc1 += load(a + c + LANES) * load(b + c + LANES);
        acc2 += load(a + c + 2 * LANES) * load(b + c + 2 * LANES);
        acc3 += load(a + c + 3 * LANES) * load(b + c + 3 * LANES);
    }
    if (c < nv) acc0 += load(a + c) * load(b + c), c += LANES;
    if (c < nv) acc1 += load(a + c) * load(b + c), c += LANES;
    if (c < nv) acc2 += load(a + c) * load(b + c), c += LANES;
    vf acc = (acc0 + acc1) + (acc2 + acc3);
    acc += __builtin_shuffle(acc, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    acc += __builtin_shuffle(acc, (vi){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
    acc += __builtin_shuffle(acc, (vi){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
    acc += __builtin_shuffle(acc, (vi){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0});
    float sum = acc[0];
    for (; c < n; c++) sum += a[c] * b[c];
    return sum;
}

/* o += p x (element by element: the same bits whichever loop takes an element) */
HK_INLINE void axpy(float *restrict o, float p, const float *restrict x, int64_t n) {
    const int64_t nv = n - n % LANES;
    int64_t c;
    for (c = 0; c < nv; c += LANES) store(o + c, load(o + c) + p * load(x + c));
    for (; c < n; c++) o[c] += p * x[c];
}

/* e^x lane by lane for x <= 0 (a score or logit minus the largest), within 2 ulp of expf:
 * Cody-Waite reduction by ln 2 and Cephes's degree-5 polynomial, a vector at a time (libm's
 * expf, one call per score, was a quarter of this module's time). Below -87 (a weight under
 * 2^-125 of the largest) it answers e^-87. */
HK_INLINE vf exp_le0(vf x) {
    const vi lo = x < -87.0f;
    x = (vf)((lo & (vi)((vf){0} - 87.0f)) | (~lo & (vi)x));
    vf n = x * 1.44269504088896341f;
    n = (n + 12582912.0f) - 12582912.0f; /* round to the nearest integer (|n| < 2^22) */
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const vf y = p * r * r + r + 1.0f;
    const vi bits = (__builtin_convertvector(n, vi) + 127) << 23; /* 2^n: n >= -126 here */
    return y * (vf)bits;
}

/* the first n lanes of x's floats at p as a vector, the others fill (a tail's lanes) */
HK_INLINE vf load_part(const float *p, int64_t n, float fill) {
    vf v = (vf){0} + fill;
    memcpy(&v, p, (size_t)n * sizeof(float));
    return v;
}

/* x[0..n) = e^(x - top) in place, x <= top */
HK_INLINE void exp_shifted(float *x, int64_t n, float top) {
    int64_t c = 0;
    for (; c + LANES <= n; c += LANES) store(x + c, exp_le0(load(x + c) - top));
    if (c < n) {
        const vf e = exp_le0(load_part(x + c, n - c, top) - top);
        memcpy(x + c, &e, (size_t)(n - c) * sizeof(float));
    }
}

/* Pages asked for ahead of the one in use: a sequence's pages need not be adjacent, and the
 * pool comes from DRAM (a step's weights evict it); 4 ran the attention 1.14x faster than none
 * (2: 1.11x, 8: 1.08x) at a 124M decoder's shapes with the weights' traffic between visits. */
#define AHEAD 4

/* ask for the n floats at p (one page: all heads' keys or values of a position) ahead of use */
HK_INLINE void fetch(const float *p, int64_t n) {
    for (int64_t c = 0; c < n; c += 64 / sizeof(float)) __builtin_prefetch(p + c);
}

typedef struct {
    const float *q, *k, *v;
    float *kpool, *vpool, *out;
    const int64_t *pages, *lengths;
    int64_t B, H, KV, hd, W, qs, ks, vs;
    float scale;
    float *scores; /* H * W + H floats of scratch: the scores, each head's 1 / sum */
    int64_t *kv_at; /* H of scratch */
} job_t;

HK_CLONES
static void run(const job_t *j) {
    const int64_t H = j->H, KV = j->KV, hd = j->hd, W = j->W, group = H / KV, row = KV * hd;
    int64_t *restrict kv_at = j->kv_at; /* head h's offset in a page: (h / group) * hd, no division per read */
    for (int64_t h = 0; h < H; h++) kv_at[h] = h / group * hd;
    for (int64_t b = 0; b < j->B; b++) {
        const int64_t n = j->lengths[b];
        const int64_t *pg = j->pages + b * W;
        const float *restrict q = j->q + b * j->qs;
        float *restrict o = j->out + b * H * hd;
        memcpy(j->kpool + pg[n] * row, j->k + b * j->ks, row * sizeof(float));
        memcpy(j->vpool + pg[n] * row, j->v + b * j->vs, row * sizeof(float));
        /* position by position, every head of it: each page (all heads' keys, then values) is
         * read once front to back, as the prefetcher likes; s[h * W + t] is head h's score of t */
        float *restrict s = j->scores, *restrict inv = j->scores + H * W;
        for (int64_t t = 0; t < AHEAD && t <= n; t++) fetch(j->kpool + pg[t] * row, row);
        for (int64_t t = 0; t <= n; t++) {
            const float *kt = j->kpool + pg[t] * row;
            if (t + AHEAD <= n) fetch(j->kpool + pg[t + AHEAD] * row, row);
            for (int64_t h = 0; h < H; h++) s[h * W + t] = dot(q + h * hd, kt + kv_at[h], hd) * j->scale;
        }
        for (int64_t h = 0; h < H; h++) {
            float *restrict sh = s + h * W, top = -INFINITY, sum = 0.0f;
            for (int64_t t = 0; t <= n; t++)
                if (sh[t] > top) top = sh[t];
            exp_shifted(sh, n + 1, top);
            for (int64_t t = 0; t <= n; t++) sum += sh[t];
            inv[h] = 1.0f / sum;
        }
        memset(o, 0, H * hd * sizeof(float));
        for (int64_t t = 0; t < AHEAD && t <= n; t++) fetch(j->vpool + pg[t] * row, row);
        for (int64_t t = 0; t <= n; t++) {
            const float *vt = j->vpool + pg[t] * row;
            if (t + AHEAD <= n) fetch(j->vpool + pg[t + AHEAD] * row, row);
            for (int64_t h = 0; h < H; h++) axpy(o + h * hd, s[h * W + t], vt + kv_at[h], hd);
        }
        for (int64_t h = 0; h < H; h++)
            for (int64_t d = 0; d < hd; d++) o[h * hd + d] *= inv[h];
    }
}

/* lora_add: y[b] += (A[g] x[b])^T Bt[g] with g = rows[b] (no change where g < 0): each row's
 * LoRA read from its adapter's tables, shared by the rows of that adapter (BGMV without a
 * per-row copy of the weights). The delta is summed in scratch, then added: y + delta. */
typedef struct {
    const float *x, *a, *bt;
    const int64_t *rows;
    float *y, *delta;
    int64_t B, d_in, r, d_out, xs, ys;
} lora_t;

HK_CLONES
static void run_lora(const lora_t *j) {
    const int64_t d_in = j->d_in, r = j->r, d_out = j->d_out;
    for (int64_t b = 0; b < j->B; b++) {
        const int64_t g = j->rows[b];
        if (g < 0) continue;
        const float *restrict x = j->x + b * j->xs;
        const float *a = j->a + g * r * d_in, *bt = j->bt + g * r * d_out;
        float *restrict y = j->y + b * j->ys, *restrict d = j->delta;
        memset(d, 0, d_out * sizeof(float));
        for (int64_t k = 0; k < r; k++) axpy(d, dot(a + k * d_in, x, d_in), bt + k * d_out, d_out);
        for (int64_t c = 0; c < d_out; c++) y[c] += d[c];
    }
}

/* greedy: each row's first largest logit and -log sum_t e^(x_t - top), its log-probability; 1
 * (nothing trusted) when a row holds a NaN or its top is not finite: the caller's reference
 * keeps numpy's rules for those. One pass for the top and its first index (each lane keeps its
 * first largest, the lanes' tie goes to the lowest index), one for the sum in a fixed order. */
HK_CLONES
static int run_greedy(const float *logits, int64_t n, int64_t V, int64_t stride, int64_t *tokens, double *logprobs) {
    const int64_t nv = V - V % LANES;
    for (int64_t b = 0; b < n; b++) {
        const float *x = logits + b * stride;
        float top = -INFINITY;
        int64_t at = 0, c = 0;
        if (nv) {
            vf best = load(x), v;
            vi idx = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, lane = idx, nan = best != best;
            for (c = LANES; c < nv; c += LANES) {
                v = load(x + c);
                const vi more = v > best;
                best = (vf)((more & (vi)v) | (~more & (vi)best));
                idx = (more & (lane + (int)c)) | (~more & idx);
                nan |= v != v;
            }
            for (int l = 0; l < LANES; l++) {
                if (nan[l]) return 1;
                if (best[l] > top || (best[l] == top && idx[l] < at)) top = best[l], at = idx[l];
            }
        }
        for (; c < V; c++) {
            if (x[c] != x[c]) return 1;
            if (x[c] > top) top = x[c], at = c; /* (a row all -inf keeps top -inf: refused below) */
        }
        if (!isfinite(top)) return 1;
        vf acc0 = {0}, acc1 = {0};
        for (c = 0; c + 2 * LANES <= nv; c += 2 * LANES) {
            acc0 += exp_le0(load(x + c) - top);
            acc1 += exp_le0(load(x + c + LANES) - top);
        }
        if (c < nv) acc0 += exp_le0(load(x + c) - top), c += LANES;
        vf acc = acc0 + acc1;
        double sum = 0.0;
        for (int l = 0; l < LANES; l++) sum += acc[l];
        if (c < V) {
            const vf e = exp_le0(load_part(x + c, V - c, top) - top);
            for (int64_t l = 0; l < V - c; l++) sum += e[l];
        }
        tokens[b] = at;
        logprobs[b] = -log(sum);
    }
    return 0;
}

static PyObject *py_greedy(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long px, ptok, plp;
    long long n, V, stride;
    if (!PyArg_ParseTuple(args, "KLLLKK", &px, &n, &V, &stride, &ptok, &plp)) return NULL;
    if (n < 0 || V <= 0 || stride < V || !px || !ptok || !plp) {
        PyErr_SetString(PyExc_ValueError, "greedy: empty, null or mismatched operand");
        return NULL;
    }
    int bad;
    Py_BEGIN_ALLOW_THREADS
    bad = run_greedy((const float *)(uintptr_t)px, n, V, stride, (int64_t *)(uintptr_t)ptok, (double *)(uintptr_t)plp);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(!bad);
}

static PyObject *py_lora_add(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long px, pa, pbt, prows, py;
    long long B, d_in, r, d_out, G, xs, ys;
    if (!PyArg_ParseTuple(args, "KKKKKLLLLLLL", &px, &pa, &pbt, &prows, &py, &B, &d_in, &r, &d_out, &G, &xs, &ys))
        return NULL;
    if (B < 0 || d_in <= 0 || r <= 0 || d_out <= 0 || G <= 0 || xs < d_in || ys < d_out || !px || !pa || !pbt ||
        !prows || !py) {
        PyErr_SetString(PyExc_ValueError, "lora_add: empty, null or mismatched operand");
        return NULL;
    }
    const int64_t *rows = (const int64_t *)(uintptr_t)prows;
    for (long long b = 0; b < B; b++)
        if (rows[b] < -1 || rows[b] >= G) {
            PyErr_Format(PyExc_IndexError, "lora_add: row %lld reads adapter %lld of %lld", b, (long long)rows[b], G);
            return NULL;
        }
    float *delta = malloc((size_t)d_out * sizeof(float));
    if (!delta) return PyErr_NoMemory();
    lora_t job = {(const float *)(uintptr_t)px, (const float *)(uintptr_t)pa, (const float *)(uintptr_t)pbt, rows,
                  (float *)(uintptr_t)py, delta, B, d_in, r, d_out, xs, ys};
    Py_BEGIN_ALLOW_THREADS
    run_lora(&job);
    Py_END_ALLOW_THREADS
    free(delta);
    Py_RETURN_NONE;
}

static PyObject *py_attend(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long pq, pk, pv, pkpool, pvpool, ppages, plengths, pout;
    long long B, H, KV, hd, W, P, qs, ks, vs;
    double scale;
    if (!PyArg_ParseTuple(args, "KKKKKKKKLLLLLLdLLL", &pq, &pk, &pv, &pkpool, &pvpool, &ppages, &plengths, &pout, &B,
                          &H, &KV, &hd, &W, &P, &scale, &qs, &ks, &vs))
        return NULL;
    if (B < 0 || H <= 0 || KV <= 0 || H % KV || hd <= 0 || W <= 0 || P <= 0 || qs < H * hd || ks < KV * hd ||
        vs < KV * hd || !pq || !pk || !pv || !pkpool ||
        !pvpool || !ppages || !plengths || !pout) {
        PyErr_SetString(PyExc_ValueError, "attend: empty, null or mismatched operand");
        return NULL;
    }
    const int64_t *pages = (const int64_t *)(uintptr_t)ppages, *lengths = (const int64_t *)(uintptr_t)plengths;
    for (long long b = 0; b < B; b++) {
        if (lengths[b] < 0 || lengths[b] >= W) {
            PyErr_Format(PyExc_IndexError, "attend: sequence %lld holds %lld positions, its pages %lld", b,
                         (long long)lengths[b], W);
            return NULL;
        }
        for (long long t = 0; t <= lengths[b]; t++)
            if (pages[b * W + t] < 0 || pages[b * W + t] >= P) {
                PyErr_Format(PyExc_IndexError, "attend: sequence %lld reads page %lld of %lld", b,
                             (long long)pages[b * W + t], P);
                return NULL;
            }
    }
    float *scores = malloc((size_t)(H * W + H) * sizeof(float));
    int64_t *kv_at = malloc((size_t)H * sizeof(int64_t));
    if (!scores || !kv_at) {
        free(scores);
        free(kv_at);
        return PyErr_NoMemory();
    }
    job_t job = {(const float *)(uintptr_t)pq, (const float *)(uintptr_t)pk, (const float *)(uintptr_t)pv,
                 (float *)(uintptr_t)pkpool, (float *)(uintptr_t)pvpool, (float *)(uintptr_t)pout, pages, lengths,
                 B, H, KV, hd, W, qs, ks, vs, (float)scale, scores, kv_at};
    Py_BEGIN_ALLOW_THREADS
    run(&job);
    Py_END_ALLOW_THREADS
    free(scores);
    free(kv_at);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"attend", py_attend, METH_VARARGS,
     "attend(q, k, v, kpool, vpool, pages, lengths, out, B, H, KV, hd, W, P, scale, qs, ks, vs): one decode step's "
     "attention over the KV pool's pages, this step's keys and values written first"},
    {"lora_add", py_lora_add, METH_VARARGS,
     "lora_add(x, A, Bt, rows, y, B, d_in, r, d_out, G, xs, ys): y[b] += (A[rows[b]] x[b]) Bt[rows[b]], "
     "rows < 0 unchanged"},
    {"greedy", py_greedy, METH_VARARGS,
     "greedy(logits, n, V, stride, tokens, logprobs): each row's first argmax (int64) and its log-probability "
     "(float64); False (nothing written that counts) if a row holds a NaN or a non-finite top"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "runtime.gen._decode", "A decode step's attention over the KV pool's pages, LoRA in place, the greedy choice.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__decode(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "API_VERSION", HK_DECODE_API_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
