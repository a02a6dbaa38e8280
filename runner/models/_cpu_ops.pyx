# cython: language_level=3, boundscheck=False, wraparound=False
"""Fused float32 elementwise ops of the Llama-family forward on the CPU (C in a Cython module).

Four ops, each one pass over its rows, rows split over OpenMP threads when the module was
built with it:

* ``rms_norm``: ``out = w * (x * r)``, ``r = 1 / sqrt(sum(x^2) / d + eps)``;
* ``fused_add_rms_norm``: ``residual += x``, then ``x = w * (residual * r)`` with ``r`` of the
  new residual (the semantics of vLLM's ``fused_add_rms_norm``: both written in place);
* ``silu_mul``: ``out = silu(g) * u`` rounded as torch's ``silu`` then ``mul`` on an AVX512
  CPU (the same Sleef ``exp``, handed in by address; libm's ``expf`` for a row's last
  ``d % 32`` elements, as ATen's scalar tail);
* ``rope``: rotate the first ``rotary_dim`` dimensions of every head of ``x`` by per-row
  ``cos`` / ``sin`` (``[rotary_dim / 2]`` per row) into ``out``; pairs ``(i, i + rotary_dim / 2)``
  ("rotate half", neox style) or ``(2i, 2i + 1)`` written de-interleaved (``rope.py``'s
  interleaved convention); dimensions past ``rotary_dim`` copied.

The products are rounded as torch's separate kernels round them (the build passes
``-ffp-contract=off``: no fused multiply-add); the sum of squares is accumulated in float32
in 16 lanes, so it differs from torch's reduction in the last bits only.

The Python-facing wrapper is ``runner/models/cpu_ops.py`` (validation, strides); this module
takes raw addresses and element strides and trusts them.
"""

from libc.stdint cimport int64_t, uintptr_t

