# cython: language_level=3, boundscheck=False, wraparound=False
"""Paged attention for the CPU that reads K/V in place through the block table.

One call attends every query row of a set of requests (decodes, speculative rows,
prefills and chunked-prefill continuations alike: varlen, bottom-right causal over the
request's cached context): no gather, no padding, no mask. A work item is a request (or,
with fewer requests than twice the threads, a request's KV head): it walks the request's
keys once, in chunks of ``AP_CHUNK`` (128), for all the query rows that read them (query tokens
times query heads, in tiles of ``AP_ROWS``; each key token's ``H_kv * D`` K and V rows are
contiguous), with an online softmax in float32 (running max ``m``, running sum ``l``,
rescaled accumulator). The loops run 16 float lanes wide on an AVX-512 CPU for head sizes
that are multiples of 16, 8 otherwise (``vector_lanes``); head sizes 32, 64 and 128 have
their own compiled functions. Items run on OpenMP threads when the module was built with it.
Only keys from the request's first query row's window start to ``seq_len - 1`` are read (a
row's unseen keys inside that span: K read, logit masked to ``-inf``, V not read), so a
poisoned or recycled block past ``seq_len`` or before the window cannot leak in; a NaN logit
or value a row does see makes the row NaN (as ``torch_native``). ``ap_check`` bounds the
metadata against the tensors before ``ap_run`` reads anything.

The Python-facing wrapper is ``backends/cpu_sdpa/paged.py`` (validation, strides); this
module takes raw addresses and strides and trusts them.
"""

from libc.stdint cimport int32_t, int64_t, uintptr_t

