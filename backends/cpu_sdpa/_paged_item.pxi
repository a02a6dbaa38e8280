# Included by _paged.pyx (its C, in order): one work item of the kernel as macros, instantiated
# per dtype, lane width and head size in _paged_run.pxi: the value accumulator (AP_DEFINE_VACC),
# the item (AP_DEFINE_ITEM: tiles of query rows, 128-key chunks, online softmax) and the
# head-size-32 four-row logit pass (AP_DEFINE_PAIR32).

cdef extern from *:
    """
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
                    if (row0 == 0) {   /* the chunk's K and V rows into L2 ahead of their  \\
                        reads: the blocks are scattered, so the hardware prefetcher cannot  \\
                        guess them (the first tile only: later tiles find them in cache) */ \\
                        const int64_t rb = (int64_t)a->kv_tok * (int64_t)sizeof(TYPE);        \\
                        for (int j = 0; j < nc; j++) {                                        \\
                            const char *kr = (const char *)kp[j], *vr = (const char *)(kp[j] + a->kv_half);\\
                            for (int64_t b = 0; b < rb; b += 64) {                            \\
                                __builtin_prefetch(kr + b, 0, 2);                             \\
                                __builtin_prefetch(vr + b, 0, 2);                             \\
                            }                                                                 \\
                        }                                                                     \\
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

    """
    int AP_CHUNK  # (a declaration: an extern block needs one)
