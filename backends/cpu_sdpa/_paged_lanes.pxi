# Included by _paged.pyx (its C, in order): scalar bf16 conversions, the vectorizable exp, and
# the 8- and 16-lane vector helpers (loads, lane-sum trees, exp) the item functions are built from.

cdef extern from *:
    """
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

    """
    int AP_CHUNK  # (a declaration: an extern block needs one)
