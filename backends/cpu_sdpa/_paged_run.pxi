# Included by _paged.pyx (its C, in order): the item functions per dtype (float32, bfloat16,
# float16 where the compiler has _Float16) and their choice by head size and CPU, the run over
# OpenMP threads (ap_run) and the metadata check before any read (ap_check).

cdef extern from *:
    """
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
    int AP_CHUNK  # (a declaration: an extern block needs one)