cdef extern from *:
    """
    #include <math.h>
    #include <stdint.h>
    #include <string.h>
    #ifdef _OPENMP
    #include <omp.h>
    #endif

    #define AP_ROWS 32      /* query rows (token x query head) per tile */
    #define AP_CHUNK 128    /* keys per online-softmax step */
    #define AP_DMAX 256     /* the largest head size */

    typedef struct {
        void *out; int64_t out_tok, out_head;
        const void *q; int64_t q_tok, q_head;
        const void *kv; int64_t kv_blk, kv_half, kv_tok, kv_head;
        const int32_t *block_table; int64_t bt_row;
        const int32_t *qsl; const int32_t *seq_lens;
        const int64_t *reqs; int64_t n_reqs;
        int num_heads, num_kv_heads, head_size, block_size, head_splits;
        float scale; int window; float softcap; int causal;
    } ap_args;

    #if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
    #define AP_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
    #define AP_V4 __attribute__((target("arch=x86-64-v4")))
    #define AP_HAVE_W16 1
    #else
    #define AP_CLONES
    #define AP_HAVE_W16 0
    #endif

    static inline float ap_bf16_to_f32(uint16_t x) {
        union { uint32_t u; float f; } c; c.u = ((uint32_t)x) << 16; return c.f;
    }
    static inline uint16_t ap_f32_to_bf16(float f) {   /* round to nearest even, NaN kept */
        union { uint32_t u; float f; } c; c.f = f;
        if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40u);
        c.u += 0x7fffu + ((c.u >> 16) & 1u);
        return (uint16_t)(c.u >> 16);
    }

    /* exp(x) for x <= 0 (a logit minus the running max), in plain arithmetic so that a
       loop of it vectorizes: x = n ln2 + r, |r| <= ln2 / 2, e^r by the degree-6 minimax
       polynomial of Cephes' expf (about 1 ulp), 2^n through the exponent bits. */
    static inline float ap_expf(float x) {
        x = x > -87.0f ? x : -87.0f;
        const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
        const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
        float p = 1.9875691500e-4f;
        p = p * r + 1.3981999507e-3f;
        p = p * r + 8.3334519073e-3f;
        p = p * r + 4.1665795894e-2f;
        p = p * r + 1.6666665459e-1f;
        p = p * r + 5.0000001201e-1f;
        p = p * r * r + r + 1.0f;
        const int32_t bits = ((int32_t)n + 127) << 23;
        float two_n;
        memcpy(&two_n, &bits, sizeof two_n);
        return p * two_n;
    }

    /* 8 lanes (GCC/Clang vector extensions: each target clone lowers them to its widest
       registers). Head sizes are multiples of 8. */
    typedef float ap_v8 __attribute__((vector_size(32)));
    typedef int32_t ap_v8i __attribute__((vector_size(32)));
    typedef uint16_t ap_v8u16 __attribute__((vector_size(16)));
    typedef uint32_t ap_v8u32 __attribute__((vector_size(32)));
    #define AP_INLINE static inline __attribute__((always_inline))
    #if defined(__clang__)
    #define AP_SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
    #else
    #define AP_SHUF(a, b, ...) __builtin_shuffle(a, b, (ap_v8i){__VA_ARGS__})
    #endif
    AP_INLINE ap_v8 ap_ld8_f32(const float *p) { ap_v8 v; memcpy(&v, p, sizeof v); return v; }
    AP_INLINE ap_v8 ap_ld8_bf16(const uint16_t *p) {
        ap_v8u16 h; memcpy(&h, p, sizeof h);
        ap_v8u32 w = __builtin_convertvector(h, ap_v8u32) << 16;
        ap_v8 f; memcpy(&f, &w, sizeof f); return f;
    }
    /* out[k] = the sum of the lanes of xk, k = 0..3 (a transpose-and-add tree) */
    AP_INLINE void ap_sum4(ap_v8 x0, ap_v8 x1, ap_v8 x2, ap_v8 x3, float *out) {
        #define AP_EV 0, 8, 2, 10, 4, 12, 6, 14
        #define AP_OD 1, 9, 3, 11, 5, 13, 7, 15
        #define AP_LO 0, 1, 8, 9, 4, 5, 12, 13
        #define AP_HI 2, 3, 10, 11, 6, 7, 14, 15
        const ap_v8 h01 = AP_SHUF(x0, x1, AP_EV) + AP_SHUF(x0, x1, AP_OD);
        const ap_v8 h23 = AP_SHUF(x2, x3, AP_EV) + AP_SHUF(x2, x3, AP_OD);
        const ap_v8 h = AP_SHUF(h01, h23, AP_LO) + AP_SHUF(h01, h23, AP_HI);
        out[0] = h[0] + h[4]; out[1] = h[1] + h[5]; out[2] = h[2] + h[6]; out[3] = h[3] + h[7];
    }
    /* the sums of the lanes of x0 .. x7 as one vector (the same transpose-and-add tree
       as ap_sum4, so the same roundings) */
    AP_INLINE ap_v8 ap_sum8(ap_v8 x0, ap_v8 x1, ap_v8 x2, ap_v8 x3, ap_v8 x4, ap_v8 x5, ap_v8 x6, ap_v8 x7) {
        const ap_v8 h01 = AP_SHUF(x0, x1, AP_EV) + AP_SHUF(x0, x1, AP_OD);
        const ap_v8 h23 = AP_SHUF(x2, x3, AP_EV) + AP_SHUF(x2, x3, AP_OD);
        const ap_v8 h45 = AP_SHUF(x4, x5, AP_EV) + AP_SHUF(x4, x5, AP_OD);
        const ap_v8 h67 = AP_SHUF(x6, x7, AP_EV) + AP_SHUF(x6, x7, AP_OD);
        const ap_v8 g03 = AP_SHUF(h01, h23, AP_LO) + AP_SHUF(h01, h23, AP_HI);
        const ap_v8 g47 = AP_SHUF(h45, h67, AP_LO) + AP_SHUF(h45, h67, AP_HI);
        return AP_SHUF(g03, g47, 0, 1, 2, 3, 8, 9, 10, 11) + AP_SHUF(g03, g47, 4, 5, 6, 7, 12, 13, 14, 15);
    }
    /* ap_expf on 8 lanes, x <= 0; -inf lanes give exactly 0 */
    AP_INLINE ap_v8 ap_exp8(ap_v8 x) {
        const ap_v8i seen = x > -INFINITY;
        const ap_v8i big = x > -87.0f;
        ap_v8i xi; memcpy(&xi, &x, sizeof xi);
        const ap_v8 lo = {-87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f};
        ap_v8i loi; memcpy(&loi, &lo, sizeof loi);
        xi = (xi & big) | (loi & ~big);
        memcpy(&x, &xi, sizeof x);
        const ap_v8i ni = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, ap_v8i); /* x <= 0: nearest */
        const ap_v8 n = __builtin_convertvector(ni, ap_v8);
        const ap_v8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
        ap_v8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
        p = p * r + 8.3334519073e-3f;
        p = p * r + 4.1665795894e-2f;
        p = p * r + 1.6666665459e-1f;
        p = p * r + 5.0000001201e-1f;
        p = p * r * r + r + 1.0f;
        const ap_v8i bits = ((ni + 127) << 23) & seen;   /* 2^n, or +0 for an unseen lane */
        ap_v8 two_n; memcpy(&two_n, &bits, sizeof two_n);
        return p * two_n;
    }


    /* 16 lanes: the x86-64-v4 (AVX-512) variants of the item functions, for head sizes
       that are multiples of 16 (ap_run picks them when the CPU has AVX-512) */
    typedef float ap_v16 __attribute__((vector_size(64)));
    typedef int32_t ap_v16i __attribute__((vector_size(64)));
    typedef uint16_t ap_v16u16 __attribute__((vector_size(32)));
    typedef uint32_t ap_v16u32 __attribute__((vector_size(64)));
    #if defined(__clang__)
    #define AP_SHUF16(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
    #else
    #define AP_SHUF16(a, b, ...) __builtin_shuffle(a, b, (ap_v16i){__VA_ARGS__})
    #endif
    AP_INLINE ap_v16 ap_ld16_f32(const float *p) { ap_v16 v; memcpy(&v, p, sizeof v); return v; }
    AP_INLINE ap_v16 ap_ld16_bf16(const uint16_t *p) {
        ap_v16u16 h; memcpy(&h, p, sizeof h);
        ap_v16u32 w = __builtin_convertvector(h, ap_v16u32) << 16;
        ap_v16 f; memcpy(&f, &w, sizeof f); return f;
    }
    /* the sums of the lanes of x[0] .. x[15] as one vector (a transpose-and-add tree) */
    AP_INLINE ap_v16 ap_sum16(const ap_v16 *x) {
        #define AP_EV16 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
        #define AP_OD16 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
        #define AP_LO16 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
        #define AP_HI16 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
        #define AP_LQ16 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
        #define AP_HQ16 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
        ap_v16 h[8], g[4], f[2];
        for (int k = 0; k < 8; k++)
            h[k] = AP_SHUF16(x[2 * k], x[2 * k + 1], AP_EV16) + AP_SHUF16(x[2 * k], x[2 * k + 1], AP_OD16);
        for (int k = 0; k < 4; k++)
            g[k] = AP_SHUF16(h[2 * k], h[2 * k + 1], AP_LO16) + AP_SHUF16(h[2 * k], h[2 * k + 1], AP_HI16);
        for (int k = 0; k < 2; k++)
            f[k] = AP_SHUF16(g[2 * k], g[2 * k + 1], AP_LQ16) + AP_SHUF16(g[2 * k], g[2 * k + 1], AP_HQ16);
        return AP_SHUF16(f[0], f[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + AP_SHUF16(f[0], f[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
    AP_INLINE ap_v8 ap_sum8p(const ap_v8 *x) { return ap_sum8(x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]); }
    /* ap_exp8 on 16 lanes (the same arithmetic lane by lane) */
    AP_INLINE ap_v16 ap_exp16(ap_v16 x) {
        const ap_v16i seen = x > -INFINITY;
        const ap_v16i big = x > -87.0f;
        ap_v16i xi; memcpy(&xi, &x, sizeof xi);
        ap_v16 lo; for (int k = 0; k < 16; k++) lo[k] = -87.0f;
        ap_v16i loi; memcpy(&loi, &lo, sizeof loi);
        xi = (xi & big) | (loi & ~big);
        memcpy(&x, &xi, sizeof x);
        const ap_v16i ni = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, ap_v16i);
        const ap_v16 n = __builtin_convertvector(ni, ap_v16);
        const ap_v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
        ap_v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
        p = p * r + 8.3334519073e-3f;
        p = p * r + 4.1665795894e-2f;
        p = p * r + 1.6666665459e-1f;
        p = p * r + 5.0000001201e-1f;
        p = p * r * r + r + 1.0f;
        const ap_v16i bits = ((ni + 127) << 23) & seen;
        ap_v16 two_n; memcpy(&two_n, &bits, sizeof two_n);
        return p * two_n;
    }
    /* the lanes' sum of a vector of exponentials, in a fixed order */
    AP_INLINE float ap_hsum8(ap_v8 t) { return ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7])); }
    AP_INLINE float ap_hsum16(ap_v16 t) {
        ap_v8 lo, hi; memcpy(&lo, &t, 32); memcpy(&hi, (const char *)&t + 32, 32);
        return ap_hsum8(lo + hi);
    }

    /* acc[g * D + d] += the sum over keys j in [jlo, jhi) of p[g * AP_CHUNK + j] * V_j[d],
       g < NG, d in [d0, d0 + W NV): each value row loaded once for the NG rows, the
       accumulators in registers (VF: W lanes, LOADW loads W elements as floats) */
    #define AP_VACC_BLOCK(TYPE, VF, W, LOADW, NG, NV)                                       \\
        {                                                                                     \\
            VF A[NG][NV];                                                                     \\
            for (int g = 0; g < NG; g++)                                                      \\
                for (int v = 0; v < NV; v++) memcpy(&A[g][v], acc + g * D + d0 + W * v, sizeof(VF));\\
            const float *P[NG];   /* each row's weights: one base pointer, no index math */\\
            for (int g = 0; g < NG; g++) P[g] = p + g * AP_CHUNK;                             \\
            for (int64_t j = jlo; j < jhi; j++) {                                             \\
                const TYPE *vr = kp[j] + off + d0;                                            \\
                VF V[NV];                                                                     \\
                for (int v = 0; v < NV; v++) V[v] = LOADW(vr + W * v);                        \\
                for (int g = 0; g < NG; g++) {                                                \\
                    const float pg = P[g][j];                                                 \\
                    for (int v = 0; v < NV; v++) A[g][v] += pg * V[v];                        \\
                }                                                                             \\
            }                                                                                 \\
            for (int g = 0; g < NG; g++)                                                      \\
                for (int v = 0; v < NV; v++) memcpy(acc + g * D + d0 + W * v, &A[g][v], sizeof(VF));\\
        }
    #define AP_DEFINE_VACC(NAME, TYPE, VF, W, LOADW)                                          \\
    AP_INLINE void NAME(float *acc, const float *p, int ng, const TYPE *const *kp, int64_t off, \\
                        int jlo, int jhi, int D) {                                            \\
        int d0 = 0;                                                                           \\
        if (ng == 4)                                                                          \\
            for (; d0 + 4 * W <= D; d0 += 4 * W) AP_VACC_BLOCK(TYPE, VF, W, LOADW, 4, 4)      \\
        for (; d0 + 2 * W <= D; d0 += 2 * W)                                                  \\
            switch (ng) {                                                                     \\
            case 4: AP_VACC_BLOCK(TYPE, VF, W, LOADW, 4, 2) break;                            \\
            case 3: AP_VACC_BLOCK(TYPE, VF, W, LOADW, 3, 2) break;                            \\
            case 2: AP_VACC_BLOCK(TYPE, VF, W, LOADW, 2, 2) break;                            \\
            default: AP_VACC_BLOCK(TYPE, VF, W, LOADW, 1, 2) break;                           \\
            }                                                                                 \\
        if (d0 < D)                                                                           \\
            switch (ng) {                                                                     \\
            case 4: AP_VACC_BLOCK(TYPE, VF, W, LOADW, 4, 1) break;                            \\
            case 3: AP_VACC_BLOCK(TYPE, VF, W, LOADW, 3, 1) break;                            \\
            case 2: AP_VACC_BLOCK(TYPE, VF, W, LOADW, 2, 1) break;                            \\
            default: AP_VACC_BLOCK(TYPE, VF, W, LOADW, 1, 1) break;                           \\
            }                                                                                 \\
    }

    /* One work item: every query row of request reqs[item / head_splits] for the query
       heads of its KV heads hk0 .. hk1 - 1. TYPE: the element type of q / kv / out;
       LOAD / LOAD8 (8 lanes) / STORE convert to and from float; the main loops run W
       lanes wide (VF, LOADW, SUMW: W vectors' lane sums as one vector, EXPW, HSUMW);
       DC: the head size fixed at compile time (0: any); ATTR: the function's target. */
    #define AP_DEFINE_ITEM(NAME, ATTR, TYPE, LOAD, LOAD8, STORE, VF, W, LOADW, SUMW, EXPW, HSUMW, DC, PAIR) \\
    static ATTR void NAME(const ap_args *a, int64_t item) {                                   \\
        const int G = a->num_heads / a->num_kv_heads, B = a->block_size;                      \\
        const int D = DC > 0 ? DC : a->head_size;                                             \\
        const int per = (a->num_kv_heads + a->head_splits - 1) / a->head_splits;              \\
        const int hk0 = (int)(item % a->head_splits) * per;                                   \\
        const int hk1 = hk0 + per < a->num_kv_heads ? hk0 + per : a->num_kv_heads;            \\
        const int HH = (hk1 - hk0) * G;   /* query heads of this item, from hk0 * G on */     \\
        const int64_t r = a->reqs[item / a->head_splits];                                     \\
        const int64_t q0 = a->qsl[r], ql = a->qsl[r + 1] - q0, L = a->seq_lens[r];            \\
        const int64_t nrows = ql * HH;                                                        \\
        const int32_t *bt = a->block_table + r * a->bt_row;                                   \\
        const TYPE *q = (const TYPE *)a->q; const TYPE *kv = (const TYPE *)a->kv;             \\
        TYPE *out = (TYPE *)a->out;                                                           \\
        float qf[AP_ROWS * AP_DMAX] __attribute__((aligned(64)));                             \\
        float acc[AP_ROWS * AP_DMAX] __attribute__((aligned(64)));                            \\
        VF lv[AP_ROWS];   /* the softmax denominators, lane by lane */   \\
        float m[AP_ROWS], s[AP_ROWS * AP_CHUNK] __attribute__((aligned(64)));     \\
        int64_t rlo[AP_ROWS], rhi[AP_ROWS], koff[AP_ROWS];                                    \\
        int vjlo[AP_ROWS], vjhi[AP_ROWS];   /* the keys of the chunk each row sees */         \\
        const TYPE *kp[AP_CHUNK];                                                             \\
        for (int64_t row0 = 0; row0 < nrows; row0 += AP_ROWS) {                               \\
            const int nr = (int)(nrows - row0 < AP_ROWS ? nrows - row0 : AP_ROWS);            \\
            int64_t klo = INT64_MAX, khi = 0;                                                 \\
            for (int i = 0; i < nr; i++) {                                                    \\
                const int64_t t = (row0 + i) / HH, h = hk0 * G + (row0 + i) % HH;             \\
                koff[i] = (int64_t)(h / G) * a->kv_head;                                      \\
                const int64_t p = L - ql + t;                                                 \\
                rhi[i] = a->causal ? p + 1 : L;                                               \\
                rlo[i] = (a->window > 0 && p - a->window + 1 > 0) ? p - a->window + 1 : 0;    \\
                if (rlo[i] < klo) klo = rlo[i];                                               \\
                if (rhi[i] > khi) khi = rhi[i];                                               \\
                const TYPE *qr = q + (q0 + t) * a->q_tok + h * a->q_head;                     \\
                for (int d = 0; d < D; d++) qf[i * D + d] = LOAD(qr[d]) * a->scale;           \\
                for (int d = 0; d < D; d++) acc[i * D + d] = 0.0f;                            \\
                m[i] = -INFINITY; lv[i] = (VF){0};                                                  \\
            }                                                                                 \\
            for (int64_t c0 = klo; c0 < khi; c0 += AP_CHUNK) {                                \\
                const int nc = (int)(khi - c0 < AP_CHUNK ? khi - c0 : AP_CHUNK);              \\
                {   /* one division per chunk, not two per key */                             \\
                    int64_t col = c0 / B, slot = c0 % B;                                      \\
                    const TYPE *blk = kv + (int64_t)bt[col] * a->kv_blk;                      \\
                    for (int j = 0; j < nc; j++) {                                            \\
                        kp[j] = blk + slot * a->kv_tok;                                       \\
                        if (++slot == B && j + 1 < nc) { slot = 0; blk = kv + (int64_t)bt[++col] * a->kv_blk; }\\
                    }                                                                         \\
                }                                                                             \\
                /* the chunk's logits for every row of the tile: W keys per pass, their    \\
                   W-lane partial sums reduced by one transpose-and-add tree */             \\
                int j4 = 0;                                                                              \\
                if (W == 16 && DC == 32 && G > 1)                                                  \\
                    for (; j4 + 16 <= nc; j4 += 16) PAIR(s, qf, koff, nr, (const void *const *)kp, j4);  \\
                for (; j4 + W <= nc; j4 += W) {                                               \\
                    const TYPE *kk[W];   /* the keys' K rows for the KV head of row i */      \\
                    int64_t kko = -1;                                                         \\
                    for (int i = 0; i < nr; i++) {                                            \\
                        const float *qi = qf + i * D;                                         \\
                        if (koff[i] != kko) {   /* a new KV head: rows of one group share them */\\
                            kko = koff[i];                                                    \\
                            for (int k = 0; k < W; k++) kk[k] = kp[j4 + k] + kko;             \\
                        }                                                                     \\
                        VF x[W];                                                              \\
                        for (int k = 0; k < W; k++) x[k] = (VF){0};                           \\
                        for (int d = 0; d < D; d += W) {                                      \\
                            VF qd; memcpy(&qd, qi + d, sizeof qd);                            \\
                            for (int k = 0; k < W; k++) x[k] += qd * LOADW(kk[k] + d);        \\
                        }                                                                     \\
                        const VF lg = SUMW(x);                                                \\
                        memcpy(s + i * AP_CHUNK + j4, &lg, sizeof lg);                        \\
                    }                                                                         \\
                }                                                                             \\
                for (; j4 + 4 <= nc; j4 += 4) {  /* four keys per pass: 8-lane partial sums */\\
                    for (int i = 0; i < nr; i++) {                                            \\
                        const float *qi = qf + i * D;                                         \\
                        const TYPE *k0 = kp[j4] + koff[i], *k1 = kp[j4 + 1] + koff[i];        \\
                        const TYPE *k2 = kp[j4 + 2] + koff[i], *k3 = kp[j4 + 3] + koff[i];    \\
                        ap_v8 x0 = {0}, x1 = {0}, x2 = {0}, x3 = {0};                         \\
                        for (int d = 0; d < D; d += 8) {                                      \\
                            ap_v8 qd; memcpy(&qd, qi + d, sizeof qd);                         \\
                            x0 += qd * LOAD8(k0 + d); x1 += qd * LOAD8(k1 + d);               \\
                            x2 += qd * LOAD8(k2 + d); x3 += qd * LOAD8(k3 + d);               \\
                        }                                                                     \\
                        ap_sum4(x0, x1, x2, x3, s + i * AP_CHUNK + j4);                       \\
                    }                                                                         \\
                }                                                                             \\
                for (int j = j4; j < nc; j++) {                                               \\
                    for (int i = 0; i < nr; i++) {                                            \\
                        const float *qi = qf + i * D;                                         \\
                        const TYPE *k = kp[j] + koff[i];                                      \\
                        float x = 0.0f;                                                       \\
                        _Pragma("omp simd reduction(+:x)")                                    \\
                        for (int d = 0; d < D; d++) x += qi[d] * LOAD(k[d]);                  \\
                        s[i * AP_CHUNK + j] = x;                                              \\
                    }                                                                         \\
                }                                                                             \\
                /* per row: the keys it sees, the running max, the weights (lanes from     \\
                   ncw on: never read) */                                                     \\
                const int ncw = (nc + W - 1) / W * W;                                         \\
                for (int i = 0; i < nr; i++) {                                                \\
                    float *si = s + i * AP_CHUNK;                                             \\
                    const int jlo = rlo[i] > c0 ? (int)(rlo[i] - c0) : 0;                     \\
                    const int jhi = rhi[i] - c0 < nc ? (int)(rhi[i] - c0) : nc;               \\
                    if (a->softcap > 0.0f)                                                    \\
                        for (int j = jlo; j < jhi; j++) si[j] = a->softcap * tanhf(si[j] / a->softcap);\\
                    float mx = -INFINITY;                                                     \\
                    int nan = 0;   /* a NaN logit (a poisoned key) poisons the row */         \\
                    _Pragma("omp simd reduction(max:mx) reduction(|:nan)")                    \\
                    for (int j = 0; j < AP_CHUNK; j++) {                                      \\
                        si[j] = (j < jlo || j >= jhi) ? -INFINITY : si[j];                    \\
                        nan |= si[j] != si[j];                                                \\
                        mx = si[j] > mx ? si[j] : mx;                                         \\
                    }                                                                         \\
                    if (nan) lv[i][0] = NAN;                                                  \\
                    vjlo[i] = jlo; vjhi[i] = mx == -INFINITY ? jlo : jhi;                     \\
                    if (mx == -INFINITY) { for (int j = 0; j < AP_CHUNK; j++) si[j] = 0.0f; continue; }\\
                    if (mx > m[i]) {                                                          \\
                        if (m[i] != -INFINITY) {                                              \\
                            const float corr = ap_expf(m[i] - mx);                            \\
                            float *ai = acc + i * D;                                          \\
                            lv[i] *= corr;                                                    \\
                            for (int d = 0; d < D; d++) ai[d] *= corr;                        \\
                        }                                                                     \\
                        m[i] = mx;                                                            \\
                    }                                                                         \\
                    VF tot = {0};                                                             \\
                    for (int j = 0; j < ncw; j += W) {  /* -inf (unseen) lanes become 0 */  \\
                        VF x; memcpy(&x, si + j, sizeof x);                                   \\
                        const VF e = EXPW(x - m[i]);                                          \\
                        memcpy(si + j, &e, sizeof e);                                         \\
                        tot += e;                                                             \\
                    }                                                                         \\
                    lv[i] += tot;  /* summed over lanes at the end */                                                    \\
                }                                                                             \\
                /* the weighted values: the consecutive rows of one KV head that see the   \\
                   same keys of the chunk (a GQA group) share each value load, their       \\
                   accumulators held in registers over the chunk's keys */                 \\
                for (int i = 0; i < nr; ) {                                                   \\
                    int ng = 1;                                                               \\
                    while (ng < 4 && i + ng < nr && koff[i + ng] == koff[i]                   \\
                           && vjlo[i + ng] == vjlo[i] && vjhi[i + ng] == vjhi[i]) ng++;       \\
                    if (vjlo[i] < vjhi[i])                                                    \\
                        NAME##_vacc(acc + i * D, s + i * AP_CHUNK, ng, kp, a->kv_half + koff[i], \\
                                    vjlo[i], vjhi[i], D);                                     \\
                    i += ng;                                                                  \\
                }                                                                             \\
            }                                                                                 \\
            for (int i = 0; i < nr; i++) {                                                    \\
                const int64_t t = (row0 + i) / HH, h = hk0 * G + (row0 + i) % HH;             \\
                TYPE *o = out + (q0 + t) * a->out_tok + h * a->out_head;                      \\
                const float inv = 1.0f / HSUMW(lv[i]);                                       \\
                for (int d = 0; d < D; d++) o[d] = STORE(acc[i * D + d] * inv);               \\
            }                                                                                 \\
        }                                                                                     \\
    }

    #if AP_HAVE_W16
    /* head size 32, 16 lanes, G > 1: the logits of keys j4 .. j4 + 15 for the tile's rows.
       Four consecutive rows of one KV head (a GQA group of 4 or more) take four keys at a
       time: each K row loaded once for the four, their 16 partial-sum vectors reduced by
       one ap_sum16 tree into the (row, key) logits; any other row takes 16 keys alone */
    #define AP_DEFINE_PAIR32(NAME, TYPE, LOADW)                                                                   \\
    static inline __attribute__((always_inline)) AP_V4 void NAME(float *s, const float *qf, const int64_t *koff,  \\
                                                                 int nr, const void *const *kpv, int j4) {        \\
        const TYPE *const *kp = (const TYPE *const *)kpv;                                                         \\
        int i = 0;                                                                                                \\
        while (i < nr) {                                                                                          \\
            const int64_t ko = koff[i];                                                                           \\
            if (i + 4 <= nr && koff[i + 1] == ko && koff[i + 2] == ko && koff[i + 3] == ko) {                     \\
                ap_v16 Q[4][2];   /* four rows of one KV head: each K load serves the four */                     \\
                for (int g = 0; g < 4; g++)                                                                       \\
                    for (int h = 0; h < 2; h++) memcpy(&Q[g][h], qf + (i + g) * 32 + 16 * h, sizeof(ap_v16));     \\
                for (int k0 = 0; k0 < 16; k0 += 4) {                                                              \\
                    ap_v16 x[16];   /* lane sums: the logit of row i + g, key j4 + k0 + k at x[4 g + k] */        \\
                    for (int k = 0; k < 4; k++) {                                                                 \\
                        const TYPE *kr = kp[j4 + k0 + k] + ko;                                                    \\
                        const ap_v16 ka = LOADW(kr), kb = LOADW(kr + 16);                                         \\
                        for (int g = 0; g < 4; g++) x[4 * g + k] = Q[g][0] * ka + Q[g][1] * kb;                   \\
                    }                                                                                             \\
                    const ap_v16 lg = ap_sum16(x);                                                                \\
                    for (int g = 0; g < 4; g++)                                                                   \\
                        memcpy(s + (i + g) * AP_CHUNK + j4 + k0, (const float *)&lg + 4 * g, 4 * sizeof(float));  \\
                }                                                                                                 \\
                i += 4;                                                                                           \\
            } else {                                                                                              \\
                ap_v16 qa, qb, x[16];                                                                             \\
                memcpy(&qa, qf + i * 32, sizeof qa); memcpy(&qb, qf + i * 32 + 16, sizeof qb);                    \\
                for (int k = 0; k < 16; k++) {                                                                    \\
                    const TYPE *kr = kp[j4 + k] + ko;                                                             \\
                    x[k] = qa * LOADW(kr) + qb * LOADW(kr + 16);                                                  \\
                }                                                                                                 \\
                const ap_v16 lg = ap_sum16(x);                                                                    \\
                memcpy(s + i * AP_CHUNK + j4, &lg, sizeof lg);                                                    \\
                i++;                                                                                              \\
            }                                                                                                     \\
        }                                                                                                         \\
    }
    #endif
    /* never called: the 8-lane functions' PAIR argument */
    static inline void ap_pair_none(float *s, const float *qf, const int64_t *koff, int nr, const void *const *kp, int j4) {
        (void)s; (void)qf; (void)koff; (void)nr; (void)kp; (void)j4;
    }

    /* per dtype: the value accumulator and the item function for head sizes 32, 64, 128
       (loops over the head unrolled at compile time) and any other, 8 lanes wide (target
       clones: x86-64-v4 / v3 / baseline), and where GCC targets x86-64 the same 16 lanes
       wide for AVX-512 CPUs (head sizes that are multiples of 16); NAME(head_size, w16)
       returns the function to run */
    #define AP_DEFINE_ITEMS8(NAME, TYPE, LOAD, LOAD8, STORE)                                   \\
        AP_DEFINE_VACC(NAME##_d32_vacc, TYPE, ap_v8, 8, LOAD8)                                \\
        AP_DEFINE_VACC(NAME##_d64_vacc, TYPE, ap_v8, 8, LOAD8)                                \\
        AP_DEFINE_VACC(NAME##_d128_vacc, TYPE, ap_v8, 8, LOAD8)                               \\
        AP_DEFINE_VACC(NAME##_dany_vacc, TYPE, ap_v8, 8, LOAD8)                               \\
        AP_DEFINE_ITEM(NAME##_d32, AP_CLONES, TYPE, LOAD, LOAD8, STORE, ap_v8, 8, LOAD8, ap_sum8p, ap_exp8, ap_hsum8, 32, ap_pair_none)\\
        AP_DEFINE_ITEM(NAME##_d64, AP_CLONES, TYPE, LOAD, LOAD8, STORE, ap_v8, 8, LOAD8, ap_sum8p, ap_exp8, ap_hsum8, 64, ap_pair_none)\\
        AP_DEFINE_ITEM(NAME##_d128, AP_CLONES, TYPE, LOAD, LOAD8, STORE, ap_v8, 8, LOAD8, ap_sum8p, ap_exp8, ap_hsum8, 128, ap_pair_none)\\
        AP_DEFINE_ITEM(NAME##_dany, AP_CLONES, TYPE, LOAD, LOAD8, STORE, ap_v8, 8, LOAD8, ap_sum8p, ap_exp8, ap_hsum8, 0, ap_pair_none)
    #if AP_HAVE_W16
    #define AP_DEFINE_ITEMS(NAME, TYPE, LOAD, LOAD8, LOAD16, STORE)                            \\
        AP_DEFINE_ITEMS8(NAME, TYPE, LOAD, LOAD8, STORE)                                      \\
        AP_DEFINE_PAIR32(NAME##_w16_pair32, TYPE, LOAD16)                                      \\
        AP_DEFINE_VACC(NAME##_w16_d32_vacc, TYPE, ap_v16, 16, LOAD16)                         \\
        AP_DEFINE_VACC(NAME##_w16_d64_vacc, TYPE, ap_v16, 16, LOAD16)                         \\
        AP_DEFINE_VACC(NAME##_w16_d128_vacc, TYPE, ap_v16, 16, LOAD16)                        \\
        AP_DEFINE_VACC(NAME##_w16_dany_vacc, TYPE, ap_v16, 16, LOAD16)                        \\
        AP_DEFINE_ITEM(NAME##_w16_d32, AP_V4, TYPE, LOAD, LOAD8, STORE, ap_v16, 16, LOAD16, ap_sum16, ap_exp16, ap_hsum16, 32, NAME##_w16_pair32)\\
        AP_DEFINE_ITEM(NAME##_w16_d64, AP_V4, TYPE, LOAD, LOAD8, STORE, ap_v16, 16, LOAD16, ap_sum16, ap_exp16, ap_hsum16, 64, ap_pair_none)\\
        AP_DEFINE_ITEM(NAME##_w16_d128, AP_V4, TYPE, LOAD, LOAD8, STORE, ap_v16, 16, LOAD16, ap_sum16, ap_exp16, ap_hsum16, 128, ap_pair_none)\\
        AP_DEFINE_ITEM(NAME##_w16_dany, AP_V4, TYPE, LOAD, LOAD8, STORE, ap_v16, 16, LOAD16, ap_sum16, ap_exp16, ap_hsum16, 0, ap_pair_none)\\
        static void (*NAME(int head_size, int w16))(const ap_args *, int64_t) {               \\
            if (w16 && head_size % 16 == 0)                                                   \\
                return head_size == 32 ? NAME##_w16_d32 : head_size == 64 ? NAME##_w16_d64    \\
                     : head_size == 128 ? NAME##_w16_d128 : NAME##_w16_dany;                  \\
            return head_size == 32 ? NAME##_d32 : head_size == 64 ? NAME##_d64                \\
                 : head_size == 128 ? NAME##_d128 : NAME##_dany;                              \\
        }
    #else
    #define AP_DEFINE_ITEMS(NAME, TYPE, LOAD, LOAD8, LOAD16, STORE)                            \\
        AP_DEFINE_ITEMS8(NAME, TYPE, LOAD, LOAD8, STORE)                                      \\
        static void (*NAME(int head_size, int w16))(const ap_args *, int64_t) {               \\
            (void)w16;                                                                        \\
            return head_size == 32 ? NAME##_d32 : head_size == 64 ? NAME##_d64                \\
                 : head_size == 128 ? NAME##_d128 : NAME##_dany;                              \\
        }
    #endif

    #define AP_ID(x) (x)
    AP_DEFINE_ITEMS(ap_item_f32, float, AP_ID, ap_ld8_f32, ap_ld16_f32, AP_ID)
    AP_DEFINE_ITEMS(ap_item_bf16, uint16_t, ap_bf16_to_f32, ap_ld8_bf16, ap_ld16_bf16, ap_f32_to_bf16)
    #if defined(__FLT16_MAX__)
    #define AP_HAVE_F16 1
    #define AP_F16_LOAD(x) ((float)(x))
    #define AP_F16_STORE(x) ((_Float16)(x))
    typedef _Float16 ap_v8h __attribute__((vector_size(16)));
    typedef _Float16 ap_v16h __attribute__((vector_size(32)));
    static inline __attribute__((always_inline)) ap_v8 ap_ld8_f16(const _Float16 *p) {
        ap_v8h h; memcpy(&h, p, sizeof h); return __builtin_convertvector(h, ap_v8);
    }
    static inline __attribute__((always_inline)) ap_v16 ap_ld16_f16(const _Float16 *p) {
        ap_v16h h; memcpy(&h, p, sizeof h); return __builtin_convertvector(h, ap_v16);
    }
    AP_DEFINE_ITEMS(ap_item_f16, _Float16, AP_F16_LOAD, ap_ld8_f16, ap_ld16_f16, AP_F16_STORE)
    #else
    #define AP_HAVE_F16 0
    #endif

    static int ap_force_w8 = 0;   /* tests: the 8-lane functions even on an AVX-512 CPU */
    /* the CPU runs the 16-lane functions (AVX-512 F/BW/DQ/VL, x86-64-v4's vector part) */
    static int ap_cpu_w16(void) {
    #if AP_HAVE_W16
        static int w = -1;
        if (w < 0) {
            __builtin_cpu_init();
            w = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
        }
        return w;
    #else
        return 0;
    #endif
    }

    /* dtype: 0 float32, 1 bfloat16, 2 float16. Returns 0, or -1 for an unsupported dtype. */
    static int ap_run(const ap_args *a, int dtype, int num_threads) {
        void (*item)(const ap_args *, int64_t) = 0;
        const int w16 = ap_cpu_w16() && !ap_force_w8;
        if (dtype == 0) item = ap_item_f32(a->head_size, w16);
        else if (dtype == 1) item = ap_item_bf16(a->head_size, w16);
    #if AP_HAVE_F16
        else if (dtype == 2) item = ap_item_f16(a->head_size, w16);
    #endif
        if (!item) return -1;
        /* one item per request (all its heads: each key token's K/V row, H_kv * D
           contiguous, read once); split by KV head when there are too few requests to
           keep the threads busy */
        ap_args b = *a;
        b.head_splits = (num_threads > 1 && a->n_reqs < 2 * num_threads) ? a->num_kv_heads : 1;
        a = &b;
        const int64_t n = a->n_reqs * a->head_splits;
    #ifdef _OPENMP
        if (num_threads > 1 && n > 1) {
            #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
            for (int64_t it = 0; it < n; it++) item(a, it);
            return 0;
        }
    #endif
        for (int64_t it = 0; it < n; it++) item(a, it);
        return 0;
    }

    /* The metadata against the tensors' extents, before any read: 0, or a problem code
       (1 request index, 2 query_start_loc, 3 seq_len, 4 block-table columns, 5 block id)
       with the request and the offending value. Only the block-table columns the kernel
       reads are checked (the window's and the context's; padding past them is not read). */
    static int ap_check(const ap_args *a, int64_t num_tokens, int64_t num_qsl, int64_t num_seq,
                        int64_t bt_rows, int64_t bt_cols, int64_t num_blocks,
                        int64_t *bad_req, int64_t *bad_val) {
        const int64_t B = a->block_size;
        for (int64_t i = 0; i < a->n_reqs; i++) {
            const int64_t r = a->reqs[i];
            *bad_req = r; *bad_val = r;
            if (r < 0 || r + 1 >= num_qsl || r >= num_seq || r >= bt_rows) return 1;
            const int64_t q0 = a->qsl[r], q1 = a->qsl[r + 1], L = a->seq_lens[r];
            *bad_val = q1;
            if (q0 < 0 || q1 < q0 || q1 > num_tokens) { *bad_val = q0 < 0 || q1 < q0 ? q0 : q1; return 2; }
            *bad_val = L;
            if (L < 0 || (q1 > q0 && (a->causal ? q1 - q0 > L : L == 0))) return 3;
            if (q1 == q0) continue;   /* no query row: nothing read */
            const int64_t ncol = (L + B - 1) / B;
            if (ncol > bt_cols) return 4;
            const int64_t p = L - (q1 - q0);   /* the first query row's position */
            const int64_t lo = (a->window > 0 && p - a->window + 1 > 0) ? p - a->window + 1 : 0;
            const int32_t *bt = a->block_table + r * a->bt_row;
            for (int64_t c = lo / B; c < ncol; c++)
                if (bt[c] < 0 || bt[c] >= num_blocks) { *bad_val = bt[c]; return 5; }
        }
        return 0;
    }

    /* the lanes the item functions for head_size run: 16 or 8 */
    static int ap_lanes(int head_size) { return ap_cpu_w16() && !ap_force_w8 && head_size % 16 == 0 ? 16 : 8; }
    static void ap_set_force_w8(int on) { ap_force_w8 = on; }

    static int ap_openmp(void) {
    #ifdef _OPENMP
        return 1;
    #else
        return 0;
    #endif
    }
    """
    ctypedef struct ap_args:
        void *out
        int64_t out_tok, out_head
        const void *q
        int64_t q_tok, q_head
        const void *kv
        int64_t kv_blk, kv_half, kv_tok, kv_head
        const int32_t *block_table
        int64_t bt_row
        const int32_t *qsl
        const int32_t *seq_lens
        const int64_t *reqs
        int64_t n_reqs
        int num_heads, num_kv_heads, head_size, block_size, head_splits
        float scale
        int window
        float softcap
        int causal
    int ap_run(const ap_args *a, int dtype, int num_threads) nogil
    int ap_check(const ap_args *a, int64_t num_tokens, int64_t num_qsl, int64_t num_seq, int64_t bt_rows,
                 int64_t bt_cols, int64_t num_blocks, int64_t *bad_req, int64_t *bad_val) nogil
    int ap_openmp()
    int ap_lanes(int head_size)
    void ap_set_force_w8(int on)
    int AP_DMAX
    int AP_HAVE_F16