cdef extern from *:
    """
    #include <math.h>
    #include <stdint.h>
    #include <string.h>
    #ifdef _OPENMP
    #include <omp.h>
    #endif

    #if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
    #define CO_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
    #else
    #define CO_CLONES
    #endif

    #define CO_LANES 16

    /* 1 / sqrt(mean(x^2) + eps) of one row of d floats */
    static inline float co_inv_rms(const float *x, int64_t d, float eps) {
        float acc[CO_LANES] = {0};
        int64_t j = 0;
        for (; j + CO_LANES <= d; j += CO_LANES)
            for (int l = 0; l < CO_LANES; ++l) acc[l] += x[j + l] * x[j + l];
        float s = 0.0f;
        for (int l = 0; l < CO_LANES; ++l) s += acc[l];
        for (; j < d; ++j) s += x[j] * x[j];
        return 1.0f / sqrtf(s / (float)d + eps);
    }

    CO_CLONES
    static void co_rms_norm_rows(const float *x, int64_t xs, const float *w, float *out, int64_t os,
                                 int64_t r0, int64_t r1, int64_t d, float eps) {
        for (int64_t i = r0; i < r1; ++i) {
            const float *xi = x + i * xs;
            float *oi = out + i * os;
            float r = co_inv_rms(xi, d, eps);
            for (int64_t j = 0; j < d; ++j) oi[j] = w[j] * (xi[j] * r);
        }
    }

    CO_CLONES
    static void co_add_rms_norm_rows(float *x, int64_t xs, float *res, int64_t rs, const float *w,
                                     int64_t r0, int64_t r1, int64_t d, float eps) {
        for (int64_t i = r0; i < r1; ++i) {
            float *xi = x + i * xs;
            float *ri = res + i * rs;
            for (int64_t j = 0; j < d; ++j) ri[j] = ri[j] + xi[j];
            float r = co_inv_rms(ri, d, eps);
            for (int64_t j = 0; j < d; ++j) xi[j] = w[j] * (ri[j] * r);
        }
    }

    CO_CLONES
    static void co_rope_rows(const float *x, int64_t x_tok, int64_t x_head, float *out, int64_t o_tok,
                             int64_t o_head, const float *cs, const float *sn, int64_t c_tok,
                             int64_t r0, int64_t r1, int heads, int head_size, int rot, int interleaved) {
        int half = rot / 2;
        for (int64_t i = r0; i < r1; ++i) {
            const float *c = cs + i * c_tok;
            const float *s = sn + i * c_tok;
            for (int h = 0; h < heads; ++h) {
                const float *xi = x + i * x_tok + h * x_head;
                float *oi = out + i * o_tok + h * o_head;
                if (interleaved) {
                    for (int j = 0; j < half; ++j) {
                        float x1 = xi[2 * j], x2 = xi[2 * j + 1];
                        float a = x1 * c[j], b = x2 * s[j];
                        float e = x2 * c[j], f = x1 * s[j];
                        oi[j] = a - b;
                        oi[j + half] = e + f;
                    }
                } else {
                    for (int j = 0; j < half; ++j) {
                        float x1 = xi[j], x2 = xi[j + half];
                        float a = x1 * c[j], b = x2 * s[j];
                        float e = x2 * c[j], f = x1 * s[j];
                        oi[j] = a - b;
                        oi[j + half] = e + f;
                    }
                }
                for (int j = rot; j < head_size; ++j) oi[j] = xi[j];
            }
        }
    }

    /* silu(g) * u over rows, as torch's separate ``silu`` and ``mul`` kernels round it on a
       CPU whose ATen capability is AVX512: per row, blocks of 32 elements as two 16-lane
       vectors x / (1 + exp(-x)) with exp = the Sleef_expf16_u10 torch calls (its address is
       handed in once: co_set_exp16), the rest of the row one element at a time with libm's
       expf (ATen's scalar tail), then the product with u. */
    #if defined(__GNUC__) && defined(__x86_64__)
    #include <immintrin.h>
    #define CO_HAVE_SILU 1
    #define CO_AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,fma")))
    typedef __m512 (*co_exp16_fn)(__m512);
    static co_exp16_fn co_exp16 = 0;
    CO_AVX512
    static void co_silu_mul_rows(const float *g, int64_t gs, const float *u, int64_t us, float *o, int64_t os,
                                 int64_t r0, int64_t r1, int64_t d) {
        const __m512 one = _mm512_set1_ps(1.0f), neg_zero = _mm512_set1_ps(-0.0f);
        const co_exp16_fn ex = co_exp16;
        for (int64_t i = r0; i < r1; ++i) {
            const float *gi = g + i * gs, *ui = u + i * us;
            float *oi = o + i * os;
            int64_t j = 0;
            for (; j + 32 <= d; j += 32)
                for (int h = 0; h < 32; h += 16) {
                    const __m512 x = _mm512_loadu_ps(gi + j + h);
                    const __m512 sig = _mm512_div_ps(x, _mm512_add_ps(one, ex(_mm512_xor_ps(neg_zero, x))));
                    _mm512_storeu_ps(oi + j + h, _mm512_mul_ps(sig, _mm512_loadu_ps(ui + j + h)));
                }
            for (; j < d; ++j) {
                const float x = gi[j];
                oi[j] = (x / (1.0f + expf(-x))) * ui[j];
            }
        }
    }
    static int co_set_exp16(uintptr_t fn) { co_exp16 = (co_exp16_fn)fn; return fn != 0; }
    #else
    #define CO_HAVE_SILU 0
    static void co_silu_mul_rows(const float *g, int64_t gs, const float *u, int64_t us, float *o, int64_t os,
                                 int64_t r0, int64_t r1, int64_t d) { (void)g; (void)gs; (void)u; (void)us;
                                 (void)o; (void)os; (void)r0; (void)r1; (void)d; }
    static int co_set_exp16(uintptr_t fn) { (void)fn; return 0; }
    #endif

    /* each thread of one OpenMP team of nt threads (the pool torch's parallel regions reuse)
       sets its own CPU affinity: thread t to the CPUs cpus[offs[t] .. offs[t + 1]); returns the
       number of threads whose sched_setaffinity failed, or -1 if the team was not nt threads */
    #ifndef _GNU_SOURCE
    #define _GNU_SOURCE
    #endif
    #include <sched.h>
    static int co_bind_threads(const int64_t *cpus, const int64_t *offs, int nt) {
        int failed = 0, team = nt;
    #ifdef _OPENMP
        #pragma omp parallel num_threads(nt) reduction(+:failed)
        {
            int t = omp_get_thread_num();
            if (t == 0) team = omp_get_num_threads();
    #else
        {
            int t = 0; team = 1;
    #endif
            cpu_set_t set;
            CPU_ZERO(&set);
            for (int64_t i = offs[t]; i < offs[t + 1]; ++i) CPU_SET((int)cpus[i], &set);
            if (sched_setaffinity(0, sizeof(set), &set) != 0) failed += 1;
        }
        return team == nt ? failed : -1;
    }

    /* rows [0, n) in num_threads contiguous slices (each row's result does not depend on the split) */
    #ifdef _OPENMP
    #define CO_SPLIT(n, nt, BODY) do { \
            if ((nt) > 1 && (n) > 1) { \
                _Pragma("omp parallel num_threads(nt)") \
                { \
                    int64_t t_ = omp_get_thread_num(), T_ = omp_get_num_threads(); \
                    int64_t r0 = (n) * t_ / T_, r1 = (n) * (t_ + 1) / T_; \
                    BODY; \
                } \
            } else { int64_t r0 = 0, r1 = (n); BODY; } \
        } while (0)
    static int co_openmp(void) { return 1; }
    #else
    #define CO_SPLIT(n, nt, BODY) do { int64_t r0 = 0, r1 = (n); BODY; } while (0)
    static int co_openmp(void) { return 0; }
    #endif

    static void co_rms_norm(const float *x, int64_t xs, const float *w, float *out, int64_t os,
                            int64_t n, int64_t d, float eps, int nt) {
        CO_SPLIT(n, nt, co_rms_norm_rows(x, xs, w, out, os, r0, r1, d, eps));
    }
    static void co_fused_add_rms_norm(float *x, int64_t xs, float *res, int64_t rs, const float *w,
                                      int64_t n, int64_t d, float eps, int nt) {
        CO_SPLIT(n, nt, co_add_rms_norm_rows(x, xs, res, rs, w, r0, r1, d, eps));
    }
    static void co_silu_mul(const float *g, int64_t gs, const float *u, int64_t us, float *o, int64_t os,
                            int64_t n, int64_t d, int nt) {
        CO_SPLIT(n, nt, co_silu_mul_rows(g, gs, u, us, o, os, r0, r1, d));
    }
    static void co_rope(const float *x, int64_t x_tok, int64_t x_head, float *out, int64_t o_tok,
                        int64_t o_head, const float *cs, const float *sn, int64_t c_tok, int64_t n,
                        int heads, int head_size, int rot, int interleaved, int nt) {
        CO_SPLIT(n, nt, co_rope_rows(x, x_tok, x_head, out, o_tok, o_head, cs, sn, c_tok, r0, r1, heads,
                                     head_size, rot, interleaved));
    }
    """
    void co_rms_norm(const float *x, int64_t xs, const float *w, float *out, int64_t os,
                     int64_t n, int64_t d, float eps, int nt) nogil
    void co_fused_add_rms_norm(float *x, int64_t xs, float *res, int64_t rs, const float *w,
                               int64_t n, int64_t d, float eps, int nt) nogil
    void co_rope(const float *x, int64_t x_tok, int64_t x_head, float *out, int64_t o_tok,
                 int64_t o_head, const float *cs, const float *sn, int64_t c_tok, int64_t n,
                 int heads, int head_size, int rot, int interleaved, int nt) nogil
    void co_silu_mul(const float *g, int64_t gs, const float *u, int64_t us, float *o, int64_t os,
                     int64_t n, int64_t d, int nt) nogil
    int co_set_exp16(uintptr_t fn)
    int CO_HAVE_SILU
    int co_openmp()
    int co_bind_threads(const int64_t *cpus, const int64_t *offs, int nt) nogil


