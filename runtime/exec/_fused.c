/* runtime.exec._fused: the bf16 layers' residual sum, LayerNorm and bf16 cast in one pass.
 *
 * The reference is runtime/exec/cpu_batched.py's layernorm (ATen's add, native_layer_norm, one
 * affine per tenant run, a cast: three to five passes over the rows); tests/test_fused.py checks
 * that this module agrees with it and that each row's answer is its own. Built with the package
 * (setup.py, optional): with no compiler the NumPy/ATen path runs, as for formats._probe.
 *
 *   add_layernorm(x, y, rows, gain, shift, out16, R, d, T, eps, threads)
 *       for each row r < R (d floats):   s = x[r] + float(y[r])          (y: bf16)
 *                                        x[r] = (s - mean(s)) / sqrt(var(s) + eps) * gain[rows[r]]
 *                                               + shift[rows[r]]
 *                                        out16[r] = bf16(x[r])          (when out16 is not 0)
 *       x, y, out16 are row-major (R, d); gain and shift (T, d) fp32 tables whose row t holds
 *       LayerNorm's weight (bias) with tenant t's delta added; rows int64 (R,), each < T.
 *       Arguments are addresses (a tensor's data_ptr()); the Python caller checks the shapes.
 *
 * Rows are independent: a row's bits do not depend on R, on its neighbours, on `threads` (a
 * thread takes whole rows; the per-row arithmetic is fixed) or on its address (setup.py builds
 * this with -ffp-contract=off: a vector loop and its scalar peel would otherwise fuse different
 * multiply-adds, so a row's bits would follow its alignment). bf16 rounding is round-to-nearest-
 * even, as torch's float -> bfloat16 conversion, so out16 equals x.to(torch.bfloat16).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define HK_FUSED_API_VERSION 1
#define LANES 16 /* partial sums per row: one AVX-512 register, so the reductions vectorize */

#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__)) && defined(__linux__)
/* One build for every x86 CPU: the loader picks the widest clone this CPU runs. */
#define HK_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define HK_CLONES
#endif

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays a quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

typedef struct {
    float *x;
    const uint16_t *y;
    const int64_t *rows;
    const float *gain, *shift;
    uint16_t *out16;
    int64_t r0, r1, d;
    float eps;
} job_t;

HK_CLONES
static void run_rows(const job_t *j) {
    const int64_t d = j->d, dv = d - d % LANES;
    for (int64_t r = j->r0; r < j->r1; r++) {
        float *restrict x = j->x + r * d;
        const uint16_t *restrict y = j->y + r * d;
        float acc[LANES] = {0};
        int64_t c;
        for (c = 0; c < dv; c += LANES)
            for (int k = 0; k < LANES; k++) {
                float s = x[c + k] + bf16_to_f32(y[c + k]);
                x[c + k] = s;
                acc[k] += s;
            }
        float sum = 0.f;
        for (; c < d; c++) {
            x[c] += bf16_to_f32(y[c]);
            sum += x[c];
        }
        for (int k = 0; k < LANES; k++) sum += acc[k];
        const float mean = sum / (float)d;
        float sq[LANES] = {0};
        for (c = 0; c < dv; c += LANES)
            for (int k = 0; k < LANES; k++) {
                float e = x[c + k] - mean;
                sq[k] += e * e;
            }
        float var = 0.f;
        for (; c < d; c++) var += (x[c] - mean) * (x[c] - mean);
        for (int k = 0; k < LANES; k++) var += sq[k];
        const float rstd = 1.0f / sqrtf(var / (float)d + j->eps);
        const float *restrict g = j->gain + j->rows[r] * d, *restrict b = j->shift + j->rows[r] * d;
        if (j->out16) {
            uint16_t *restrict o = j->out16 + r * d;
            for (c = 0; c < d; c++) {
                float v = (x[c] - mean) * rstd * g[c] + b[c];
                x[c] = v;
                o[c] = f32_to_bf16(v);
            }
        } else {
            for (c = 0; c < d; c++) x[c] = (x[c] - mean) * rstd * g[c] + b[c];
        }
    }
}

static void *run_job(void *arg) {
    run_rows((const job_t *)arg);
    return NULL;
}

#define MAX_THREADS 256

static PyObject *py_add_layernorm(PyObject *self, PyObject *args) {
    unsigned long long px, py, prows, pgain, pshift, pout16;
    long long R, d, T, threads;
    double eps;
    if (!PyArg_ParseTuple(args, "KKKKKKLLLdL", &px, &py, &prows, &pgain, &pshift, &pout16, &R, &d, &T, &eps,
                          &threads))
        return NULL;
    if (R < 0 || d <= 0 || T <= 0 || !px || !py || !prows || !pgain || !pshift) {
        PyErr_SetString(PyExc_ValueError, "add_layernorm: empty or null operand");
        return NULL;
    }
    const int64_t *rows = (const int64_t *)(uintptr_t)prows;
    for (long long r = 0; r < R; r++)
        if (rows[r] < 0 || rows[r] >= T) {
            PyErr_Format(PyExc_IndexError, "add_layernorm: row %lld reads table row %lld of %lld", r,
                         (long long)rows[r], T);
            return NULL;
        }
    job_t base = {(float *)(uintptr_t)px, (const uint16_t *)(uintptr_t)py, rows, (const float *)(uintptr_t)pgain,
                  (const float *)(uintptr_t)pshift, (uint16_t *)(uintptr_t)pout16, 0, R, d, (float)eps};
    /* a thread only for a share worth its start (tens of microseconds): 64 rows at least */
    long long n = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (n > R / 64) n = R / 64 > 0 ? R / 64 : 1;
    Py_BEGIN_ALLOW_THREADS
    if (n == 1) {
        run_rows(&base);
    } else {
        job_t jobs[MAX_THREADS];
        pthread_t tid[MAX_THREADS];
        int started[MAX_THREADS];
        for (long long t = 0; t < n; t++) {
            jobs[t] = base;
            jobs[t].r0 = R * t / n;
            jobs[t].r1 = R * (t + 1) / n;
            started[t] = t > 0 && pthread_create(&tid[t], NULL, run_job, &jobs[t]) == 0;
        }
        run_rows(&jobs[0]);
        for (long long t = 1; t < n; t++) {
            if (started[t])
                pthread_join(tid[t], NULL);
            else /* no thread to be had: this one does the share */
                run_rows(&jobs[t]);
        }
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"add_layernorm", py_add_layernorm, METH_VARARGS,
     "add_layernorm(x, y, rows, gain, shift, out16, R, d, T, eps, threads): x = LayerNorm(x + y) row by row"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "runtime.exec._fused", "Fused residual + LayerNorm + bf16 cast for the bf16 layers.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fused(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "API_VERSION", HK_FUSED_API_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