MAX_HEAD_SIZE = AP_DMAX
"""The largest head size the kernel takes (its per-row accumulators live on the stack)."""

HAS_FLOAT16 = bool(AP_HAVE_F16)
"""float16 is compiled in (the C compiler has ``_Float16``)."""

OPENMP = bool(ap_openmp())
"""Built with OpenMP: ``num_threads > 1`` splits the ``(request, KV head)`` pairs."""


def vector_lanes(int head_size):
    """The vector width (float lanes, 16 or 8) the kernel's loops run at for ``head_size``:
    16 where the CPU has AVX-512 (F, BW, DQ, VL) and ``head_size`` is a multiple of 16, else 8."""
    return ap_lanes(head_size)


def _force_8_lanes(bint on):
    """Tests only: run the 8-lane functions even where the 16-lane ones would run
    (process-wide; not thread-safe against concurrent calls)."""
    ap_set_force_w8(on)


cdef inline void _set_metadata(ap_args *a, uintptr_t block_table, int64_t bt_row, uintptr_t query_start_loc,
                               uintptr_t seq_lens, uintptr_t reqs, int64_t n_reqs) noexcept:
    """The per-step metadata fields ``paged_attention`` and ``check_metadata`` share."""
    a.block_table = <const int32_t *> block_table
    a.bt_row = bt_row
    a.qsl = <const int32_t *> query_start_loc
    a.seq_lens = <const int32_t *> seq_lens
    a.reqs = <const int64_t *> reqs
    a.n_reqs = n_reqs