OPENMP = bool(co_openmp())
"""Built with OpenMP: ``num_threads > 1`` splits the rows."""


def rms_norm(uintptr_t x, int64_t xs, uintptr_t w, uintptr_t out, int64_t os, int64_t n, int64_t d,
             float eps, int num_threads):
    """``out[i] = w * (x[i] * r_i)`` over ``n`` rows of ``d`` float32 (row strides ``xs``, ``os``)."""
    with nogil:
        co_rms_norm(<const float *> x, xs, <const float *> w, <float *> out, os, n, d, eps, num_threads)


def fused_add_rms_norm(uintptr_t x, int64_t xs, uintptr_t res, int64_t rs, uintptr_t w, int64_t n,
                       int64_t d, float eps, int num_threads):
    """``res[i] += x[i]``; ``x[i] = w * (res[i] * r_i)`` over ``n`` rows of ``d`` float32, in place."""
    with nogil:
        co_fused_add_rms_norm(<float *> x, xs, <float *> res, rs, <const float *> w, n, d, eps, num_threads)


def rope(uintptr_t x, int64_t x_tok, int64_t x_head, uintptr_t out, int64_t o_tok, int64_t o_head,
         uintptr_t cos, uintptr_t sin, int64_t c_tok, int64_t n, int heads, int head_size, int rotary_dim,
         bint interleaved, int num_threads):
    """RoPE of ``n`` tokens x ``heads`` heads of ``x`` into ``out`` (float32; element strides per
    token and per head; ``cos`` / ``sin`` ``rotary_dim / 2`` floats per token, token stride ``c_tok``)."""
    with nogil:
        co_rope(<const float *> x, x_tok, x_head, <float *> out, o_tok, o_head, <const float *> cos,
                <const float *> sin, c_tok, n, heads, head_size, rotary_dim, interleaved, num_threads)