def paged_attention(uintptr_t out, int64_t out_tok, int64_t out_head,
                    uintptr_t q, int64_t q_tok, int64_t q_head,
                    uintptr_t kv, int64_t kv_blk, int64_t kv_half, int64_t kv_tok, int64_t kv_head,
                    uintptr_t block_table, int64_t bt_row, uintptr_t query_start_loc, uintptr_t seq_lens,
                    uintptr_t reqs, int64_t n_reqs, int num_heads, int num_kv_heads, int head_size,
                    int block_size, float scale, int window, float softcap, bint causal, int dtype,
                    int num_threads, int64_t num_tokens, int64_t num_qsl, int64_t num_seq, int64_t bt_rows,
                    int64_t bt_cols, int64_t num_blocks):
    """Raw entry point (addresses and element strides; ``paged.py`` checks the tensors).
    The extents (``num_tokens`` query/out rows, ``num_qsl`` / ``num_seq`` entries of
    ``query_start_loc`` / ``seq_lens``, the block table's ``bt_rows`` x ``bt_cols``, the
    cache's ``num_blocks``) bound the metadata, checked in C before any K/V read (request
    indices, ``query_start_loc`` within ``num_tokens`` and non-decreasing, ``0 <=
    query_len <= seq_len``, the block-table columns the rows read and their block ids).
    Runs without the GIL. Returns ``None``, or a message naming the first request whose
    metadata fails (nothing was read or written). Raises ``ValueError`` for an
    unsupported ``dtype`` code."""
    cdef ap_args a
    cdef int rc
    cdef int64_t bad_req = 0, bad_val = 0
    a.out = <void *> out
    a.out_tok = out_tok
    a.out_head = out_head
    a.q = <const void *> q
    a.q_tok = q_tok
    a.q_head = q_head
    a.kv = <const void *> kv
    a.kv_blk = kv_blk
    a.kv_half = kv_half
    a.kv_tok = kv_tok
    a.kv_head = kv_head
    _set_metadata(&a, block_table, bt_row, query_start_loc, seq_lens, reqs, n_reqs)
    a.num_heads = num_heads
    a.num_kv_heads = num_kv_heads
    a.head_size = head_size
    a.block_size = block_size
    a.scale = scale
    a.window = window
    a.softcap = softcap
    a.causal = causal
    with nogil:
        rc = ap_check(&a, num_tokens, num_qsl, num_seq, bt_rows, bt_cols, num_blocks, &bad_req, &bad_val)
        if rc == 0:
            rc = ap_run(&a, dtype, num_threads)
        else:
            rc = -1 - rc
    if rc == -1:
        raise ValueError(f"paged_attention: unsupported dtype code {dtype}")
    if rc < -1:
        return _message(-2 - rc, bad_req, bad_val, num_tokens, num_qsl, num_seq, bt_rows, bt_cols, num_blocks,
                        block_size)
    return None


def check_metadata(uintptr_t block_table, int64_t bt_row, uintptr_t query_start_loc, uintptr_t seq_lens,
                   uintptr_t reqs, int64_t n_reqs, int block_size, int window, bint causal, int64_t num_tokens,
                   int64_t num_qsl, int64_t num_seq, int64_t bt_rows, int64_t bt_cols, int64_t num_blocks):
    """``paged_attention``'s metadata check alone (same arguments, same ``None`` or
    message), for a caller that must validate before it writes the cache."""
    cdef ap_args a
    cdef int rc
    cdef int64_t bad_req = 0, bad_val = 0
    _set_metadata(&a, block_table, bt_row, query_start_loc, seq_lens, reqs, n_reqs)
    a.block_size = block_size
    a.window = window
    a.causal = causal
    with nogil:
        rc = ap_check(&a, num_tokens, num_qsl, num_seq, bt_rows, bt_cols, num_blocks, &bad_req, &bad_val)
    if rc:
        return _message(rc - 1, bad_req, bad_val, num_tokens, num_qsl, num_seq, bt_rows, bt_cols, num_blocks,
                        block_size)
    return None


def _message(int code, int64_t r, int64_t v, int64_t num_tokens, int64_t num_qsl, int64_t num_seq,
             int64_t bt_rows, int64_t bt_cols, int64_t num_blocks, int block_size):
    return _CHECK_MESSAGES[code].format(r=r, v=v, num_tokens=num_tokens, num_qsl=num_qsl, num_seq=num_seq,
                                        bt_rows=bt_rows, bt_cols=bt_cols, num_blocks=num_blocks,
                                        block_size=block_size)


_CHECK_MESSAGES = (
    "request index {r} is outside query_start_loc ({num_qsl} entries), seq_lens ({num_seq}) or the "
    "block table ({bt_rows} rows)",
    "request {r}: query_start_loc {v} is negative, decreasing or past the {num_tokens} query rows",
    "request {r}: seq_len {v} is negative or shorter than its query",
    "request {r}: seq_len {v} needs more than the block table's {bt_cols} columns of {block_size} tokens",
    "request {r}: block id {v} in a column it reads is outside the KV cache's {num_blocks} blocks",
)