HAVE_SILU_MUL = bool(CO_HAVE_SILU)
"""Built with the AVX-512 ``silu_mul`` (GCC-compatible compiler, x86-64)."""


def set_exp16(uintptr_t fn):
    """Hand ``silu_mul`` the address of ``Sleef_expf16_u10`` (a 16-lane float32 ``exp``: the one
    torch's AVX512 kernels call; 0 clears it). Returns whether ``silu_mul`` may now run."""
    return bool(co_set_exp16(fn)) and HAVE_SILU_MUL


def silu_mul(uintptr_t g, int64_t gs, uintptr_t u, int64_t us, uintptr_t out, int64_t os, int64_t n, int64_t d,
             int num_threads):
    """``out[i] = silu(g[i]) * u[i]`` over ``n`` rows of ``d`` float32 (row strides ``gs``, ``us``,
    ``os``); only after :func:`set_exp16` returned ``True``."""
    with nogil:
        co_silu_mul(<const float *> g, gs, <const float *> u, us, <float *> out, os, n, d, num_threads)


def bind_threads(list cpu_sets):
    """Pin thread ``t`` of an OpenMP team of ``len(cpu_sets)`` threads to the CPUs
    ``cpu_sets[t]`` (``sched_setaffinity`` of each thread, from inside the team). libgomp
    keeps the team's threads for later regions of the same size, so torch's parallel regions
    (the same libgomp: one ``libgomp.so.1`` is loaded) run on them. Returns the number of
    threads whose call failed; raises ``RuntimeError`` when the team came out smaller."""
    cdef int nt = len(cpu_sets)
    cdef list flat = [int(c) for cs_ in cpu_sets for c in cs_]
    offs_l = [0]
    cdef int64_t total = 0
    for cs in cpu_sets:
        total += len(cs)
        offs_l.append(total)
    import array
    cdef long[:] cpus_v = array.array("l", flat or [0])
    cdef long[:] offs_v = array.array("l", offs_l)
    cdef int rc
    with nogil:
        rc = co_bind_threads(<const int64_t *> &cpus_v[0], <const int64_t *> &offs_v[0], nt)
    if rc < 0:
        raise RuntimeError(f"bind_threads: OpenMP gave a team of other than {nt} threads")
    return rc
